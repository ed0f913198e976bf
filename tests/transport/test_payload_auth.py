"""Process-group payloads are authenticated (tritonkv.umac tags, connector/transport/session.py):
a man in the middle of the gloo connection who changes, reorders, zeroes or replays payload bytes
makes ``recv`` raise PayloadAuthError (a ProtocolError: the pipe breaks), never return them.

The man in the middle is played by the sender's piece generator (``_Sender._pieces``): the tag
was computed over the message as the caller gave it, then the pieces that travel are tampered
with. Every test first shows the untouched message arriving, so a pipe that refused everything
would fail there; and the last test shows the tampering is on the wire: with the tag check off,
the changed bytes are what ``recv`` returns.
"""

from __future__ import annotations

import pytest
import torch
from support.transport import pipe_pair

from connector.transport import PayloadAuthError, ProtocolError, TransferError
from connector.transport import receiving as receiving_mod
from connector.transport import sending as sending_mod
from connector.transport.session import PAYLOAD_NONCE, Session

BLOCK = 4096
NBYTES = 1 << 20  # above the 64 KiB inline limit: travels on the process group


def _payload(seed: int, nbytes: int = NBYTES) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _tamper(monkeypatch, change):
    """Make every piece sent on the process group ``change(message_index, piece)`` (a uint8
    tensor; returns what travels instead). Returns the list of messages' keys seen."""
    original = sending_mod._Sender._pieces
    seen: list[str] = []

    def pieces(self, item, src, copies, deadline, what):
        if item.inline:
            yield from original(self, item, src, copies, deadline, what)
            return
        seen.append(item.key)
        for piece in original(self, item, src, copies, deadline, what):
            yield change(len(seen) - 1, piece.clone())

    monkeypatch.setattr(sending_mod._Sender, "_pieces", pieces)
    return seen


def _round_trip(server, client, key: str, payload: torch.Tensor) -> torch.Tensor:
    client.send(key, {"kv": payload}, meta={"n": 1})
    return server.recv(timeout_s=20).tensors["kv"]


