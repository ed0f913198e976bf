"""The vLLM connector's worker sides without an engine: caches, producers and consumers built
directly (at TP 1 unless told), and an in-process save-then-load (no sockets, no vLLM)."""

from __future__ import annotations

import inspect
import time
from functools import partial
from types import SimpleNamespace

import torch

from connector.kvstore import KVBuffer, KVServer
from connector.vllm_connector.cache_views import RankCaches
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.consumer import Consumer
from connector.vllm_connector.metadata import LoadSpec, SaveSpec
from connector.vllm_connector.producer import Producer
from connector.vllm_connector.stats import TransferStats
from support.kvstore import deliver

HEAD_SIZE, SENTINEL = 8, 12345
DIGEST = "d1" * 16  # the prompt digest the saves of these tests bind their entries to
# The transport of the in-process KV servers: gloo, as in production. (With the TCPStore
# rendezvous the transport had before, several gloo servers in one process made a store client's
# connect time out now and then, 5 s: a reverse-DNS lookup of its; these tests then used "socket".)
TRANSPORT = "gloo"

VLLM_CPU = (6, 2, 4, 2 * HEAD_SIZE)  # [num_blocks, H, block_size, 2 * head_size], block_size 4
NHD = (2, 6, 4, 2, HEAD_SIZE)  # FlashAttention [2, B, N, H, D], block_size 4
OPAQUE = (6, 3, 4, 5)  # no layout this connector knows: a page of 60 values, block_size 4


def caches(shape, seed=0, num_layers=2):
    """Per-layer int16 caches seen as bf16: random, or all the sentinel when ``seed`` is None."""
    gen = torch.Generator().manual_seed(seed or 0)
    out = []
    for _ in range(num_layers):
        bits = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
        out.append((bits.fill_(SENTINEL) if seed is None else bits).view(torch.bfloat16))
    return out


def hnd(seed=None):
    """FlashAttention caches of NHD shape with HND memory order: the same page size as NHD's."""
    return [c.transpose(2, 3) for c in caches((2, 6, 2, 4, HEAD_SIZE), seed)]


def bits(tensors):
    return torch.stack([c.view(torch.int16) for c in tensors])


def rank_caches(tensors, block_size, *, use_mla=False, isa="vec") -> RankCaches:
    """``tensors`` (one per layer) as views; ``isa``: the attention ISA vllm-cpu would have
    picked (this is a CPU platform)."""
    return RankCaches(tensors, HEAD_SIZE, block_size, use_mla=use_mla, on_cpu=True, isa=isa)


def producer(
    tensors,
    block_size,
    *,
    kv_format="auto",
    cfg=None,
    use_mla=False,
    isa="vec",
    tp_rank=0,
    engine_port=14600,
    secret=None,
    streams=None,
) -> Producer:
    """A producer over ``tensors`` (not serving yet: :meth:`Producer.serve` or ``attach_buffer``);
    ``streams``: a stand-in for a GPU's (support.fake_streams)."""
    return Producer(
        cfg or ConnectorConfig(kv_format=kv_format),
        rank_caches(tensors, block_size, use_mla=use_mla, isa=isa),
        tp_rank=tp_rank,
        engine_port=engine_port,
        fingerprint="fp",
        secret=secret,
        stats=TransferStats(),
        streams=streams,
    )


def consumer(
    tensors,
    block_size,
    *,
    cfg=None,
    use_mla=False,
    isa="vec",
    tp_rank=0,
    tp_size=1,
    total_kv_heads=None,
    secret=None,
    connect=None,
    streams=None,
) -> Consumer:
    """A consumer over ``tensors``; ``total_kv_heads`` defaults to this rank's heads (TP 1)."""
    views = rank_caches(tensors, block_size, use_mla=use_mla, isa=isa)
    return Consumer(
        cfg or ConnectorConfig(),
        views,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=views.num_heads if total_kv_heads is None else total_kv_heads,
        use_mla=use_mla,
        secret=secret,
        stats=TransferStats(),
        connect=connect,
        streams=streams,
    )


def fake_client(get):
    """A client whose ``get`` is ``get`` (and ``close`` does nothing); asked to defer the
    entry check, a ``get`` that does not take it gives no tag to check."""

    def get_entry(key, defer_entry_check=False, **kw):
        if "defer_entry_check" in inspect.signature(get).parameters:
            return get(key, defer_entry_check=defer_entry_check, **kw)
        got = get(key, **kw)
        return (*got, None) if defer_entry_check else got

    return SimpleNamespace(get=get_entry, close=lambda: None)


def transfer(
    src: Producer, dst_tensors, dst_block_size, src_blocks, dst_blocks, num_tokens, start, **kw
):
    """Save a ``num_tokens`` prompt on ``src``, load it on a consumer over ``dst_tensors`` (whose
    first ``start`` positions are a local hit); returns ``(consumer, its load-error blocks)``."""
    buffer = KVBuffer(1 << 24)
    src.attach_buffer(buffer)
    src.wait_for_save([SaveSpec("p", "t1", src_blocks, num_tokens, prompt_digest=DIGEST)])
    dst = consumer(
        dst_tensors,
        dst_block_size,
        connect=lambda host, port: fake_client(partial(deliver, buffer)),
        **kw,
    )
    dst.start_load_kv(
        [
            LoadSpec(
                "c",
                "t1",
                "h",
                1,
                dst_blocks,
                start,
                num_tokens - 1 - start,
                num_tokens,
                prompt_digest=DIGEST,
            )
        ]
    )
    buffer.close()
    errors = dst.get_block_ids_with_load_errors()
    dst.shutdown()
    return dst, errors


class ServedProducer:
    """A producer rank over random NHD caches (``src``), its buffer served on a loopback port
    over gloo (``server.port``)."""

    def __init__(self, block_size: int, *, seed: int = 7, kv_format: str = "tokens"):
        self.src = caches(NHD, seed=seed)
        self.worker = producer(self.src, block_size, kv_format=kv_format)
        self.buffer = KVBuffer(1 << 24)
        self.worker.attach_buffer(self.buffer)
        self.server = KVServer(self.buffer, "127.0.0.1", 0, transport="gloo")

    def close(self) -> None:
        self.server.close()
        self.buffer.close()


def poll_loads(conn, until, wait_s: float = 20.0, ended=frozenset()):
    """``conn.get_finished`` (given ``ended`` as vLLM's finished_req_ids, through its clients'
    ``end``) until ``until`` requests were reported or ``wait_s`` passed; returns ``(finished,
    load-error blocks)``."""
    finished, errors, end = set(), set(), time.monotonic() + wait_s
    while not until <= finished and time.monotonic() < end:
        conn.clients.end(set(ended))
        finished |= conn.get_finished() or set()
        errors |= conn.get_block_ids_with_load_errors()
        time.sleep(0.01)
    return finished, errors
