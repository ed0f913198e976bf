"""What the P/D benchmarks share: the OpenAI-API client, NIXL's install, the result files' stamp.

:mod:`bench.bench_pd` (loopback), :mod:`bench.pd_link` (link-limited) and :mod:`bench.pd_goal`
(transfer time = prefill time) import from here; this module imports none of them.
"""

from __future__ import annotations

import csv
import http.client
import json
import subprocess
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from connector.serve.launch import http_json

from .common import git_sha, host_description, host_kind

BENCH = Path(__file__).resolve().parent
NIXL_SITE = BENCH.parent / ".bench_deps" / "nixl"
REQUEST_TIMEOUT_S = 120.0
MODEL_NAME = "tiny"  # the served model name connector.serve.launch gives every server


@dataclass
class Answer:
    """One request's outcome: timings (seconds), generated token ids, error text if it failed."""

    elapsed: float = 0.0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # between streamed tokens after the first
    tokens: list[int] = field(default_factory=list)
    kv_params: dict | None = None
    error: str | None = None


def completion_body(prompt: str, max_tokens: int, **extra) -> dict:
    """A greedy ``/v1/completions`` request that returns its token ids (``extra`` merged in)."""
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def post(url: str, body: dict) -> Answer:
    """A non-streamed completion; its wall time and tokens (errors are returned, not raised)."""
    t0 = time.perf_counter()
    try:
        reply = http_json(url + "/v1/completions", body, timeout_s=REQUEST_TIMEOUT_S)
    except Exception as e:
        return Answer(time.perf_counter() - t0, error=f"{type(e).__name__}: {e}"[:300])
    elapsed = time.perf_counter() - t0
    choice = reply["choices"][0]
    return Answer(
        elapsed,
        tokens=list(choice.get("token_ids") or []),
        kv_params=reply.get("kv_transfer_params"),
    )


def stream(url: str, body: dict) -> Answer:
    """A streamed completion: time to the first token, the gaps between later tokens, the tokens."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
    answer = Answer()
    t0 = time.perf_counter()
    last = None
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            ids = chunk["choices"][0].get("token_ids") or []
            if not ids:
                continue
            now = time.perf_counter()
            if last is None:
                answer.ttft = now - t0
            else:
                answer.gaps.append((now - last) / len(ids))
            last = now
            answer.tokens += ids
    except Exception as e:
        answer.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        conn.close()
    answer.elapsed = time.perf_counter() - t0
    return answer


def ensure_nixl(python: str) -> bool:
    """NIXL in ``.bench_deps/nixl`` (installed there without its dependencies if missing)."""
    if (NIXL_SITE / "nixl" / "_api.py").exists():
        return True
    cmd = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--target", str(NIXL_SITE), "nixl-cu12==1.5.1", "nixl==1.5.1"]
    return subprocess.run(cmd, check=False).returncode == 0


def loadavg() -> str:
    """The 1/5/15-minute load averages, as ``/proc/loadavg`` writes them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run_stamp() -> dict:
    """The columns every P/D result row ends with: host, host kind, commit, date (UTC)."""
    return {
        "host": host_description(),
        "host_kind": host_kind(),
        "git_sha": git_sha(),
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
    }


def stamp_line(stamp: dict) -> str:
    """:func:`run_stamp` as the first line of a summary file."""
    return f"{stamp['host']} | {stamp['git_sha']} | {stamp['date']}"


def write_csv(path: Path, rows: list[dict], stamp: dict) -> None:
    """``rows`` (dicts with the same keys), each followed by ``stamp``'s columns; nothing if empty."""
    if not rows:
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], *stamp])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **stamp})
