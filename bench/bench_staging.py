"""Device tensors over the transports that carry host memory (gloo, socket): staged in pieces,
each piece's copy overlapping the network (connector/transport/staging.py), against copying
the whole tensor to the host first and back to the device after (what a caller without staging
does), and against host tensors (the limit), same run, interleaved.

    python -m bench.bench_staging [--mib 256] [--rounds 5] [--dry-run]

Both ends in this process (a listener and a connected pipe, loopback): a round is one message of
``--mib`` MiB from ``send`` until ``recv`` returned on the other end with the tensor where it
belongs (on the device: after a synchronize). Medians of ``--rounds``. Providers:

- ``host``: a CPU tensor in, a CPU tensor out (the transport's own limit).
- ``staged``: a CUDA tensor in, ``recv(device="cuda")`` out.
- ``whole``: the CUDA tensor copied to pinned host memory and synchronized, sent as a host
  tensor, received on the host, copied to the device and synchronized.

Lines ``staging <transport> <provider> <MiB> MiB: <ms> ms, <GB/s> GB/s``, then per transport
``staged/whole time ratio`` and ``staged/host time ratio``. ``--dry-run`` (no GPU): tiny sizes
on the CPU, where ``staged`` is the host path (it checks the script, not the staging).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from connector.transport import PipeListener, connect_pipe


def _pair(transport: str, device: str):
    listener = PipeListener(transport=transport, device=device)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("p", listener.accept(timeout_s=30)))
    t.start()
    client = connect_pipe("127.0.0.1", listener.port, transport=transport, device=device)
    t.join(30)
    return listener, got["p"], client


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _round(provider: str, server, client, x: torch.Tensor, device: str) -> float:
    t0 = time.perf_counter()
    if provider == "whole":
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=device == "cuda")
        host.copy_(x, non_blocking=True)
        _sync(device)
        client.send("x", {"x": host})
        got = server.recv(120, device="cpu").tensors["x"]
        got = got.to(device, non_blocking=True)
    else:
        client.send("x", {"x": x})
        got = server.recv(120, device=x.device).tensors["x"]
    _sync(device)
    dt = time.perf_counter() - t0
    if not torch.equal(got.view(torch.uint8), x.view(torch.uint8)):
        raise AssertionError(f"{provider}: received bytes differ")
    return dt


def run(mib: int, rounds: int, dry_run: bool) -> list[str]:
    on_gpu = torch.cuda.is_available() and not dry_run
    device = "cuda" if on_gpu else "cpu"
    nbytes = (mib if not dry_run else 1) << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    inputs = {"host": src, "staged": src.to(device), "whole": src.to(device)}
    lines = []
    for transport in ("gloo", "socket"):
        listener, server, client = _pair(transport, device)
        try:
            times: dict[str, list[float]] = {p: [] for p in inputs}
            for p, x in inputs.items():  # warm-up: pools, pinned buffers, streams
                _round(p, server, client, x, device)
            for _ in range(rounds):
                for p, x in inputs.items():
                    times[p].append(_round(p, server, client, x, device))
        finally:
            client.close(timeout_s=2)
            server.close(timeout_s=2)
            listener.close()
        med = {p: statistics.median(ts) for p, ts in times.items()}
        for p, t in med.items():
            lines.append(
                f"staging {transport} {p} {nbytes >> 20} MiB: {t * 1e3:.2f} ms, "
                f"{nbytes / t / 1e9:.2f} GB/s"
            )
        lines.append(
            f"staging {transport} staged/whole time ratio: {med['staged'] / med['whole']:.3f}"
        )
        lines.append(
            f"staging {transport} staged/host time ratio: {med['staged'] / med['host']:.3f}"
        )
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.rounds < 1:
        raise SystemExit(f"--mib and --rounds: expected >= 1, got {args.mib} and {args.rounds}")
    print(f"bench_staging: torch {torch.__version__}, cuda {torch.cuda.is_available()}")
    for line in run(args.mib, args.rounds, args.dry_run):
        print(line, flush=True)


if __name__ == "__main__":
    main()
