"""Hidden-state entries bound to their digest (the ``digest`` option): a bit flipped in transit
(the ``flip_bit`` hook, after the digest was taken) is caught by the network reader (check
``receipt``) and by the file writer before its rename (check ``write``: no file under the name,
for vLLM's reader either), a file corrupted on disk by ``read_hidden_file`` (check ``file``);
with the switch off (the negative control) the flipped bit arrives unseen. The digests ride in
the safetensors header, which readers of the tensors ignore (Example's contract)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from connector.hidden import DigestMismatch, load_hidden_states, prompt_digest
from connector.hidden.files import HiddenFileWriter, read_hidden_file
from connector.hidden.scheduler import HiddenSaveSpec
from connector.hidden.worker import HiddenWorker
from connector.integrity import HIDDEN_DIGEST_KEYS
from connector.kvstore import KVBuffer, KVServer

SECRET = "d" * 40
SHAPE = (8, 3, 4, 5)  # num_blocks, num_hidden_states, block_size, hidden_size (odd)


def _cache() -> torch.Tensor:
    """Values of magnitude in [1, 2) (so the flipped exponent bit makes an inf), distinct."""
    n = torch.Size(SHAPE).numel()
    return (1 + torch.arange(n, dtype=torch.float32) / n).reshape(SHAPE)


def _expected(cache, spec):
    pos = torch.arange(spec.num_tokens)
    return cache[torch.tensor(spec.block_ids)[pos // SHAPE[2]], :, pos % SHAPE[2]]


@pytest.fixture
def served(tmp_path):
    """A KV buffer served on loopback, a file writer, and a factory of CPU hidden workers."""
    buffer = KVBuffer(1 << 20)
    server = KVServer(buffer, "127.0.0.1", 0, secret=SECRET)
    writer = HiddenFileWriter(1 << 20)
    workers = []

    def make(digest):
        workers.append(
            HiddenWorker(_cache(), tp_rank=0, writer=writer, buffer=lambda: buffer, digest=digest)
        )
        return workers[-1]

    yield make, server.port, writer
    for worker in workers:
        worker.shutdown()
    writer.close()
    server.close()
    buffer.close()


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("digest", [True, False], ids=["digest", "no-digest"])
def test_a_bit_flipped_in_transit_is_caught_by_both_ways_out(served, tmp_path, digest) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states as vllm_read_file,
    )

    make, port, writer = served
    worker = make(digest)
    path = str(tmp_path / "f.safetensors")
    flipped = HiddenSaveSpec(
        "req-f",
        "t" * 32,
        [5, 2],
        7,
        list(range(7)),
        path,
        "flip_bit",
        prompt_digest=prompt_digest(range(7)),
    )
    clean = HiddenSaveSpec(
        "req-c",
        "c" * 32,
        [3],
        4,
        [9, 8, 7, 6],
        str(tmp_path / "c.safetensors"),
        prompt_digest=prompt_digest([9, 8, 7, 6]),
    )
    worker.save([flipped, clean])
    assert worker.flush(10)  # its publisher thread, then the writer
    want = _expected(worker.cache, flipped)
    if digest:
        with pytest.raises(DigestMismatch, match=r"transfer tttttttt: digest check 'receipt'"):
            load_hidden_states(
                "127.0.0.1", port, flipped.transfer_id, flipped.prompt_digest, secret=SECRET
            )
        with pytest.raises(RuntimeError, match=r"digest check 'write' failed.*hidden_states"):
            read_hidden_file(path, timeout_s=5)
        assert not os.path.exists(path)  # nothing corrupted under the final name
        with pytest.raises(FileNotFoundError):
            vllm_read_file(path)  # vLLM's own reader finds no file, not a wrong one
    else:
        over_net = load_hidden_states(
            "127.0.0.1", port, flipped.transfer_id, flipped.prompt_digest, secret=SECRET
        )
        from_file = read_hidden_file(path, timeout_s=5)
        for got in (over_net, from_file, vllm_read_file(path)):
            assert (_ints(got["hidden_states"]) != _ints(want)).sum() == 1  # landed, unseen
    # the step's other request is untouched either way
    got = load_hidden_states(
        "127.0.0.1", port, clean.transfer_id, clean.prompt_digest, secret=SECRET
    )
    assert torch.equal(_ints(got["hidden_states"]), _ints(_expected(worker.cache, clean)))
    assert torch.equal(read_hidden_file(clean.path)["token_ids"], torch.tensor([9, 8, 7, 6]))


def test_the_header_holds_the_digests_and_readers_of_the_tensors_ignore_it(served, tmp_path):
    """Example's contract: the same keys, dtypes, shapes and bytes through safetensors'
    ``load_file``; the digests in ``__metadata__``; a byte flipped on disk later is caught by
    ``read_hidden_file`` (check ``file``), not by ``load_file``."""
    make, _, writer = served
    worker = make(True)
    path = str(tmp_path / "h.safetensors")
    ids = list(range(40, 46))
    spec = HiddenSaveSpec("req-h", "h" * 32, [1, 6], 6, ids, path, prompt_digest=prompt_digest(ids))
    worker.save([spec])
    assert worker.flush(10)  # its publisher thread, then the writer
    plain = load_file(path)
    assert set(plain) == {"hidden_states", "token_ids"}
    assert plain["hidden_states"].dtype == torch.float32 and plain["token_ids"].dtype == torch.int64
    assert torch.equal(_ints(plain["hidden_states"]), _ints(_expected(worker.cache, spec)))
    with safe_open(path, framework="pt") as f:
        assert set(f.metadata()) == set(HIDDEN_DIGEST_KEYS.values())
    assert torch.equal(read_hidden_file(path)["token_ids"], plain["token_ids"])
    with open(path, "r+b") as f:  # the last byte: the end of one tensor's data
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0x01]))
    load_file(path)  # safetensors itself does not notice
    with pytest.raises(DigestMismatch, match=r"h\.safetensors: digest check 'file' failed"):
        read_hidden_file(path)


def test_a_malformed_digest_field_is_refused(tmp_path) -> None:
    from connector.integrity import check_hidden

    tensors = {"hidden_states": torch.zeros(2, 1, 4), "token_ids": torch.arange(2)}
    with pytest.raises(ValueError, match="hidden_states_digest is malformed"):
        check_hidden({"hidden_states_digest": "xyz"}, tensors, "receipt", "")
    check_hidden({}, tensors, "receipt", "")  # none stored (digest off): nothing to compare
