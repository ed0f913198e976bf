"""Hidden states of ``extract_hidden_states``: the scheduler side, and what it tells the workers.

:class:`HiddenScheduler` decides which requests' hidden states the workers take, in which step,
and returns where they went when a request finishes (see :mod:`.hidden_states` for the cache and
the worker side). Two modes per request, as vLLM's ``ExampleHiddenStatesConnector`` has them:

- **prompt** (the default): in the step that computes a request's last prompt token (under
  chunked prefill: its last chunk) the workers take prompt positions ``[0, num_prompt_tokens)``
  with the prompt's token ids (a :class:`HiddenSaveSpec`). The request's blocks are freed as
  usual when it finishes: its rows were packed long before.
- **whole sequence** (``kv_transfer_params["include_output_tokens"]: true``): every token the
  model was fed, the prompt and all outputs but the last (which no forward pass took in), with
  ``all_token_ids[:-1]`` beside them. In the prompt's last step the workers only take the file's
  lock (a :class:`HiddenHold`: it exists before vLLM can tell anyone the path); when the request
  finishes, ``request_finished`` asks vLLM to keep its blocks (``delay_free_blocks``) and the next
  step's spec (``release_blocks``) takes the rows from them, after which every worker reports the
  request in ``finished_sending`` and vLLM frees them.

Either way ``request_finished`` returns ``hidden_states_path`` (a file, Example's contract) and/or
``hidden_states_transfer_id`` with the producer's ``hidden_states_host`` and
``hidden_states_port`` and ``hidden_states_digest`` (read with :func:`.reader.load_hidden_states`),
and ``hidden_states_num_tokens``. The served entry is bound to ``hidden_states_digest``, the
request's prompt digest (:func:`~connector.vllm_connector.handoff.request_digest`, as a KV entry:
token ids, LoRA adapter, ``cache_salt``, multimodal inputs): the KV server serves it only to a
reader presenting that digest (:mod:`.reader` says why the params carry it). An aborted request
gets nothing and its workers discard what they took (:class:`HiddenDiscard`). No vLLM import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import uuid
from dataclasses import dataclass, field

from ..integrity import faults
from ..logs import get_logger
from ..steps import finishing_prompts
from ..vllm_connector.handoff import request_digest

log = get_logger("connector")

__all__ = ["PARAM_KEYS", "HiddenDiscard", "HiddenHold", "HiddenSaveSpec", "HiddenScheduler"]

#: the ``kv_transfer_params`` keys a finished request's hidden states are announced under
PARAM_KEYS = (
    "hidden_states_path",
    "hidden_states_transfer_id",
    "hidden_states_host",
    "hidden_states_port",
    "hidden_states_digest",
    "hidden_states_num_tokens",
)


_SAFE_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def file_stem(req_id: str) -> str:
    """The file name (without ``.safetensors``) of ``req_id``'s hidden states in the folder:
    ``req_id`` itself when it is letters, digits and ``._-`` only, not starting with a dot, and
    at most 200 characters (vLLM's own ids: Example's names); else its first 100 characters
    (others than those as ``_``, none of ``._-`` leading) and 16 hex digits of its SHA-256. A
    request id can come from a client (vLLM takes the ``X-Request-Id`` header): it never names
    a path outside the folder."""
    if _SAFE_STEM.fullmatch(req_id):
        return req_id
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", req_id)[:100].lstrip("._-")
    tag = hashlib.sha256(req_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{safe}-{tag}" if safe else tag


@dataclass
class HiddenSaveSpec:
    """Worker: take positions ``[0, num_tokens)`` of ``block_ids`` (the hidden-state group's
    blocks) as ``transfer_id``; write them to ``path`` too unless it is None.
    ``release_blocks``: the request finished and vLLM keeps its blocks for this save: every
    worker reports ``req_id`` in ``finished_sending`` in the step it gets the spec, whatever
    became of the save. ``prompt_digest``: the request's
    :func:`~connector.vllm_connector.handoff.request_digest`; the served entry is bound to it
    (the KV server serves it only to a reader presenting it)."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    token_ids: list[int]
    path: str | None
    debug_fault: str = ""  # integrity.FAULTS the request names (debug_allow_corrupt only)
    release_blocks: bool = False
    prompt_digest: str = field(kw_only=True)


