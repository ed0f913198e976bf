"""Payloads hashed as stored entries (``send(entry_nh=)``, ``recv(entry_keys=)``): a producer
computes an entry's NH under the entry's own key (tritonkv.umac.entry_keys of the secret and the
entry's key) when it packs it, and the pipe makes the payload's tag from those outputs under the
frame's PRF key, with no pass over the tensor when it sends. The receiver hashes the tensor
under the entry key of the key it asked for. A changed bit, another entry's key or secret, NH
outputs of other bytes, and a receiver that expects no entry are all refused.

The man in the middle is the sender's piece generator, as in test_payload_auth.py.
"""

from __future__ import annotations

import pytest
import torch
from support.transport import pipe_pair

from connector.transport import PayloadAuthError, ProtocolError, TransferError, frame
from connector.transport import sending as sending_mod
from tritonkv import umac

NBYTES = (1 << 20) + 100  # on the process group; the last NH block padded
SECRET = b"s" * 32


def _payload(seed: int, nbytes: int = NBYTES) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _entry(key: str, seed: int, secret: bytes = SECRET):
    """An entry's tensors and its NH outputs, as a producer's pack would have made them."""
    kv = _payload(seed)
    return {"kv": kv, "ids": torch.arange(7)}, {
        "kv": umac.nh_hash(kv, umac.entry_keys(secret, key))
    }


def _flip_second_message(monkeypatch, at: int):
    original = sending_mod._Sender._pieces
    seen = []

    def pieces(self, item, src, copies, deadline, what):
        if not item.inline and item.key not in seen:
            seen.append(item.key)
        for piece in original(self, item, src, copies, deadline, what):
            if len(seen) == 2 and not item.inline and src.numel() > at:
                piece = piece.clone()
                piece[at] ^= 0x20
            yield piece

    monkeypatch.setattr(sending_mod._Sender, "_pieces", pieces)


@pytest.mark.timeout(60)
def test_an_entry_hashed_when_packed_arrives_without_a_pass_on_send(monkeypatch):
    tensors, nh = _entry("e1", 1)
    hashed = []
    original = umac.nh_hash
    monkeypatch.setattr(umac, "nh_hash", lambda t, k: hashed.append(t.numel()) or original(t, k))
    with pipe_pair("gloo") as (server, client):
        client.send("e1", tensors, entry_nh=nh)
        got = server.recv(timeout_s=20, entry_keys=umac.entry_keys(SECRET, "e1"))
    assert torch.equal(got.tensors["kv"], tensors["kv"])
    assert torch.equal(got.tensors["ids"], tensors["ids"])
    # the sender hashed only the small tensor (under the frame's key), the receiver both
    assert hashed[0] == 7 and hashed.count(NBYTES) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at", [0, 4095, NBYTES - 1])
def test_a_changed_bit_of_an_entry_is_refused(monkeypatch, at):
    _flip_second_message(monkeypatch, at)
    with pipe_pair("gloo") as (server, client):
        for i, key in enumerate(["first", "second"]):
            tensors, nh = _entry(key, i)
            client.send(key, tensors, entry_nh=nh)
            keys = umac.entry_keys(SECRET, key)
            if i == 0:  # untouched: arrives
                assert torch.equal(
                    server.recv(timeout_s=20, entry_keys=keys).tensors["kv"], tensors["kv"]
                )
                continue
            with pytest.raises(PayloadAuthError):
                server.recv(timeout_s=20, entry_keys=keys)
        assert server.stats()["payload_auth_failures"] == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wrong", ["key", "secret", "outputs"])
def test_another_entry_key_or_outputs_of_other_bytes_are_refused(wrong):
    tensors, nh = _entry("e", 3)
    if wrong == "outputs":  # outputs of other bytes (a producer's stale hash)
        nh = {"kv": umac.nh_hash(_payload(4), umac.entry_keys(SECRET, "e"))}
    keys = {
        "key": umac.entry_keys(SECRET, "other"),
        "secret": umac.entry_keys(b"t" * 32, "e"),
        "outputs": umac.entry_keys(SECRET, "e"),
    }[wrong]
    with pipe_pair("gloo") as (server, client):
        client.send("e", tensors, entry_nh=nh)
        with pytest.raises(PayloadAuthError):
            server.recv(timeout_s=20, entry_keys=keys)


@pytest.mark.timeout(60)
def test_a_receiver_that_expects_no_entry_refuses_entry_hashed_tensors():
    tensors, nh = _entry("e", 5)
    with pipe_pair("gloo") as (server, client):
        client.send("e", tensors, entry_nh=nh)
        with pytest.raises(ProtocolError, match="entry's key"):
            server.recv(timeout_s=20)
        with pytest.raises(TransferError):  # broken for good
            server.recv(timeout_s=1)


@pytest.mark.timeout(60)
def test_entry_outputs_are_checked_when_sent_and_unused_inline():
    tensors, nh = _entry("e", 6)
    with pipe_pair("gloo") as (server, client):
        with pytest.raises(ValueError, match="expected int64 NH outputs"):
            client.send("e", tensors, entry_nh={"kv": nh["kv"][1:]})
        with pytest.raises(ValueError, match="not a tensor of the message"):
            client.send("e", tensors, entry_nh={"nope": nh["kv"]})
        with pytest.raises(TypeError):
            client.send("e", tensors, entry_nh=[nh["kv"]])
        small = _payload(7, 100)  # inline: the frame's MAC covers it, no entry flag
        small_nh = {"kv": umac.nh_hash(small, umac.entry_keys(SECRET, "s"))}
        client.send("s", {"kv": small}, entry_nh=small_nh)
        assert torch.equal(server.recv(timeout_s=20).tensors["kv"], small)


def test_the_entry_flag_on_an_inline_payload_is_a_protocol_error():
    spec = frame.spec_of("kv", torch.zeros(4), entry_nh=True)
    raw = frame.encode_header(frame.Kind.MSG, "k", b"{}", (spec,), frame.FLAG_INLINE)
    with pytest.raises(ProtocolError, match="inline"):
        frame.decode_header(raw)
    assert (
        frame.decode_header(frame.encode_header(frame.Kind.MSG, "k", b"{}", (spec,)))
        .specs[0]
        .entry_nh
    )


def test_entry_keys_differ_by_secret_and_key_and_match_their_definition():
    import hashlib
    import hmac

    import numpy as np

    a = umac.entry_keys(SECRET, "k1")
    assert not np.array_equal(a.nh_key, umac.entry_keys(SECRET, "k2").nh_key)
    assert not np.array_equal(a.nh_key, umac.entry_keys(b"t" * 32, "k1").nh_key)
    prk = hmac.new(b"tritonkv umac entry salt v1", SECRET, hashlib.sha256).digest()
    info = b"tritonkv umac entry nh key v1" + (2).to_bytes(2, "little") + b"k1" + b"\x01"
    seed = hmac.new(prk, info, hashlib.sha256).digest()
    want = np.frombuffer(hashlib.shake_256(seed).digest(4112), dtype="<u4")
    assert np.array_equal(a.nh_key, want)
    assert a.mac_key is None
    with pytest.raises(TypeError, match="PRF key"):
        umac.tag_of_outputs(a, [(4, torch.zeros((1, 2), dtype=torch.int64))])
    with pytest.raises(TypeError):
        umac.entry_keys(SECRET, b"k1")
    with pytest.raises(ValueError):
        umac.entry_keys(SECRET, "")
