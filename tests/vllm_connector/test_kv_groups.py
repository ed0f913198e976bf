"""Models of several KV cache groups (vLLM's hybrid KV cache manager): what each group moves, one
entry per group under one transfer id, a sliding window's blocks outside it neither moved nor
written, and a failed load reported as a failed request (vLLM cannot map block ids of several
groups back to requests)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.connector_sides import (
    DIGEST,
    VLLM_CPU,
    bits,
    caches,
    fake_client,
    poll_loads,
    rank_caches,
)
from support.kvstore import deliver

from connector.kvstore import KVBuffer
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.consumer import Consumer
from connector.vllm_connector.groups import KVGroup, describe_groups, group_key
from connector.vllm_connector.metadata import GroupPart, LoadSpec, SaveSpec, group_loads
from connector.vllm_connector.producer import Producer
from connector.vllm_connector.saves import SavePlan
from connector.vllm_connector.stats import TransferStats

BLOCK = 4  # VLLM_CPU's block size
SLIDING, FULL = KVGroup("sliding", (0, 2), BLOCK, window=6), KVGroup("full", (1, 3), BLOCK)


def test_a_group_says_what_it_is_and_refuses_nonsense():
    assert describe_groups([SLIDING, FULL]) == "groups=sliding=6/4/L0,2;full/4/L1,3"
    assert group_key("a" * 32, 0) == "a" * 32 and group_key("a" * 32, 2) == "a" * 32 + "#g2"
    for bad in [
        dict(kind="mamba", layers=(0,), block_size=4),
        dict(kind="sliding", layers=(0,), block_size=4),
        dict(kind="full", layers=(0,), block_size=4, window=8),
        dict(kind="sliding", layers=(0,), block_size=0, window=8),
    ]:
        with pytest.raises(ValueError):
            KVGroup(**bad)


@settings(max_examples=300, deadline=None)
@given(
    num_tokens=st.integers(1, 400), window=st.integers(1, 130), block=st.sampled_from([1, 4, 16])
)
def test_a_sliding_group_moves_the_blocks_vllm_keeps_for_the_last_tokens_window(
    num_tokens, window, block
):
    """The first position moved is the first slot of the first block vLLM's sliding-window
    manager keeps for a consumer that computed ``num_tokens - 1`` tokens (its own rule, asked of
    it), so no position the window reads is missing and no kept block is left half written; at
    most the window plus one block is moved."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    group = KVGroup("sliding", (0,), block, window=window)
    first = group.first_position(num_tokens)
    manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
    skipped = SlidingWindowManager.get_num_skipped_tokens(manager, num_tokens - 1)
    assert first == skipped // block * block
    assert first % block == 0 and first <= max(0, num_tokens - window)
    assert num_tokens - first <= window + block - 1
    assert KVGroup("full", (0,), block).first_position(num_tokens) == 0


def test_the_facade_reads_vllms_group_specs():
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from connector.vllm_connector.connector import kv_cache_groups

    kw = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    full, sliding = FullAttentionSpec(**kw), SlidingWindowSpec(sliding_window=48, **kw)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]

    def config(*groups):
        return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(n, s) for n, s in groups])

    assert kv_cache_groups(None, config((names, full))) == []
    assert kv_cache_groups(None, config((names[::2], sliding), (names[1::2], full))) == [
        KVGroup("sliding", (0, 2), 32, 48),
        KVGroup("full", (1, 3), 32),
    ]
    chunked = ChunkedLocalAttentionSpec(attention_chunk_size=64, **kw)
    with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec"):
        kv_cache_groups(None, config((names[:2], chunked), (names[2:], full)))


