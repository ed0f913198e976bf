"""The hidden-state file writer and readers: vLLM's lock protocol (its ``load_hidden_states``
waits for the writer), temporary name then rename, a bounded queue that refuses instead of
waiting, a full disk as that request's error; and tritonkv's ``load_hidden_states`` over an authenticated
KV server, with its deadline and its errors."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import sys
import threading
import time

import pytest
import torch

from connector.hidden import HiddenStatesReader, load_hidden_states, prompt_digest
from connector.hidden import files as hidden_files
from connector.hidden.files import HiddenFileWriter, read_hidden_file
from connector.kvstore import KeyMissError, KVBuffer, KVServer
from connector.transport import TransferError

SECRET = "s" * 40
DIGEST = prompt_digest([1, 2, 3])  # the prompt digest the test entries are bound to


def _tensors(n: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(n, 2, 16, generator=g),
        "token_ids": torch.arange(n, dtype=torch.int64),
    }


class _Gate:
    """Holds the writer inside its writes (a slow disk) until the test opens it."""

    def __init__(self, monkeypatch):
        import safetensors.torch

        self.open = threading.Event()
        real = safetensors.torch.save_file

        def gated(tensors, filename, metadata=None):
            assert self.open.wait(10)
            return real(tensors, filename, metadata=metadata)

        monkeypatch.setattr(safetensors.torch, "save_file", gated)


def test_lock_protocol_with_vllms_reader(tmp_path, monkeypatch) -> None:
    """vLLM's load_hidden_states blocks until the file is complete, then reads it; no
    temporary file stays."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states as vllm_read_file,
    )

    writer = HiddenFileWriter(1 << 20)
    path = str(tmp_path / "r.safetensors")
    gate, got = _Gate(monkeypatch), {}
    try:
        writer.submit(path, _tensors(), HiddenFileWriter.lock(path))
        reader = threading.Thread(target=lambda: got.update(vllm_read_file(path)))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and not os.path.exists(path)  # waiting on the lock
        gate.open.set()
        reader.join(10)
        assert not reader.is_alive()
        assert torch.equal(got["hidden_states"], _tensors()["hidden_states"])
        assert sorted(os.listdir(tmp_path)) == ["r.safetensors", "r.safetensors.lock"]
    finally:
        writer.close()


