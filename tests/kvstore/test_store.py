"""KVBuffer alone, in process: puts, leases, misses and their reasons, capacity policies, TTL on
an injected clock, and threads."""

import threading
import time

import pytest
import torch
from support.kvstore import accounted, deliver
from support.transport import assert_entry_equal, make_entry
from support.vllm_fixtures import captured_log

from connector.kvstore import BufferFullError, KeyMissError, KVBuffer, Lease, Part
from connector.transport import PipeClosedError


def _t(nbytes: int) -> dict:
    return {"x": torch.zeros(nbytes, dtype=torch.uint8)}


@pytest.mark.timeout(30)
def test_put_checkout_discard_and_miss_reasons():
    buf = KVBuffer(1 << 20)
    tensors, meta = make_entry(3)
    buf.put("a", tensors, meta)
    got, got_meta = deliver(buf, "a")
    assert_entry_equal(got, tensors) and got_meta == meta
    with pytest.raises(KeyMissError, match="claimed") as ei:
        buf.checkout("a")
    assert ei.value.reason.startswith("claimed") and ei.value.key == "a"
    buf.put("b", _t(10))
    assert buf.discard("b") and not buf.discard("b")
    with pytest.raises(KeyMissError, match="discarded"):
        buf.checkout("b")
    with pytest.raises(KeyMissError, match="never put"):
        buf.checkout("zzz")
    s = buf.stats()
    assert (s["hits"], s["misses"], s["claimed"], s["discards"], s["entries"]) == (1, 3, 1, 1, 0)
    assert accounted(s)


@pytest.mark.timeout(30)
def test_bad_inputs_say_expected_and_given():
    buf = KVBuffer(1000)
    buf.put("a", _t(10))
    with pytest.raises(ValueError, match="already in the buffer"):
        buf.put("a", _t(10))
    with pytest.raises(ValueError, match=r"can never fit, capacity_bytes=1000"):
        buf.put("huge", _t(1001))
    with pytest.raises(TypeError, match=r"expected dict\[str, Tensor\], got list"):
        buf.put("c", [torch.ones(1)])
    with pytest.raises(TypeError, match=r"tensors\['x'\]: expected a Tensor, got int"):
        buf.put("c", {"x": 3})
    with pytest.raises(TypeError, match=r"meta\['m'\]"):
        buf.put("c", _t(1), {"m": [1]})
    with pytest.raises(TypeError, match="key: expected str, got int"):
        buf.put(5, _t(1))
    with pytest.raises(ValueError, match=r"key: expected 1\.\.1024"):
        buf.put("", _t(1))
    with pytest.raises(ValueError, match="full_policy: expected one of"):
        KVBuffer(10, full_policy="drop")
    with pytest.raises(ValueError, match="ttl_s: expected a positive number"):
        KVBuffer(10, ttl_s=0)
    with pytest.raises(TypeError, match="token_ids"):
        buf.match_prefix("abc")
    with pytest.raises(ValueError, match="wait_s: expected a number >= 0, got -1"):
        buf.checkout("a", wait_s=-1)
    with pytest.raises(TypeError, match="part: expected a Part or None, got tuple"):
        buf.checkout("a", part=("x", 0, 0, 1))


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_put_refuses_entries_no_consumer_could_receive():
    """put checks the DATA reply an entry becomes against the wire limits (a 9-D entry used to be
    stored, then break every consumer's pipe, and count as delivered)."""
    buf = KVBuffer(1 << 20)
    with pytest.raises(ValueError, match=r"tensor 'x': expected ndim <= 8, got 9"):
        buf.put("k", {"x": torch.zeros([1] * 9)})
    with pytest.raises(ValueError, match=r"name: expected 1\.\.256 UTF-8 bytes, got 300"):
        buf.put("k", {"n" * 300: torch.zeros(2)})
    with pytest.raises(TypeError, match="cannot travel on the wire"):
        buf.put("k", {"x": torch.zeros(2, dtype=torch.complex32)})
    assert len(buf) == 0 and buf.stats()["puts"] == 0