@pytest.mark.timeout(60)
def test_untouched_payload_arrives_with_its_tag_checked(monkeypatch):
    checked = []
    original = receiving_mod._PayloadReceiver.authenticate

    def spy(self, header, tensors, auth, key, *rest):
        checked.append((key, auth[1]))
        return original(self, header, tensors, auth, key, *rest)

    monkeypatch.setattr(receiving_mod._PayloadReceiver, "authenticate", spy)
    _tamper(monkeypatch, lambda i, piece: piece)
    with pipe_pair("gloo") as (server, client):
        for i in range(3):
            payload = _payload(i)
            assert torch.equal(_round_trip(server, client, f"k{i}", payload), payload)
        small = _payload(9, 100)  # inline: the session's HMAC covers it, no umac tag
        assert torch.equal(_round_trip(server, client, "inline", small), small)
    assert [k for k, _ in checked] == ["k0", "k1", "k2"]
    assert len({counter for _, counter in checked}) == 3  # a nonce per frame


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at", [0, 1, BLOCK - 1, NBYTES // 2 + 7, NBYTES - 1])
def test_one_changed_bit_on_the_group_is_refused(monkeypatch, at):
    def flip(i, piece):
        if i == 1:
            piece[at] ^= 0x10
        return piece

    _tamper(monkeypatch, flip)
    with pipe_pair("gloo") as (server, client):
        good = _payload(1)
        assert torch.equal(_round_trip(server, client, "first", good), good)
        client.send("second", {"kv": _payload(2)})
        with pytest.raises(PayloadAuthError, match="payload authentication failed"):
            server.recv(timeout_s=20)
        assert server.stats()["payload_auth_failures"] == 1
        with pytest.raises(TransferError):  # the pipe is broken for good
            server.recv(timeout_s=1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", ["swap_blocks", "zero_tail", "shift"])
def test_reordered_or_cut_payload_is_refused(monkeypatch, change):
    def tamper(i, piece):
        blocks = piece.view(-1, BLOCK)
        if change == "swap_blocks":
            blocks[[3, 4]] = blocks[[4, 3]]
        elif change == "zero_tail":  # what a receive cut short would leave
            piece[-1000:] = 0
        else:  # every byte one place on: the last one lost, a zero first
            piece = torch.cat([torch.zeros(1, dtype=torch.uint8), piece[:-1]])
        return piece

    _tamper(monkeypatch, tamper)
    with pipe_pair("gloo") as (server, client):
        client.send("k", {"kv": _payload(3)})
        with pytest.raises(PayloadAuthError):
            server.recv(timeout_s=20)


@pytest.mark.timeout(60)
def test_replayed_payload_of_an_earlier_transfer_is_refused(monkeypatch):
    """The second message's bytes replaced by the first's, as recorded on the wire."""
    recorded = []

    def replay(i, piece):
        if i == 0:
            recorded.append(piece.clone())
            return piece
        return recorded[0]

    _tamper(monkeypatch, replay)
    with pipe_pair("gloo") as (server, client):
        first = _payload(4)
        assert torch.equal(_round_trip(server, client, "a", first), first)
        client.send("b", {"kv": _payload(5)})
        with pytest.raises(PayloadAuthError):
            server.recv(timeout_s=20)


@pytest.mark.timeout(60)
def test_replayed_payload_with_its_own_tag_is_refused(monkeypatch):
    """The first message's bytes and umac tag sent again as the second frame: the tag's nonce
    (the frame counter) differs, so it is refused even though bytes and tag match each other."""
    tags = []
    original = sending_mod._Sender._payload_tag

    def replay_tag(self, item, counter):
        tags.append(original(self, item, counter))
        return tags[0]

    monkeypatch.setattr(sending_mod._Sender, "_payload_tag", replay_tag)
    with pipe_pair("gloo") as (server, client):
        same = _payload(6)
        assert torch.equal(_round_trip(server, client, "a", same), same)
        client.send("a", {"kv": same.clone()})
        with pytest.raises(PayloadAuthError):
            server.recv(timeout_s=20)


@pytest.mark.timeout(60)
def test_changed_byte_in_a_packed_chunk_or_into_out_is_refused(monkeypatch):
    """Several small tensors travel packed in one chunk (a changed byte there), and a payload
    received into ``out``: both refused (``out`` may hold the changed bytes; recv raised)."""

    def flip(i, piece):
        piece[100] ^= 1
        return piece

    original = sending_mod._Sender._packed

    def packed(self, item, chunk, deadline, what):
        buf = original(self, item, chunk, deadline, what)
        if self._pipe.transport == "gloo":
            buf[5] ^= 1
        return buf

    monkeypatch.setattr(sending_mod._Sender, "_packed", packed)
    with pipe_pair("gloo") as (server, client):
        parts = {f"t{j}": _payload(10 + j, 96 << 10) for j in range(3)}
        client.send("packed", parts)
        with pytest.raises(PayloadAuthError):
            server.recv(timeout_s=20)
    monkeypatch.undo()
    _tamper(monkeypatch, flip)
    with pipe_pair("gloo") as (server, client):
        out = {"kv": torch.empty(NBYTES, dtype=torch.uint8)}
        client.send("k", {"kv": _payload(7)})
        with pytest.raises(ProtocolError, match="payload authentication failed"):
            server.recv(timeout_s=20, out=out)


@pytest.mark.timeout(60)
def test_without_the_check_the_tampered_bytes_would_arrive(monkeypatch):
    """Control: with the receiver's check turned off the flipped bit is what recv returns, so
    the tests above see the tag check, not a transport that drops changed pieces."""
    monkeypatch.setattr(receiving_mod._PayloadReceiver, "authenticate", lambda *a: None)

    def flip(i, piece):
        piece[42] ^= 1
        return piece

    _tamper(monkeypatch, flip)
    with pipe_pair("gloo") as (server, client):
        sent = _payload(8)
        got = _round_trip(server, client, "k", sent)
        assert not torch.equal(got, sent)
        assert int((got != sent).sum()) == 1


def test_each_direction_and_frame_has_keys_of_its_own():
    keys = (bytes(range(32)), bytes(range(1, 33)))
    listener, connector = Session.pair(*keys, listener=True), Session.pair(*keys, listener=False)
    sent = connector.payload_keys(3, sending=True)
    assert sent.nonce == PAYLOAD_NONCE + (3).to_bytes(8, "little")
    got = listener.payload_keys(3, sending=False)
    assert got.mac_key == sent.mac_key  # the receiving end derives the sender's keys
    assert listener.payload_keys(3, sending=True).mac_key != sent.mac_key  # other direction
    assert connector.payload_keys(4, sending=True).mac_key != sent.mac_key  # other frame


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at", [None, 0, 13 * BLOCK + 5, 24 * BLOCK, 40 * BLOCK - 2])
def test_a_payload_in_many_pieces_is_hashed_as_they_land(monkeypatch, at):
    """Pieces of 8 blocks (frame.PIECE_BYTES patched): the receiver hashes each landed piece
    while the next one arrives; an untouched payload (at None) passes with the pieces' hashes
    used (and the sender's whole-tensor tag matching them), a bit flipped in the first, a
    middle or the last (short) piece is refused."""
    from connector.transport import frame

    monkeypatch.setattr(frame, "PIECE_BYTES", 8 * BLOCK)
    hashed = []
    original = receiving_mod._PayloadReceiver._hash_piece

    def spy(self, name, piece, keys):
        hashed.append(piece.numel())
        return original(self, name, piece, keys)

    monkeypatch.setattr(receiving_mod._PayloadReceiver, "_hash_piece", spy)
    nbytes = 40 * BLOCK - 1  # 5 pieces, the last one a byte short (160 KiB: not inline)
    offsets, flipped = [], []

    def flip(i, piece):
        start = sum(offsets)
        offsets.append(piece.numel())
        if at is not None and start <= at < start + piece.numel():
            piece[at - start] ^= 4
            flipped.append(at)
        return piece

    _tamper(monkeypatch, flip)
    with pipe_pair("gloo") as (server, client):
        sent = _payload(20, nbytes)
        client.send("k", {"kv": sent})  # one tensor: not packed with others
        if at is None:
            got = server.recv(timeout_s=20).tensors
            assert torch.equal(got["kv"], sent)
        else:
            with pytest.raises(PayloadAuthError):
                server.recv(timeout_s=20)
    assert hashed == [8 * BLOCK] * 4 + [8 * BLOCK - 1]
    assert flipped == ([] if at is None else [at])