def test_read_hidden_file_has_a_deadline(tmp_path) -> None:
    path = str(tmp_path / "slow.safetensors")
    fd = HiddenFileWriter.lock(path)  # a writer that never finishes
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="still being written"):
            read_hidden_file(path, timeout_s=0.3)
        assert time.monotonic() - t0 < 3
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        read_hidden_file(str(tmp_path / "never.safetensors"), timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s"):
        read_hidden_file(path, timeout_s=0)


def test_full_queue_refuses_at_once(tmp_path, monkeypatch) -> None:
    """A request beyond the queue's bytes is refused without waiting: its .error says why, its
    lock is released; the queued one is written."""
    writer = HiddenFileWriter(700)
    gate = _Gate(monkeypatch)
    first, second = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    try:
        assert writer.submit(first, _tensors(), HiddenFileWriter.lock(first))
        t0 = time.monotonic()
        assert not writer.submit(second, _tensors(), HiddenFileWriter.lock(second))
        assert time.monotonic() - t0 < 1
        with pytest.raises(RuntimeError, match="queue is full"):
            read_hidden_file(second, timeout_s=2)
        gate.open.set()
        assert writer.flush(10)
        assert torch.equal(read_hidden_file(first)["token_ids"], torch.arange(5))
        assert writer.stats()["refused"] == 1 and writer.stats()["written"] == 1
    finally:
        writer.close()


def test_full_disk_is_that_requests_error(tmp_path, monkeypatch) -> None:
    """A write that fails (ENOSPC) leaves no file, no temporary file, an .error, and the lock
    released; the next request is written."""
    import safetensors.torch

    real = safetensors.torch.save_file
    calls = []

    def flaky(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 1:
            with open(filename, "wb") as f:
                f.write(b"half")  # a crash mid-write
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", flaky)
    writer = HiddenFileWriter(1 << 20)
    bad, good = str(tmp_path / "bad.safetensors"), str(tmp_path / "good.safetensors")
    try:
        writer.submit(bad, _tensors(), HiddenFileWriter.lock(bad))
        writer.submit(good, _tensors(seed=1), HiddenFileWriter.lock(good))
        assert writer.flush(10)
        assert not calls[0].endswith("bad.safetensors")  # written under a temporary name
        with pytest.raises(RuntimeError, match="No space left"):
            read_hidden_file(bad, timeout_s=2)
        assert torch.equal(
            read_hidden_file(good)["hidden_states"], _tensors(seed=1)["hidden_states"]
        )
        left = sorted(os.listdir(tmp_path))
        assert left == sorted(
            [
                "bad.safetensors.error",
                "bad.safetensors.lock",
                "good.safetensors",
                "good.safetensors.lock",
            ]
        )
        with open(bad + ".lock") as lock:  # released
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        writer.close()


def test_without_safetensors_each_file_fails_not_the_writer(tmp_path, monkeypatch) -> None:
    """safetensors missing (it comes with vLLM, not with tritonkv): every file gets its .error
    and its lock released, and the writer goes on (it once died at the import, and every later
    file waited for it)."""
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import fails
    writer = HiddenFileWriter(1 << 20)
    paths = [str(tmp_path / f"r{i}.safetensors") for i in range(2)]
    try:
        for path in paths:
            writer.submit(path, _tensors(), HiddenFileWriter.lock(path))
        assert writer.flush(10)
        for path in paths:
            with pytest.raises(RuntimeError, match="ModuleNotFoundError: import of safetensors"):
                read_hidden_file(path, timeout_s=2)
        monkeypatch.delitem(sys.modules, "safetensors.torch")
        good = str(tmp_path / "good.safetensors")
        writer.submit(good, _tensors(seed=1), HiddenFileWriter.lock(good))
        assert writer.flush(10)
        assert torch.equal(read_hidden_file(good)["token_ids"], _tensors(seed=1)["token_ids"])
    finally:
        writer.close()


def test_delete_after_write(tmp_path) -> None:
    writer = HiddenFileWriter(1 << 20)
    path = str(tmp_path / "x.safetensors")
    try:
        writer.submit(path, _tensors(), HiddenFileWriter.lock(path))
        writer.delete(path)
        assert writer.flush(10)
        assert os.listdir(tmp_path) == [] and writer.stats()["deleted"] == 1
    finally:
        writer.close()
    assert hidden_files.HiddenFileWriter(1).max_bytes == 1
    with pytest.raises(ValueError, match="max_bytes"):
        HiddenFileWriter(0)


@pytest.fixture
def server():
    buffer = KVBuffer(1 << 20)
    srv = KVServer(buffer, "127.0.0.1", 0, secret=SECRET)
    yield buffer, srv
    srv.close()
    buffer.close()


def test_load_hidden_states(server) -> None:
    buffer, srv = server
    tensors = _tensors(9)
    buffer.put("tid", tensors, {"kind": "hidden_states", "num_tokens": 9}, digest=DIGEST)
    got = load_hidden_states("127.0.0.1", srv.port, "tid", DIGEST, secret=SECRET, timeout_s=10)
    assert torch.equal(
        got["hidden_states"].view(torch.int32), tensors["hidden_states"].view(torch.int32)
    )
    assert torch.equal(got["token_ids"], tensors["token_ids"])
    with pytest.raises(KeyMissError):  # delivered once
        load_hidden_states(
            "127.0.0.1", srv.port, "tid", DIGEST, secret=SECRET, timeout_s=10, wait_s=0
        )


def _later(delay_s: float, fn, *args) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), fn(*args)), daemon=True)
    t.start()
    return t


def test_fetch_waits_for_an_entry_put_after_the_response(server) -> None:
    """A producer delivers off its step: the entry may land after the response naming it. The
    readers wait for it (default: half their timeout); with ``wait_s=0`` they do not."""
    buffer, srv = server
    tensors = _tensors(5)
    with pytest.raises(KeyMissError):
        load_hidden_states("127.0.0.1", srv.port, "late", DIGEST, secret=SECRET, wait_s=0)
    meta = {"kind": "hidden_states", "num_tokens": 5}
    put = _later(0.3, lambda: buffer.put("late", tensors, meta, digest=DIGEST))
    got = load_hidden_states("127.0.0.1", srv.port, "late", DIGEST, secret=SECRET, timeout_s=10)
    assert _same(got, tensors)
    put.join(5)
    _later(0.3, lambda: buffer.put("late2", tensors, meta, digest=DIGEST))
    with HiddenStatesReader(secret=SECRET, timeout_s=10) as reader:
        assert _same(reader.load("127.0.0.1", srv.port, "late2", DIGEST), tensors)


