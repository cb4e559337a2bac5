"""The fabric check of a preflight run: measured KV bandwidth per NIC pair gates the launch.

`pdtool launch --preflight` starts every worker without its engine. Before a worker reports
healthy, each decode rank opens its NICs with the messenger's endpoints and publishes a landing
buffer (`fabric-check/<instance>.r<rank>.json` in the job folder, which every node sees), and
each prefill rank writes `transfer.preflight_mib` MiB into every decode rank it may send KV to
(`sources_by_target`: the plan's routes, every DP group and every replica of a head), over
each NIC pair (`transfer.probe`). Its figures go to `fabric-check/results/<instance>.r<rank>
.json` and its log; a pair under the floor (`transfer.preflight_min_gbps`) stops that prefill
worker with the pair and the key named, so the preflight fails before anything loads weights.

A worker started again by the supervisor finds its pairs measured (the results) and does not
measure again (a slow pair still stops it); decode ranks keep their buffers until every
source they expect has written. The launchers clear `fabric-check/` when a preflight run
starts. docs/fabric-check.md.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transfer.fabric import FabricError

FOLDER = "fabric-check"
#: the longest a prefill rank waits for a decode rank's buffer, and for its own writes: the
#: launcher's health timeout stops a preflight that waits on a peer that never came up sooner
WAIT_S = 3600.0


class FabricCheckError(RuntimeError):
    """A NIC pair under the floor, or one that could not be written; the text names both."""


@dataclass(frozen=True)
class RankId:
    instance: str  # "prefill-0"
    rank: int

    def __str__(self) -> str:
        return f"{self.instance} rank {self.rank}"

    @property
    def file(self) -> str:
        return f"{self.instance}.r{self.rank}.json"


def sources_by_target(plan: Any) -> dict[RankId, list[RankId]]:
    """Each decode rank -> the prefill ranks that may write KV to it, in plan order (a source's
    index there is its slot at the target). Pure: from the plan's routes, where a decode
    attention rank lists the prefill attention ranks holding each head it needs; any DP group
    of any prefill instance may serve a request."""
    if plan.aggregated:
        return {}
    cands = {r.dst_rank: {c for s in r.slices for c in s.src_candidates}
             for r in plan.transfer.routes}
    prefill = [(inst, r) for inst in plan.role_instances("prefill") for r in inst.ranks]
    out = {}
    for inst in plan.role_instances("decode"):
        for r in inst.ranks:
            out[RankId(inst.name, r.rank)] = [RankId(p.name, pr.rank) for p, pr in prefill
                                               if pr.tp_rank in cands.get(r.tp_rank, ())]
    return out


def floor_gbps(plan: Any, src_nic: str, dst_nic: str) -> float:
    """The pair's floor: transfer.preflight_min_gbps, or a quarter of the slower link."""
    tr = plan.transfer
    if tr.preflight_min_gbps >= 0:
        return tr.preflight_min_gbps
    links = [tr.nic_gbps.get(n, 0.0) for n in (src_nic, dst_nic)]
    return 0.25 * min(links) if all(links) else 0.0


def enabled(plan: Any) -> bool:
    """Pairs to measure, over pdtool's own messenger (SGLang's mooncake and nixl backends do
    not use libfabric; validate keeps every other engine on pdtool's)."""
    return (plan.transfer.preflight_mib > 0 and not plan.aggregated
            and plan.transfer.backend == "pdtool")


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)  # whole or absent for a reader on another node