@dataclass
class HiddenHold:
    """Worker: lock ``path`` now; the request's whole sequence comes when it finishes."""

    req_id: str
    transfer_id: str
    path: str


@dataclass
class HiddenDiscard:
    """Worker: an aborted request's hidden states: discard ``transfer_id``, delete ``path``."""

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
                "hidden_states_serve"
            )
        self.block_size, self.group = block_size, group
        self.storage_path, self.allow_custom_path = storage_path, allow_custom_path
        self.serve_at, self.allow_faults = serve_at, allow_faults
        self._watched: dict[str, object] = {}  # req_id -> Request
        self._whole: set[str] = set()  # req_ids of whole-sequence requests
        self._taken: dict[str, HiddenSaveSpec] = {}  # req_id -> what the workers took or hold
        self._finished: list[HiddenSaveSpec] = []  # whole sequences, for the next step
        self._discards: list[HiddenDiscard] = []

    def watch(self, request) -> None:
        """Take ``request``'s hidden states (called when vLLM allocates it blocks)."""
        req_id = request.request_id
        if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
            log.warning(
                "tritonkv: request %s: its prompt is given as embeddings; its hidden states are "
                "not taken (no token ids to put beside them)",
                req_id,
            )
            return
        params = request.kv_transfer_params
        whole = params.get("include_output_tokens", False) if isinstance(params, dict) else False
        if whole is True:
            self._whole.add(req_id)
        elif whole is not False:
            log.warning(
                "tritonkv: request %s: include_output_tokens: expected true or false, got %r; "
                "its hidden states hold the prompt's tokens only",
                req_id,
                whole,
            )
        self._watched[req_id] = request

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
        return os.path.join(self.storage_path, f"{file_stem(request.request_id)}.safetensors")

    def build_meta(self, scheduler_output) -> dict[str, list]:
        """``{"hidden_saves", "hidden_holds", "hidden_discards"}`` for this step's metadata."""
        saves, self._finished = self._finished, []
        discards, self._discards = self._discards, []
        holds: list[HiddenHold] = []
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
                prompt_digest=request_digest(request),
            )
            self._taken[req_id] = spec
            if req_id not in self._whole:
                saves.append(spec)
            elif spec.path is not None:
                holds.append(HiddenHold(req_id, spec.transfer_id, spec.path))
        return {"hidden_saves": saves, "hidden_holds": holds, "hidden_discards": discards}

    def request_finished(
        self, request, aborted: bool, block_ids: tuple[list[int], ...] = ()
    ) -> tuple[bool, dict | None]:
        """``(delay_free_blocks, kv_transfer_params keys)`` for ``request`` (``block_ids``: its
        blocks per cache group, as vLLM gives them). No keys if none were taken or it was
        aborted (then its workers discard what they took in the next step); a delay for a whole
        sequence, which the next step takes from those blocks."""
        req_id = request.request_id
        self._watched.pop(req_id, None)
        whole = req_id in self._whole
        self._whole.discard(req_id)
        spec = self._taken.pop(req_id, None)
        if spec is None:
            return False, None
        if aborted:
            self._discards.append(HiddenDiscard(spec.transfer_id, spec.path))
            return False, None
        if whole:
            token_ids = list(request.all_token_ids)[:-1]  # the last was never fed to the model
            blocks = block_ids[self.group] if len(block_ids) > self.group else []
            needed = -(-len(token_ids) // self.block_size)
            spec = dataclasses.replace(
                spec,
                block_ids=list(blocks[:needed]),
                num_tokens=len(token_ids),
                token_ids=token_ids,
                release_blocks=True,
            )
            self._finished.append(spec)
        params: dict = {}
        if spec.path is not None:
            params["hidden_states_path"] = spec.path
        if self.serve_at is not None:
            params.update(
                hidden_states_transfer_id=spec.transfer_id,
                hidden_states_host=self.serve_at[0],
                hidden_states_port=self.serve_at[1],
                hidden_states_digest=spec.prompt_digest,
            )
        params["hidden_states_num_tokens"] = spec.num_tokens
        return whole, params