def _plan_save(num_tokens: int) -> SaveSpec:
    plan = SavePlan(BLOCK, groups=[SLIDING, FULL])
    request = SimpleNamespace(
        request_id="r",
        kv_transfer_params={"do_remote_decode": True},
        prompt_token_ids=list(range(num_tokens)),
        num_prompt_tokens=num_tokens,
        num_computed_tokens=0,
    )
    plan.watch(request)
    ids = ([5, 4, 3, 2, 1, 0], [2, 0, 1, 3, 5, 4])  # 6 blocks of VLLM_CPU
    blocks = SimpleNamespace(get_block_ids=lambda _r: ids)
    out = SimpleNamespace(num_scheduled_tokens={"r": num_tokens}, kv_connector_block_state=blocks)
    (spec,), _ = plan.step(out)
    return spec


def test_the_plan_saves_every_group_and_a_chosen_id_once_the_prompt_is_computed():
    """Several groups are never published chunk by chunk: a proxy's chosen id (the overlapped
    flow) is saved under that id, whole, in the step that computes the prompt's last token."""
    spec = _plan_save(15)  # window 6: the last token's window starts at 9, in block 2
    assert spec.groups == [GroupPart(0, [5, 4, 3, 2], 8), GroupPart(1, [2, 0, 1, 3], 0)]
    plan = SavePlan(BLOCK, groups=[SLIDING, FULL])
    chosen = SimpleNamespace(
        request_id="o", kv_transfer_params={"do_remote_decode": True, "transfer_id": "c" * 32},
        prompt_token_ids=list(range(10)), num_prompt_tokens=10, num_computed_tokens=0,
    )  # fmt: skip
    plan.watch(chosen)
    blocks = SimpleNamespace(get_block_ids=lambda _r: ([1, 2, 3], [4, 5, 6]))
    out = SimpleNamespace(num_scheduled_tokens={"o": 8}, kv_connector_block_state=blocks)
    assert plan.step(out) == ([], [])  # a first chunk: nothing yet
    chosen.num_computed_tokens = 8
    out.num_scheduled_tokens = {"o": 2}
    (spec,), _ = plan.step(out)
    assert (spec.transfer_id, spec.chunk, spec.num_tokens) == ("c" * 32, None, 10)
    assert spec.groups == [GroupPart(0, [1, 2, 3], 4), GroupPart(1, [4, 5, 6], 0)]
    assert plan.take_refusals() == [] and plan.finished("o", aborted=False) == "c" * 32


def test_a_chosen_id_in_use_is_refused_for_the_whole_prompts_digest():
    """A state model's producer holds the last token back; the refusal seals the id for the
    digest its decode side waits with: the whole prompt's."""
    from connector.vllm_connector.handoff import request_digest

    plan = SavePlan(BLOCK, groups=[KVGroup("state", (0,), BLOCK), FULL])
    blocks = SimpleNamespace(get_block_ids=lambda _r: ([1, 2, 3], [4, 5, 6]))
    for req_id in ("a", "b"):
        request = _request(10)
        request.request_id = req_id
        request.kv_transfer_params["transfer_id"] = "d" * 32
        whole = request_digest(request)
        plan.hold_back(request)
        plan.watch(request)
        out = SimpleNamespace(num_scheduled_tokens={req_id: 9}, kv_connector_block_state=blocks)
        saves, _ = plan.step(out)
        if req_id == "a":
            assert [(s.transfer_id, s.prompt_digest) for s in saves] == [("d" * 32, whole)]
        else:
            assert saves == [] and plan.take_refusals() == [("d" * 32, whole)]


def _sides(kv_format: str, buffer: KVBuffer, seed_dst=None, cfg=None):
    """A producer over random caches of two groups storing into ``buffer``, a consumer (of
    ``cfg``) over sentinel ones loading from it."""
    src = [caches(VLLM_CPU, seed=s) for s in (1, 2)]
    dst = [caches(VLLM_CPU, seed=seed_dst) for _ in (1, 2)]
    src_views = [rank_caches(c, BLOCK) for c in src]
    prod = Producer(
        ConnectorConfig(kv_format=kv_format), src_views[0], tp_rank=0, engine_port=1,
        fingerprint="fp", secret=None, stats=TransferStats(), group_caches=src_views,
    )  # fmt: skip
    prod.attach_buffer(buffer)
    dst_views = [rank_caches(c, BLOCK) for c in dst]
    cons = Consumer(
        cfg or ConnectorConfig(), dst_views[0], tp_rank=0, tp_size=1, total_kv_heads=2,
        use_mla=False, secret=None, stats=TransferStats(), group_caches=dst_views,
        connect=lambda host, port: _Client(buffer),
    )  # fmt: skip
    return src, dst, prod, cons