def _read_when_there(path: Path, what: str, say: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    next_note = time.monotonic() + 30
    while True:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() > deadline:
            raise FabricCheckError(f"{what} published no fabric-check buffer in {WAIT_S:.0f} s")
        if time.monotonic() > next_note:
            say(f"fabric check: waiting for {what} ({path})")
            next_note += 30
        time.sleep(0.2)


def serve_targets(ctx: Any, folder: Path, say: Any) -> None:
    """Decode: publish a landing buffer per rank; each is closed (a daemon thread) once every
    source it expects has written."""
    from transfer.probe import ProbeTarget, expected_writes
    from transfer.sglang.rails import rail_specs

    plan, tr = ctx.plan, ctx.plan.transfer
    sources = sources_by_target(plan)
    nbytes = tr.preflight_mib << 20
    ranks = {RankId(p.name, r.rank): r for p in plan.role_instances("prefill") for r in p.ranks}
    for rank in ctx.ranks:
        me = RankId(ctx.instance.name, rank.rank)
        srcs = sources.get(me, [])
        if not srcs or all((folder / "results" / s.file).exists() for s in srcs):
            continue  # measured already (this worker was restarted)
        target = ProbeTarget(tr.provider, tuple(rank.nics), ctx.host, nbytes, len(srcs))
        _write_json(folder / me.file, {**target.descriptor(), "host": ctx.host,
                                       "pid": os.getpid()})
        expect = expected_writes([len(rail_specs(tr.provider, tuple(ranks[s].nics), None))
                                  for s in srcs], len(target.rails), nbytes)
        say(f"fabric check: {me} waits for {len(srcs)} prefill rank(s) on "
            f"{','.join(target.rails.labels)}")

        def close_when_done(t: ProbeTarget = target, n: int = expect) -> None:
            if t.wait(n, WAIT_S):
                time.sleep(2.0)  # the sources' last completions
                t.close()

        threading.Thread(target=close_when_done, daemon=True, name="fabric-check").start()


def measure_sources(ctx: Any, folder: Path, say: Any) -> None:
    """Prefill: write into each decode rank this rank may serve; record every pair; raise
    FabricCheckError for a pair under its floor (after recording them all)."""
    from transfer.probe import ProbeSource

    plan, tr = ctx.plan, ctx.plan.transfer
    nbytes = tr.preflight_mib << 20
    targets = [(t, srcs) for t, srcs in sources_by_target(plan).items()]
    slow = []
    for rank in ctx.ranks:
        me = RankId(ctx.instance.name, rank.rank)
        mine = [(t, srcs.index(me)) for t, srcs in targets if me in srcs]
        done = folder / "results" / me.file
        if not mine:
            continue
        if done.exists():  # restarted: the pairs stand as measured, slow ones included
            slow += [r for r in json.loads(done.read_text()) if r["gbps"] < r["floor_gbps"]]
            continue
        source = ProbeSource(tr.provider, tuple(rank.nics), ctx.host, nbytes)
        rows = []
        try:
            for target, slot in mine:
                desc = _read_when_there(folder / target.file, str(target), say)
                try:
                    pairs = source.probe(desc, slot, tr.timeout_s)
                except FabricError as e:
                    raise FabricCheckError(f"{me} -> {target} ({desc.get('host')}): {e}") from None
                for p in pairs:
                    floor = floor_gbps(plan, p.src_nic, p.dst_nic)
                    row = {"src": str(me), "src_nic": p.src_nic, "dst": str(target),
                           "dst_nic": p.dst_nic, "mib": tr.preflight_mib,
                           "gbps": round(p.gbps, 2), "floor_gbps": floor,
                           "link_gbps": [tr.nic_gbps.get(p.src_nic, 0.0),
                                         tr.nic_gbps.get(p.dst_nic, 0.0)]}
                    rows.append(row)
                    say(f"fabric check: {me} ({p.src_nic}) -> {target} ({p.dst_nic}): "
                        f"{p.gbps:.1f} Gbit/s" + (f" (floor {floor:g})" if floor else ""))
                    if p.gbps < floor:
                        slow.append(row)
        finally:
            source.close()
        _write_json(done, rows)
    if slow:
        r = slow[0]
        raise FabricCheckError(
            f"transfer.preflight_min_gbps: {r['src']} ({r['src_nic']}) -> {r['dst']} "
            f"({r['dst_nic']}) moved {r['gbps']:g} Gbit/s, under the floor of "
            f"{r['floor_gbps']:g} Gbit/s" + (f" (and {len(slow) - 1} more pair(s))"
                                             if len(slow) > 1 else "") +
            ": check that NIC pair's link (ibv_devinfo / fi_info) or the plan's NIC map "
            "(cluster.nics), or lower transfer.preflight_min_gbps")


def run(ctx: Any, say: Any) -> None:
    """The worker's part of the fabric check (preflight runs only)."""
    if not enabled(ctx.plan) or ctx.role not in ("prefill", "decode"):
        return
    folder = Path(ctx.plan_path).parent / FOLDER
    if ctx.role == "decode":
        serve_targets(ctx, folder, say)
    else:
        measure_sources(ctx, folder, say)


def results(run_dir: Path) -> list[dict[str, Any]]:
    """Every pair measured in the job folder's last preflight run."""
    rows: list[dict[str, Any]] = []
    for path in sorted((run_dir / FOLDER / "results").glob("*.json")):
        rows += json.loads(path.read_text())
    return rows
