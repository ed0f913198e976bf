"""Transport benchmark: tensor pipe vs raw torch.distributed send/recv, and KV buffer latency.

    python -m bench.bench_pipe [--quick] [--transport gloo|nccl]

Throughput: this process listens, a child process (this module, ``--role child``) connects; the
pipe's own two-rank process group carries both providers, in the same run, interleaved:

- ``raw``: ``pg.send`` / ``pg.recv`` of one uint8 tensor into a buffer the receiver allocated once
  (tag 7, the pipe's payloads use tag 0): the limit.
- ``pipe``: ``TensorPipe.send`` of ``{"x": tensor}`` and ``TensorPipe.recv()`` on the other side:
  header on the control socket, validation, a fresh output tensor per message, payload on the
  process group.
- ``pipe_out``: the same, received into a preallocated tensor (``recv(out=...)``).
- ``entry``: the same as ``pipe``, sent as a stored KV entry is (``send(entry_nh=...)``, its NH
  outputs made once, as the producer's pack makes them) and received as the consumer receives one
  (``recv(entry_keys=..., defer_entry_check=True)``, the tag checked with NH outputs the receiver
  computed once from the bytes it got, as its unpack computes them): neither end reads the
  payload to authenticate it, so this is the transport's cost on the KV path (the NH inside the
  pack and unpack: ``bench_umac``). ``pipe`` and ``pipe_out`` hash the payload on both ends.

Each point is the median of ``rounds`` timings of ``reps`` back-to-back messages, from the sender's
first send until the receiver's "done" reply (one small round trip, the same for all providers).

Latency with 10, 1k and 100k entries held: a local delivery (``KVBuffer.checkout`` then
``checkin``), ``KVBuffer.match_prefix`` (64-token query over random prompts, block 16) and
``KVClient.get`` (remote, small entry, gloo, same host). A delivery claims its entry, so each
delivery's entry is put, untimed, just before it. Medians; they should stay flat as the buffer
grows (dict and hash lookups, no scans).

The last line is ``pipe/raw throughput ratio at 64 MiB: R (entry/raw E)``.
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import subprocess
import sys
import time

import torch

from connector.kvstore import KVBuffer, KVClient, KVServer
from connector.transport import PipeListener, PipeOptions, connect_pipe
from tritonkv import umac

MIB = 1 << 20
RAW_TAG = 7
ENTRY_KEY = "bench-entry"  # the stored entry's key its NH key comes from (no secret: loopback)


def _wait(work, timeout_s: float = 300.0) -> None:
    work.wait(datetime.timedelta(seconds=timeout_s))


# ------------------------------------------------------------------------------------ child side
def child(port: int, transport: str, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    pipe = connect_pipe(
        "127.0.0.1",
        port,
        transport=transport,
        device=device,
        options=PipeOptions(recv_timeout_s=300),
    )
    pg = pipe.process_group
    entry_nh = {}  # payload bytes -> NH outputs of the entry the main side sends
    try:
        while True:
            m = pipe.recv(300.0, idle=True)
            cmd = m.meta.get("cmd")
            if cmd == "quit":
                break
            n, reps = int(m.meta["n"]), int(m.meta["reps"])
            if cmd == "raw":
                buf = torch.empty(n, dtype=torch.uint8, device=device)
                buf.fill_(0)  # fault the pages in once, as a long-lived receive buffer would be
                pipe.send("ready")
                for _ in range(reps):
                    _wait(pg.recv([buf], 0, RAW_TAG))
                if buf.is_cuda:
                    torch.cuda.synchronize()
            elif cmd == "pipe":
                pipe.send("ready")
                for _ in range(reps):
                    got = pipe.recv(300.0)
                    assert got.tensors["x"].numel() == n
            elif cmd == "entry":
                keys = umac.entry_keys(None, ENTRY_KEY)
                pipe.send("ready")
                for _ in range(reps):
                    got = pipe.recv(300.0, entry_keys=keys, defer_entry_check=True)
                    if n not in entry_nh:  # the first (warm-up) message: hashed once, here
                        entry_nh[n] = umac.nh_hash(got.tensors["x"], keys)
                    got.entry_tag.check({"x": entry_nh[n]})
            elif cmd == "pipe_out":
                out = {"x": torch.zeros(n, dtype=torch.uint8, device=device)}
                pipe.send("ready")
                for _ in range(reps):
                    pipe.recv(300.0, out=out)
            pipe.send("done")
            pipe.flush(60)
    finally:
        pipe.close()


# ----------------------------------------------------------------------------------- throughput
def _measure(pipe, provider: str, buf: torch.Tensor, reps: int, nh=None) -> float:
    """Seconds for ``reps`` messages of ``buf`` through ``provider`` (``nh``: its NH outputs
    under the entry's key, for ``entry``)."""
    pipe.send("cmd", None, {"cmd": provider, "n": buf.numel(), "reps": reps})
    assert pipe.recv(300.0).key == "ready"
    t0 = time.perf_counter()
    if provider == "raw":
        for _ in range(reps):
            _wait(pipe.process_group.send([buf], 1, RAW_TAG))
    elif provider == "entry":
        for _ in range(reps):
            pipe.send("m", {"x": buf}, entry_nh={"x": nh})
    else:
        for _ in range(reps):
            pipe.send("m", {"x": buf})
    assert pipe.recv(300.0).key == "done"
    return time.perf_counter() - t0


def throughput(sizes_mib, rounds: int, transport: str, device: str, child_device: str):
    listener = PipeListener(transport=transport, device=device)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_pipe", "--role", "child", "--port",
         str(listener.port), "--transport", transport, "--device", child_device],
    )  # fmt: skip
    rows = []
    try:
        pipe = listener.accept(timeout_s=120)
        providers = ("raw", "pipe", "pipe_out", "entry")
        for mib in sizes_mib:
            n = mib * MIB
            buf = torch.randint(0, 256, (n,), dtype=torch.uint8).to(device)
            reps = max(2, min(32, (256 * MIB) // n))
            nh = umac.nh_hash(buf, umac.entry_keys(None, ENTRY_KEY))
            for p in providers:  # warm-up
                _measure(pipe, p, buf, 1, nh)
            times = {p: [] for p in providers}
            for _ in range(rounds):
                for p in providers:
                    times[p].append(_measure(pipe, p, buf, reps, nh))
            gbps = {p: n * reps / statistics.median(times[p]) / 1e9 for p in providers}
            rows.append((mib, reps, gbps))
            print(
                f"{mib:>6} MiB  reps {reps:>2}  raw {gbps['raw']:7.3f} GB/s  pipe "
                f"{gbps['pipe']:7.3f} GB/s  pipe(out=) {gbps['pipe_out']:7.3f} GB/s  entry "
                f"{gbps['entry']:7.3f} GB/s  ratio {gbps['pipe'] / gbps['raw']:.2f}",
                flush=True,
            )
        pipe.send("bye", None, {"cmd": "quit"})
        pipe.flush(30)
        pipe.close()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        listener.close()
    return rows


# -------------------------------------------------------------------------------------- latency
def _median_us(fn, args_list) -> float:
    ts = []
    for a in args_list:
        t0 = time.perf_counter()
        fn(a)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _median_delivery_us(buf: KVBuffer, deliver, n: int, prefix: str) -> float:
    """Median microseconds of ``deliver(key)`` over ``n`` small entries, each put (untimed) just
    before its delivery claims it."""
    ts = []
    for j in range(n):
        key = f"{prefix}-{j}"
        buf.put(key, {"kv": torch.zeros(16), "cu_seqlens": torch.zeros(2)}, {"j": j})
        t0 = time.perf_counter()
        deliver(key)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _local_delivery(buf: KVBuffer):
    def deliver(key: str) -> None:
        with buf.checkout(key):
            pass

    return deliver


def latency(counts, ops: int):
    rows = []
    rng = random.Random(0)
    for count in counts:
        buf = KVBuffer(8 << 30, ttl_s=None, block_size=16)
        prompts = []
        for i in range(count):
            toks = [i, *[rng.randrange(32000) for _ in range(63)]]  # 4 blocks, distinct prefixes
            prompts.append(toks)
            buf.put(f"req-{i}", {"kv": torch.zeros(16), "cu_seqlens": torch.zeros(2)}, {"i": i},
                    token_ids=toks)  # fmt: skip
        queries = [[*prompts[rng.randrange(count)][:48], 1, 2, 3] for _ in range(ops)]
        lease_us = _median_delivery_us(buf, _local_delivery(buf), ops, "local")
        match_us = _median_us(buf.match_prefix, queries)
        assert buf.match_prefix(queries[0])[0] == 48
        server = KVServer(buf, "127.0.0.1", 0)
        try:
            with KVClient("127.0.0.1", server.port, timeout_s=30) as client:
                client.discard("connect")  # connects: the rendezvous is not what is timed
                get_us = _median_delivery_us(buf, client.get, max(200, ops // 10), "remote")
        finally:
            server.close()
        rows.append((count, lease_us, match_us, get_us))
        print(
            f"{count:>7} entries  local delivery {lease_us:8.1f} us  "
            f"match_prefix {match_us:8.1f} us  "
            f"remote get {get_us:8.1f} us",
            flush=True,
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and rounds (< 2 min)")
    ap.add_argument("--transport", default=None, help="gloo (default without 2 GPUs) or nccl")
    ap.add_argument("--role", default="main", choices=("main", "child"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.role == "child":
        child(args.port, args.transport, args.device)
        return
    transport = args.transport or ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    device, child_device = ("cuda:0", "cuda:1") if transport == "nccl" else ("cpu", "cpu")
    sizes = (1, 16, 64) if args.quick else (1, 4, 16, 64, 256, 512)
    rounds = 7 if args.quick else 9
    counts = (10, 1_000, 100_000)
    ops = 2_000 if args.quick else 10_000
    print(f"# bench_pipe transport={transport} torch={torch.__version__} quick={args.quick}")
    print("## KV buffer latency (median)")
    latency(counts, ops)
    print(f"## throughput, {transport}, median of {rounds} rounds")
    rows = throughput(sizes, rounds, transport, device, child_device)
    print()
    cols = ("pipe", "pipe_out", "entry")
    print("| size | raw GB/s | " + " | ".join(f"{c} GB/s | {c}/raw" for c in cols) + " |")
    print("|-----:|---------:|" + "-----:|-----:|" * len(cols))
    for mib, _reps, g in rows:
        cells = " | ".join(f"{g[c]:.3f} | {g[c] / g['raw']:.2f}" for c in cols)
        print(f"| {mib} MiB | {g['raw']:.3f} | {cells} |")
    at64 = next(g for mib, _r, g in rows if mib == 64)
    print(
        f"pipe/raw throughput ratio at 64 MiB: {at64['pipe'] / at64['raw']:.2f} "
        f"(entry/raw {at64['entry'] / at64['raw']:.2f})"
    )


if __name__ == "__main__":
    main()