class _Client:
    """A client of ``buffer`` in process (hashable: an overlapped load leases it)."""

    def __init__(self, buffer: KVBuffer):
        self.buffer = buffer

    def get(self, key, timeout_s=None, **kw):
        """A GET of ``key`` (an overlapped load's too: ``wait_s`` waits for it)."""
        return deliver(self.buffer, key, **kw)

    def close(self):
        pass


@pytest.mark.parametrize("kv_format", ["tokens", "pages"])
@pytest.mark.parametrize(("num_tokens", "local"), [(15, 0), (15, 4), (6, 0), (23, 8)])
def test_one_transfer_carries_both_groups_and_only_the_window(kv_format, num_tokens, local):
    """Saved as one entry per group, loaded (async, as for every model of several groups) into
    other blocks: the full group's claimed positions equal the producer's, the sliding group's
    from its first kept block on; every other slot keeps its sentinel."""
    buffer = KVBuffer(1 << 24)
    src, dst, prod, cons = _sides(kv_format, buffer)
    save = _plan_save(num_tokens)
    prod.wait_for_save([save])
    assert len(buffer) == 2  # one entry per group, under the id and group_key(id, 1)
    dst_ids = ([0, 3, 5, 1, 4, 2][:-(-num_tokens // BLOCK)], [5, 4, 3, 2, 1, 0][: -(-num_tokens // BLOCK)])  # fmt: skip
    firsts = [SLIDING.first_position(num_tokens), 0]
    load = LoadSpec(
        "c", save.transfer_id, "h", 1, dst_ids[0], local, num_tokens - 1 - local, num_tokens,
        prompt_digest=save.prompt_digest,
        groups=[GroupPart(g, dst_ids[g], firsts[g]) for g in (0, 1)],
    )  # fmt: skip
    cons.start_load_kv([load])
    finished, errors = poll_loads(cons, {"c"})
    assert finished == {"c"} and not errors and not cons.take_failed()
    _assert_loaded(kv_format, src, dst, save, dst_ids, num_tokens, local)
    buffer.close()
    cons.shutdown()


def _assert_loaded(kv_format, src, dst, save, dst_ids, num_tokens: int, local: int) -> None:
    """Each group's claimed positions in ``dst`` equal the producer's (:func:`_sides`), from its
    first position on; every other slot keeps its sentinel."""
    firsts = [SLIDING.first_position(num_tokens), 0]
    stop = num_tokens - 1
    for g in (0, 1):
        first = max(local, firsts[g])
        if kv_format == "pages":  # whole blocks: to the last one allocated
            first, stop_g = first // BLOCK * BLOCK, len(dst_ids[g]) * BLOCK
        else:
            stop_g = stop
        want = caches(VLLM_CPU, seed=None)  # all sentinel
        src_views, want_views = rank_caches(src[g], BLOCK).layers, rank_caches(want, BLOCK).layers
        for pos in range(first, stop_g):
            s_blk, d_blk = save.groups[g].block_ids[pos // BLOCK], dst_ids[g][pos // BLOCK]
            off = pos % BLOCK
            for (sk, sv), (wk, wv) in zip(src_views, want_views, strict=True):
                wk[d_blk, :, off] = sk[s_blk, :, off]
                wv[d_blk, :, off] = sv[s_blk, :, off]
        assert torch.equal(bits(dst[g]), bits(want)), f"group {g}"


def _overlapped_load(save: SaveSpec, wait_s: float, num_tokens: int = 15):
    """The load of an overlapped hand-off of ``save``'s prompt (no local hit), as the scheduler
    side makes it for several groups: waiting up to ``wait_s``, not chunked; its block ids."""
    n = -(-num_tokens // BLOCK)
    dst_ids = ([0, 3, 5, 1, 4, 2][:n], [5, 4, 3, 2, 1, 0][:n])
    firsts = [SLIDING.first_position(num_tokens), 0]
    load = LoadSpec(
        "c", save.transfer_id, "h", 1, dst_ids[0], 0, num_tokens - 1, num_tokens,
        prompt_digest=save.prompt_digest, wait_s=wait_s,
        groups=[GroupPart(g, dst_ids[g], firsts[g]) for g in (0, 1)],
    )  # fmt: skip
    return load, dst_ids


def test_an_overlapped_load_of_several_groups_waits_for_their_whole_prompt_entries():
    buffer = KVBuffer(1 << 24)
    src, dst, prod, cons = _sides("tokens", buffer)
    save = _plan_save(15)
    load, dst_ids = _overlapped_load(save, wait_s=20.0)
    cons.start_load_kv([load])
    time.sleep(0.3)
    assert cons.get_finished() is None  # the prefill is still running
    prod.wait_for_save([save])  # the prompt computed: both groups stored at once
    finished, errors = poll_loads(cons, {"c"})
    assert finished == {"c"} and not errors and not cons.take_failed()
    _assert_loaded("tokens", src, dst, save, dst_ids, 15, 0)
    assert len(buffer) == 0  # both entries claimed
    buffer.close()
    cons.shutdown()


@pytest.mark.parametrize("ending", ["sealed", "deadline"])
def test_an_overlapped_load_of_several_groups_ends_when_refused_or_at_its_deadline(ending):
    """A producer that refused the id (sealed for that prompt) ends the wait at once; one that
    never stores it, at the load's wait: the request is reported failed (recomputed), its slots
    unwritten."""
    buffer = KVBuffer(1 << 24)
    _, dst, _, cons = _sides("tokens", buffer, cfg=ConnectorConfig(load_timeout_s=1.0))
    save = _plan_save(15)
    load, _ = _overlapped_load(save, wait_s=30.0 if ending == "sealed" else 0.5)
    t0 = time.monotonic()
    cons.start_load_kv([load])
    if ending == "sealed":
        time.sleep(0.2)
        buffer.discard(save.transfer_id, save.prompt_digest, seal=True)
    finished, errors = poll_loads(cons, {"c"})
    assert finished == {"c"} and errors == set() and cons.take_failed() == {"c"}
    assert time.monotonic() - t0 < 10.0
    assert all(torch.equal(bits(d), bits(caches(VLLM_CPU, seed=None))) for d in dst)
    buffer.close()
    cons.shutdown()


def test_a_failed_group_save_discards_the_transfer_and_ends_a_waiting_load():
    """One group's save fails after another's was stored: the transfer's entries are discarded
    and it is sealed, so an overlapped load waiting for it fails at once (recomputed), not at
    its deadline."""
    buffer = KVBuffer(1 << 24)
    _, dst, prod, cons = _sides("tokens", buffer)
    save = _plan_save(15)
    load, _ = _overlapped_load(save, wait_s=30.0)
    real = prod._save

    def fail_group_1(spec):
        if spec.group == 1:
            raise ValueError("injected: no room")
        real(spec)

    prod._save = fail_group_1
    t0 = time.monotonic()
    cons.start_load_kv([load])
    time.sleep(0.2)
    prod.wait_for_save([save])
    assert len(buffer) == 0
    finished, errors = poll_loads(cons, {"c"})
    assert finished == {"c"} and errors == set() and cons.take_failed() == {"c"}
    assert time.monotonic() - t0 < 10.0
    buffer.close()
    cons.shutdown()


def test_a_load_missing_one_groups_entry_fails_the_request_not_blocks():
    buffer = KVBuffer(1 << 24)
    _, _, prod, cons = _sides("pages", buffer)
    save = _plan_save(15)
    prod.wait_for_save([save])
    load = LoadSpec(
        "c", save.transfer_id, "h", 1, [0, 1, 2, 3], 0, 14, 15, prompt_digest=save.prompt_digest,
        groups=[GroupPart(0, [0, 1, 2, 3], 8), GroupPart(1, [4, 5, 0, 1], 0),
                GroupPart(2, [2, 3, 4, 5], 0)],
    )  # fmt: skip
    cons.groups = [*cons.groups, cons.groups[1]]  # a third group the producer never saved
    cons.start_load_kv([load])
    finished, errors = poll_loads(cons, {"c"})
    assert finished == {"c"} and errors == set()
    assert cons.take_failed() == {"c"} and cons.take_failed() == set()
    buffer.close()
    cons.shutdown()


def test_group_loads_write_the_claim_from_each_groups_first_position():
    load = LoadSpec(
        "c", "t", "h", 1, [1], 4, 10, 15, prompt_digest=DIGEST,
        groups=[GroupPart(0, [1, 2], 8), GroupPart(1, [3, 4], 0)],
    )  # fmt: skip
    sliding, full = group_loads(load)
    assert (sliding.group, sliding.start, sliding.count, sliding.first) == (0, 8, 6, 8)
    assert (full.group, full.start, full.count, full.first) == (1, 4, 10, 0)
    assert sliding.block_ids == [1, 2] and not sliding.groups


def test_a_consumer_of_several_groups_loads_async_and_refuses_what_it_cannot_load():
    from connector.vllm_connector.scheduler import _group_problems, _is_async

    cfg = ConnectorConfig()
    assert _is_async(cfg, {}, [SLIDING, FULL]) and not _is_async(cfg, {}, [])
    assert _group_problems({"tp_size": 2}, 2, 2) == []
    assert _group_problems({"tp_size": 2, "overlap": True}, 2, 2) == []
    assert "TP size 1 differs" in _group_problems({"tp_size": 1}, 2, 2)[0]


@pytest.mark.parametrize("state", [False, True])
def test_an_overlapped_handoff_of_several_groups_waits_for_whole_prompt_entries(state):
    """The consumer's scheduler side completes an overlapped hand-off from its own prompt and
    loads it async, waiting up to ``prefill_wait_s``, one entry per group (not chunked); a
    state model's entries hold ``N - 1`` positions (the producer held the last back)."""
    from connector.vllm_connector.handoff import PROTOCOL, request_digest
    from connector.vllm_connector.scheduler import SchedulerSide

    groups = [KVGroup("state", (0, 2), BLOCK) if state else SLIDING, FULL]
    cfg = ConnectorConfig(prefill_wait_s=7.0)
    side = SchedulerSide(
        cfg, is_producer=False, is_consumer=True, block_size=BLOCK, tp_size=1,
        total_kv_heads=2, use_mla=False, engine_port=0, fingerprint="fp", kv_groups=groups,
    )  # fmt: skip
    side.open_to_any = True  # loopback producer, whatever the environment's secret
    side._secret = None
    params = {
        "do_remote_prefill": True, "protocol": PROTOCOL, "remote_host": "127.0.0.1",
        "remote_port": 14600, "fingerprint": "fp", "tp_size": 1, "transfer_id": "c" * 32,
        "overlap": True,
    }  # fmt: skip
    request = SimpleNamespace(
        request_id="o", kv_transfer_params=params, prompt_token_ids=list(range(15)),
        num_prompt_tokens=15,
    )  # fmt: skip
    assert side.get_num_new_matched_tokens(request, 0) == (14, True)
    ids = ([0, 1, 2, 3], [4, 5, 6, 7])
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ids), 14)
    (load,) = side.build_meta(
        SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None)
    )["loads"]
    assert (load.wait_s, load.chunked, load.count) == (7.0, False, 14)
    assert (load.num_tokens, load.prompt_digest) == (14 if state else 15, request_digest(request))
    assert load.groups == [GroupPart(0, ids[0], 0 if state else 8), GroupPart(1, ids[1], 0)]


def test_a_state_group_names_its_state_and_refuses_what_it_cannot_place():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    from connector.vllm_connector.connector import kv_cache_groups

    names = [f"model.layers.{i}.x" for i in range(4)]
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)

    def groups(**kw):
        mamba = MambaSpec(block_size=32, shapes=((3, 8), (2, 4, 4)),
                          dtypes=(torch.bfloat16, torch.float32), **kw)  # fmt: skip
        config = SimpleNamespace(
            kv_cache_groups=[
                KVCacheGroupSpec(names[::2], mamba),
                KVCacheGroupSpec(names[1::2], full),
            ]
        )
        return kv_cache_groups(None, config)

    state, _ = groups(mamba_cache_mode="align")
    assert state.kind == "state" and state.layers == (0, 2)
    assert state.describe() == "state[MAMBA2:[[3,8],[2,4,4]]:bfloat16,float32:align]/32/L0,2"
    for bad in [dict(mamba_cache_mode="all"), dict(num_speculative_blocks=1)]:
        with pytest.raises(ValueError, match="mamba_cache_mode"):
            groups(**bad)


def _request(n: int, fault: str = "") -> SimpleNamespace:
    params = {"do_remote_decode": True, "tritonkv_debug_fault": fault}
    ids = list(range(100, 100 + n))
    return SimpleNamespace(
        request_id="r", kv_transfer_params=params, prompt_token_ids=ids, _all_token_ids=list(ids),
        num_prompt_tokens=n, num_computed_tokens=0, max_tokens=16,
    )  # fmt: skip


def test_a_producer_with_state_groups_holds_the_last_token_back():
    """It computes N - 1 positions (so the state is h(N-1)); its hand-off and entries still name
    the whole prompt. Not for a one-token prompt, nor with the test hook that shifts the
    boundary."""
    from connector.vllm_connector.handoff import request_digest

    state = KVGroup("state", (0,), BLOCK)
    plan = SavePlan(BLOCK, True, groups=[state, FULL])
    request = _request(10)
    whole = (10, request_digest(request))
    plan.hold_back(request)
    assert request.num_prompt_tokens == 9 and request.prompt_token_ids == list(range(100, 109))
    assert request._all_token_ids == list(range(100, 109)) and request.max_tokens == 1
    assert plan.whole(request) == whole
    plan.hold_back(request)  # once only
    assert request.num_prompt_tokens == 9
    plan.watch(request)
    ids = ([1, 2, 3], [4, 5, 6])
    out = SimpleNamespace(
        num_scheduled_tokens={"r": 9},
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda _r: ids),
    )
    (spec,), _ = plan.step(out)
    assert (spec.num_tokens, spec.prompt_digest) == (9, whole[1])
    assert spec.groups == [GroupPart(0, [1, 2, 3], 0), GroupPart(1, [4, 5, 6], 0)]
    for request in (_request(1), _request(10, "state_after_last")):
        plan.hold_back(request)
        assert request.num_prompt_tokens == len(request.prompt_token_ids) in (1, 10)
    assert SavePlan(BLOCK, groups=[SLIDING, FULL]).hold_back(r := _request(10)) is None
    assert r.num_prompt_tokens == 10  # no state group: nothing held back


