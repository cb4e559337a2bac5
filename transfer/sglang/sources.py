"""Which prefill rank sends a request's MLA latent: drawn per request, not SGLang's fixed rank.

SGLang 0.5.23 (`CommonKVReceiver._setup_bootstrap_infos`) connects a decode rank whose
attention TP is smaller than the prefill's to every prefill rank of its group
(`target_tp_ranks`) and, for MLA, marks all but the first `is_dummy` — in the bootstrap infos
it caches for every later request. So one prefill GPU (and its NIC) sends every request to that
decode rank while its replicas idle; under DP attention on the decode (attention TP 1 per DP
rank) every decode DP rank reads from prefill rank 0 alone.

The latent is replicated on every one of those ranks, so any of them can send. The backend
decides per request in `send_metadata` (the point where the decode tells each prefill rank
whether it is the real sender), as pdtool's messenger does for replicated heads
(`transfer.routes.routes_for` with an rng): one of the connected ranks at random, the others
dummies for this request only. The cached infos are not changed. SGLang's bookkeeping is
unaffected: every connected rank still gets a META for every request, as before.

What is not drawn: the prefill DP rank. Under DP attention on the prefill, a request's KV
exists only on the DP rank that computed it (the router's choice; SGLang's default
`follow_bootstrap_room` takes the bootstrap room, random per request, modulo the DP size), so
the decode reads from that DP rank's attention TP group; within it the replica is drawn here,
and the NIC by the prefill's striping (`rails.py`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

_rng = random.Random()  # seeded from the OS: decode ranks and processes draw independently


def dummy_flags(infos: Sequence[dict[str, Any]], is_mla: bool,
                rng: random.Random | None = None) -> list[bool]:
    """`is_dummy` for each of SGLang's bootstrap infos for one request. MLA with several
    connected ranks: one drawn at random is real. Otherwise (every MHA/GQA source sends its
    heads; one MLA source) SGLang's flags."""
    if not is_mla or len(infos) < 2:
        return [bool(info["is_dummy"]) for info in infos]
    real = (rng or _rng).randrange(len(infos))
    return [k != real for k in range(len(infos))]
