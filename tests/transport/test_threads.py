"""Transfer threads on chosen CPUs (``connector.transport.threads``): parsing, refusal, a real transfer."""

from __future__ import annotations

import os
import threading

import pytest
from support.transport import assert_entry_equal, make_entry

from connector.kvstore import KVBuffer, KVClient, KVServer
from connector.transport.threads import (
    os_thread_name,
    parse_cpus,
    set_transfer_cpus,
    transfer_cpus,
    transfer_thread,
)

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity"),
]


def test_parse_cpus():
    assert parse_cpus("3") == {3}
    assert parse_cpus("3, 7,10-12") == {3, 7, 10, 11, 12}
    for bad in ("", "a", "3-", "5-2", "-1", "1,,2"):
        with pytest.raises(ValueError, match=f"expected ids and ranges.*got {bad!r}"):
            parse_cpus(bad)


def test_cpus_the_process_may_not_use_are_refused():
    with pytest.raises(ValueError, match=r"transfer CPUs \[100000\]: this process may not run"):
        set_transfer_cpus([100000])
    assert transfer_cpus() is None


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (["0"], TypeError, r"expected int CPU ids, got '0'"),
        ([True], TypeError, r"expected int CPU ids, got True"),
        (3, TypeError, r"expected an iterable of int CPU ids, got int"),
        ([-1], ValueError, r"expected one or more CPU ids >= 0, got \[-1\]"),
        ([], ValueError, r"expected one or more CPU ids >= 0, got \[\]"),
    ],
)
def test_bad_cpu_ids_are_refused(bad, error, match):
    """Such ids used to be accepted (the probe thread died of them unseen) and then killed every
    transfer thread at its first line."""
    with pytest.raises(error, match=match):
        set_transfer_cpus(bad)
    assert transfer_cpus() is None


def _affinity(thread: threading.Thread) -> set[int]:
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        line = next(ln for ln in f if ln.startswith("Cpus_allowed_list:"))
    return parse_cpus(line.split(":", 1)[1].strip())


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs /proc")
def test_server_and_client_threads_run_on_the_transfer_cpus():
    """Every thread the server and the client start (accept, connection, pipe, rendezvous) runs on
    the transfer CPU; the calling thread keeps its own CPUs. A 1.5 MiB entry goes over gloo."""
    before = os.sched_getaffinity(0)
    cpu = max(before)
    earlier = set(threading.enumerate())  # e.g. pipes other tests left to wind down
    entry, meta = make_entry(99)
    buf = KVBuffer(64 << 20)
    buf.put("k", entry, meta)
    set_transfer_cpus([cpu])
    try:
        server = KVServer(buf)
        try:
            with KVClient("127.0.0.1", server.port, timeout_s=20) as client:
                got, got_meta = client.get("k")
                ours = [
                    t for t in set(threading.enumerate()) - earlier if t.name.startswith("tkv-")
                ]
                names = {t.name.split("]")[-1].lstrip("-") for t in ours}
                assert {"accept", "conn0", "send", "read"} <= names, names
                assert {t.name: _affinity(t) for t in ours} == {t.name: {cpu} for t in ours}
        finally:
            server.close()
    finally:
        set_transfer_cpus(None)
    assert got_meta == meta
    assert_entry_equal(got, entry, "k")
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("cpus", [[100000], [-1]], ids=["cpu-taken-away", "invalid-id"])
def test_a_thread_that_cannot_move_still_runs(monkeypatch, caplog, cpus):
    import connector.transport.threads as threads_mod

    monkeypatch.setattr(threads_mod, "_cpus", frozenset(cpus))  # e.g. taken away since checked
    ran = []
    t = threads_mod.transfer_thread(ran.append, "tkv-test", (1,))
    t.start()
    t.join(10)
    assert ran == [1]
    assert "tkv-test stays on its CPUs" in caplog.text


def _kernel_name() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


@pytest.mark.parametrize(
    "name, expected",
    [
        ("tkv-server[14579]-conn3", "tkv-srv-conn3"),
        ("tkv-pipe[127.0.0.1:40022]-send", "tkv-pipe-send"),
        ("tkv-server[80]-accept", "tkv-srv-accept"),
        ("tkv-pg-rendezvous", "tkv-pg-rendezvo"),  # Linux keeps 15 bytes
        ("tkv-ünicode", "tkv-?nicode"),
    ],
)
def test_transfer_threads_tell_the_kernel_their_name(name, expected):
    """What ps -L, top -H and py-spy show for a transfer thread (not the process's name)."""
    assert os_thread_name(name) == expected
    seen = []
    t = transfer_thread(lambda: seen.append(_kernel_name()), name)
    t.start()
    t.join(10)
    assert seen == [expected]
    assert _kernel_name() != expected  # the caller's own name is unchanged
