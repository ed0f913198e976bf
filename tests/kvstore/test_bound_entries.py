"""Entries bound to a digest: a GET or DISCARD presenting another digest (or none) is answered as
for a key never put, over the wire and in process; only the owner discards an entry whatever its
digest."""

import threading
import time

import pytest
import torch
from support.kvstore import accounted, deliver, hello, raw_connection, read_frame

from connector.kvstore import KeyMissError, KVBuffer, KVClient, KVServer
from connector.kvstore.protocol import DIGEST, REASON, WAIT_MS, Op
from connector.transport import encode_header

RIGHT = "a1" * 16
WRONGS = [None, "b2" * 16, RIGHT[:-1], RIGHT.upper(), ""]
WRONG_IDS = ["none", "other", "shorter", "upper-case", "empty"]


@pytest.fixture
def served():
    buffer = KVBuffer(1 << 20)
    buffer.put("t", {"kv": torch.arange(8)}, {"n": 1}, digest=RIGHT)
    server = KVServer(buffer)
    client = KVClient("127.0.0.1", server.port, transport="socket", timeout_s=10)
    try:
        yield buffer, server, client
    finally:
        client.close()
        server.close()
        buffer.close()


def _miss(client, key, **kw) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(KeyMissError) as ei:
        client.get(key, **kw)
    return ei.value.reason, time.monotonic() - t0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wrong", WRONGS, ids=WRONG_IDS)
def test_a_get_with_a_wrong_or_missing_digest_misses_like_an_unknown_id(served, wrong):
    buffer, server, client = served
    unknown, _ = _miss(client, "never-put", digest=wrong)
    assert _miss(client, "t", digest=wrong)[0] == unknown == "never put (or forgotten)"
    # waiting for it: the same wait and the same reason as for a key that never comes
    unknown_waited, t_unknown = _miss(client, "never-put", digest=wrong, wait_s=0.3)
    wrong_waited, t_wrong = _miss(client, "t", digest=wrong, wait_s=0.3)
    assert wrong_waited == unknown_waited == "not put within wait_s=0.3 s"
    assert t_wrong >= 0.3 and t_unknown >= 0.3
    assert "t" in buffer and buffer.stats()["pinned"] == 0
    got, meta = client.get("t", digest=RIGHT)
    assert torch.equal(got["kv"], torch.arange(8)) and meta == {"n": 1}
    # delivered: who presents the digest learns why, anyone else what an unknown id gets
    assert _miss(client, "t", digest=RIGHT)[0] == "claimed: already delivered"
    assert _miss(client, "t", digest=wrong)[0] == unknown
    assert accounted(server.stats())


@pytest.mark.timeout(30)
def test_a_malformed_digest_on_the_wire_misses_like_an_unknown_id(served):
    buffer, server, _ = served
    s = raw_connection(server)
    hello(s)
    replies = []
    for key, digest in (("t", 5), ("t", 1.5), ("t", True), ("never-put", 5)):
        s.send_frame(encode_header(Op.GET, key, {WAIT_MS: 0, DIGEST: digest}))
        reply = read_frame(s)
        replies.append((reply.kind, reply.meta))
    s.close()
    assert replies == [(Op.MISS, {REASON: "never put (or forgotten)"})] * 4
    assert "t" in buffer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wrong", WRONGS, ids=WRONG_IDS)
def test_a_discard_with_a_wrong_digest_drops_nothing(served, wrong):
    buffer, server, client = served
    assert client.discard("never-put", digest=wrong) is False
    assert client.discard("t", digest=wrong) is False
    assert "t" in buffer and buffer.stats()["discards"] == 0
    assert torch.equal(client.get("t", digest=RIGHT)[0]["kv"], torch.arange(8))
    buffer.put("u", {"kv": torch.zeros(2)}, digest=RIGHT)
    assert client.discard("u", digest=RIGHT) is True
    assert "u" not in buffer and accounted(server.stats())


def test_in_process_a_bound_entry_is_found_only_with_its_digest_and_dropped_by_its_owner():
    buf = KVBuffer(1 << 20)
    buf.put("t", {"kv": torch.zeros(4)}, digest=RIGHT)
    buf.put("free", {"kv": torch.zeros(4)})  # unbound: only a request without a digest finds it
    for wrong in WRONGS:
        with pytest.raises(KeyMissError, match=r"never put \(or forgotten\)"):
            deliver(buf, "t", digest=wrong)
        assert not buf.discard("t", wrong)
    with pytest.raises(KeyMissError, match=r"never put \(or forgotten\)"):
        deliver(buf, "free", digest=RIGHT)
    assert torch.equal(deliver(buf, "free")[0]["kv"], torch.zeros(4))
    assert buf.discard_any("t") and not buf.discard_any("t")  # the producer aborting its own entry
    with pytest.raises(KeyMissError, match="discarded"):
        deliver(buf, "t", digest=RIGHT)
    with pytest.raises(TypeError, match="digest: expected str or None, got int"):
        buf.put("x", {"kv": torch.zeros(1)}, digest=5)
    with pytest.raises(ValueError, match="digest: expected a non-empty str"):
        buf.put("x", {"kv": torch.zeros(1)}, digest="")
    with pytest.raises(TypeError, match="digest: expected str or None, got bytes"):
        buf.checkout("free", digest=b"x")
    assert accounted(buf.stats())


def test_a_checkout_waiting_with_a_wrong_digest_does_not_shield_the_entry_from_eviction():
    """Only a waiter that could take the entry keeps ``full_policy="evict"`` off it."""
    buf = KVBuffer(1000, full_policy="evict", put_timeout_s=1.0)
    buf.put("old", {"kv": torch.zeros(600, dtype=torch.uint8)}, digest=RIGHT)
    missed = []

    def wait_with_a_wrong_digest():
        try:
            buf.checkout("old", wait_s=1.0, digest="x")
        except KeyMissError as e:
            missed.append(e.reason)

    waiter = threading.Thread(target=wait_with_a_wrong_digest)
    waiter.start()
    time.sleep(0.1)
    buf.put("new", {"kv": torch.zeros(600, dtype=torch.uint8)}, digest=RIGHT)
    waiter.join(5)
    assert "old" not in buf and "new" in buf and buf.stats()["evictions"] == 1
    assert missed == ["not put within wait_s=1 s"]
