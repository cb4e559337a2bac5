"""How the launcher starts each engine: the launch half of the engine adapter.

`pdtool.adapters` holds what the plan and the rules know about an engine (pure); this module
holds what only the launcher needs: the engine's own command line on each node, the
environment that line reads, the front's command line and readiness probe, and the check
`launcher.verify` runs once the deployment is up. Every launcher branch on the engine goes
through `engine_launch(cfg)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdtool.adapters import adapter
from pdtool.launch.backends import backend_env, timer_env
from pdtool.launch.sglang import router_argv, server_argv
from pdtool.launch.shell import Var, Word
from pdtool.launch.weights import cache_env
from pdtool.plan import InstancePlan, Plan, RankPlan
from pdtool.schema import Config

Host = Callable[[int], Var]

#: how long SGLang's HTTP servers keep an idle connection while a comparison freezes them
FROZEN_KEEP_ALIVE_S = 3600


class EngineLaunch:
    """pdtool's reference engine: the worker entry runs the engine and the front in its own
    process (no command line after `--`), configured from the plan alone."""

    def server_argv(self, cfg: Config, plan: Plan, inst: InstancePlan, ranks: list[RankPlan],
                    host: Var, head: Var) -> list[str | Word]:
        """The engine's own line for `ranks` on one node ([]: the worker runs it)."""
        return []

    def server_env(self, cfg: Config) -> dict[str, str]:
        """What that line reads from its environment."""
        return {}

    def router_argv(self, cfg: Config, plan: Plan, host: Host) -> list[str | Word]:
        """The front's own line ([]: the worker runs pdtool's front)."""
        return []

    def router_ready(self, plan: Plan) -> str | None:
        """The front's readiness path when /health answers before it can route, or None."""
        return None

    def frozen_env(self) -> dict[str, str]:
        """What the servers need to be frozen between a comparison's rounds (`pdtool bench
        --launch --compare` on CPUs) and serve again when thawed."""
        return {}

    def verify(self, cfg: Any, plan: Any, hosts: Sequence[str], n: int, timeout: float) -> str:
        """launcher.verify: `n` greedy prompts through the front against the model computed
        here (raises VerifyFailed)."""
        from pdtool.launch.verify import check_reference

        return check_reference(cfg, plan, hosts, n, timeout)


class SGLangLaunch(EngineLaunch):
    """SGLang: one `sglang.launch_server` per node of an instance, sglang-router in front."""

    def server_argv(self, cfg: Config, plan: Plan, inst: InstancePlan, ranks: list[RankPlan],
                    host: Var, head: Var) -> list[str | Word]:
        return server_argv(cfg, plan, inst, ranks, host, head)

    def server_env(self, cfg: Config) -> dict[str, str]:
        """SGLang's timers, its own transfer backend's variables and the model cache."""
        return {**timer_env(cfg), **backend_env(cfg), **cache_env(cfg)}

    def router_argv(self, cfg: Config, plan: Plan, host: Host) -> list[str | Word]:
        return router_argv(cfg, plan, host)

    def router_ready(self, plan: Plan) -> str | None:
        """sglang-router answers /health before it registered its workers (in the
        background); aggregated instances are its "regular" workers."""
        rp = plan.router
        want = (f"regular={len(rp.targets)}" if plan.aggregated else
                f"prefill={len(rp.prefill)},decode={len(rp.decode)}")
        return f"/workers#{want}"

    def frozen_env(self) -> dict[str, str]:
        """SGLang's servers close an idle connection after 5 s (uvicorn's keep-alive), so one
        frozen for longer closed the router's pooled connection just as the router reused it,
        and that request waited 120 s, for SGLang's bootstrap timeout, before the router retried
        it (sglang-router: "Decode request failed ... error sending request")."""
        return {"SGLANG_TIMEOUT_KEEP_ALIVE": str(FROZEN_KEEP_ALIVE_S)}

    def verify(self, cfg: Any, plan: Any, hosts: Sequence[str], n: int, timeout: float) -> str:
        """SGLang's kernels cannot be recomputed here: every prefill->decode pair must give
        the same tokens."""
        from pdtool.launch.verify import check_sglang

        return check_sglang(plan, hosts, n, timeout)


LAUNCHES: dict[str, EngineLaunch] = {"reference": EngineLaunch(), "sglang": SGLangLaunch()}


def engine_launch(cfg: Config) -> EngineLaunch:
    """The launch half of `cfg.engine.kind`'s adapter (UnknownEngine when there is none)."""
    return LAUNCHES[adapter(cfg).kind]
