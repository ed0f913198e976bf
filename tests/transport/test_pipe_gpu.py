"""Device tensors on every transport (skipped without a GPU; ``bench/gpu_check.sh`` runs it):
gloo and socket stage CUDA tensors through pinned host buffers both ways, and two ends on one
GPU that ask for NCCL (which refuses two ranks on one GPU) agree on gloo."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from connector.kvstore import KVBuffer, KVClient, KVServer
from connector.transport import PipeListener, connect_pipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@contextlib.contextmanager
def cuda_pair(transport: str, listener_transport: str | None = None):
    listener = PipeListener(transport=listener_transport or transport, device="cuda")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("p", listener.accept(timeout_s=30)))
    t.start()
    client = connect_pipe("127.0.0.1", listener.port, transport=transport, device="cuda")
    t.join(30)
    try:
        yield got["p"], client
    finally:
        client.close(timeout_s=2)
        got["p"].close(timeout_s=2)
        listener.close()


def _tensors():
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), device="cuda", generator=gen)
    return {
        "big": big.to(torch.int32),  # 4 MiB: alone on the group for gloo
        "small": torch.arange(7, device="cuda", dtype=torch.int16),  # packed or inline
        "bf16": torch.randn(33, 5, device="cuda").to(torch.bfloat16).t(),  # not contiguous
    }


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["gloo", "socket"])
def test_cuda_tensors_travel_bit_exact_through_host_staging(transport):
    sent = _tensors()
    with cuda_pair(transport) as (server, client):
        client.send("k", sent, {"n": 1})
        m = server.recv(30)
        for name, t in sent.items():
            assert m.tensors[name].device.type == "cuda", name
            assert _same_bits(m.tensors[name], t), name
        out = {"big": torch.full_like(sent["big"], -1)}
        server.send("back", {"big": m.tensors["big"]})
        got = client.recv(30, out=out)
        assert got.tensors["big"] is out["big"] and _same_bits(out["big"], sent["big"])


@pytest.mark.timeout(120)
def test_two_ends_on_one_gpu_asking_for_nccl_use_gloo():
    with cuda_pair("nccl") as (server, client):
        assert client.transport == server.transport == "gloo"
        sent = _tensors()
        client.send("k", sent)
        m = server.recv(30)
        assert all(_same_bits(m.tensors[n], t) for n, t in sent.items())


@pytest.mark.timeout(120)
def test_a_kv_server_on_cuda_serves_a_cuda_client_over_gloo():
    buf = KVBuffer(64 << 20)
    kv = torch.randn(4, 1024, 64, device="cuda").to(torch.bfloat16)
    buf.put("t", {"kv": kv})
    with (
        KVServer(buf, transport="gloo", device="cuda") as srv,
        KVClient("127.0.0.1", srv.port, transport="gloo", device="cuda") as client,
    ):
        got, _ = client.get("t")
    assert got["kv"].device.type == "cuda" and _same_bits(got["kv"], kv)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["gloo", "socket"])
def test_staging_is_ordered_after_the_callers_stream_in_both_directions(transport):
    """A 40 MiB tensor (three pieces) written, and an ``out`` tensor overwritten, on a stream
    that is still busy when send and recv are called: the staging copies wait for it."""
    n = (40 << 20) // 4
    want = torch.arange(n, device="cuda", dtype=torch.int32)
    busy = torch.cuda.Stream()
    with cuda_pair(transport) as (server, client):
        x = torch.zeros(n, device="cuda", dtype=torch.int32)
        busy.wait_stream(torch.cuda.current_stream())  # want and x are made on that one
        with torch.cuda.stream(busy):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before x is written
            x.copy_(want)
            client.send("k", {"x": x})
        got = server.recv(60).tensors["x"]
        assert _same_bits(got, want)
        server.send("back", {"x": got})
        out = {"x": torch.zeros(n, device="cuda", dtype=torch.int32)}
        busy.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(busy):
            torch.cuda._sleep(200_000_000)
            out["x"].fill_(-1)  # queued before the receive: must land under it
            back = client.recv(60, out=out).tensors["x"]
        torch.cuda.synchronize()
        assert back is out["x"] and _same_bits(back, want)
