"""The producer side of a worker: this rank's KV buffer, its server, and the saves into it.

After a step's forward pass, :meth:`Producer.wait_for_save` packs each finished prompt's KV for
every layer with **one** :func:`tritonkv.pack_kv` call (token rows or whole pages: the
``kv_format`` option) into the rank's :class:`~connector.kvstore.KVBuffer` under its transfer id
(in the overlapped flow, each chunk the step completed, under ``<transfer_id>#<index>``; for a
model of several KV cache groups, one entry per group: :mod:`.groups`); each entry is bound to its prompt's digest (``SaveSpec.prompt_digest``), so that the
:class:`~connector.kvstore.KVServer` serving the buffer on ``engine_port + tp_rank`` (GET and
DISCARD only) serves or discards it only for a request presenting that digest; and a :class:`BufferWatcher` logs the buffer's occupancy. With ``digest`` on (the default) the entry's meta also
carries the integrity digest the pack computed (:mod:`connector.integrity`). No vLLM import.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from tritonkv import nh_in_copy, pack_kv, pack_state
from tritonkv.umac import TransferKeys, entry_keys, num_chunks

from ..integrity import digest_tensors, entry_meta, flip_bit, meta_from_digests
from ..kvstore import KVBuffer, KVServer, chunk_key, hide_ids, short_id
from ..logs import get_logger
from ..streams import DeviceBudget, Pending, Publisher, StreamOps, device_streams
from ..transport import (
    MIN_SECRET_BYTES,
    SECRET_ENV,
    addresses_of,
    error_text,
    is_loopback,
    name_current_thread,
)
from .cache_views import RankCaches, StateCaches, packed_shape
from .config import ConnectorConfig
from .groups import group_key
from .metadata import FIRST_KEY, SaveSpec, group_saves
from .stats import TransferStats, save_failure

log = get_logger("connector")

#: The KV server's handshake deadline unless ``connect_timeout_s`` is longer.
SERVER_CONNECT_TIMEOUT_S = 10.0


class Producer:
    """Saves prompts' KV of one rank and serves it (see the module docstring).

    Args:
        cfg: the parsed ``kv_connector_extra_config``.
        caches: this rank's registered caches.
        tp_rank: this rank's tensor-parallel rank.
        engine_port: this engine's first KV port; this rank serves on ``engine_port + tp_rank``.
        fingerprint: what a producer's and a consumer's caches must share (in every entry).
        secret: the shared secret of every KV connection (None: none; never logged).
        stats: where saves are counted.
        streams: the device's streams and events (:class:`~connector.streams.StreamOps`, made for CUDA
            caches; a test passes a stand-in). With them a save is launched on the step and
            stored by the publisher thread; without (the CPU) it is stored on the step.
        budget: the rank's device memory budget (default: one of this producer's own).

    Raises:
        ValueError: ``kv_format`` asks for what these caches cannot give.
    """

    def __init__(
        self,
        cfg: ConnectorConfig,
        caches: RankCaches,
        *,
        tp_rank: int,
        engine_port: int,
        fingerprint: str,
        secret: bytes | None,
        stats: TransferStats,
        streams: StreamOps | None = None,
        budget: DeviceBudget | None = None,
        group_caches: list[RankCaches] | None = None,
    ):
        self.cfg, self.caches, self.tp_rank = cfg, caches, tp_rank
        #: the caches of each KV cache group (:mod:`.groups`; ``[caches]`` for one group)
        self.groups = group_caches or [caches]
        self.engine_port, self.fingerprint = engine_port, fingerprint
        self.stats = stats
        self._level = logging.INFO if cfg.log_transfers else logging.DEBUG  # saved: one line
        self._secret = secret
        #: what this producer sends: ``tokens`` or ``pages``
        self.kv_format = one_kv_format(self.groups, cfg.kv_format)
        self._buffer: KVBuffer | None = None
        self._server: KVServer | None = None
        self._watcher: BufferWatcher | None = None
        self._auth_failures_seen = self._expired_seen = 0
        self._streams = streams if streams is not None else device_streams(caches.device)
        self._publisher: Publisher | None = None
        #: entries kept in device memory (``buffer_memory``), else in pinned host memory
        self.entries_on_device = cfg.entries_on_device(caches.device)
        #: the capacity of the KV buffer when its entries live on the device, else 0
        self.device_buffer_bytes = cfg.device_buffer_bytes(caches.device)
        #: the device memory of saves in flight (:class:`~connector.streams.DeviceBudget`; the rank's,
        #: shared with its consumer, when given)
        self.budget = budget or DeviceBudget(cfg.gpu_memory_bytes - self.device_buffer_bytes)

    @property
    def buffer(self) -> KVBuffer | None:
        """The KV buffer (None before :meth:`serve` and after :meth:`shutdown`)."""
        return self._buffer

    @property
    def server(self) -> KVServer | None:
        """The KV server (None before :meth:`serve` and after :meth:`shutdown`)."""
        return self._server

    @property
    def watcher(self) -> BufferWatcher | None:
        """The buffer watcher (None before :meth:`serve`)."""
        return self._watcher

    def attach_buffer(self, buffer: KVBuffer) -> None:
        """Store entries in ``buffer``, without serving them: an in-process consumer takes them
        (tests, benchmarks). The caller closes it."""
        self._buffer = buffer

    def serve(self) -> None:
        """Start this rank's KV buffer and its server on ``engine_port + tp_rank``: it answers
        GET and DISCARD only, and only to peers holding the shared secret (when one is set;
        without one only on a loopback address, unless ``insecure``)."""
        check_listener(self.cfg, self._secret)
        self._buffer = KVBuffer(
            self.device_buffer_bytes or self.cfg.buffer_bytes,
            ttl_s=self.cfg.ttl_s,
            full_policy=self.cfg.full_policy,
            put_timeout_s=self.cfg.put_timeout_s,
        )
        port = self.engine_port + self.tp_rank
        device = self.caches.device
        self._server = kv_server(self.cfg, self._buffer, self.tp_rank, port, self._secret, device)
        log.info("tritonkv: rank %d serving KV on %s:%d", self.tp_rank, self.cfg.host, port)
        self._watcher = BufferWatcher(self)

    def wait_for_save(self, saves: list[SaveSpec], discards: list[str] = (), refusals=()) -> None:
        """Discard the entries of ``discards`` (aborted requests), seal the ``(transfer id, prompt
        digest)`` of ``refusals`` (their decode side stops waiting), and pack and store
        ``saves`` (each KV cache group's entry), after the forward pass. Never raises: a failed
        save (too large, no memory, a full buffer) is logged, counted, and recomputed."""
        if self._buffer is None:
            return
        discard_transfers(self._buffer, discards, refusals)
        for spec in saves:
            for one in group_saves(spec):
                try:
                    self._save(one)
                except Exception as exc:
                    self._save_failed(one, exc)
                    break

    def entry_bytes(self, spec: SaveSpec) -> int:
        """Bytes of ``spec``'s packed entry, known before packing: its rows
        (:func:`entry_rows`) × the bytes of one row over every layer, K and V."""
        caches = self.groups[spec.group]
        views = caches.pages if self.kv_format == "pages" else caches.layers
        rows = entry_rows(spec, self.kv_format, caches.block_size)[1]
        return math.prod(packed_shape(views, rows)) * views[0][0].element_size()

    def _slots(self, spec: SaveSpec):
        """The slot of each row of ``spec``'s entry (:func:`entry_rows`)."""
        caches = self.groups[spec.group]
        offset, rows = entry_rows(spec, self.kv_format, caches.block_size)
        return caches.slots(spec.block_ids, offset, offset + rows, rows, offset)

    def _save(self, spec: SaveSpec) -> None:
        paged = self.kv_format == "pages"
        caches = self.groups[spec.group]
        if isinstance(caches, StateCaches):
            self._save_state(spec, caches)
            return
        views = caches.pages if paged else caches.layers
        nbytes = self.entry_bytes(spec)
        room = min(self._buffer.capacity_bytes, self._buffer.limits.max_message_bytes)
        if nbytes > room:  # refused before packing: nothing allocated for it
            raise ValueError(
                f"its entry of {spec.num_tokens} tokens needs {nbytes} bytes, more than one "
                f"entry may hold ({room} bytes: buffer_bytes, or the wire's message limit)"
            )
        offset, rows = entry_rows(spec, self.kv_format, caches.block_size)
        shape = packed_shape(views, rows)
        meta = {"fingerprint": self.fingerprint, "kv_format": self.kv_format}
        if paged:
            meta["page_kind"] = caches.page_kind
        meta.update(spec.chunk.as_meta() if spec.chunk else {FIRST_KEY: offset} if offset else {})
        row_bytes = shape[-2] * shape[-1] * views[0][0].element_size()
        hashed = nh_in_copy(caches.device, row_bytes)  # (else the sender hashes it)
        nh = entry_keys(self._secret, entry_key(spec)) if hashed else None
        # an entry's NH checks every whole delivery of it: no whole-entry digest beside it
        digest = self.cfg.digest and nh is None
        pack = lambda out: _pack(caches.prepared(views), self._slots(spec), out, digest, nh)
        self._pack_and_store(spec, shape, views[0][0].dtype, self.kv_format, nbytes, meta, pack)

    def _save_state(self, spec: SaveSpec, caches: StateCaches) -> None:
        """Save a state group's entry: one row of every state tensor, the request's running state
        once its ``num_tokens`` positions were computed (h(N-1): :mod:`.groups`)."""
        meta = {"fingerprint": self.fingerprint, "kv_format": "state"}
        slot = caches.state_slot(spec.block_ids, spec.num_tokens)
        shape = (1, caches.row_bytes)
        pack = lambda out: _pack_state(caches, slot, out, self.cfg.digest)
        self._pack_and_store(spec, shape, torch.uint8, "state", caches.row_bytes, meta, pack)

    def _pack_and_store(self, spec: SaveSpec, shape, dtype, kv_format, nbytes, meta, pack) -> None:
        """Pack ``spec``'s entry with ``pack(out) -> (packed, digest or None, slots, NH outputs
        or None)`` into a new ``shape`` tensor of ``dtype`` and store it: launched on a GPU
        (:meth:`_launch`), on the step elsewhere."""
        t0 = time.perf_counter()
        if self._streams is not None:
            self._launch(spec, shape, dtype, kv_format, nbytes, meta, t0, pack)
            return
        out = torch.empty(shape, dtype=dtype, device=self.groups[spec.group].device)
        packed, digest, _, nh = pack(out)
        if self.cfg.digest:  # the whole entry's computed by the pack itself (integrity.py)
            meta.update(entry_meta(packed, digest, kv_format))
        if "flip_bit" in spec.debug_fault:  # test hook: after the digest was taken
            flip_bit(packed)
        self._store(spec, packed, meta, nbytes, 1e3 * (time.perf_counter() - t0), nh)

    def _launch(self, spec: SaveSpec, shape, dtype, kv_format, nbytes, meta, t0, pack) -> None:
        """The pack on a GPU, launched without waiting for it (:mod:`connector.streams`): on our stream,
        after an event of vLLM's (the forward pass wrote the KV or the state); vLLM's stream then
        waits for the pack's event (what it runs next may overwrite these blocks). The publisher
        thread copies the entry to the host and stores it once the pack completed
        (:meth:`_publish`)."""
        ops = self._streams
        vllm_stream = ops.current()
        with ops.use(ops.side):
            what = f"the pack of transfer {short_id(spec.transfer_id)}"
            fail = "alloc_fail" in spec.debug_fault
            out, reserved = self.budget.empty(ops, shape, dtype, what, fail)
            try:
                ops.side.wait_event(ops.event(vllm_stream))
                packed, digest, slots, nh = pack(out)
                digests = digest_tensors(packed, digest, kv_format) if self.cfg.digest else None
                packed_ev = ops.event(ops.side)
            except BaseException:
                self.budget.release(reserved)
                raise
        vllm_stream.wait_event(packed_ev)
        pending = Pending(packed_ev, keep=(slots,), reserved=reserved, started=t0)
        job = _Job(spec, packed, digests, meta, nbytes, pending, nh, whole=digest is not None)
        self._publisher_thread().submit(job)

    def _publisher_thread(self) -> Publisher:
        """The ``tkv-publish`` thread (:class:`~connector.streams.Publisher`): stores the launched
        saves once each one's pack completed (:meth:`_publish`), or fails them (recomputed)."""
        if self._publisher is None:
            failed = lambda job, exc: self._save_failed(job.spec, exc)
            self._publisher = Publisher(self._streams, self.budget, self._publish, failed)
        return self._publisher

    def _publish(self, job: _Job, deadline: float) -> None:
        """On the publisher thread, once ``job``'s pack completed: copy it to pinned host
        memory (unless entries live on the device) with its digests, and store it."""
        pack_ms = 1e3 * (time.perf_counter() - job.pending.started)
        on_device = self.entries_on_device
        entry, digests, nh = self._publisher.to_host(
            job, [None if on_device else job.packed, job.digests, job.nh], deadline
        )
        if on_device:
            entry = job.packed
        else:
            job.packed = None  # the device scratch goes back to the allocator
            self._publisher.let_go(job)  # its pack and copy completed
        meta = dict(job.meta)
        if digests is not None:
            meta.update(meta_from_digests(digests, job.whole))
        if "flip_bit" in job.spec.debug_fault:  # test hook: after the digest was taken
            flip_bit(entry)
        self._store(job.spec, entry, meta, job.nbytes, pack_ms, nh)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every save launched so far is stored or failed (True), or ``timeout_s``
        passed (False). Immediate off a GPU, where :meth:`wait_for_save` stores its saves."""
        return self._publisher is None or self._publisher.flush(timeout_s)

    def _store(self, spec: SaveSpec, packed, meta: dict, nbytes: int, pack_ms: float, nh=None):
        """Put ``spec``'s entry (with the NH outputs its pack computed, if any) in the buffer."""
        meta = {**meta, "num_tokens": spec.num_tokens}
        nh = None if nh is None else {"kv": nh}
        stored = self._buffer.put(
            entry_key(spec), {"kv": packed}, meta, digest=spec.prompt_digest, nh=nh
        )
        if stored:  # a prompt's tokens counted once, with its first group
            tokens = spec.saved_tokens if spec.group == 0 else 0
            self.stats.record_save(nbytes=nbytes, num_tokens=tokens, pack_ms=pack_ms)
        grouped = len(self.groups) > 1
        log_saved(spec, stored, nbytes, pack_ms, self.kv_format, self._level, grouped)

    def _save_failed(self, spec: SaveSpec, exc: BaseException) -> None:
        """Count and log a failed save; the other entries of a chunked transfer, or of a model of
        several KV cache groups, are discarded and the rest refused (a consumer waiting for one,
        as in the overlapped flow, then stops waiting at once)."""
        self.stats.record_save_failure(save_failure(exc))
        log.error(
            "tritonkv: could not save transfer %s for %s (%s: %s): the decode side will "
            "recompute it",
            short_id(spec.transfer_id),
            spec.req_id,
            type(exc).__name__,
            hide_ids(error_text(exc)),
        )
        if (spec.chunk is not None or len(self.groups) > 1) and self._buffer is not None:
            self._buffer.discard_any(spec.transfer_id, seal=True)

    def sample_stats(self) -> None:
        """Add to the stats what this rank's KV server and buffer counted since the last call
        (failed authentications, entries expired unclaimed) and the buffer's gauges (bytes and
        entries held): a few counters read under their locks, cheap on vLLM's step."""
        if self._server is not None:
            failures = self._server.stats()["auth_failures"]
            self.stats.record_auth_failures(failures - self._auth_failures_seen)
            self._auth_failures_seen = failures
        if self._buffer is not None:
            figures = self._buffer.stats()
            self.stats.record_expired(figures["expirations"] - self._expired_seen)
            self._expired_seen = figures["expirations"]
            self.stats.set_gauge("buffer_bytes", figures["bytes"])
            self.stats.set_gauge("buffer_entries", figures["entries"])

    def shutdown(self) -> None:
        # The watcher is joined, not left to wake after the interpreter began to exit: a daemon
        # thread that discards the last reference to this object then frees its cache tensors
        # without the GIL and aborts the process ("terminate called without an active exception").
        if self._watcher is not None:
            self._watcher.stop()
        if self._publisher is not None:
            self._publisher.stop()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


def check_listener(cfg: ConnectorConfig, secret: bytes | None) -> None:
    """ValueError where the KV server would serve anyone who can reach it: no secret, a
    non-loopback address, and not ``insecure``."""
    if secret is None and not is_loopback(cfg.host) and not cfg.insecure:
        raise ValueError(
            f"tritonkv: the producer would serve KV on {cfg.host!r} to anyone who can "
            f"reach it: set a shared secret of at least {MIN_SECRET_BYTES} bytes on both "
            f"servers, in the {SECRET_ENV} environment variable or in a file named by "
            '"secret_file" in kv_connector_extra_config (e.g. `openssl rand -hex 32`), or '
            'listen on a loopback address, or set "insecure": true to accept that'
        )


def kv_server(cfg: ConnectorConfig, buffer: KVBuffer, rank: int, port: int, secret, device):
    """The :class:`KVServer` of ``buffer`` on ``cfg.host:port`` (TP rank ``rank``'s:
    ``engine_port + rank``); OSError naming the port's arithmetic where it cannot listen."""
    # consumers dial the advertised address: the server knows it as its own (a NAT or port
    # forward the operator set up), so their authentication names it without being refused
    aliases = addresses_of(cfg.advertise_host, port) if cfg.advertise_host else []
    try:
        return KVServer(
            buffer,
            cfg.host,
            port,
            connect_timeout_s=max(SERVER_CONNECT_TIMEOUT_S, cfg.connect_timeout_s),
            transport=cfg.transport_for(device),
            device=device,
            secret=secret,
            insecure=cfg.insecure,
            aliases=aliases,
        )
    except OSError as e:
        raise OSError(
            e.errno,
            f"tritonkv: rank {rank} cannot serve KV on {cfg.host}:{port} "
            f"(kv_connector_extra_config port {cfg.port} + DP index * TP size + TP rank): "
            f"{e.strerror}",
        ) from e


def discard_transfers(buffer: KVBuffer, discards, refusals) -> None:
    """Discard every entry of each of ``discards`` (its own: any digest) and of each ``(transfer
    id, digest)`` of ``refusals`` (for that digest only), and seal them: parts stored later are
    refused, and a consumer waiting for one stops at once. A failure is logged (the TTL discards
    the entries later)."""
    targets = [(t, None, "its request was aborted") for t in discards]
    targets += [(t, d, "a prompt of this digest was refused its id") for t, d in refusals]
    for transfer_id, digest, why in targets:
        try:
            if digest is None:
                held = buffer.discard_any(transfer_id, seal=True)
            else:
                held = buffer.discard(transfer_id, digest, seal=True)
            if held:
                log.info("tritonkv: discarded transfer %s (%s)", short_id(transfer_id), why)
        except Exception as exc:
            log.error(
                "tritonkv: could not discard transfer %s (%s)",
                short_id(transfer_id),
                hide_ids(error_text(exc)),
            )


def one_kv_format(groups: list[RankCaches], choice: str) -> str:
    """What every KV cache group's caches send for the ``kv_format`` option ``choice`` (one
    format for all); ValueError when they differ."""
    formats = {g.kv_format(choice) for g in groups if isinstance(g, RankCaches)}
    if len(formats) > 1:
        raise ValueError(
            "tritonkv: the KV cache groups' caches would send different kv_formats; expected "
            f"one for all (layouts {[g.layout for g in groups]})"
        )
    return formats.pop()


def entry_key(spec: SaveSpec) -> str:
    """The key ``spec``'s entry is stored under: its transfer's, group's and chunk's."""
    key = group_key(spec.transfer_id, spec.group)
    return key if spec.chunk is None else chunk_key(key, spec.chunk.index)


def _pack(prepared, slots, out, digest: bool, nh: TransferKeys | None):
    """``(packed, its digest or None, slots, its NH outputs or None)``: :func:`tritonkv.pack_kv`
    of ``slots`` into ``out``, with the NH outputs under ``nh`` (the entry's key) computed by
    the pack's copy (:func:`tritonkv.nh_in_copy`; the payload's tag is then made from them,
    with no pass over the entry when it is sent; elsewhere the sender hashes it)."""
    kw = {}
    if nh is not None:
        chunks = num_chunks(out.numel() * out.element_size())
        kw = {
            "nh_key": nh,
            "nh_out": torch.empty((chunks, 2), dtype=torch.int64, device=out.device),
        }
    got = pack_kv(prepared, slots, out=out, digest=digest, **kw)
    return got[0], got[2] if digest else None, slots, kw.get("nh_out")


def _pack_state(caches: StateCaches, slot: int, out, digest: bool):
    """``(packed, its digest or None, slots, None)``: :func:`tritonkv.pack_state` of state slot
    ``slot`` into ``out`` (``[1, row_bytes]`` uint8), on the current stream."""
    slots = caches.slots([slot])
    if digest:
        packed, found = pack_state(caches.states, slots, out=out, digest=True)
        return packed, found, slots, None
    return pack_state(caches.states, slots, out=out), None, slots, None


def entry_rows(spec: SaveSpec, kv_format: str, block_size: int) -> tuple[int, int]:
    """``(offset, rows)``: ``spec``'s entry of ``kv_format`` holds prompt positions ``[offset,
    offset + rows)``, known before packing. Token rows: the prompt (or its chunk) from the
    group's first position (a block boundary); whole pages: every slot of its blocks from the
    chunk's (or the group's) first one (past the prompt in the last)."""
    offset = spec.first if spec.chunk is None else spec.chunk.start
    if kv_format == "pages":
        return offset, len(spec.block_ids) * block_size - offset
    return offset, (spec.num_tokens if spec.chunk is None else spec.chunk.stop) - offset


def log_saved(
    spec: SaveSpec,
    stored: bool,
    nbytes: int,
    pack_ms: float,
    kv_format: str,
    level: int,
    grouped: bool = False,
) -> None:
    """The log line of a save, at ``level`` (``stored`` False: refused, its transfer discarded
    or aborted; ``grouped``: the save of one of several KV cache groups)."""
    chunk = spec.chunk
    what = "" if chunk is None else f" chunk {chunk.index} (positions {chunk.start}..)"
    if grouped:
        what = f" group {spec.group} (positions {spec.first}..)"
    if not stored:
        log.info(
            "tritonkv: not storing transfer %s%s for %s: it was discarded or aborted",
            *(short_id(spec.transfer_id), what, spec.req_id),
        )
        return
    log.log(
        level,
        "tritonkv: saved transfer %s%s for %s: %d tokens, %d bytes, pack %.2f ms, kv_format %s",
        *(short_id(spec.transfer_id), what, spec.req_id, spec.saved_tokens, nbytes, pack_ms),
        kv_format,
    )


@dataclass
class _Job:
    """A save launched on the GPU, waiting for its pack: what :meth:`Producer._publish` needs."""

    spec: SaveSpec
    packed: torch.Tensor | None  # the pack's device output, kept until it is copied or stored
    digests: torch.Tensor | None  # [n, 2] int64 on the device (integrity.digest_tensors)
    meta: dict
    nbytes: int
    pending: Pending
    nh: torch.Tensor | None = None  # [num_chunks, 2] int64 NH outputs on the device, or None
    whole: bool = True  # digests start with the whole entry's (else its NH checks it)


class BufferWatcher:
    """Logs a producer's buffer occupancy when it changes (at most every ``interval_s``), also
    while no step runs: what an operator, or ``connector.serve.soak``, reads to see KV left over.

    Its thread holds the producer only by a weak reference between looks: a watcher that discarded
    the last reference to it at interpreter exit would free its caches there, and that aborts the
    process. :meth:`stop` ends the thread and joins it.
    """

    def __init__(self, producer: Producer, interval_s: float = 2.0):
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=BufferWatcher._watch,
            args=(weakref.ref(producer), self._stop, interval_s),
            name="tkv-buffer-watch",
            daemon=True,
        )
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread; waits up to ``timeout_s`` for it (not when called on it)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @staticmethod
    def _watch(ref, stop: threading.Event, interval_s: float) -> None:
        name_current_thread(threading.current_thread().name)
        last = None
        while not stop.is_set():
            producer = ref()
            buffer = None if producer is None else producer.buffer
            if buffer is None:
                return
            s = buffer.stats()
            now = (s["entries"], s["bytes"], s["claimed"], s["discards"], s["expirations"])
            if now != last:
                last = now
                log.info(
                    "tritonkv: rank %d KV buffer holds %d entries, %d bytes (claimed %d, "
                    "discarded %d, expired %d, evicted %d)",
                    producer.tp_rank,
                    s["entries"],
                    s["bytes"],
                    s["claimed"],
                    s["discards"],
                    s["expirations"],
                    s["evictions"],
                )
            del producer, buffer
            stop.wait(interval_s)
