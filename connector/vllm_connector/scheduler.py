"""The connector's scheduler side: which requests to save and load, and the hand-offs.

A producer watches requests sent with ``do_remote_decode``, tells its workers what to save in
each step (:mod:`.saves`: the whole prompt once computed, or, for the overlapped flow, chunk by
chunk as it is computed), and hands off where the KV is when the request finishes. A consumer
checks each request's hand-off, reports the tokens it will load, tells its workers what to load
into which blocks, and has unused entries discarded. An overlapped hand-off (:mod:`.handoff`)
always loads asynchronously, its loads of the prompt's chunks each waiting up to
``prefill_wait_s`` for the producer to store it (a model of several KV cache groups: its
whole-prompt entry of each group, stored once the prompt is computed). Plain Python, no vLLM
import: the facade (:mod:`.connector`) adapts vLLM's calls to this.
"""

from __future__ import annotations

from collections import OrderedDict

from tritonkv import __version__

from ..integrity import faults
from ..kvstore import short_id
from ..logs import Throttle, get_logger, held_note
from ..transport import SECRET_ENV, is_loopback, load_secret
from .config import ConnectorConfig
from .groups import KVGroup, backoff, group_parts
from .handoff import (
    OVERLAP,
    PROTOCOL,
    build_handoff,
    completed,
    handoff_problems,
    is_handoff,
    parse_handoff,
    request_digest,
    shown,
    sign_handoff,
    signature_problem,
)
from .metadata import DiscardSpec, LoadSpec
from .saves import SavePlan, embeds_prompt
from .stats import TransferStats
from .tp_mapping import plan_heads

log = get_logger("connector")


