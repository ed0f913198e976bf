"""Transfer ids in log lines: a full id is what a GET or DISCARD needs, so both workers (and the
KV store under them) log only its first 8 hex digits and "…", and ``transfer_events`` (which the
e2e tests use to match a request's save and load) reads those short ids."""

from __future__ import annotations

import logging
import re

import pytest
from support.connector_sides import DIGEST, NHD, TRANSPORT, caches, consumer, producer
from support.vllm_fixtures import captured_log

from connector.kvstore import short_id
from connector.serve.launch import free_port_run, transfer_events
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.metadata import DiscardSpec, LoadSpec, SaveSpec

FULL_ID = re.compile(r"[0-9a-f]{32}")
LOADED, RELEASED, ABORTED, UNKNOWN = (f"{i:x}" * 32 for i in (10, 11, 12, 13))


@pytest.mark.timeout(60)
def test_no_log_line_carries_a_full_transfer_id_and_the_events_match_on_short_ids():
    port, dead = free_port_run(1), free_port_run(1)
    cfg = ConnectorConfig(kv_format="tokens", transport=TRANSPORT)
    prod = producer(caches(NHD), 4, cfg=cfg, engine_port=port)
    cons = consumer(caches(NHD, seed=None), 4, cfg=ConnectorConfig(transport=TRANSPORT))

    def load(req_id, transfer_id):
        return LoadSpec(
            req_id, transfer_id, "127.0.0.1", port, [0, 4, 2], 0, 9, 10, prompt_digest=DIGEST
        )

    with captured_log("vllm.tritonkv", logging.DEBUG) as records:
        prod.serve()
        try:
            prod.wait_for_save(
                [
                    SaveSpec(f"p-{t[0]}", t, [5, 1, 3], 10, prompt_digest=DIGEST)
                    for t in (LOADED, RELEASED, ABORTED)
                ]
            )
            prod.wait_for_save([], [ABORTED])  # its request was aborted
            cons.start_load_kv([load("c-loaded", LOADED), load("c-unknown", UNKNOWN)])
            assert cons.get_block_ids_with_load_errors() == {0, 4, 2}  # the unknown one's
            cons.discard(
                [
                    DiscardSpec(t, "127.0.0.1", p, prompt_digest=DIGEST)
                    for t, p in ((RELEASED, port), (RELEASED, port), (UNKNOWN, dead))
                ]
            )
        finally:
            cons.shutdown()
            prod.shutdown()
    lines = [r.getMessage() for r in records]
    text = "\n".join(lines)
    assert text.count("discarded unused transfer") == 2 and "could not discard" in text
    assert f"discarded transfer {short_id(ABORTED)} (its request was aborted)" in text
    leaked = [line for line in lines if FULL_ID.search(line)]
    assert not leaked, leaked
    saved, loaded = transfer_events(text, "p-a")["saved"], transfer_events(text, "c-loaded")
    assert [e["transfer"] for e in saved] == [short_id(LOADED)] == ["aaaaaaaa…"]
    assert [e["transfer"] for e in loaded["loaded"]] == [short_id(LOADED)]
    assert [e["transfer"] for e in transfer_events(text, "c-unknown")["failed"]] == [
        short_id(UNKNOWN)
    ]
    assert f"discarded unused transfer {short_id(RELEASED)} on " in text


def test_short_id_keeps_eight_characters_and_shows_odd_values_safely():
    assert short_id("0123456789abcdef" * 2) == "01234567…"
    assert short_id("t1") == "t1…"
    assert short_id("a\nb") == "a\\nb…"  # a client's value cannot forge a log line
    assert "\n" not in short_id("\n" * 40)
    assert short_id(None) == "none" and short_id(12345678901) == "12345678…"