@pytest.mark.timeout(30)
def test_put_waiting_for_room_wakes_when_an_entry_expires():
    """An expiring entry makes room: put waits until then, not until its own deadline."""
    buf = KVBuffer(100, ttl_s=1.0)  # long enough that "new" cannot expire before stats() too
    buf.put("old", _t(100))
    t0 = time.monotonic()
    buf.put("new", _t(100), timeout_s=10)
    assert time.monotonic() - t0 < 3
    s = buf.stats()
    assert s["expirations"] == 1 and "new" in buf and accounted(s)


@pytest.mark.timeout(30)
def test_full_policy_error_refuses_at_once():
    buf = KVBuffer(1000, full_policy="error")
    buf.put("a", _t(600))
    t0 = time.monotonic()
    with pytest.raises(
        BufferFullError, match=r"600 of 1000 bytes used by 1 entries, entry needs 600"
    ):
        buf.put("b", _t(600))
    assert time.monotonic() - t0 < 0.5
    s = buf.stats()
    assert s["full_errors"] == 1 and s["entries"] == 1 and accounted(s)


@pytest.mark.timeout(30)
def test_full_policy_wait_blocks_until_room_then_times_out():
    buf = KVBuffer(1000, full_policy="wait", put_timeout_s=5)
    buf.put("a", _t(600))
    done = threading.Event()
    t = threading.Thread(target=lambda: (buf.put("b", _t(600)), done.set()))
    t.start()
    assert not done.wait(0.2)  # blocked: no room
    deliver(buf, "a")  # claiming frees room
    assert done.wait(5)
    t.join(5)
    t0 = time.monotonic()
    with pytest.raises(BufferFullError) as ei:
        buf.put("c", _t(600), timeout_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 2 and ei.value.waited_s >= 0.25
    s = buf.stats()
    assert (s["full_errors"], s["timeouts"], s["entries"]) == (1, 1, 1)
    assert s["full_waits"] >= 1 and accounted(s)


@pytest.mark.timeout(30)
def test_full_policy_evict_drops_oldest_unclaimed_with_warning():
    buf = KVBuffer(1000, full_policy="evict", put_timeout_s=0.3)
    for k in "abc":
        buf.put(k, _t(300))
    pinned = buf.checkout("a")  # "a" is being sent: must not be evicted
    with captured_log("vllm.tritonkv.kvstore") as records:
        buf.put("d", _t(300))
    assert "a" in buf and "b" not in buf and "d" in buf
    assert any("evicting unclaimed entry b…" in r.getMessage() for r in records)
    with pytest.raises(KeyMissError, match="evicted"):
        buf.checkout("b")
    buf.checkin(pinned, delivered=False)
    s = buf.stats()
    assert s["evictions"] == 1 and s["failed_deliveries"] == 1 and accounted(s)
    # everything pinned: eviction impossible, falls back to a bounded wait
    leases = [buf.checkout(k) for k in ("a", "c", "d")]
    with pytest.raises(BufferFullError):
        buf.put("e", _t(300))
    for lease in leases:
        buf.checkin(lease, delivered=True)
    assert accounted(buf.stats())


@pytest.mark.timeout(30)
def test_key_a_consumer_waits_for_is_not_evicted():
    buf = KVBuffer(1000, full_policy="evict")
    buf.put("x", _t(10))
    got = []
    t = threading.Thread(target=lambda: got.append(deliver(buf, "later", wait_s=5)))
    t.start()
    time.sleep(0.1)
    buf.put("later", _t(500))
    t.join(5)
    assert got and got[0][0]["x"].numel() == 500


@pytest.mark.timeout(30)
def test_ttl_expires_unclaimed_entries():
    clock = [100.0]
    buf = KVBuffer(1000, ttl_s=0.2, clock=lambda: clock[0])
    buf.put("old", _t(10))
    clock[0] += 0.3
    buf.put("new", _t(10))
    s = buf.stats()
    assert (s["expirations"], s["entries"]) == (1, 1) and accounted(s)
    with pytest.raises(KeyMissError, match=r"expired: unclaimed for 0.2 s"):
        buf.checkout("old")


@pytest.mark.timeout(30)
def test_an_entry_being_delivered_does_not_expire():
    clock = [100.0]
    buf = KVBuffer(1000, ttl_s=0.2, clock=lambda: clock[0])
    buf.put("slow", _t(10))
    lease = buf.checkout("slow")
    clock[0] += 1.0
    assert buf.stats()["expirations"] == 0 and "slow" in buf
    buf.checkin(lease, delivered=False)  # unpinned: now it is past its TTL
    s = buf.stats()
    assert (s["expirations"], s["entries"], s["failed_deliveries"]) == (1, 0, 1) and accounted(s)


@pytest.mark.timeout(30)
def test_expiry_passes_a_held_old_entry_and_stops_at_the_first_young_one():
    clock = [100.0]
    buf = KVBuffer(1000, ttl_s=0.2, clock=lambda: clock[0])
    buf.put("held", _t(10))
    lease = buf.checkout("held")
    buf.put("old", _t(10))
    clock[0] += 0.15
    buf.put("young", _t(10))
    clock[0] += 0.1  # "held" and "old" are past their TTL, "young" is not
    s = buf.stats()
    assert (s["expirations"], s["entries"], s["pinned"]) == (1, 2, 1) and accounted(s)
    assert "old" not in buf and "held" in buf and "young" in buf
    buf.checkin(lease, delivered=False)
    s = buf.stats()
    assert (s["expirations"], s["entries"], s["pinned"]) == (2, 1, 0) and "young" in buf
    clock[0] += 0.5
    assert buf.stats()["entries"] == 0


@pytest.mark.timeout(30)
def test_checkout_waits_for_a_late_put():
    buf = KVBuffer(1000)
    threading.Timer(0.1, lambda: buf.put("late", _t(4))).start()
    got, _ = deliver(buf, "late", wait_s=5)
    assert got["x"].numel() == 4
    t0 = time.monotonic()
    with pytest.raises(KeyMissError, match=r"not put within wait_s=0\.2"):
        buf.checkout("never", wait_s=0.2)
    assert 0.15 < time.monotonic() - t0 < 1


@pytest.mark.timeout(30)
def test_a_lease_is_checked_in_once_and_only_by_its_buffer():
    buf, other = KVBuffer(1000), KVBuffer(1000)
    buf.put("k", _t(8), {"m": 1})
    lease = buf.checkout("k")
    assert isinstance(lease, Lease) and lease.open and (lease.key, lease.nbytes) == ("k", 8)
    assert lease.meta == {"m": 1} and lease.part is None
    with pytest.raises(ValueError, match="expected a lease of this buffer"):
        other.checkin(lease, delivered=True)
    buf.checkin(lease, delivered=True)
    assert not lease.open
    with pytest.raises(ValueError, match="already checked in"):
        buf.checkin(lease, delivered=True)
    s = buf.stats()
    assert (s["hits"], s["claimed"], s["bytes_sent"], s["pinned"]) == (1, 1, 8, 0)


@pytest.mark.timeout(30)
def test_a_lease_block_that_raises_keeps_the_entry_for_a_retry():
    buf = KVBuffer(1000)
    buf.put("k", _t(8))
    with pytest.raises(ConnectionError), buf.checkout("k"):
        raise ConnectionError("the consumer went away")
    assert "k" in buf and buf.stats()["failed_deliveries"] == 1
    with buf.checkout("k") as lease:  # the retry
        assert buf.stats()["pinned"] == 1 and lease.tensors["x"].numel() == 8
    assert "k" not in buf and buf.stats()["claimed"] == 1


@pytest.mark.timeout(30)
def test_a_part_lease_cuts_its_tensor_and_claims_once_the_parts_cover_the_dim():
    buf = KVBuffer(1 << 20)
    kv = torch.arange(24).view(2, 3, 4)
    buf.put("t", {"kv": kv, "cu": torch.tensor([0, 3])})
    with pytest.raises(ValueError, match="has no dim 2 range"):
        buf.checkout("t", part=Part("kv", 2, 3, 5))
    first = buf.checkout("t", part=Part("kv", 2, 0, 3))
    second = buf.checkout("t", part=Part("kv", 2, 3, 4))  # side by side
    assert torch.equal(first.tensors["kv"], kv[:, :, :3]) and first.tensors["kv"].is_contiguous()
    assert torch.equal(second.tensors["cu"], torch.tensor([0, 3]))
    buf.checkin(first, delivered=True)
    assert "t" in buf  # index 3 not delivered yet
    buf.checkin(second, delivered=True)
    s = buf.stats()
    assert (s["part_deliveries"], s["claimed"], s["failed_deliveries"]) == (2, 1, 1)
    assert "t" not in buf and accounted(s)


@pytest.mark.timeout(60)
def test_threads_put_checkout_discard_concurrently():
    buf = KVBuffer(64 << 10, full_policy="wait", put_timeout_s=10)
    errors = []

    def worker(w):
        try:
            for j in range(300):
                key = f"w{w}-{j}"
                buf.put(key, _t(100 + j % 50), {"j": j}, token_ids=[w, j, 0, 0] * 4)
                if j % 3 == 0:
                    assert buf.discard(key)
                else:
                    got, meta = deliver(buf, key)
                    assert meta == {"j": j} and got["x"].numel() == 100 + j % 50
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors, errors[:3]
    s = buf.stats()
    assert s["puts"] == 2400 and s["entries"] == 0 and s["bytes"] == 0 and accounted(s)


@pytest.mark.timeout(30)
def test_a_closed_buffer_refuses_puts_and_still_delivers():
    buf = KVBuffer(1000)
    buf.put("held", _t(4))
    buf.close()
    with pytest.raises(PipeClosedError, match="buffer is closed"):
        buf.put("new", _t(4))
    assert deliver(buf, "held")[0]["x"].numel() == 4


@pytest.mark.timeout(30)
def test_a_sealed_discard_drops_the_whole_group_and_refuses_its_later_parts():
    """A transfer stored in chunks (``<id>#<index>``): a sealed discard with the entries' digest
    discards every chunk of it and no other key, refuses the chunks put afterwards (counted, nothing
    stored) and ends at once a checkout waiting for one, with the reason; another digest's
    entries of that group, and other groups, are neither discarded nor sealed."""
    buf = KVBuffer(1 << 20)
    for key in ("t#0", "t#1", "u#0", "t"):
        buf.put(key, _t(10), digest="d")
    buf.put("t#2", _t(10), digest="other")
    waiter: dict = {}

    def wait():
        t0 = time.monotonic()
        try:
            buf.checkout("t#3", wait_s=20, digest="d")
        except KeyMissError as e:
            waiter["reason"], waiter["waited"] = e.reason, time.monotonic() - t0

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.2)
    assert buf.discard("t#1", "d", seal=True)
    thread.join(10)
    assert waiter["reason"].startswith("discarded") and waiter["waited"] < 10
    assert sorted(buf._table.entries) == ["t#2", "u#0"]
    assert buf.put("t#3", _t(10), digest="d") is False and "t#3" not in buf
    assert buf.put("t#4", _t(10), digest="other") is True
    assert buf.put("u#1", _t(10), digest="d") is True
    s = buf.stats()
    assert (s["discards"], s["sealed_puts"], s["entries"]) == (3, 1, 4)
    assert accounted(s)


@pytest.mark.timeout(30)
def test_an_owners_sealed_drop_seals_every_digest_and_a_plain_discard_seals_nothing():
    buf = KVBuffer(1 << 20)
    assert buf.discard_any("v", seal=True) is False  # nothing held yet: sealed all the same
    assert buf.put("v#0", _t(10), digest="a") is False
    assert buf.put("v", _t(10)) is False
    buf.put("w#0", _t(10), digest="a")
    assert buf.discard("w#0", "a") and buf.put("w#0", _t(10), digest="a") is True
    assert buf.stats()["sealed_puts"] == 2