def test_a_sealed_transfer_ends_the_wait_at_once(server) -> None:
    """A save that failed seals its transfer id (HiddenWorker): a reader waiting for it gets
    its MISS then, not after its wait."""
    buffer, srv = server
    _later(0.3, lambda: buffer.discard_any("failed", seal=True))
    t0 = time.monotonic()
    with pytest.raises(KeyMissError):
        load_hidden_states("127.0.0.1", srv.port, "failed", DIGEST, secret=SECRET, timeout_s=30)
    assert time.monotonic() - t0 < 10  # its wait was 15 s


def test_fetch_refusals(server) -> None:
    buffer, srv = server
    buffer.put("kv", {"kv": torch.zeros(2)}, {"kind": "kv"}, digest=DIGEST)
    with pytest.raises(ValueError, match="expected hidden states"):
        load_hidden_states("127.0.0.1", srv.port, "kv", DIGEST, secret=SECRET, timeout_s=10)
    with pytest.raises(TransferError):  # wrong secret: refused, within the deadline
        load_hidden_states("127.0.0.1", srv.port, "x", DIGEST, secret="w" * 40, timeout_s=5)
    with pytest.raises(TypeError, match="transfer_id"):
        load_hidden_states("127.0.0.1", srv.port, "", DIGEST, secret=SECRET)
    with pytest.raises(ValueError, match="port"):
        load_hidden_states("127.0.0.1", 0, "x", DIGEST, secret=SECRET)


def test_a_reader_presenting_another_digest_is_refused(server) -> None:
    """An entry bound to its prompt's digest is served only to a reader presenting it: another
    digest, or the digest of another prompt, gets the miss of an unknown transfer id (with a
    message saying a wrong digest is one cause) and does not consume the entry, which the right
    digest then reads, once."""
    buffer, srv = server
    tensors = _tensors(4)
    buffer.put("bound", tensors, {"kind": "hidden_states", "num_tokens": 4}, digest=DIGEST)
    with HiddenStatesReader(secret=SECRET, timeout_s=10) as reader:
        for wrong in (prompt_digest([1, 2, 4]), "f" * 32):
            with pytest.raises(KeyMissError, match="not their digest") as err:
                reader.load("127.0.0.1", srv.port, "bound", wrong, wait_s=0)
            assert err.value.reason == "never put (or forgotten)"
        with pytest.raises(KeyMissError, match="not their digest"):  # the one-shot function too
            load_hidden_states(
                "127.0.0.1", srv.port, "bound", "0" * 32, secret=SECRET, timeout_s=10, wait_s=0
            )
        assert "bound" in buffer and buffer.stats()["claimed"] == 0
        assert _same(reader.load("127.0.0.1", srv.port, "bound", DIGEST), tensors)
        with pytest.raises(KeyMissError):  # delivered once
            reader.load("127.0.0.1", srv.port, "bound", DIGEST, wait_s=0)


def test_a_reader_must_present_a_digest(server) -> None:
    """None (the params of a producer that returns no digest) or anything but 32 lowercase hex
    digits is refused before anything is sent, naming what was expected; the entry stays."""
    buffer, srv = server
    buffer.put("bound", _tensors(), {"kind": "hidden_states"}, digest=DIGEST)
    with HiddenStatesReader(secret=SECRET, timeout_s=10) as reader:
        with pytest.raises(TypeError, match=r"hidden_states_digest.*got None"):
            reader.load("127.0.0.1", srv.port, "bound", None)
        with pytest.raises(TypeError, match=r"hidden_states_digest.*got bytes"):
            reader.load("127.0.0.1", srv.port, "bound", DIGEST.encode())
        for bad in ("", DIGEST.upper(), DIGEST[:-1], DIGEST + "0", "g" * 32):
            with pytest.raises(ValueError, match="32 lowercase hex digits"):
                reader.load("127.0.0.1", srv.port, "bound", bad)
        with pytest.raises(TypeError, match="digest"):
            reader.load("127.0.0.1", srv.port, "bound")  # missing
        with pytest.raises(TypeError, match="digest"):
            load_hidden_states("127.0.0.1", srv.port, "bound", secret=SECRET)  # missing
        assert srv.stats()["requests"] == 0 and "bound" in buffer


def _same(got: dict, want: dict) -> bool:
    return torch.equal(
        got["hidden_states"].view(torch.int32), want["hidden_states"].view(torch.int32)
    ) and torch.equal(got["token_ids"], want["token_ids"])


