"""bench/netlink.py (the link of ``bench_pd --link``): namespaces made and removed, the rate limit
applied and obeyed; and bench/pd_link.py's bookkeeping without servers."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest

from bench import netlink, pd_link
from bench.pd_common import Answer

REASON = netlink.unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")


def _host_addresses() -> str:
    return subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=20).stdout


@needs_netns
def test_link_makes_and_removes_namespaces_with_the_rate_limit_applied():
    with netlink.link(100) as link:
        assert {link.producer_ns, link.consumer_ns} <= netlink.namespaces()
        for side in ("producer", "consumer"):
            shown = link.qdisc(side)
            assert "tbf" in shown and "rate 100Mbit" in shown, shown
        assert link.producer_ip not in _host_addresses()  # addresses only inside
        link.set_rate(300)
        assert "rate 300Mbit" in link.qdisc("producer") and link.rate_mbit == 300
        names = {link.producer_ns, link.consumer_ns}
    assert not names & netlink.namespaces()


@needs_netns
def test_link_is_removed_when_the_body_raises():
    with pytest.raises(KeyError), netlink.link(50) as link:
        names = {link.producer_ns, link.consumer_ns}
        raise KeyError("boom")
    assert not names & netlink.namespaces()


@needs_netns
def test_a_transfer_over_the_link_is_bounded_by_the_rate():
    """8 MB at 40 Mbit/s takes at least ~1.6 s: the measured rate stays under a generous 2 x."""
    size, rate_mbit = 8 << 20, 40
    with netlink.link(rate_mbit) as link:
        with netlink.entered(link.consumer_ns):
            server = socket.create_server((link.consumer_ip, 0))
        port = server.getsockname()[1]
        got = []

        def receive():
            conn, _ = server.accept()
            with conn:
                n = 0
                while chunk := conn.recv(1 << 20):
                    n += len(chunk)
                got.append(n)

        reader = threading.Thread(target=receive, daemon=True)
        reader.start()
        before = link.tx_bytes("producer")
        with netlink.entered(link.producer_ns):
            client = socket.create_connection((link.consumer_ip, port), timeout=30)
        t0 = time.perf_counter()
        with client:
            client.sendall(b"\x5a" * size)
        reader.join(60)
        elapsed = time.perf_counter() - t0
        server.close()
        assert got == [size]
        assert link.tx_bytes("producer") - before >= size  # it crossed the veth
        assert size * 8 / elapsed / 1e6 < 2 * rate_mbit


@needs_netns
def test_entered_returns_the_thread_to_its_namespace():
    with netlink.link(100) as link:
        with netlink.entered(link.producer_ns):
            inside = subprocess.run(
                ["cat", "/proc/thread-self/net/dev"], capture_output=True, text=True, timeout=20
            ).stdout
        assert link.producer_dev in inside
        with open("/proc/thread-self/net/dev") as f:
            assert link.producer_dev not in f.read()


def test_unavailable_names_root_and_link_refuses(monkeypatch):
    monkeypatch.setattr(netlink.os, "geteuid", lambda: 1000)
    assert "root" in netlink.unavailable()
    with pytest.raises(netlink.LinkUnavailable, match="root"), netlink.link(100):
        pass


def test_set_rate_refuses_a_rate_that_is_not_positive():
    link = netlink.Link("p", "c", "pd", "cd", "10.0.0.1", "10.0.0.2")
    with pytest.raises(ValueError, match="positive"):
        link.set_rate(0)
    with pytest.raises(ValueError, match="producer"):
        link.prefix("both")


def test_burst_covers_a_gso_segment_and_4_ms_of_traffic():
    assert netlink.tbf_burst_bytes(1) == 64 * 1024
    assert netlink.tbf_burst_bytes(10_000) == 5_000_000


def test_checked_answers_count_wrong_and_failed_against_colocated():
    want = [Answer(tokens=[1, 2]), Answer(tokens=[3, 4]), Answer(tokens=[5])]
    got = [Answer(tokens=[1, 2]), Answer(tokens=[3, 9]), Answer(error="HTTP 500")]
    assert pd_link.count_wrong(got, want) == (1, 1)
    assert (
        pd_link.text_diffs({"generated_texts": ["a", "b"]}, {"generated_texts": ["a", "c", "d"]})
        == 2
    )


def test_row_and_summary_read_vllm_bench_serve_results():
    result = {"completed": 4, "failed": 0, "p50_ttft_ms": 12.345, "p99_ttft_ms": 20.0}
    result |= {"p50_itl_ms": 1.0, "p99_itl_ms": 3.0, "output_throughput": 55.5}
    r = pd_link.row("tritonkv-pag", 250, 2, result, checked=3, wrong=0, failed_checks=0,
                    load_text_diffs=0, link_mb_per_req=4.7, load_before="1 1 1", load_after="2 2 2")  # fmt: skip
    assert (r["ttft_p50_ms"], r["link"], r["output_tok_s"]) == (12.35, "25 GbE (TCP)", 55.5)
    text = pd_link.summary([r], 1250.0, pd_link.QUICK)
    assert "tritonkv-pag" in text and "12.35" in text and "2 2 2" in text
    assert "13.11" in text  # 16384 B/token / 1250 tok/s
