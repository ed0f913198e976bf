"""A KV entry whose bytes are changed on the process group on the way to the consumer: the
client's ``get`` raises PayloadAuthError (a ProtocolError, which the connector's consumer counts
as a ``protocol`` load failure and recomputes), and its next ``get`` reconnects and loads what
arrives untouched. The sender's pieces are tampered with after the tag was computed (the man in
the middle of tests/transport/test_payload_auth.py)."""

from __future__ import annotations

import pytest
import torch

from connector.kvstore import KVBuffer, KVClient, KVServer
from connector.transport import PayloadAuthError, ProtocolError
from connector.transport import sending as sending_mod


def _entry(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen)}


@pytest.mark.timeout(60)
def test_a_tampered_entry_is_refused_and_the_next_load_reconnects(monkeypatch):
    original = sending_mod._Sender._pieces
    tampered = []

    def pieces(self, item, src, copies, deadline, what):
        for piece in original(self, item, src, copies, deadline, what):
            if not item.inline and item.key == "bad":
                piece = piece.clone()
                piece[12345] ^= 0x80
                tampered.append(item.key)
            yield piece

    monkeypatch.setattr(sending_mod._Sender, "_pieces", pieces)
    buf = KVBuffer(64 << 20)
    good, bad = _entry(1), _entry(2)
    buf.put("bad", bad)
    buf.put("good", good)
    srv = KVServer(buf)
    try:
        with KVClient("127.0.0.1", srv.port, timeout_s=20) as client:
            with pytest.raises(PayloadAuthError, match="payload authentication failed") as ei:
                client.get("bad")
            assert isinstance(ei.value, ProtocolError)
            got, _ = client.get("good")
            assert torch.equal(got["kv"], good["kv"])
            assert client.stats()["connects"] == 2  # the refused pipe was closed
    finally:
        srv.close()
    assert tampered == ["bad"]


def test_the_consumer_counts_it_as_a_protocol_failure():
    stats = pytest.importorskip("connector.vllm_connector.stats")
    assert stats.load_failure(PayloadAuthError("payload authentication failed")) == "protocol"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", [None, b"k" * 32])
def test_an_entry_hashed_when_packed_is_checked_under_its_key_and_so_is_a_part(monkeypatch, secret):
    """Entries put with NH outputs under their own key (``put(nh=)``, as a producer's pack
    makes them) load with the tag made from those outputs; a part of one (other bytes) goes
    out hashed by the server under the entry's key too, so that the consumer's unpack can
    compute the NH its tag is checked with; a part of an entry put without them, under the
    frame's key. An entry whose outputs are of other bytes, or a changed byte of an entry or
    of a part on the way, is refused."""
    from connector.kvstore import Part
    from tritonkv import umac

    sent = []
    original = sending_mod._Sender._pieces

    def pieces(self, item, src, copies, deadline, what):
        sent.append((item.key, [s.entry_nh for s in item.specs]))
        for piece in original(self, item, src, copies, deadline, what):
            if not item.inline and item.key in ("flipped", "flipped part"):
                piece = piece.clone()
                piece[7] ^= 1
            yield piece

    monkeypatch.setattr(sending_mod._Sender, "_pieces", pieces)
    buf = KVBuffer(64 << 20)
    names = ["whole", "parts", "unhashed", "stale", "flipped", "flipped part"]
    entries = {k: _entry(i) for i, k in enumerate(names)}
    for key, tensors in entries.items():
        hashed = _entry(99)["kv"] if key == "stale" else tensors["kv"]
        nh = umac.nh_hash(hashed, umac.entry_keys(secret, key))
        buf.put(
            key, {"kv": tensors["kv"].view(256, -1)}, nh=None if key == "unhashed" else {"kv": nh}
        )
    srv = KVServer(buf, secret=secret)
    try:
        with KVClient("127.0.0.1", srv.port, timeout_s=20, secret=secret) as client:
            got, _ = client.get("whole")
            assert torch.equal(got["kv"].view(-1), entries["whole"]["kv"])
            for key in ("parts", "unhashed"):
                got, _ = client.get(key, part=Part("kv", 0, 0, 128))
                assert torch.equal(got["kv"].reshape(-1), entries[key]["kv"][: 1 << 19])
            refused = [
                ("stale", None),
                ("flipped", None),
                ("flipped part", Part("kv", 0, 128, 256)),
            ]
            for key, part in refused:
                with pytest.raises(PayloadAuthError):
                    client.get(key, part=part)
    finally:
        srv.close()
    marked = [("whole", [True]), ("parts", [True]), ("unhashed", [False])]
    assert sent[:3] == marked and sent[-1] == ("flipped part", [True])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport, entry_bytes", [("socket", 1 << 20), ("gloo", 32 << 10)])
def test_an_inline_delivery_of_an_entry_hashed_when_packed_is_checked_against_its_nh_first(
    monkeypatch, transport, entry_bytes
):
    """An inline payload (every one over ``socket``; a small one over gloo) carries no tag made
    from the entry's NH outputs, and a producer stores no whole-entry digest beside them: the
    server checks the entry against them before sending it. One whose bytes changed in the
    store is not sent (the client gets an error naming it); an intact one loads. Deliveries on
    the process group are left to the tag (no check here)."""
    from connector.kvstore import server as server_mod
    from connector.transport import RemoteError
    from tritonkv import umac

    secret = b"s" * 32
    checked = []  # the sizes of what the server hashed

    class Spy:
        entry_keys = staticmethod(umac.entry_keys)

        @staticmethod
        def nh_hash(data, keys):
            checked.append(data.numel())
            return umac.nh_hash(data, keys)

    monkeypatch.setattr(server_mod, "umac", Spy)
    buf = KVBuffer(64 << 20)
    gen = torch.Generator().manual_seed(5)
    entries = {}
    for key in ("intact", "changed", "big"):
        size = (2 << 20) if key == "big" else entry_bytes
        kv = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        nh = umac.nh_hash(kv, umac.entry_keys(secret, key))
        entries[key] = kv.clone()
        buf.put(key, {"kv": kv}, nh={"kv": nh})
        if key == "changed":
            kv[entry_bytes // 2] ^= 0x10  # after its NH was taken, as a bug of the producer's would
    srv = KVServer(buf, secret=secret)
    try:
        with KVClient("127.0.0.1", srv.port, timeout_s=20, secret=secret, transport=transport) as c:
            got, _ = c.get("intact")
            assert torch.equal(got["kv"], entries["intact"])
            with pytest.raises(RemoteError, match="differs from what its producer hashed"):
                c.get("changed")
            got, _ = c.get("big")
            assert torch.equal(got["kv"], entries["big"])
    finally:
        srv.close()
    big_inline = transport == "socket"
    assert checked == [entry_bytes, entry_bytes] + ([2 << 20] if big_inline else [])
