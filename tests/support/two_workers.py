"""Two processes driving the connector's worker sides the way vLLM's model runner does: in the
producer, a "forward pass" writes a prompt's KV on the compute stream and the connector's
``wait_for_save`` follows at once; in the consumer, ``start_load_kv``, then a kernel reading the
blocks (replayed from a CUDA graph on a GPU), then ``get_finished`` and
``get_block_ids_with_load_errors``. Real KV servers and clients between them (``socket`` or
``gloo``), FlashAttention-shaped bf16 caches (``[2, num_blocks, block_size, num_kv_heads,
head_size]``). On a GPU the connector's calls run under ``torch.cuda.set_sync_debug_mode("error")``
(after one warm-up round: Triton compiles and tritonkv builds its layer table on a first call);
on CPU the sides take their GPU path on :class:`~support.fake_streams.FakeStreams`.

Rounds (the same in both processes, :data:`ROUNDS`): a warm-up, two checked loads, a save whose
allocation fails (its load finds nothing: recomputed), a load whose allocation fails (recomputed),
and a last checked load (the sides still work).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection

import torch

from connector.vllm_connector.cache_views import RankCaches
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.consumer import Consumer
from connector.vllm_connector.metadata import LoadSpec, SaveSpec
from connector.vllm_connector.producer import Producer
from connector.vllm_connector.stats import TransferStats

DIGEST = "d1" * 16
SENTINEL = 12345
# (name, producer's faults, consumer's faults, loaded?)
ROUNDS = (
    ("warm-up", "", "", True),
    ("checked", "", "", True),
    ("checked-2", "", "", True),
    ("save-alloc-fail", "alloc_fail", "", False),
    ("load-alloc-fail", "", "alloc_fail", False),
    ("after-failures", "", "", True),
)
SIZES = {  # num_layers, num_blocks, block_size, num_kv_heads, head_size, num_tokens
    "cpu": (2, 24, 4, 2, 8, 10),  # 3 blocks a prompt, 6 rounds
    "cuda": (8, 96, 16, 8, 128, 200),  # 13 blocks a prompt
}


def flash_caches(device: str) -> list[torch.Tensor]:
    num_layers, num_blocks, block_size, heads, head_size, _ = SIZES[device]
    shape = (2, num_blocks, block_size, heads, head_size)
    return [
        torch.full(shape, SENTINEL, dtype=torch.int16, device=device).view(torch.bfloat16)
        for _ in range(num_layers)
    ]


def rank_caches(tensors, device: str) -> RankCaches:
    _, _, block_size, _, head_size, _ = SIZES[device]
    on_cpu = device == "cpu"
    return RankCaches(
        tensors, head_size, block_size, use_mla=False, on_cpu=on_cpu, isa="vec" if on_cpu else None
    )


def blocks_of(device: str, round_no: int, side: str) -> list[int]:
    """The prompt's blocks in round ``round_no`` on ``side``: in an order of each side's own,
    disjoint across rounds (a failed load's blocks hold nothing of an earlier round)."""
    _, num_blocks, block_size, _, _, num_tokens = SIZES[device]
    n = -(-num_tokens // block_size)
    gen = torch.Generator().manual_seed(int(side == "consumer"))
    return torch.randperm(num_blocks, generator=gen)[round_no * n : (round_no + 1) * n].tolist()


def pattern(device: str, round_no: int) -> torch.Tensor:
    """``[num_layers, 2, num_tokens, num_kv_heads, head_size]`` int16: round ``round_no``'s KV
    (never the sentinel)."""
    num_layers, _, _, heads, head_size, num_tokens = SIZES[device]
    gen = torch.Generator().manual_seed(round_no)
    bits = torch.randint(
        -(2**15),
        2**15 - 1,
        (num_layers, 2, num_tokens, heads, head_size),
        generator=gen,
        dtype=torch.int16,
    )
    bits[bits == SENTINEL] = 0
    return bits


def positions(device: str, blocks: list[int], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = SIZES[device][2]
    pos = torch.arange(count)
    return torch.tensor(blocks)[pos // block_size], pos % block_size


def forward(caches, blocks, device: str, round_no: int) -> None:
    """The "forward pass": writes the round's KV into the prompt's slots (on the current
    stream)."""
    rows = pattern(device, round_no).to(device, non_blocking=True)
    b, o = (t.to(device) for t in positions(device, blocks, rows.shape[2]))
    for layer, cache in enumerate(caches):
        c = cache.view(torch.int16)
        for kv in range(2):
            c[kv, b, o] = rows[layer, kv]


@contextlib.contextmanager
def sync_debug(device: str, on: bool):
    """``torch.cuda.set_sync_debug_mode("error")`` on a GPU while active (when ``on``)."""
    if device != "cuda" or not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _streams(device: str):
    if device == "cuda":
        return None, torch.cuda.Stream()  # the sides make their StreamOps; vLLM's stream
    from support.fake_streams import FakeStreams

    return FakeStreams(auto_complete=True), None


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def producer_main(device: str, transport: str, port: int, conn) -> None:
    """The producer process: serve on ``port``, save every round's prompt, report, and wait for
    the parent's word to stop."""
    try:
        fake, compute = _streams(device)
        cfg = ConnectorConfig(transport=transport, kv_format="tokens", port=port)
        caches = flash_caches(device)
        if device == "cuda":  # filled on the default stream; the "forward" runs on another
            torch.cuda.synchronize()
        prod = Producer(
            cfg,
            rank_caches(caches, device),
            tp_rank=0,
            engine_port=port,
            fingerprint="fp",
            secret=None,
            stats=TransferStats(),
            streams=fake,
        )
        prod.serve()
        _, _, _, _, _, num_tokens = SIZES[device]
        for round_no, (name, faults, _, _) in enumerate(ROUNDS):
            blocks = blocks_of(device, round_no, "producer")
            spec = SaveSpec(
                name,
                f"{round_no:032x}",
                blocks,
                num_tokens,
                prompt_digest=DIGEST,
                debug_fault=faults,
            )
            with _on(compute):
                forward(caches, blocks, device, round_no)
                with sync_debug(device, round_no > 0):
                    prod.wait_for_save([spec])
            if not prod.flush(60):
                raise TimeoutError(f"round {name}: the save was not published in 60 s")
        conn.send(("saved", prod.stats.peek()))
        if conn.poll(300):
            conn.recv()
        prod.shutdown()
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def consume(device: str, transport: str, port: int) -> dict:
    """The consumer side, in this process: every round's load, the blocks read after it (a CUDA
    graph's replay on a GPU). Returns ``{round name: (load-error blocks, bits read or None)}``
    and the stats."""
    fake, compute = _streams(device)
    caches = flash_caches(device)
    cfg = ConnectorConfig(transport=transport, load_timeout_s=30.0)
    cons = Consumer(
        cfg,
        rank_caches(caches, device),
        tp_rank=0,
        tp_size=1,
        total_kv_heads=SIZES[device][3],
        use_mla=False,
        secret=None,
        stats=TransferStats(),
        streams=fake,
    )
    num_tokens = SIZES[device][5]
    count = num_tokens - 1  # vLLM computes the last prompt token
    reader = _Reader(caches, device, count, compute)
    results = {}
    try:
        for round_no, (name, _, faults, _) in enumerate(ROUNDS):
            blocks = blocks_of(device, round_no, "consumer")
            spec = LoadSpec(
                name,
                f"{round_no:032x}",
                "127.0.0.1",
                port,
                blocks,
                0,
                count,
                num_tokens,
                prompt_digest=DIGEST,
                debug_fault=faults,
            )
            with _on(compute):
                with sync_debug(device, round_no > 0):
                    cons.start_load_kv([spec])
                read = reader.read(blocks)  # the "attention" kernel, after the load on the stream
                with sync_debug(device, round_no > 0):
                    cons.get_finished()
                    errors = cons.get_block_ids_with_load_errors()
            if compute is not None:
                compute.synchronize()
            results[name] = (errors, read.cpu())
        return {"rounds": results, "stats": cons.stats.peek(), "budget": cons.budget.in_use}
    finally:
        cons.shutdown()


class _Reader:
    """Reads prompt positions ``[0, count)`` of every layer into ``[num_layers, 2, count, heads,
    head_size]`` int16: on a GPU one CUDA graph, captured once and replayed per round with the
    round's block ids copied into its static index."""

    def __init__(self, caches, device: str, count: int, compute):
        self.caches, self.device, self.count, self.compute = caches, device, count, compute
        self.graph = None
        if device == "cuda":
            b, o = positions(device, blocks_of(device, 0, "consumer"), count)
            self.b, self.o = b.to(device), o.to(device)
            self.out = self._gather()  # warm-up outside the capture
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._gather()
            self.pinned = torch.empty(2, count, dtype=torch.int64, pin_memory=True)

    def _gather(self):
        return torch.stack(
            [
                torch.stack([c.view(torch.int16)[kv, self.b, self.o] for kv in range(2)])
                for c in self.caches
            ]
        )

    def read(self, blocks):
        b, o = positions(self.device, blocks, self.count)
        if self.graph is None:
            self.b, self.o = b, o
            return self._gather()
        self.pinned[0].copy_(b)
        self.pinned[1].copy_(o)
        self.b.copy_(self.pinned[0], non_blocking=True)
        self.o.copy_(self.pinned[1], non_blocking=True)
        self.graph.replay()
        return self.out.clone()


def run(device: str, transport: str, port: int) -> tuple[dict, dict]:
    """Both sides: the producer in a spawned process, the consumer here. Returns the consumer's
    results (:func:`consume`) and the producer's stats."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=producer_main, args=(device, transport, port, child), daemon=True)
    proc.start()
    child.close()  # the producer's end only: its death is then the end of our pipe
    # (on a GPU within gpu_check.sh's step limit of 180 s, so that a failure gets reported)
    limit_s = 150 if device == "cuda" else 240
    try:
        if not multiprocessing.connection.wait([parent, proc.sentinel], limit_s):
            raise TimeoutError(f"the producer process did not report within {limit_s} s")
        try:
            kind, saved = parent.recv()
        except EOFError:
            raise RuntimeError(
                f"the producer process ended (exit code {proc.exitcode}) without a report"
            ) from None
        if kind != "saved":
            raise RuntimeError(f"the producer process failed: {saved}")
        return consume(device, transport, port), saved
    finally:
        with contextlib.suppress(OSError):  # (a dead producer: nobody to stop)
            parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
