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
