"""Staging device tensors through pinned host buffers in pieces, overlapped with the network
(connector/transport/staging.py), on this CPU machine: CPU tensors stand in for device tensors
and copies run only when their events are waited on (tests/support/fake_copies.py), so a piece
used before its copy completed shows as sentinel bytes. The same path on CUDA tensors is in
tests/transport/test_pipe_gpu.py (bench/gpu_check.sh)."""

from __future__ import annotations

import time

import pytest
import torch
from support.fake_copies import SENTINEL, FakeCopies, staged_cpu_tensors
from support.transport import assert_bits_equal, pipe_pair

from connector.transport import TransferError, frame, staging
from connector.transport.frame import pieces

PIECE = 4096


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(frame, "PIECE_BYTES", PIECE)


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_pieces_cover_a_chunk_in_order_the_last_one_shorter(small_pieces):
    assert pieces(0) == []
    assert pieces(PIECE) == [(0, PIECE)]
    assert pieces(2 * PIECE + 1) == [(0, PIECE), (PIECE, PIECE), (2 * PIECE, 1)]


def test_fake_copies_leave_the_sentinel_until_their_event_is_waited_on():
    """The stand-in can fail: a destination read before its wait holds the sentinel."""
    fake = FakeCopies()
    dst = torch.zeros(8, dtype=torch.uint8)
    ev = fake.copy(dst, _bytes(8), None)
    assert bool((dst == SENTINEL).all())
    fake.wait(ev, time.monotonic() + 1, "x")
    assert torch.equal(dst, _bytes(8))


def test_sending_copies_the_next_piece_while_this_one_goes_out(small_pieces):
    fake = FakeCopies()
    src = _bytes(2 * PIECE + 100)
    ready = fake.ready()
    sent = []
    for k, piece in enumerate(staging.to_host_pieces(fake, src, ready, time.monotonic() + 5, "x")):
        fake.note("send", k)
        sent.append(piece.clone())
    assert_bits_equal(torch.cat(sent), src)
    assert fake.log == [
        ("copy", 0),
        ("copy", 1),
        ("wait", 0),
        ("send", 0),
        ("copy", 2),  # into piece 0's buffer, once piece 0 was sent
        ("wait", 1),
        ("send", 1),
        ("wait", 2),
        ("send", 2),
    ]
    assert all(after is ready for after in fake.copies_after)


def test_receiving_copies_each_piece_to_the_device_while_the_next_arrives(small_pieces):
    fake = FakeCopies()
    src = _bytes(3 * PIECE)
    dst = torch.zeros_like(src)
    ready = fake.ready()
    arrived = iter(pieces(src.numel()))

    def receive(buf):
        off, n = next(arrived)
        fake.note("recv", off // PIECE)
        buf.copy_(src[off : off + n])

    staging.to_device_pieces(fake, dst, ready, receive, time.monotonic() + 5, "x")
    assert_bits_equal(dst, src)
    assert fake.log == [
        ("recv", 0),
        ("copy", 0),
        ("recv", 1),
        ("copy", 1),
        ("wait", 0),  # piece 0's buffer is refilled only after its copy ran
        ("recv", 2),
        ("copy", 2),
        ("wait", 1),
        ("wait", 2),
    ]
    assert all(after is ready for after in fake.copies_after)


def test_a_copy_that_never_completes_times_out_and_its_buffers_are_never_reused(small_pieces):
    fake = FakeCopies()
    fake.fail_waits = True
    src = _bytes(2 * PIECE)
    held = len(staging.QUARANTINE)
    try:
        with pytest.raises(TimeoutError, match="staging copy of payload of 'k'"):
            list(staging.to_host_pieces(fake, src, None, time.monotonic() + 1, "payload of 'k'"))
        assert len(staging.QUARANTINE) == held + 3  # both buffers and the source
        assert staging.QUARANTINE[-1] is src
    finally:
        del staging.QUARANTINE[held:]


def _message() -> dict[str, torch.Tensor]:
    return {
        "kv": _bytes(5 * PIECE + 123, 1).view(torch.uint8),  # 6 pieces, the last one short
        "k16": torch.randn(3 * PIECE // 2, generator=torch.Generator().manual_seed(2)).to(
            torch.bfloat16
        ),  # 3 pieces
        "ids": torch.arange(7),  # small: the packed chunk
        "pos": torch.arange(5, dtype=torch.int32),
        "none": torch.empty(0, 4),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["gloo", "socket"])
def test_staged_tensors_travel_bit_exact_in_pieces_through_a_pipe(
    transport, small_pieces, monkeypatch
):
    pair = pipe_pair(transport, pack_max_bytes=1024)
    with pair as (server, client), staged_cpu_tensors(monkeypatch) as fake:
        want = _message()
        client.send("k", want)
        got = server.recv(20).tensors
        for name, t in want.items():
            assert_bits_equal(got[name], t, name)
        # every staging copy waited for the event recorded when the message was queued (or,
        # receiving, when recv began)
        assert fake.readies and all(a in fake.readies for a in fake.copies_after)
        waited = {n for what, n in fake.log if what == "wait"}
        assert waited == {n for what, n in fake.log if what == "copy"}
        copies = 6 + 3 + 2  # each piece of kv and k16, ids and pos (packed on gloo, not inline)
        assert len(waited) == (2 * copies if transport == "gloo" else copies)


@pytest.mark.timeout(60)
def test_a_staged_receive_fills_out_in_place(small_pieces, monkeypatch):
    pair = pipe_pair("gloo", pack_max_bytes=1024)
    with pair as (server, client), staged_cpu_tensors(monkeypatch):
        want = _message()
        out = {name: torch.full_like(t, 7) for name, t in want.items() if name != "none"}
        client.send("k", want)
        got = server.recv(20, out=out).tensors
        for name, t in want.items():
            assert_bits_equal(got[name], t, name)
            if name in out:
                assert got[name] is out[name]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["gloo", "socket"])
def test_a_staging_copy_that_never_completes_fails_that_send_by_name(
    transport, small_pieces, monkeypatch
):
    with pipe_pair(transport) as (server, client), staged_cpu_tensors(monkeypatch) as fake:
        fake.fail_waits = True
        held = len(staging.QUARANTINE)
        done = []
        try:
            client.send("k", {"kv": _bytes(3 * PIECE)}, on_done=done.append)
            with pytest.raises(TransferError):
                client.flush(10)
            assert len(done) == 1 and "staging copy of" in str(done[0])
            assert len(staging.QUARANTINE) > held
        finally:
            del staging.QUARANTINE[held:]
