"""The consumer side of a worker: loads of producers' entries, and their unpacking into this
rank's caches.

A consumer rank loads the KV heads it holds from the producer rank(s) that hold them
(:func:`~.tp_mapping.plan_heads`; concurrently when several) and writes them into the allocated
slots with **one** :func:`tritonkv.unpack_kv` call per load (each load presents the hand-off's
prompt digest, and refuses a reply larger than this rank's caches expect for it before
allocating it: :func:`expected_bytes`), before the step's forward pass, or,
with ``async_load``, loads on load threads and unpacks in the first ``get_finished`` after, on
the worker's own thread. The load of an overlapped hand-off (``LoadSpec.wait_s`` > 0) is always
async, on threads of its own (its KV cache groups' entries one after the other), and its load,
on a client of its own
(:meth:`.ProducerClients.load`), lets the producer's server wait up to ``wait_s`` for the entry
to be stored; a request that ends meanwhile (aborted) has that load closed at once
(:meth:`.ProducerClients.end`). It asks producers, on a thread of its own, to discard entries
nobody here will load, and stops asking a producer that timed out for a while
(:class:`ProducerBackoff`).
Every failure is logged and its blocks go to the error set: vLLM recomputes them. With ``digest`` on
(the default) the unpack's digest of what it read must equal the producer's, and with
``digest_write_back`` the written slots are read back too (:mod:`connector.integrity`); a mismatch is such
a failure, also counted in ``digest_failures``. No vLLM import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from functools import partial

import torch

from tritonkv import unpack_kv, unpack_state
from tritonkv.umac import nh_hash, num_chunks

from .. import integrity
from ..kvstore import ClientBusyError, KVClient, Part, chunk_key, hide_ids, short_id
from ..logs import Throttle, get_logger, held_note
from ..streams import DeviceBudget, StreamOps, device_streams
from ..transport import (
    EntryTag,
    RemoteError,
    TransferTimeout,
    error_text,
    pin_current_thread,
)
from .cache_views import RankCaches, StateCaches
from .config import ConnectorConfig
from .entries import check_entry, entry_span, expected_bytes
from .groups import group_key
from .landings import GpuLoad, Landing, Landings
from .metadata import DiscardSpec, LoadSpec, group_loads
from .producer_clients import ProducerBackoff, ProducerClients, discard_entries
from .stats import TransferStats, load_failure
from .tp_mapping import HeadSource, plan_heads, rank_heads

log = get_logger("connector")

# One loaded entry (the prompt, or one chunk of it): (kv_format, packed KV, its expected digest,
# the first prompt position of its rows, the payload tag still to check with its NH or None)
ReceivedPart = tuple[str, torch.Tensor, integrity.Expected, int, EntryTag | None]
# ([(the load of one KV cache group, source, packed KV, its expected digest, first position,
# tag to check)], whether they hold whole pages, load ms): what one load's loads got
Received = tuple[
    list[tuple[LoadSpec, HeadSource, torch.Tensor, integrity.Expected, int, EntryTag | None]],
    bool,
    float,
]
# How long a consumer on a GPU lets the producer's server wait for an entry not yet stored: a
# producer on a GPU stores it once its pack and copy to the host completed (producer.Publisher).
PUBLISH_WAIT_S = 0.5
# The threads of async loads: (name, workers) for plain ones and for those that may wait for
# their entry (overlapped: a prefill still running must not hold back a load whose entry is there).
LOAD_POOLS = {False: ("load", 2), True: ("wait", 8)}


class Consumer:
    """Loads producers' KV into one rank's caches (see the module docstring).

    Args:
        cfg: the parsed ``kv_connector_extra_config``.
        caches: this rank's registered caches.
        tp_rank: this rank's tensor-parallel rank; it loads from ``port + producer rank``.
        tp_size: this engine's tensor-parallel size.
        total_kv_heads: the model's KV heads (all ranks).
        use_mla: whether the model uses MLA (one latent row per token, on every rank).
        secret: the shared secret of every KV connection (None: none; never logged).
        stats: where loads and failures are counted.
        connect: ``connect(host, port)`` makes the client of one producer rank (default: a
            :class:`~connector.kvstore.KVClient` with the config's transport and deadlines);
            each is made once, shared by the load threads, and closed at :meth:`shutdown`.
        streams: the device's streams and events (:class:`~connector.streams.StreamOps`, made for CUDA
            caches; a test passes a stand-in): see :meth:`_load`.
        budget: the rank's device memory budget (default: one of this consumer's own).
        group_caches: the caches of each KV cache group (:mod:`.groups`; default ``[caches]``):
            one entry each; a failed load reports its request, not blocks (:meth:`take_failed`).
    """

    def __init__(
        self,
        cfg: ConnectorConfig,
        caches: RankCaches,
        *,
        tp_rank: int,
        tp_size: int,
        total_kv_heads: int,
        use_mla: bool,
        secret: bytes | None,
        stats: TransferStats,
        connect: Callable[[str, int], KVClient] | None = None,
        streams: StreamOps | None = None,
        budget: DeviceBudget | None = None,
        group_caches: list[RankCaches] | None = None,
    ):
        self.cfg, self.caches, self.groups = cfg, caches, group_caches or [caches]
        self._failed_reqs: set[str] = set()  # loads of several groups that failed
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.total_kv_heads, self.use_mla = total_kv_heads, use_mla
        self.stats = stats
        self._level = logging.INFO if cfg.log_transfers else logging.DEBUG  # loaded: one line
        self._throttle = Throttle()  # failed loads: a peer may fail them at will
        self._secret = secret
        self.backoff = ProducerBackoff(cfg.connect_timeout_s)
        #: its clients of producer ranks (the worker ends finished requests' loads: ``end``)
        self.clients = ProducerClients(connect or self._new_client)
        self._lock = threading.Lock()  # guards the pools (load threads start the gather pool)
        self._load_errors: set[int] = set()
        # async loads in flight, by request id: (spec, start time, future of _receive)
        self._loading: dict[str, tuple[LoadSpec, float, Future]] = {}
        self._discarding: list[Future] = []
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._streams = streams if streams is not None else device_streams(caches.device)
        # nccl: received KV lands in device memory; else on the host, ours to copy (the budget)
        self._device_wire = cfg.transport_for(caches.device) == "nccl"
        self.budget = budget or DeviceBudget(cfg.gpu_memory_bytes)
        self._landings = Landings(self.budget, cfg.load_timeout_s)  # launched on a GPU

    def _pool(self, name: str, workers: int) -> ThreadPoolExecutor:
        """The ``tritonkv-<name>`` threads (load: async loads; discard; gather: concurrent
        loads of one load), started on first use on the transfer CPUs."""
        with self._lock:
            if name not in self._pools:
                self._pools[name] = ThreadPoolExecutor(
                    workers, thread_name_prefix=f"tritonkv-{name}", initializer=pin_current_thread
                )
            return self._pools[name]

    def start_load_kv(self, loads: list[LoadSpec], remote_discards: list[DiscardSpec] = ()) -> None:
        """Start this step's loads (a sync one completes here, before the forward pass) and hand
        ``remote_discards`` to the discard thread."""
        if remote_discards:
            self._discarding = [f for f in self._discarding if not f.done()]
            self._discarding.append(self._pool("discard", 1).submit(self.discard, remote_discards))
        for spec in loads:
            t0 = time.perf_counter()
            if not (self.cfg.async_load or spec.wait_s > 0 or spec.groups):  # groups: async
                self._load(spec, t0, partial(self._receive, spec))
                continue
            try:
                future = self._pool(*LOAD_POOLS[spec.wait_s > 0]).submit(self._receive, spec)
            except Exception as exc:  # e.g. the pool shut down: this load's failure only
                self._fail(spec, t0, exc)
                continue
            self._loading[spec.req_id] = (spec, t0, future)

    def get_finished(self, idle_wait_s: float = 0.0) -> set[str] | None:
        """Async loads whose load completed: unpacked here, on the worker's own thread (or failed).
        ``idle_wait_s`` > 0 (a step that computes nothing, run back to back while requests wait
        for remote KV): wait that long at most for a first one, rather than spin the cores."""
        pending = [future for _, _, future in self._loading.values()]
        if idle_wait_s > 0 and pending and not any(f.done() for f in pending):
            wait_futures(pending, timeout=idle_wait_s, return_when=FIRST_COMPLETED)
        done = [req_id for req_id, (_, _, future) in self._loading.items() if future.done()]
        finished = set()
        for req_id in done:
            spec, t0, future = self._loading.pop(req_id)
            if not self._load(spec, t0, future.result, is_async=True):
                finished.add(req_id)  # done here, or failed
        # On a GPU: those whose unpack completed (polled, never waited for), digests compared.
        finished |= {s.spec.req_id for s in self._settle(False) if s.is_async}
        return finished or None

    def take_failed(self) -> set[str]:
        """Requests of several KV cache groups whose load failed since the last call."""
        failed, self._failed_reqs = self._failed_reqs, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        # A failed async load's blocks come in the get_finished call that reports it, before this
        # one in the same step; on a GPU a sync load's digest verdict waits here for its unpack.
        self._settle(wait=True)
        failed, self._load_errors = self._load_errors, set()
        return failed

    def wait_for_discards(self, timeout_s: float = 30.0) -> None:
        """Wait until the discards handed to the discard thread so far are done."""
        wait_futures(self._discarding, timeout=timeout_s)

    def discard(self, remote_discards: list[DiscardSpec]) -> None:
        """Have the producers discard entries no request here will load, now (on the discard
        thread from :meth:`start_load_kv`: a dead producer costs the connect deadline). Failures
        are logged: the entry's TTL discards it later."""
        args = (self.tp_rank, self.tp_size, self.backoff, self.clients, self.cfg.connect_timeout_s)
        discard_entries(remote_discards, *args)

    def _new_client(self, host: str, port: int) -> KVClient:
        return new_client(self.cfg, self.caches.device, self._device_wire, self._secret, host, port)

    def _receive(self, spec: LoadSpec) -> Received:
        """What ``spec``'s transfer holds for this rank (:data:`Received`): one load per KV cache
        group and producer rank holding heads of this rank, made concurrently, each checked
        against this cache. Network only, no copies: a torch op on a load thread would give it an
        OpenMP team, which on CPU slows every team in the process."""
        t0 = time.perf_counter()
        sources = plan_heads(
            self.total_kv_heads, spec.producer_tp, self.tp_size, self.tp_rank, mla=self.use_mla
        )
        asked = [(one, s) for one in group_loads(spec) for s in sources]
        # one at a time: one load, or an overlapped one of several groups (all stored at once)
        if len(asked) == 1 or (spec.wait_s > 0 and spec.groups):
            got = [self._receive_part(*one) for one in asked]
        else:  # gather: all loads at once, each within its own deadline
            gather = self._pool("gather", 8)
            futures = [gather.submit(self._receive_part, *a) for a in asked]
            got = [f.result() for f in futures]  # the first failure fails the whole load
        paged = {entry[0] for entries in got for entry in entries} - {"state"} == {"pages"}
        parts = [
            (one, source, *rest)
            for (one, source), entries in zip(asked, got, strict=True)
            for _, *rest in entries
        ]
        return parts, paged, 1e3 * (time.perf_counter() - t0)

    def _receive_part(self, spec: LoadSpec, source: HeadSource) -> list[ReceivedPart]:
        """What one producer rank, ``source.rank``, holds of ``source``'s heads: its entry (of
        ``spec.group``), or, for a chunked load, its chunks one after the other until the last
        (each waiting up to ``spec.wait_s`` for the producer to store it)."""
        caches = self.groups[spec.group]
        addr = (spec.host, spec.port + source.rank)
        self.backoff.check(addr, spec.transfer_id)
        part = None  # the whole entry, unless this rank takes only some of its heads
        if not self.use_mla and source.num_heads < len(
            rank_heads(self.total_kv_heads, spec.producer_tp, source.rank)
        ):
            part = Part("kv", 3, *source.src)
        try:
            max_bytes = expected_bytes(caches, self.tp_size, spec, source)
            if self._streams is not None and self._device_wire:  # it lands in GPU memory
                self.budget.check_room(max_bytes, "an entry received on the device")
            waits = _waits(spec, self.cfg.load_timeout_s, self._streams is not None)
            heads = None if part is None else (part.start, part.stop)

            def checked(span, tensors: dict, meta: dict, tag) -> ReceivedPart:
                entry = check_entry(
                    caches, self.tp_size, spec, source, meta, tensors.get("kv"), span
                )
                want = integrity.expected(meta, heads) if self.cfg.digest else None
                return (*entry, want, span[0], tag)

            with self.clients.loading(spec.req_id, addr, spec.wait_s, self.cfg.load_timeout_s) as c:
                entries = receive_entries(c, spec, part, max_bytes, waits, checked)
        except TransferTimeout as exc:
            # A producer that did not connect or answer in time: every further load from it
            # would stall the same way (a sync load stalls the whole decode batch), so they fail
            # at once for a while. Not for a client busy with this worker's own requests.
            if not isinstance(exc, ClientBusyError):
                self.backoff.timed_out(addr, exc.detail)
            raise
        except RemoteError as exc:
            if part is not None:  # e.g. whole pages, which have no head dim to slice
                raise RemoteError(
                    f"{exc.detail}; a producer of another TP size must send token rows: set "
                    '"kv_format": "tokens" on it',
                    peer=exc.peer,
                    key=exc.key,
                ) from None
            raise
        self.backoff.answered(addr)
        return entries

    def _load(
        self, spec: LoadSpec, t0: float, receive: Callable[[], Received], is_async: bool = False
    ) -> bool:
        """Unpack what ``receive()`` returns (see :meth:`_receive`) into ``spec``'s slots, on the
        worker's thread; a failure of either is logged and its blocks go to the error set.
        Token rows fill positions ``[start, start + count)``; whole pages every block from the
        one holding ``start`` (local hits are whole blocks) to the prompt's last allocated one
        (the last prompt token too, which vLLM recomputes; slots past the prompt, which only
        later tokens use); a state group's row its state blocks (:func:`unpack_state_row`).

        ``t0``: when the load started. Off a GPU the load is complete when this returns (False).
        On a GPU (True, unless it failed here) the copy of host-staged KV to the device (within
        the :class:`~connector.streams.DeviceBudget`) and the unpack run on vLLM's stream (the
        forward pass comes after them), their digests and NH are copied to the host behind
        them, and nothing waits: :mod:`.landings` checks them once the unpack completed."""
        ops = self._streams
        gpu = GpuLoad(ops, self.budget, spec) if ops is not None else None
        try:
            parts, paged, network_ms = receive()
            t1 = time.perf_counter()
            nbytes = 0
            for one, source, packed, want, offset, tag in parts:  # all arrived: one unpack each
                caches = self.groups[one.group]
                # host-staged: ours to copy (a device-resident buffer's entry is read in place)
                if gpu is not None and not self._device_wire and not ops.is_device(packed):
                    packed = gpu.to_device(packed)
                if isinstance(caches, StateCaches):
                    if tag is not None:  # (producers hash KV entries only as they pack them)
                        nh = {"nh_out": nh_hash(packed, tag.entry_keys)}  # no host wait
                        verify_unpack(gpu, tag, nh, None, packed, None, None)
                    nbytes += unpack_state_row(caches, one, packed, want, gpu)
                    continue
                rows = packed.shape[2]  # positions [offset, offset + rows)
                views, first, stop = _written(caches, one, paged, source, offset, rows)
                if "short_window" in spec.debug_fault and one.first:  # test hook
                    first = max(first, one.first + caches.block_size)
                if first >= stop:  # a chunk of the local hit, or of the last token only
                    continue
                if spec.corrupt or "no_digest" in spec.debug_fault:  # test hooks: no check (the
                    packed, want = _corrupted(packed) if spec.corrupt else packed, None  # KV lands)
                    tag = None
                slots = caches.slots(one.block_ids, first, stop, rows, offset)
                if "wrong_slot" in spec.debug_fault:  # test hook
                    slots = integrity.shifted_slots(slots, first - offset, stop - offset)
                layers = caches.prepared(views)
                nh = unpack_nh(tag, packed)  # the tag's NH (it covers what a read digest would)
                digest = tag is None and isinstance(want, str)
                read = unpack_kv(packed, layers, slots, digest=digest, **nh)
                where = (views, one.block_ids, caches.block_size, first, stop, offset)
                if gpu is not None:
                    gpu.keep += [packed, slots]
                write_back = self.cfg.digest_write_back and "no_digest" not in spec.debug_fault
                verify_unpack(gpu, tag, nh, want, packed, read, where if write_back else None)
                nbytes += packed.numel() * packed.element_size() * (stop - first) // max(rows, 1)
            log_args = (network_ms, paged, parts)
            if gpu is not None:
                pending, checks, host = gpu.launch(t1)
                self._landings.add(
                    Landing(spec, t0, network_ms, nbytes, log_args, pending, checks, host, is_async)
                )
                return True
            t2 = time.perf_counter()
        except Exception as exc:  # any failure of one load (OOM, a bad entry...) is its own
            if gpu is not None:
                gpu.release()
            self._fail(spec, t0, exc)
            return False
        record_loaded(self.stats, self._level, spec, nbytes, 1e3 * (t2 - t1), log_args)
        return False

    def _settle(self, wait: bool) -> list[Landing]:
        """See :meth:`.landings.Landings.settle`."""
        done = partial(record_loaded, self.stats, self._level)
        return self._landings.settle(wait, self._fail, done)

    def _fail(self, spec: LoadSpec, t0: float, exc: BaseException) -> None:
        """Put ``spec``'s blocks in the error set (vLLM recomputes them; for several KV cache
        groups, its request in :meth:`take_failed`'s), count and log it."""
        size, stop = self.caches.block_size, spec.start + spec.count
        failed = {spec.block_ids[p // size] for p in range(spec.start, stop)}
        if spec.groups:
            self._failed_reqs.add(spec.req_id)
        else:
            self._load_errors |= failed
        reason = load_failure(exc)
        self.stats.record_load_failure(reason)
        show, held = self._throttle.allow(reason)
        if show:
            log_failed(spec, self.tp_rank, t0, exc, reason, len(failed), held)

    def shutdown(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        self.clients.close()


def unpack_state_row(caches: StateCaches, spec: LoadSpec, packed, want, gpu) -> int:
    """Write a state group's row into the block vLLM reads the state from once the claimed
    positions are computed, and into the request's last block (in vLLM's "align" cache mode
    it may copy the first into the last before the step: both hold it then); its bytes."""
    computed = spec.start + spec.count
    slots = dict.fromkeys([caches.state_slot(spec.block_ids, computed), spec.block_ids[-1]])
    read = None
    for slot in slots:  # the digest of the row as the first write read it
        at = caches.slots([slot])
        got = unpack_state(packed, caches.states, at, digest=read is None and isinstance(want, str))
        read = got if read is None else read
        if gpu is not None:
            gpu.keep.append(at)
    if gpu is None:
        integrity.check_read(want, packed, read)
    else:
        gpu.keep.append(packed)
        if want is not None:
            gpu.check(want, packed, read, None)
    return packed.numel()


def new_client(cfg: ConnectorConfig, device, device_wire: bool, secret, host: str, port: int):
    """The :class:`~connector.kvstore.KVClient` of one producer rank: receiving into ``device``
    memory over nccl (``device_wire``), else into host memory (gloo, socket: the copy to the
    device is the consumer's own), with the config's transport and deadlines."""
    return KVClient(
        host,
        port,
        device=device if device_wire else "cpu",
        transport=cfg.transport_for(device),
        timeout_s=cfg.load_timeout_s,
        connect_timeout_s=cfg.connect_timeout_s,
        secret=secret,
    )


def receive_entries(
    client, spec: LoadSpec, part: Part | None, max_bytes: int, waits: dict, checked
) -> list[ReceivedPart]:
    """``[checked(span, tensors, meta)]`` of what ``client`` loads for ``spec``: its transfer's
    entry (one GET), or, for a chunked load, its chunks one after the other until the last. Each
    one's ``span`` (:func:`entry_span`) and contents (``checked``, which raises ValueError) are
    checked as it arrives, before the next is asked for: what a producer can make this rank hold
    is the prompt's KV plus one reply of at most ``max_bytes``."""
    entries, start, final = [], 0, False
    key = group_key(spec.transfer_id, spec.group)
    while not final:
        index = len(entries)
        tensors, meta, tag = client.get(
            chunk_key(key, index) if spec.chunked else key,
            part=part,
            digest=spec.prompt_digest,
            max_bytes=max_bytes,
            defer_entry_check=True,
            **waits,
        )
        span = entry_span(spec, meta, (index, start) if spec.chunked else None)
        entries.append(checked(span, tensors, meta, tag))
        start, final = span[1], span[2]
    return entries


def verify_unpack(gpu: GpuLoad | None, tag, nh: dict, want, packed, read, where) -> None:
    """Check one unpack of ``packed``: the payload ``tag`` (None: none) with the NH outputs it
    computed (``nh``: :func:`unpack_nh`), first, so that changed bytes fail as an
    authentication failure; then the digest it read against ``want``, unless a whole entry's
    tag stands for it (it checks the bytes the producer's pack wrote, under a key: the unpack
    computes no digest then; a slice of heads is hashed by the producer's server as stored, so
    its head digests are still checked); and, with ``where``, the write-back
    (:mod:`connector.integrity`). On a GPU at the verdict, on a host copy
    (:class:`~.landings.GpuLoad`); here elsewhere."""
    if tag is not None and not isinstance(want, list):
        want = None
    if gpu is not None:
        if tag is not None:
            gpu.check_tag(tag, nh["nh_out"])
        if want is not None or where is not None:
            gpu.check(want, packed, read, where)
        return
    if tag is not None:
        tag.check({"kv": nh["nh_out"]})
    integrity.check_read(want, packed, read)
    if where is not None:
        integrity.check_write_back(packed, *where)


def unpack_nh(tag: EntryTag | None, packed: torch.Tensor) -> dict:
    """The keywords that make :func:`tritonkv.unpack_kv` compute the NH outputs ``tag`` is to be
    checked with (``nh_out``, of the entry's bytes as the unpack reads them, under its key), or
    none without a tag. An entry the producer hashed as it packed it, or a slice of its heads
    (hashed by its server): its bytes are checked once unpacked (by the same launch on a GPU),
    the load failing if they differ."""
    if tag is None:
        return {}
    shape = (num_chunks(packed.numel() * packed.element_size()), 2)
    out = torch.empty(shape, dtype=torch.int64, device=packed.device)
    return {"nh_key": tag.entry_keys, "nh_out": out}


def _written(caches: RankCaches, spec: LoadSpec, paged: bool, source, offset: int, rows: int):
    """``(views, first, stop)``: where an entry of ``rows`` rows from position ``offset`` is
    written, positions ``[first, stop)`` (empty when none of it is to be loaded). Token rows: the
    positions ``spec`` loads; whole pages: every slot of the blocks from the one holding
    ``spec.start`` to the last allocated one."""
    block_size = caches.block_size
    if paged:
        views, first = caches.pages, spec.start // block_size * block_size
        stop = len(spec.block_ids) * block_size
    else:
        views, first, stop = caches.head_views(source.dst), spec.start, spec.start + spec.count
    return views, max(first, offset), min(stop, offset + rows)


def _waits(spec: LoadSpec, load_timeout_s: float, on_gpu: bool) -> dict:
    """The wait arguments of ``spec``'s GETs: an overlapped load's ``wait_s`` (the prefill may
    still run) with the transfer's deadline on top; on a GPU at least :data:`PUBLISH_WAIT_S`."""
    wait_s = max(spec.wait_s, PUBLISH_WAIT_S if on_gpu else 0.0)
    if spec.wait_s > 0:
        return {"wait_s": wait_s, "timeout_s": wait_s + load_timeout_s}
    return {"wait_s": wait_s} if on_gpu else {}


def _corrupted(packed: torch.Tensor) -> torch.Tensor:
    """A copy of ``packed`` with every value's bits scrambled (negative-control test hook)."""
    raw = packed.contiguous().view(torch.uint8).clone()
    gen = torch.Generator().manual_seed(1234)
    noise = torch.randint(1, 255, raw.shape, generator=gen, dtype=torch.uint8)
    return (raw ^ noise.to(raw.device)).view(packed.dtype).view(packed.shape)


def log_failed(spec: LoadSpec, tp_rank: int, t0: float, exc, reason, blocks: int, held: int):
    """The WARNING line of a failed load: request, peer, reason, error, sizes."""
    log.warning(
        "tritonkv: load of transfer %s for %s from %s:%d failed after %.1f ms (%s: %s: %s); "
        "its %d blocks will be recomputed (%d tokens)%s",
        short_id(spec.transfer_id),
        spec.req_id,
        spec.host,
        spec.port + tp_rank,
        1e3 * (time.perf_counter() - t0),
        reason,
        type(exc).__name__,
        hide_ids(error_text(exc)),
        blocks,
        spec.count,
        held_note(held),
    )


def record_loaded(
    stats, level: int, spec: LoadSpec, nbytes: int, unpack_ms: float, log_args: tuple
) -> None:
    """Count and log (at ``level``) a completed load (``log_args``: ``(network_ms, paged,
    parts)``)."""
    network_ms, paged, parts = log_args
    stats.record_load(
        nbytes=nbytes, num_tokens=spec.count, network_ms=network_ms, unpack_ms=unpack_ms
    )
    ranks = dict.fromkeys(f"{s.rank}[{s.src[0]}:{s.src[1]}]" for _, s, *_ in parts)
    log.log(
        level,
        "tritonkv: loaded transfer %s for %s: %d tokens (positions %d..%d; %d local), %d bytes, "
        "network %.2f ms, unpack %.2f ms, kv_format %s, from %s:%d ranks %s%s%s",
        short_id(spec.transfer_id),
        spec.req_id,
        spec.count,
        spec.start,
        spec.start + spec.count - 1,
        spec.start,
        nbytes,
        network_ms,
        unpack_ms,
        "pages" if paged else "tokens",
        spec.host,
        spec.port,
        ",".join(ranks),
        f", {len(parts) // len(ranks)} chunks" if spec.chunked else "",
        f", {len(spec.groups)} KV cache groups" if spec.groups else "",
    )