class SchedulerSide:
    """The scheduler-side state of one engine's connector (see the module docstring).

    Args:
        cfg: the parsed ``kv_connector_extra_config``.
        is_producer: this engine saves prompts' KV for others.
        is_consumer: this engine loads KV from producers' hand-offs.
        block_size: the scheduler's tokens per block.
        tp_size: this engine's tensor-parallel size.
        total_kv_heads: the model's KV heads (all ranks).
        use_mla: whether the model uses MLA (one latent row per token, on every rank).
        engine_port: this engine's first KV port (DP engines serve side by side).
        fingerprint: what a producer's and a consumer's caches must share.
        refuse_loads: why this engine cannot use loaded KV (:mod:`.capability`), or ``""``:
            a consumer with a reason refuses every hand-off with it.
        kv_groups: the model's KV cache groups (:mod:`.groups`); with several, one entry each,
            every load async (overlapped: of whole entries), no other TP size on the producer.
    """

    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        is_producer: bool,
        is_consumer: bool,
        block_size: int,
        tp_size: int,
        total_kv_heads: int,
        use_mla: bool,
        engine_port: int,
        fingerprint: str,
        refuse_loads: str = "",
        kv_groups: list[KVGroup] = (),
    ):
        self.cfg = cfg
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.block_size = block_size
        self.tp_size, self.total_kv_heads, self.use_mla = tp_size, total_kv_heads, use_mla
        self.engine_port, self.fingerprint = engine_port, fingerprint
        self.refuse_loads = refuse_loads
        self.kv_groups = list(kv_groups) if len(kv_groups) > 1 else []
        self.stats = TransferStats()  # consumer: hand-offs refused before any load
        self._throttle = Throttle()  # their log lines: any client may send them
        # Without a secret nothing proves who a producer is: only this machine's may serve us.
        # With a secret, a producer signs its hand-offs and a consumer dials only signed ones.
        self._secret = load_secret(cfg.secret_file or None)
        self.open_to_any = is_consumer and self._secret is None
        if self.open_to_any and cfg.insecure:
            log.warning(
                "tritonkv: INSECURE: this consumer has no shared secret and loads KV from any "
                "producer a hand-off names, unauthenticated: whoever can send it a request can "
                "have it load KV of their making (served to later prompts from its prefix cache)"
            )
        self._saves = SavePlan(block_size, cfg.debug_allow_corrupt, self.kv_groups)  # producer
        self._local_hit: dict[str, int] = {}  # consumer: req_id -> block-aligned local hit
        self._tried: set[str] = set()  # consumer: requests whose hand-off was used or refused
        self._refused: set[str] = set()  # consumer: requests whose hand-off was refused
        self._accepted: dict[str, dict] = {}  # consumer: req_id -> checked hand-off, unused yet
        # consumer: transfer id -> the request that loads it or discarded it (recent ones)
        self._handled: OrderedDict[str, str] = OrderedDict()
        self._receiving: set[str] = set()  # consumer: requests whose async load is running
        self._pending_loads: list[LoadSpec] = []
        self._remote_discards: list[DiscardSpec] = []

    def _check(self, request) -> tuple[dict | None, str, str]:
        """``(params, "", "")`` if ``request`` carries a tritonkv hand-off this consumer can load,
        else ``(None, why, reason)`` (``why`` empty when it carries none at all; ``reason``: one
        of :data:`.stats.LOAD_REFUSALS`). Reads only; logs nothing."""
        params = request.kv_transfer_params
        if not self.is_consumer or not is_handoff(params):
            return None, "", ""
        if self.refuse_loads:
            return None, self.refuse_loads, "engine"
        if params["protocol"] != PROTOCOL:  # nothing else in it can be read as ours
            version = params.get("tritonkv_version")
            why = (
                f"its producer speaks hand-off protocol {shown(params['protocol'])} (tritonkv "
                f"{'version not given' if version is None else shown(version)}), this consumer "
                f"{PROTOCOL!r} (tritonkv {__version__}); run one tritonkv release on producers "
                "and consumers"
            )
            return None, why, "handoff"
        params = completed(params, request)
        problems = handoff_problems(params)
        if not problems and self._secret is not None:
            why = signature_problem(params, self._secret)
            if why:
                problems.append(f"not signed by a producer holding this consumer's secret: {why}")
        if not problems and self.open_to_any and not self.cfg.insecure:
            problems += _unproven(params["remote_host"])
        if not problems and not self.cfg.allows_producer(
            params["remote_host"], params["remote_port"], params["tp_size"]
        ):
            problems.append(
                f"remote_host {params['remote_host']!r} is not among the producers this consumer "
                f"may load from (producers: {list(self.cfg.producers)})"
            )
        producer_problem = bool(problems) and not handoff_problems(params)
        if not problems and self.kv_groups:
            problems += _group_problems(params, self.tp_size, len(self.kv_groups))
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
            if embeds_prompt(request):
                problems.append("the prompt is given as embeddings, which tritonkv does not move")
            elif params["num_tokens"] != request.num_prompt_tokens:
                problems.append(
                    f"num_tokens: the producer's prompt has {params['num_tokens']} tokens, ours "
                    f"{request.num_prompt_tokens}"
                )
            elif params["prompt_digest"] != request_digest(request):
                problems.append(
                    "the producer's prompt differs from ours (token ids, LoRA adapter, "
                    "cache_salt or multimodal inputs)"
                )
        if not problems:
            return params, "", ""
        return None, "; ".join(problems), "producer" if producer_problem else "handoff"

    def _remote_params(self, request) -> dict | None:
        """The consumer-side params of ``request`` if it carries a usable tritonkv hand-off.

        A hand-off it cannot use is logged once; the request is then marked tried (recomputed),
        and its entry is never asked to be discarded: a refused hand-off may name any address.
        """
        params, why, reason = self._check(request)
        if params is None and why:
            self.stats.record_load_refusal(reason)
            show, held = self._throttle.allow(reason)
            if show:
                log.warning(
                    "tritonkv: request %s: refusing transfer %s: %s (reason %s). Recomputing its "
                    "%d prompt tokens%s",
                    request.request_id,
                    short_id(request.kv_transfer_params.get("transfer_id")),
                    why,
                    reason,
                    request.num_prompt_tokens,
                    held_note(held),
                )
            self._tried.add(request.request_id)
            self._refused.add(request.request_id)
        return params

    def on_new_request(self, request) -> None:
        """A new request: see :meth:`.saves.SavePlan.hold_back` (producers)."""
        if self.is_producer:
            self._saves.hold_back(request)

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
            try:
                params = self._remote_params(request)
            except Exception:  # never the engine's failure: this request recomputes
                log.exception("tritonkv: request %s: checking its hand-off failed", req_id)
                self.stats.record_load_refusal("handoff")
                self._tried.add(req_id)
                self._refused.add(req_id)
                params = None
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
        return count, _is_async(self.cfg, params, self.kv_groups)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        req_id = request.request_id
        params = request.kv_transfer_params
        if self.is_producer and isinstance(params, dict) and params.get("do_remote_decode"):
            self._saves.watch(request)
        start = self._local_hit.pop(req_id, None)
        if num_external_tokens <= 0 or start is None:
            return
        params = self._accepted.pop(req_id)  # checked (an overlapped one completed)
        overlapped = params.get(OVERLAP) is True
        self._tried.add(req_id)
        self._handle(params["transfer_id"], req_id)
        if _is_async(self.cfg, params, self.kv_groups):
            self._receiving.add(req_id)
        ids = blocks.get_block_ids()  # one list per KV cache group
        self._pending_loads.append(
            LoadSpec(
                req_id=req_id,
                transfer_id=params["transfer_id"],
                host=params["remote_host"],
                port=params["remote_port"],
                block_ids=list(ids[0]),
                start=start,
                count=num_external_tokens,
                num_tokens=params["num_tokens"] - backoff(self.kv_groups),  # what entries hold
                producer_tp=params["tp_size"],
                prompt_digest=params["prompt_digest"],
                fingerprint=params["fingerprint"],
                wait_s=self.cfg.prefill_wait_s if overlapped else 0.0,
                chunked=overlapped and not self.kv_groups,  # groups: saved whole
                corrupt=self.cfg.debug_allow_corrupt
                and params.get("tritonkv_debug_corrupt") is True,
                groups=group_parts(self.kv_groups, ids, request.num_prompt_tokens),
                debug_fault=faults(params, self.cfg.debug_allow_corrupt),
            )
        )

    def _handle(self, transfer_id: str, req_id: str) -> None:
        """Remember that ``req_id`` loads (or discarded) ``transfer_id`` (the last 64k ids)."""
        self._handled[transfer_id] = req_id
        if len(self._handled) > 1 << 16:
            self._handled.popitem(last=False)

    def finished_receiving(self, req_ids: set[str]) -> None:
        """The workers finished these requests' async loads."""
        self._receiving -= req_ids

    def build_meta(self, scheduler_output) -> dict[str, list]:
        """This step's instructions to the workers: the fields of ``TritonKVMetadata``
        (``saves``, ``loads``, ``discards``, ``remote_discards``), each said once."""
        saves, discards = self._saves.step(scheduler_output)
        meta: dict[str, list] = dict(
            saves=saves,
            loads=self._pending_loads,
            discards=discards,
            refusals=self._saves.take_refusals(),
            remote_discards=self._remote_discards,
        )
        self._pending_loads, self._remote_discards = [], []
        return meta

    def request_finished(self, request, aborted: bool) -> tuple[bool, dict | None]:
        """``(delay_free_blocks, kv_transfer_params)`` of a finished request (``aborted``: vLLM
        aborted it).

        Producer: return the hand-off for the decode server (its keys:
        :func:`.handoff.build_handoff`).

        An aborted request gets no hand-off: its saved KV is discarded from the buffer in the next
        step instead of waiting out its TTL.

        Consumer: a request that ends with a usable hand-off unused (aborted before it loaded,
        its prompt all in the local prefix cache) has the producer discard the entry, in the next
        step, rather than hold it until its TTL. A refused hand-off discards nothing: it came
        from a client and may name any address (its entry, if any, expires by its TTL).
        """
        req_id = request.request_id
        self._local_hit.pop(req_id, None)
        self._tried.discard(req_id)
        self._accepted.pop(req_id, None)
        receiving = req_id in self._receiving
        self._receiving.discard(req_id)
        if req_id in self._refused:  # it may name any address: ask nobody to discard it
            self._refused.discard(req_id)
        else:
            checked = self._check(request)[0]
            handoff = parse_handoff(checked) if checked is not None else None
            # an overlapped load ended by the abort (its worker stops waiting) discards too
            waited = receiving and checked is not None and checked.get(OVERLAP) is True
            if handoff is not None and (handoff.transfer_id not in self._handled or waited):
                self._handle(handoff.transfer_id, req_id)
                self._remote_discards.append(handoff)
        transfer_id = self._saves.finished(req_id, aborted)
        if transfer_id is None:
            return False, None
        num_tokens, digest = self._saves.whole(request, forget=True)  # before a held-back tail
        handoff = build_handoff(
            transfer_id=transfer_id,
            host=self.cfg.advertise_host or self.cfg.host,
            engine_port=self.engine_port,
            num_tokens=num_tokens,
            prompt_digest=digest,
            fingerprint=self.fingerprint,
            tp_size=self.tp_size,
        )
        if self._secret is None:
            return False, handoff
        # valid while its entry may still be held (the entry's TTL starts when it is stored)
        return False, sign_handoff(handoff, self._secret, valid_s=self.cfg.ttl_s + 60.0)


def _is_async(cfg: ConnectorConfig, params: dict, kv_groups: list) -> bool:
    """Whether the load of ``params`` is async: ``async_load``, an overlapped hand-off, or
    several KV cache groups (vLLM takes their failed load only as a failed request)."""
    return cfg.async_load or params.get(OVERLAP) is True or bool(kv_groups)


def _group_problems(params: dict, tp_size: int, num_groups: int) -> list[str]:
    """Why a consumer whose model has ``num_groups`` KV cache groups cannot load the hand-off
    ``params`` (``[]`` when it can): it must come from a producer of its own TP size."""
    problems = []
    if params["tp_size"] != tp_size:
        problems.append(
            f"the producer's TP size {params['tp_size']} differs from ours ({tp_size}), which "
            f"a model of {num_groups} KV cache groups cannot load yet"
        )
    return problems


def _unproven(host: str) -> list[str]:
    """Why a consumer without a secret may not load from ``host`` (nothing would prove who
    serves there): ``[]`` for a loopback address."""
    if is_loopback(host):
        return []
    return [
        f"remote_host {host!r} is not a loopback address and this consumer has no shared secret "
        f"to prove who serves there (set the same secret on both servers: {SECRET_ENV} or "
        'secret_file; or "insecure": true)'
    ]
