"""bench/bench_pd.py without servers: its client (SSE timing, errors), its Prometheus reading, its
correctness bookkeeping and goals, and the NIXL shim (``bench/nixl_tuned/sitecustomize.py``)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from bench import bench_pd, pd_common
from bench.bench_pd import Results
from bench.pd_common import Answer

REPO = Path(__file__).resolve().parents[2]


class _Handler(http.server.BaseHTTPRequestHandler):
    """Streams three chunks of token ids (the second holding two tokens), or answers /metrics."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = (
            b"# HELP vllm:prompt_tokens_by_source_total x\n"
            b'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",'
            b'source="external_kv_transfer"} 96.0\n'
            b'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",'
            b'source="local_compute"} 7.0\n'
            b'vllm:prompt_tokens_by_source_total{engine="1",source="external_kv_transfer"} 4.0\n'
            b'vllm:tritonkv_bytes_loaded_total{engine="0",model_name="tiny"} 2048.0\n'
            b'vllm:nixl_bytes_transferred_sum{engine="1"} 1024.0\n'
            b'vllm:nixl_bytes_transferred_count{engine="1"} 3.0\n'
        )
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200 if request["prompt"] != "refuse" else 400)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if request["prompt"] == "refuse":
            self.wfile.write(b"no")
            return
        chunks = [[5], [], [6, 7], [8]] if request["prompt"] != "error" else [[5]]
        for ids in chunks:
            data = {"choices": [{"text": "", "token_ids": ids}]}
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()
        if request["prompt"] == "error":
            self.wfile.write(b'data: {"error": {"message": "decode server died"}}\n\n')
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_stream_times_the_first_token_and_collects_every_token(server):
    answer = pd_common.stream(server, pd_common.completion_body("hello", 4))
    assert answer.error is None
    assert answer.tokens == [5, 6, 7, 8]
    assert answer.ttft is not None and 0 < answer.ttft <= answer.elapsed
    assert len(answer.gaps) == 2  # two chunks after the first (the empty one does not count)


@pytest.mark.parametrize("prompt,message", [("refuse", "HTTP 400"), ("error", "decode server")])
def test_stream_reports_failures_as_errors(server, prompt, message):
    answer = pd_common.stream(server, pd_common.completion_body(prompt, 4))
    assert answer.error is not None and message in answer.error


def test_external_kv_tokens_sums_every_engine(server):
    assert bench_pd.external_kv_tokens(server) == 100.0
    # KV bytes loaded: tritonkv's counter and NIXL's histogram sum (not its count)
    assert bench_pd.consumer_counts(server) == (100.0, 3072.0)


def _answer(tokens, ms=10.0, ttft=None, error=None):
    return Answer(ms / 1e3, None if ttft is None else ttft / 1e3, [], tokens, error=error)


def test_rows_count_wrong_answers_and_errors_against_colocated():
    ref = Results(
        legs={64: [(_answer([1]), None, None), (_answer([2]), None, None)]},
        ttft={64: [_answer([1, 2], ttft=5), _answer([3, 4], ttft=5)]},
        mix={4: (1.0, [_answer([9, 9], ttft=5), _answer([8, 8], ttft=5)])},
    )
    ours = Results(
        legs={
            64: [
                (_answer([1], 20), _answer([1], 30), 63.0),
                (_answer([2], 40), _answer([7], 50), 63.0),  # consumer's token differs
            ]
        },
        ttft={64: [_answer([1, 2], ttft=8), _answer([], error="HTTP 504")]},
        mix={4: (2.0, [_answer([9, 9], ttft=6), _answer([8, 0], ttft=7)])},
    )
    (row,) = bench_pd.length_rows("tritonkv", ours, ref)
    assert (row["wrong"], row["errors"]) == (1, 1)
    assert (row["producer_ms"], row["consumer_ms"], row["ttft_ms"]) == (30.0, 40.0, 8.0)
    assert row["kv_tokens_loaded"] == 63.0
    (conc,) = bench_pd.concurrency_rows("tritonkv", ours, ref)
    assert (conc["wrong"], conc["errors"], conc["req_per_s"]) == (1, 0, 1.0)
    (same,) = bench_pd.length_rows("colocated", ref, ref)
    assert same["wrong"] == 0 and same["consumer_ms"] is None


def test_summary_checks_goals_only_on_points_without_wrong_answers():
    def row(setup, n, producer, consumer, ttft, wrong=0):
        return {
            "setup": setup,
            "prompt_tokens": n,
            "producer_ms": producer,
            "consumer_ms": consumer,
            "ttft_ms": ttft,
            "kv_tokens_loaded": n - 1,
            "n": 9,
            "wrong": wrong,
            "errors": 0,
        }

    lengths = [
        row("colocated", 256, 10.0, None, 10.0),
        row("tritonkv", 256, 12.0, 6.0, 10.5),
        row("nixl-tuned", 256, 10.0, 12.0, 30.0),
        row("tritonkv", 1024, 20.0, 6.0, 30.0, wrong=1),
        row("nixl-tuned", 1024, 10.0, 12.0, 30.0),
    ]
    text = bench_pd.summary(lengths, [])
    assert "LOW   256 tokens: producer leg 1.20 x nixl-tuned's" in text
    assert "ok    256 tokens: consumer leg 0.50 x nixl-tuned's" in text
    assert "ok    256 tokens: TTFT 1.05 x colocated's" in text
    assert " 1024 tokens:" not in text  # a wrong answer: no goal is judged there


def test_nixl_shim_keeps_affinity_and_slows_the_progress_thread(tmp_path):
    """The shim, loaded as Python loads it (sitecustomize on PYTHONPATH), against a stand-in for
    nixl's compiled bindings: the agent gets a 100 µs progress delay; affinity calls do nothing."""
    fake = tmp_path / "nixl_cu12"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "_bindings.py").write_text(
        textwrap.dedent(
            """
            class nixlAgentConfig:
                pthrDelay = 0

            def nixlAgent(name, config):
                return (name, config.pthrDelay)
            """
        )
    )
    probe = textwrap.dedent(
        """
        import os
        from nixl_cu12 import _bindings
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(before)})
        assert os.sched_getaffinity(0) == before, "affinity changed"
        assert _bindings.nixlAgent("a", _bindings.nixlAgentConfig()) == ("a", 100)
        print("ok")
        """
    )
    shim = REPO / "bench" / "nixl_tuned"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(tmp_path)]))
    run = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    # Without the shim the stand-in keeps NIXL's zero delay (the probe can tell the difference).
    env["PYTHONPATH"] = str(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode != 0
