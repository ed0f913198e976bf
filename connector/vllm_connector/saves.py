"""The producer's plan of saves: which prompts to save in which step, under which transfer id,
and which saved transfers to discard.

A request sent with ``do_remote_decode`` is watched (:meth:`SavePlan.watch`) and saved whole in
the step that computes its last prompt token, under a fresh ``uuid4().hex``. A request whose
proxy chose its transfer id (the overlapped flow: its decode server already waits for it) is
published as it is computed instead: in every step, the whole blocks that step completed, as a
:class:`~.metadata.Chunk` (the last one up to the prompt's end), stored under
``"<transfer_id>#<index>"``. A chosen id that is malformed or already issued is refused and
nothing is saved. An aborted request's saved transfer (or a chunked one that ended unfinished) is
discarded in the next step. A model of several KV cache groups (:mod:`.groups`) saves one entry
per group, each from the group's first position on (a sliding window's last blocks), once the
prompt is computed, also under a chosen id: a state is final only after the prompt's last chunk
and a window's first block is known only from the prompt's end, so such a model is not published
chunk by chunk; its decode side waits for the whole-prompt entries instead. Plain Python, no vLLM
import.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any

from ..integrity import faults
from ..kvstore import short_id
from ..logs import get_logger
from ..steps import prompt_steps
from .groups import KVGroup, backoff, group_parts
from .handoff import proxy_transfer_id, request_digest
from .metadata import Chunk, SaveSpec

log = get_logger("connector")

#: How many issued transfer ids a producer remembers (a chosen one among them is refused).
ISSUED_IDS = 1 << 16


class SavePlan:
    """What one producer's scheduler side saves (see the module docstring).

    Args:
        block_size: the scheduler's tokens per block.
        debug_allow_corrupt: honour the test hooks of ``kv_transfer_params`` (``integrity``).
        groups: the model's KV cache groups when it has several (one entry each), else empty.
    """

    def __init__(
        self, block_size: int, debug_allow_corrupt: bool = False, groups: list[KVGroup] = ()
    ):
        self.block_size = block_size
        self.groups = list(groups) if len(groups) > 1 else []
        self._backoff = backoff(self.groups)
        # req_id -> (prompt length, prompt digest) before the last tokens were held back
        self._whole: dict[str, tuple[int, str]] = {}
        self._debug = debug_allow_corrupt
        self._watched: dict[str, Any] = {}  # req_id -> Request (do_remote_decode)
        self._saved: dict[str, str] = {}  # req_id -> transfer id issued
        # req_id -> (next chunk's index, positions published, prompt digest) of the requests
        # published chunk by chunk whose last chunk is still to come
        self._published: dict[str, tuple[int, int, str]] = {}
        self._issued: OrderedDict[str, None] = OrderedDict()  # recent transfer ids
        self._discards: list[str] = []  # saved transfers of aborted requests
        # (transfer id, prompt digest) of chosen ids refused: sealed for that prompt, so that
        # its decode side, waiting for the id, stops at once
        self._refusals: list[tuple[str, str]] = []

    def hold_back(self, request) -> None:
        """A model with state groups: make ``request`` (sent with ``do_remote_decode``, new) stop
        :data:`.groups.BACKOFF` token short, so that its state is h(N-1), the one the decode side
        needs (:mod:`.groups`); its hand-off still names the whole prompt (:meth:`whole`). As
        vLLM's NixlConnector does: its prompt token ids lose their tail and it is given one
        output token. Not a prompt that is too short, given as embeddings, or that skips the
        prefix cache (prompt logprobs: the decode side recomputes it all)."""
        k, params = self._backoff, request.kv_transfer_params
        skips = getattr(request, "get_skip_reading_prefix_cache", lambda: False)
        if (
            not k
            or not (isinstance(params, dict) and params.get("do_remote_decode"))
            or request.num_prompt_tokens <= k
            or embeds_prompt(request)
            or skips()
            or request.request_id in self._whole
            or "state_after_last" in faults(params, self._debug)  # test hook
        ):
            return
        self._whole[request.request_id] = (request.num_prompt_tokens, request_digest(request))
        del request.prompt_token_ids[-k:]
        del request._all_token_ids[-k:]  # vLLM's own list of the request's tokens
        request.num_prompt_tokens -= k
        request.max_tokens = 1

    def whole(self, request, forget: bool = False) -> tuple[int, str]:
        """``(prompt length, prompt digest)`` of ``request``'s whole prompt (before
        :meth:`hold_back`), for its hand-off and entries; ``forget``: the request finished."""
        known = (self._whole.pop if forget else self._whole.get)(request.request_id, None)
        return known if known is not None else (request.num_prompt_tokens, request_digest(request))

    def watch(self, request) -> None:
        """Save ``request``'s prompt (sent with ``do_remote_decode``), unless it is given as
        embeddings (logged: the decode side recomputes it)."""
        if embeds_prompt(request):
            log.warning(
                "tritonkv: request %s: its prompt is given as embeddings, which tritonkv does "
                "not move; the decode side will recompute it",
                request.request_id,
            )
            return
        self._watched[request.request_id] = request

    def step(self, scheduler_output) -> tuple[list[SaveSpec], list[str]]:
        """This step's saves, and the transfers to discard (each said once; the refusals of chosen
        ids: :meth:`take_refusals`)."""
        saves = []
        done = self._saved.keys() - self._published.keys()
        for req_id, request, block_ids, end in prompt_steps(scheduler_output, self._watched, done):
            spec = self._save_spec(req_id, request, block_ids, end)
            if spec is not None:
                saves.append(spec)
        discards, self._discards = self._discards, []
        return saves, discards

    def take_refusals(self) -> list[tuple[str, str]]:
        """``(transfer id, prompt digest)`` of the chosen ids refused since the last call: the
        worker seals each for that digest (its decode side's loads end at once)."""
        refusals, self._refusals = self._refusals, []
        return refusals

    def finished(self, req_id: str, aborted: bool) -> str | None:
        """The transfer id of a finished request's saved prompt, for its hand-off; None when
        none was saved, or when it was aborted or ended before its last chunk (then its entries
        are discarded in the next step rather than when their TTL runs out)."""
        self._watched.pop(req_id, None)
        transfer_id = self._saved.pop(req_id, None)
        unfinished = self._published.pop(req_id, None) is not None
        if transfer_id is not None and (aborted or unfinished):
            self._discards.append(transfer_id)
            transfer_id = None
        if transfer_id is None:  # no hand-off: its whole prompt is not asked for (whole())
            self._whole.pop(req_id, None)
        return transfer_id

    def _save_spec(self, req_id: str, request, block_ids, end: int) -> SaveSpec | None:
        """What to save of ``request`` once this step computed its prompt positions ``[0,
        end)`` (module docstring). None: nothing this step."""
        prompt_len = request.num_prompt_tokens
        final = end == prompt_len
        chunked = req_id in self._published
        if req_id not in self._saved:  # several groups: saved whole (module docstring)
            chosen = proxy_transfer_id(request.kv_transfer_params)[0] is not None
            chunked = chosen and not self.groups
            if not (final or chunked):
                return None
        if not block_ids:
            log.error("tritonkv: no block ids for %s; its KV cannot be saved", req_id)
            return None
        if req_id not in self._saved and not self._issue(req_id, request, chunked):
            return None
        chunk, digest = None, None
        if chunked:
            index, start, digest = self._published[req_id]
            stop = end if final else end // self.block_size * self.block_size
            if stop <= start:  # no new whole block (or recomputing after a preemption)
                return None
            chunk = Chunk(index, start, stop, final)
            if final:
                del self._published[req_id]
            else:
                self._published[req_id] = (index + 1, stop, digest)
        stop = end if chunk is None else chunk.stop
        needed = -(-stop // self.block_size)  # blocks holding positions [0, stop)
        return SaveSpec(
            req_id,
            self._saved[req_id],
            list(block_ids[0][:needed]),
            prompt_len,
            prompt_digest=digest or self.whole(request)[1],
            chunk=chunk,
            groups=group_parts(self.groups, block_ids, self.whole(request)[0], stop),
            debug_fault=faults(request.kv_transfer_params, self._debug),
        )

    def _issue(self, req_id: str, request, chunked: bool) -> bool:
        """Give ``request`` its transfer id (False: refused, nothing of it is saved)."""
        transfer_id = self._transfer_id(req_id, request)
        if transfer_id is None:
            self._watched.pop(req_id)
            return False
        self._saved[req_id] = transfer_id
        self._issued[transfer_id] = None
        while len(self._issued) > ISSUED_IDS:
            self._issued.popitem(last=False)
        if chunked:
            self._published[req_id] = (0, 0, request_digest(request))
        return True

    def _transfer_id(self, req_id: str, request) -> str | None:
        """The transfer id to save ``request``'s prompt under: the one its proxy chose (the
        overlapped flow), else a fresh ``uuid4().hex``. A chosen id that is malformed or that
        this producer issued before (the last 64k) is refused, logged, and nothing is saved:
        an entry under another id would never be found by the decode side, which waits for
        the chosen one and recomputes when its wait ends."""
        chosen, why = proxy_transfer_id(request.kv_transfer_params)
        if chosen is None and not why:
            return uuid.uuid4().hex
        if chosen is not None and chosen in self._issued:
            why = f"transfer_id {short_id(chosen)} is already in use"
            # the whole prompt's digest (what its decode side waits with), not a held-back one's
            self._refusals.append((chosen, self.whole(request)[1]))
        if not why:
            return chosen
        log.warning(
            "tritonkv: request %s: refusing the transfer id it chose (%s); its KV is not "
            "saved, the decode side will recompute it",
            req_id,
            why,
        )
        return None


def embeds_prompt(request) -> bool:
    """Whether (part of) ``request``'s prompt is given as embeddings, not token ids."""
    return request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None
