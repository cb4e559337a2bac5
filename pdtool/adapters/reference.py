"""pdtool's reference CPU engine: the messenger's fused K/V buffer per layer in
`transfer.layout`, a hidden-state row per request, one process per rank, host-memory KV and
at most `MAX_KV_PAGES` pages a rank."""

from __future__ import annotations

from pdtool.adapters.base import EngineAdapter
from pdtool.reference_limits import MAX_KV_PAGES
from pdtool.schema import RoleConfig


class ReferenceAdapter(EngineAdapter):
    kind = "reference"
    shards_mlp = True
    kv_on_gpu = False
    oracle_here = True

    def kv_token_cap(self, rc: RoleConfig) -> int:
        return MAX_KV_PAGES * rc.page_size
