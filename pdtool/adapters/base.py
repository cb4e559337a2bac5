"""What every engine adapter answers: the facts about an engine that the plan, the rules,
the memory model, the port map and the launcher used to test `engine.kind` for.

An adapter is pure (config in, figures out): rules and the plan import it, so it imports no
launch, engine or command code. Each engine's start-up lives beside its runtime
(`pdtool.worker.ENGINES`); its validation rules in its own rules module
(`pdtool.rules.ENGINE_STAGES`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pdtool.schema import Config, RoleConfig
from transfer import geometry as G
from transfer import routes as R

if TYPE_CHECKING:
    from pdtool.memory import Headroom


class EngineAdapter:
    """One engine as the toolkit sees it. Subclasses set the class facts and override the
    methods whose answer differs from the defaults here."""

    kind: ClassVar[str]
    #: the engine keeps its own KV pools (their layout ignores transfer.layout)
    own_pools: ClassVar[bool] = False
    #: one process serves all of an instance's ranks on a node (else one process per rank)
    per_node: ClassVar[bool] = False
    #: the MLP shards over TP too, so intermediate_size must divide by it
    shards_mlp: ClassVar[bool] = False
    #: its front takes prompts as text (token ids are turned into words for it)
    prompts_as_text: ClassVar[bool] = False
    #: on a GPU cluster its KV pool is in GPU memory, a share of each GPU it takes at start
    #: (else in host memory, where transfer.gpu_memory has no say)
    kv_on_gpu: ClassVar[bool] = True
    #: loads checkpoint folders (quantized ones as stored); else it builds its own weights
    loads_checkpoints: ClassVar[bool] = False
    #: shards a MoE model's experts (`{role}.ep`)
    expert_parallel: ClassVar[bool] = False
    #: the transfer.backend values it can move KV with
    transfer_backends: ClassVar[tuple[str, ...]] = ("pdtool",)
    #: pdtool computes the engine's model in-process: greedy outputs to check a deployment by
    oracle_here: ClassVar[bool] = False
    #: Prometheus job names of the front and of the instances
    front_job: ClassVar[str] = "pdtool-front"
    instances_job: ClassVar[str] = "pdtool-instances"
    #: the switch an instance's line needs before it serves /metrics (None: it always does)
    metrics_flag: ClassVar[str | None] = None
    #: the Python package whose release `engine.version` pins (None: pdtool's own engine)
    package: ClassVar[str | None] = None

    def engine_mem_fraction(self, cfg: Config, rc: RoleConfig) -> float:
        """The share of each device's memory the engine is told it may fill with weights and
        KV (the plan's `InstancePlan.mem_fraction`)."""
        return rc.mem_fraction

    def headroom(self, cfg: Config, rname: str) -> Headroom | None:
        """GPU memory the engine keeps outside `mem_fraction` (None: none modelled)."""
        return None

    def kv_pool(self, cfg: Config) -> G.PagePool:
        """The pages the transfer really writes."""
        return G.messenger_pool(cfg.transfer.layout, cfg.model.attention == "mla")

    def aux_buffers(self, cfg: Config) -> tuple[G.AuxBuffer, ...]:
        """The metadata buffers a request writes once, after its last chunk."""
        return G.reference_aux(cfg.model.hidden_size)

    def draft_group(self, cfg: Config, src: R.ShardSpec, dst: R.ShardSpec) -> G.KVGroup | None:
        """The speculative draft's KV buffers sent beside the target's, or None."""
        return None

    def worker_env(self, cfg: Config) -> dict[str, str]:
        """What the workers' transfer code checks the engine it is given against."""
        return {}

    def kv_token_cap(self, rc: RoleConfig) -> int:
        """The most KV tokens a rank allocates whatever its memory budget (0: no cap)."""
        return 0

    def router_metrics_port(self, cfg: Config) -> int | None:
        """The port of the front's Prometheus exporter (None: it has none of its own)."""
        return None

    def dp_attention(self, rc: RoleConfig) -> bool:
        """The role runs DP attention (extra listeners per instance)."""
        return False

    def transfer_timers(self, cfg: Config) -> tuple[tuple[str, float], ...]:
        """(key, seconds) of the timers a request may wait on its KV before failing."""
        return (("transfer.timeout_s", cfg.transfer.timeout_s),)