@pytest.mark.parametrize(
    ("num_tokens", "tamper", "tagged"),
    [(3, False, False), (8, False, False), (9, False, False), (12, False, False), (8, True, False),
     (8, False, True), (8, True, True)],
)  # fmt: skip
def test_a_state_row_lands_in_the_blocks_vllm_reads_it_from(num_tokens, tamper, tagged):
    """Saved from the block of the producer's last computed position, loaded into the block of
    the consumer's and into its last block (vLLM's align mode may copy the first into the last
    before the step); every other slot keeps its sentinel; the full group as ever. A state row
    changed on the way fails its digest: the request is reported failed (recomputed). A state
    row whose tag is left to the consumer (``tagged``: our producers never do that, as they hash
    only KV entries as they pack them) is hashed and checked before it is written."""
    from support.kvstore import LocalEntryTag

    from connector.vllm_connector.cache_views import StateCaches
    from tritonkv import umac

    def states(seed):  # like vllm-cpu's: the states at the start of each page, then padding
        gen = torch.Generator().manual_seed(seed or 0)
        pages = torch.randint(-128, 128, (6, 80), generator=gen, dtype=torch.int8)
        if seed is None:
            pages.fill_(77)
        return [pages[:, :24], pages[:, 24:64].view(6, 5, 8)], pages

    (src_states, _), (dst_states, dst_pages) = states(3), states(None)
    src_kv, dst_kv = caches(VLLM_CPU, seed=1), caches(VLLM_CPU, seed=None)
    buffer = KVBuffer(1 << 24)
    src = [StateCaches(src_states, BLOCK), rank_caches(src_kv, BLOCK)]
    prod = Producer(
        ConnectorConfig(kv_format="pages"), src[1], tp_rank=0, engine_port=1, fingerprint="fp",
        secret=None, stats=TransferStats(), group_caches=src,
    )  # fmt: skip
    prod.attach_buffer(buffer)
    blocks = -(-num_tokens // BLOCK)
    save_ids = ([5, 4, 3, 2][:blocks], [0, 1, 2, 3][:blocks])
    prod.wait_for_save([
        SaveSpec("p", "t" * 32, save_ids[1], num_tokens, prompt_digest=DIGEST,
                 groups=[GroupPart(0, save_ids[0]), GroupPart(1, save_ids[1])])
    ])  # fmt: skip
    assert len(buffer) == 2

    tags = []

    def get(key, defer_entry_check=False, **kw):
        tensors, meta = deliver(buffer, key, **kw)
        tag = None
        if tagged and key == "t" * 32:
            keys = umac.entry_keys(None, key)
            tag = LocalEntryTag(keys, {"kv": umac.nh_hash(tensors["kv"], keys)}, key)
            tags.append(tag)
        if tamper and key == "t" * 32:  # group 0: the state row
            tensors = {"kv": tensors["kv"].clone()}
            tensors["kv"][0, 5] ^= 4
        return (tensors, meta, tag) if defer_entry_check else (tensors, meta)

    dst = [StateCaches(dst_states, BLOCK), rank_caches(dst_kv, BLOCK)]
    cons = Consumer(
        ConnectorConfig(), dst[1], tp_rank=0, tp_size=1, total_kv_heads=2, use_mla=False,
        secret=None, stats=TransferStats(), group_caches=dst,
        connect=lambda host, port: fake_client(get),
    )  # fmt: skip
    # the consumer computes the last token itself: blocks for num_tokens + 1 positions
    load_ids = ([0, 1, 2, 3, 4][: -(-(num_tokens + 1) // BLOCK)], [5, 4, 3, 2][:blocks])
    cons.start_load_kv([
        LoadSpec("c", "t" * 32, "h", 1, load_ids[1], 0, num_tokens, num_tokens,
                 prompt_digest=DIGEST,
                 groups=[GroupPart(0, load_ids[0]), GroupPart(1, load_ids[1])])
    ])  # fmt: skip
    finished, errors = poll_loads(cons, {"c"})
    assert finished == {"c"} and not errors and cons.take_failed() == ({"c"} if tamper else set())
    assert [t.checked for t in tags] == ([["kv"]] if tagged else [])
    if tamper:  # the tag's refusal comes first where there is one
        reason = "load_failed:protocol" if tagged else "load_failed:digest"
        assert cons.stats.peek()[reason] == 1
        return
    src_slot = save_ids[0][(num_tokens - 1) // BLOCK]
    want = torch.full_like(dst_pages, 77)
    pages_src = states(3)[1]
    for slot in {load_ids[0][(num_tokens - 1) // BLOCK], load_ids[0][-1]}:
        want[slot, :64] = pages_src[src_slot, :64]  # both states; the padding stays
    assert torch.equal(dst_pages, want)
    buffer.close()
    cons.shutdown()
