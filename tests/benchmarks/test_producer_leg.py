"""bench/producer_leg.py without servers: its /proc thread walk and its histogram reading."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading

from bench import cores, producer_leg

METRICS = (
    b'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 0.5\n'
    b'vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 4.0\n'
    b'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3"} 1.0\n'
    b'vllm:e2e_request_latency_seconds_sum{engine="0"} 1.25\n'
    b'vllm:e2e_request_latency_seconds_count{engine="0"} 5.0\n'
)


class _Metrics(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(METRICS)))
        self.end_headers()
        self.wfile.write(METRICS)


def test_histogram_sums_read_sum_and_count_but_not_buckets():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        got = producer_leg.histogram_sums(f"http://127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()
    assert got["request_prefill_time"] == (0.5, 4.0)
    assert got["e2e_request_latency"] == (1.25, 5.0)
    assert got["request_queue_time"] == (0.0, 0.0)


def test_thread_cpu_walks_children_and_their_threads():
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,), name='x').start(); print(1, flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"1"
        threads = cores.thread_cpu(os.getpid())
        tids = {tid for tid, _ in threads}
        assert os.getpid() in tids and child.pid in tids
        assert len(os.listdir(f"/proc/{child.pid}/task")) >= 2
        assert set(map(int, os.listdir(f"/proc/{child.pid}/task"))) <= tids
        assert all(cpu_s >= 0 and last_cpu >= 0 for cpu_s, last_cpu in threads.values())
    finally:
        child.kill()
        child.wait(10)


def test_summary_pools_the_rounds_and_gives_the_first_setups_ratio():
    times = {
        "tritonkv": [{64: [0.010, 0.012, 0.011]}, {64: [0.030, 0.031, 0.029]}],
        "nixl-tuned": [{64: [0.020, 0.021, 0.019]}, {64: [0.019, 0.020, 0.021]}],
    }
    lines = producer_leg.summary(times, [64])
    assert lines[0] == "tritonkv 64 tokens: 20.5 ms (rounds 11.0 / 30.0)"
    assert lines[1] == "nixl-tuned 64 tokens: 20.0 ms (rounds 20.0 / 20.0)"
    assert lines[2] == "tritonkv / nixl-tuned at 64 tokens: 1.02"
