"""Shared pieces of the transport tests: deterministic entries, bit-exact comparison, and child
processes (a producer serving a KVBuffer, a consumer loading one key) driven over stdin/stdout.

Run as a script it is the child: ``python tests/support/transport.py producer|consumer ...``.
It prints ``READY <port>`` when serving, ``CHECKOUT <key>`` when a delivery starts (``--hook``),
answers ``STATS`` on stdin with ``STATS <json>``, and exits when stdin closes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# dtypes cycled through entries; fp8 and bf16 compared as bytes
ENTRY_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
)


def random_tensor(shape, dtype, seed: int) -> torch.Tensor:
    """Tensor with arbitrary (seeded) bit patterns: NaNs and denormals included."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def make_entry(i: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Entry ``i``: packed KV in a cycling dtype, cu_seqlens, hidden states, a 0-dim scalar and an
    empty tensor. Every 25th entry carries a 300 KiB KV (packed chunk on the process group), every
    100th a 1.5 MiB one (travels alone); the rest travel inline."""
    dtype = ENTRY_DTYPES[i % len(ENTRY_DTYPES)]
    num_tokens = 1 + i % 7
    width = 64
    if i % 100 == 99:
        width = 96 * 1024
    elif i % 25 == 24:
        width = 24 * 1024
    tensors = {
        "kv": random_tensor((2, 2, num_tokens, width // 8), dtype, seed=i),
        "cu_seqlens": torch.tensor([0, num_tokens], dtype=torch.int64),
        "hidden": random_tensor((num_tokens, 5), torch.bfloat16, seed=10_000 + i),
        "scale": torch.tensor(0.5 + i, dtype=torch.float32),
        "empty": torch.empty((0, 3), dtype=torch.float16),
    }
    meta = {"i": i, "num_tokens": num_tokens, "model": "tiny", "ok": i % 2 == 0, "s": 0.25}
    return tensors, meta


def big_tensor(mib: int) -> torch.Tensor:
    """Deterministic ``mib`` MiB int64 tensor, cheap to regenerate for comparison."""
    n = mib * (1 << 20) // 8
    return torch.arange(n, dtype=torch.int64).mul_(2654435761).remainder_(1 << 61)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Bit-exact comparison (fp8/bf16 NaNs included), reporting the first mismatching bytes."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {got.shape} != {want.shape}"
    a = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b = want.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(a, b):
        bad = (a != b).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"{what}: {len((a != b).nonzero())} bytes differ, first at {bad}")


def assert_entry_equal(got: dict, want: dict, what: str = "") -> None:
    assert set(got) == set(want), f"{what}: names {sorted(got)} != {sorted(want)}"
    for name in want:
        assert_bits_equal(got[name], want[name], f"{what}[{name}]")


# ----------------------------------------------------------------------------------------------
# Child process handle (used by the tests)
# ----------------------------------------------------------------------------------------------
class Child:
    """A helper child process; lines on its stdout are queued; always ``kill()`` in teardown."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, prefix: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"child printed no {prefix!r} within {timeout_s} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"child exited ({self.proc.poll()}) before printing {prefix!r}")
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def ready_port(self, timeout_s: float = 60.0) -> int:
        return int(self.wait_line("READY", timeout_s))

    def command(self, cmd: str, answer: str, timeout_s: float = 10.0) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.wait_line(answer, timeout_s)

    def stats(self) -> dict:
        return json.loads(self.command("STATS", "STATS"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL always lands
            self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                f.close()

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Close stdin (the child then shuts down cleanly); kill if it does not exit in time."""
        try:
            self.proc.stdin.close()
            return self.proc.wait(timeout=timeout_s)
        except Exception:
            return None
        finally:
            self.kill()


# ----------------------------------------------------------------------------------------------
# Child entry points
# ----------------------------------------------------------------------------------------------
def _producer(args) -> None:
    from connector.kvstore import KVBuffer, KVServer

    class HookedBuffer(KVBuffer):
        def checkout(self, key, **kw):
            lease = super().checkout(key, **kw)
            if args.hook:
                print(f"CHECKOUT {key}", flush=True)
            return lease

    buf = HookedBuffer(capacity_bytes=4 << 30)
    for i in range(args.n):
        tensors, meta = make_entry(i)
        buf.put(f"k{i}", tensors, meta)
    if args.big_mib:
        buf.put("big", {"big": big_tensor(args.big_mib)}, {"mib": args.big_mib})
    server = KVServer(buf, "127.0.0.1", 0, transport=args.transport)
    print(f"READY {server.port}", flush=True)
    for line in sys.stdin:
        if line.strip() == "STATS":
            print(f"STATS {json.dumps(server.stats())}", flush=True)
    server.close()


def _consumer(args) -> None:
    from connector.kvstore import KVClient

    client = KVClient("127.0.0.1", args.port, transport=args.transport, timeout_s=60)
    print("READY 0", flush=True)
    try:
        client.get(args.key)
        print("GOT", flush=True)
    except Exception as e:
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
    client.close()


def _pipe_echo(args) -> None:
    """Connect to a PipeListener and echo every message; ``{"cmd": "big", "mib": m}`` makes it send
    a ``big_tensor(m)`` instead (printing SENDING first); ``{"cmd": "sleep"}`` stops reading."""
    from connector.transport import TransferError, connect_pipe

    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    pipe = connect_pipe("127.0.0.1", args.port, transport=args.transport, device=args.device)
    print("READY 0", flush=True)
    try:
        while True:
            m = pipe.recv(60.0, idle=True)
            cmd = m.meta.get("cmd")
            if cmd == "big":
                t = big_tensor(int(m.meta["mib"])).to(args.device)
                print("SENDING", flush=True)
                pipe.send("big", {"big": t}, {"mib": m.meta["mib"]})
            elif cmd == "sleep":
                print("SLEEPING", flush=True)
                time.sleep(600)
            else:
                pipe.send(m.key, m.tensors, m.meta)
    except TransferError as e:
        print(f"ENDED {type(e).__name__}", flush=True)
    pipe.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="role", required=True)
    pr = sub.add_parser("producer")
    pr.add_argument("--n", type=int, default=0)
    pr.add_argument("--big-mib", type=int, default=0)
    pr.add_argument("--transport", default="gloo")
    pr.add_argument("--hook", action="store_true")
    co = sub.add_parser("consumer")
    co.add_argument("--port", type=int, required=True)
    co.add_argument("--key", required=True)
    co.add_argument("--transport", default="gloo")
    pe = sub.add_parser("pipe")
    pe.add_argument("--port", type=int, required=True)
    pe.add_argument("--transport", default="gloo")
    pe.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    {"producer": _producer, "consumer": _consumer, "pipe": _pipe_echo}[args.role](args)


if __name__ == "__main__":
    main()


def settled_stat(source, key: str, want: int, timeout_s: float = 5.0) -> int:
    """``source.stats()[key]`` once it equals ``want`` or ``timeout_s`` has passed. A server counts a
    refused or broken connection in that connection's thread, which may finish after the peer has
    already seen the refusal or the close; the caller asserts on the value returned."""
    deadline = time.monotonic() + timeout_s
    while (got := source.stats()[key]) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def waited_s(text: str) -> float:
    """The ``waited=`` seconds a transport error's text reports."""
    match = re.search(r"waited=([0-9.]+)s", text)
    if match is None:
        raise AssertionError(f"no waited=...s in {text!r}")
    return float(match.group(1))


def recv_exact(sock, n: int) -> bytes:
    """``n`` bytes from a blocking socket, or fewer if the peer closed it first."""
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


class Sealed:
    """A raw socket past authentication whose frames carry the session's tags
    (:mod:`connector.transport.session`): what a hand-written peer must do after the auth
    exchange. Anything else a socket has (``recv``, ``sendall`` of raw, unsealed bytes,
    ``settimeout``, ``close``) is the socket's."""

    def __init__(self, sock, session):
        self.sock = sock
        self.session = session

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def send_frame(self, frame: bytes, payload: bytes | None = None) -> None:
        """``frame`` (prefix + body, as ``encode_header`` makes it) with its tag, then
        ``payload`` (an inline payload) and its tag, if given."""
        from connector.transport.frame import PREFIX_SIZE, decode_prefix

        _, _, body_len = decode_prefix(frame[:PREFIX_SIZE])
        header, rest = frame[: PREFIX_SIZE + body_len], frame[PREFIX_SIZE + body_len :]
        mac = self.session.sending(header)
        out = header + mac.header_tag() + rest
        if payload is not None:
            mac.update(payload)
            out += payload + mac.payload_tag()
        self.sock.sendall(out)

    def read_frame(self):
        """The next frame's header (its tag checked; an inline payload stays on the socket), or
        None once the peer closed."""
        from connector.transport.frame import PREFIX_SIZE, decode_body, decode_prefix
        from connector.transport.session import TAG_BYTES

        prefix = recv_exact(self.sock, PREFIX_SIZE)
        if len(prefix) < PREFIX_SIZE:
            return None
        kind, flags, body_len = decode_prefix(prefix)
        body = recv_exact(self.sock, body_len)
        self._mac = self.session.receiving(prefix + body)
        self._mac.check_header(recv_exact(self.sock, TAG_BYTES), "a raw read")
        return decode_body(kind, flags, body)

    def read_payload(self, nbytes: int) -> bytes:
        """The inline payload of the frame :meth:`read_frame` just read, its tag checked."""
        from connector.transport.session import TAG_BYTES

        payload = recv_exact(self.sock, nbytes)
        self._mac.update(payload)
        self._mac.check_payload(recv_exact(self.sock, TAG_BYTES), "a raw read")
        return payload


def raw_authenticate(sock, secret: bytes | None = None) -> Sealed:
    """The connector's side of :mod:`connector.transport.auth` on a raw socket (blocking, with its
    timeout): what a hand-written client must do before its first frame. Returns the socket
    wrapped with its session."""
    from connector.transport import auth
    from connector.transport.session import Session

    def exact(n: int) -> bytes:
        out = recv_exact(sock, n)
        if len(out) < n:
            raise ConnectionError(f"closed after {len(out)}/{n} bytes of the auth exchange")
        return out

    required, nonce_l = auth.parse_challenge(exact(auth.CHALLENGE.size), "raw")
    address = auth.address_text(sock.getpeername())
    response, nonce_c = auth.respond(secret, required, nonce_l, address, "raw")
    sock.sendall(response)
    auth.check_verdict(secret, nonce_l, nonce_c, address, exact(auth.VERDICT.size), "raw")
    keys = auth.session_keys(secret, nonce_l, nonce_c, address)
    return Sealed(sock, Session.pair(*keys, listener=False))


def raw_listener_authenticate(conn, secret: bytes | None = None) -> Sealed | None:
    """The listener's side of :mod:`connector.transport.auth` on a raw socket: the connection
    wrapped with its session if the peer passed, else None."""
    from connector.transport import auth
    from connector.transport.session import Session

    challenge, nonce_l = auth.challenge(secret is not None)
    conn.sendall(challenge)
    raw = recv_exact(conn, auth.RESPONSE.size)
    if len(raw) < auth.RESPONSE.size:
        return None
    outcome = auth.check_response(secret, nonce_l, raw, {auth.address_text(conn.getsockname())})
    conn.sendall(outcome.verdict)
    if outcome.problem is not None:
        return None
    keys = auth.session_keys(secret, nonce_l, outcome.nonce_c, outcome.address)
    return Sealed(conn, Session.pair(*keys, listener=True))


@contextlib.contextmanager
def pipe_pair(transport="gloo", listener_kw=None, **options):
    """(listener-side pipe, connector-side pipe) in this process; ``options``: PipeOptions fields."""
    from connector.transport import PipeListener, PipeOptions, connect_pipe

    kw = {"options": PipeOptions(**options)} if options else {}
    listener = PipeListener(transport=transport, **(listener_kw or {}), **kw)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("p", listener.accept(timeout_s=20)))
    t.start()
    client = None
    try:
        client = connect_pipe("127.0.0.1", listener.port, transport=transport, **kw)
        t.join(20)
        yield got["p"], client
    finally:
        t.join(20)
        if client is not None:
            client.close(timeout_s=1)
        if "p" in got:
            got["p"].close(timeout_s=1)
        listener.close()