def test_reader_pulls_many_over_one_connection(server) -> None:
    buffer, srv = server
    want = {f"t{i}": _tensors(3 + i, seed=i) for i in range(5)}
    for key, tensors in want.items():
        buffer.put(key, tensors, {"kind": "hidden_states"}, digest=DIGEST)
    with HiddenStatesReader(secret=SECRET, timeout_s=10) as reader:
        for key, tensors in want.items():
            assert _same(reader.load("127.0.0.1", srv.port, key, DIGEST), tensors)
        with pytest.raises(KeyMissError):  # delivered once, and the connection lives on
            reader.load("127.0.0.1", srv.port, "t0", DIGEST)
        buffer.put("late", want["t1"], {"kind": "hidden_states"}, digest=DIGEST)
        assert _same(reader.load("127.0.0.1", srv.port, "late", DIGEST), want["t1"])
    stats = srv.stats()
    assert stats["connections"] == 1 and stats["requests"] == 7, stats


def test_reader_makes_a_connection_the_server_closed_again(server) -> None:
    buffer, srv = server
    with HiddenStatesReader(secret=SECRET, timeout_s=10) as reader:
        buffer.put("a", _tensors(), {"kind": "hidden_states"}, digest=DIGEST)
        assert _same(reader.load("127.0.0.1", srv.port, "a", DIGEST), _tensors())
        port = srv.port
        srv.close()  # the server restarts: the kept connection is closed under the reader
        again = KVServer(buffer, "127.0.0.1", port, secret=SECRET)
        try:
            buffer.put("b", _tensors(7), {"kind": "hidden_states"}, digest=DIGEST)
            assert _same(reader.load("127.0.0.1", port, "b", DIGEST), _tensors(7))
            assert again.stats()["connections"] == 1
        finally:
            again.close()


def test_reader_keeps_at_most_max_peers(server) -> None:
    buffer, srv = server
    other = KVServer(buffer, "127.0.0.1", 0, secret=SECRET)
    try:
        with HiddenStatesReader(secret=SECRET, timeout_s=10, max_peers=1) as reader:
            for key, port in (("a", srv.port), ("b", other.port), ("c", srv.port)):
                buffer.put(key, _tensors(), {"kind": "hidden_states"}, digest=DIGEST)
                assert _same(reader.load("127.0.0.1", port, key, DIGEST), _tensors())
                assert list(reader._clients) == [("127.0.0.1", port)]
        assert srv.stats()["connections"] == 2 and other.stats()["connections"] == 1
    finally:
        other.close()


def test_reader_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_peers"):
        HiddenStatesReader(max_peers=0)
    with pytest.raises((TypeError, ValueError), match="timeout_s"):
        HiddenStatesReader(timeout_s=-1)
    with HiddenStatesReader() as reader:
        with pytest.raises(TypeError, match="transfer_id"):
            reader.load("127.0.0.1", 1, "", DIGEST)
        with pytest.raises(ValueError, match="port"):
            reader.load("127.0.0.1", 70000, "x", DIGEST)


def test_links_planted_beside_a_file_are_never_followed(tmp_path) -> None:
    """Someone who may write in the folder plants ``<path>.lock`` and ``<path>.error`` as
    symlinks to a file of the server's: the lock fails (the request gets no file, as for any
    OSError) and the error goes unwritten; the target is untouched either way."""
    from connector.hidden.files import _write_error

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    path = str(tmp_path / "req.safetensors")
    os.symlink(target, path + ".lock")
    with pytest.raises(OSError):
        HiddenFileWriter.lock(path)
    os.symlink(target, path + ".error")
    _write_error(path, "a reason")
    assert target.read_text() == "keep me\n"


def test_the_default_folder_is_private_and_an_unsafe_one_is_refused(tmp_path) -> None:
    from connector.hidden.files import private_folder

    made = private_folder(str(tmp_path / "fresh"))
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    assert private_folder(made) == made  # an existing private one is reused
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ValueError, match="mode 0755: expected a directory of uid"):
        private_folder(str(shared))
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(ValueError, match="not a directory"):
        private_folder(str(link))
    if os.getuid() == 0:  # root can give it away: another owner is refused too
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        os.chown(other, 65534, 65534)
        with pytest.raises(ValueError, match="of uid 65534"):
            private_folder(str(other))
    default = private_folder()
    assert default.endswith(f"tritonkv-hidden-{os.getuid()}")
