"""Transports and devices (connector/transport/options.py, buffers.py, handshake.py): gloo and
socket carry host memory, so device tensors are staged through pinned host buffers; two ends on
one GPU, which NCCL cannot connect, agree on gloo. The staging on CUDA needs a GPU
(``tests/transport/test_pipe_gpu.py``); its logic on stand-in copies is in test_staging.py."""

from __future__ import annotations

import threading

import pytest
import torch
from support.transport import raw_authenticate

from connector.transport import PipeListener, connect_pipe, staging
from connector.transport import connect as connect_module
from connector.transport import listener as listener_module
from connector.transport.buffers import STAGING_POOL, staging_buffer
from connector.transport.frame import Kind, encode_header
from connector.transport.options import device_uuid


def test_cpu_tensors_are_not_staged_and_staging_buffers_are_reused():
    t = torch.arange(10)
    assert staging.copies_for(t.device) is None  # host memory: nothing to stage
    assert device_uuid("cpu") == ""
    first = staging_buffer(STAGING_POOL.min_bytes)
    ptr = first.data_ptr()
    del first
    again = staging_buffer(STAGING_POOL.min_bytes)  # nothing references the first: reused
    assert again.data_ptr() == ptr and again.numel() == STAGING_POOL.min_bytes


@pytest.fixture
def one_gpu(monkeypatch):
    """Both ends report the same GPU (on this CPU machine: a monkeypatched UUID)."""
    for module in (connect_module, listener_module):
        monkeypatch.setattr(module, "device_uuid", lambda device: "GPU-0000-same")


@pytest.mark.timeout(60)
def test_two_ends_on_one_gpu_asking_for_nccl_agree_on_gloo(one_gpu):
    listener = PipeListener(transport="nccl", connect_timeout_s=10)
    accepted = []
    t = threading.Thread(target=lambda: accepted.append(listener.accept(10)))
    t.start()
    client = connect_pipe("127.0.0.1", listener.port, transport="nccl", device="cpu")
    t.join(10)
    server = accepted[0]
    try:
        assert client.transport == server.transport == "gloo"
        x = torch.arange(1 << 18, dtype=torch.float32)  # large enough for the process group
        client.send("k", {"x": x})
        assert torch.equal(server.recv(10).tensors["x"], x)
    finally:
        client.close()
        server.close()
        listener.close()


@pytest.mark.timeout(30)
def test_a_peer_on_the_same_gpu_that_takes_nothing_but_nccl_is_told_why(one_gpu):
    listener = PipeListener(transport="nccl", connect_timeout_s=5)
    errors = []

    def accept():
        try:
            listener.accept(10)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=accept)
    t.start()
    import socket

    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as raw:
        s = raw_authenticate(raw)
        hello = {"proto": 2, "transport": "nccl", "device": "GPU-0000-same"}  # no fallback
        s.send_frame(encode_header(Kind.HELLO, "", hello))
        reply = s.read_frame()
    t.join(10)
    listener.close()
    assert reply.kind == Kind.ERROR
    assert "both ends are on GPU GPU-0000-same" in reply.meta["error"]
    assert errors and "NCCL cannot connect them" in str(errors[0])
