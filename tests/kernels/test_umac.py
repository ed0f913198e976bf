"""The keyed payload hash (tritonkv.umac): its definition word by word, the same bits from every
backend (the NumPy reference, the torch twin, the C library, the Triton kernel under the
interpreter), the key schedule, and refusal of each forgery it is meant to stop: a wrong key, one
flipped bit anywhere, reordered blocks or tensors, truncation, zero-extension, and another
transfer's payload or tag. Each refusal test first checks that the untouched payload passes, so a
check that refused everything would fail there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritonkv import _cpu_umac, _umac_core, umac
from tritonkv._umac_core import CHUNK_BYTES, ITERATIONS, KEY_WORDS, SHIFT_WORDS

BACKENDS = ("numpy", "torch", "native", "triton")
_PROPERTY = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
    max_examples=40,
)
SESSION = bytes(range(32))
DTYPES = (torch.uint8, torch.int16, torch.bfloat16, torch.float16, torch.float32, torch.int64)


@pytest.fixture(autouse=True)
def _native_reset(monkeypatch):
    """Tests switch the C library off: leave it as loaded by default afterwards."""
    yield
    monkeypatch.undo()
    _cpu_umac._reset()


def _use(monkeypatch, backend: str) -> None:
    """Make :func:`umac.nh_hash` (and so the tags) run on ``backend`` (not ``numpy``)."""
    monkeypatch.setenv("TRITONKV_KERNELS", "triton" if backend == "triton" else "torch")
    _cpu_umac._reset()
    if backend == "torch":
        monkeypatch.setenv("TRITONKV_NATIVE", "0")
        with pytest.warns(RuntimeWarning, match="TRITONKV_NATIVE=0"):
            assert _cpu_umac.native() is None
    else:
        monkeypatch.delenv("TRITONKV_NATIVE", raising=False)
        assert backend == "triton" or _cpu_umac.native() is not None, _cpu_umac.backend()


def _nh(backend: str, data: torch.Tensor, key) -> np.ndarray:
    if backend == "numpy":
        return umac.nh_hash_numpy(data, key)
    return umac.nh_hash(data, key).numpy().view(np.uint64)


def _random(num_bytes: int, seed: int, dtype=torch.uint8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)
    size = torch.empty(0, dtype=dtype).element_size()
    return raw[: num_bytes // size * size].view(dtype)


def _definition(data: torch.Tensor, nh_key: np.ndarray) -> list[list[int]]:
    """NH by the module docstring, word by word in Python integers (small tensors)."""
    raw = data.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * (-len(raw) % CHUNK_BYTES)
    key = [int(k) for k in nh_key]
    out = []
    for c in range(len(raw) // CHUNK_BYTES):
        block = raw[c * CHUNK_BYTES : (c + 1) * CHUNK_BYTES]
        m = [int.from_bytes(block[4 * i : 4 * i + 4], "little") for i in range(CHUNK_BYTES // 4)]
        row = []
        for t in range(ITERATIONS):
            s = 0
            for g in range(0, len(m), 8):
                for j in range(4):
                    a = (m[g + j] + key[g + j + SHIFT_WORDS * t]) % 2**32
                    b = (m[g + j + 4] + key[g + j + 4 + SHIFT_WORDS * t]) % 2**32
                    s += a * b
            row.append(s % 2**64)
        out.append(row)
    return out


# ----------------------------------------------------------------------- the definition


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_bytes", [0, 1, 5, CHUNK_BYTES, CHUNK_BYTES + 3, 2 * CHUNK_BYTES])
def test_nh_is_the_definition(monkeypatch, backend, num_bytes):
    """Every backend gives the word-by-word definition, padded last blocks included."""
    if backend != "numpy":
        _use(monkeypatch, backend)
    key = umac.transfer_keys(SESSION, b"definition")
    data = _random(num_bytes, num_bytes)
    got = _nh(backend, data, key)
    assert got.shape == (-(-num_bytes // CHUNK_BYTES), ITERATIONS)
    assert got.tolist() == _definition(data, key.nh_key)


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
@_PROPERTY
@given(
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    sliced=st.booleans(),
)
def test_backends_bit_exact(monkeypatch, backend, shape, dtype, seed, sliced):
    """Batch shapes vary (up to 6561 elements, a few blocks): each backend equals the NumPy
    reference, for contiguous tensors and for a strided slice (its contiguous form's bytes)."""
    _use(monkeypatch, backend)
    numel = int(np.prod(shape)) * 9
    data = _random(numel * torch.empty(0, dtype=dtype).element_size(), seed, dtype)
    data = data.view(*shape, 9)
    if sliced:
        data = data[..., 1:6:2]
    key = umac.transfer_keys(SESSION, seed.to_bytes(4, "little"))
    assert np.array_equal(_nh(backend, data, key), umac.nh_hash_numpy(data, key))


def test_twin_on_large_blocks_in_passes(monkeypatch):
    """The twin's passes of TWIN_ROWS blocks (3 here) add up to the reference over 8 blocks."""
    monkeypatch.setattr(_umac_core, "TWIN_ROWS", 3)
    key = umac.transfer_keys(SESSION, b"passes")
    data = _random(8 * CHUNK_BYTES - 7, 3)
    got = umac.nh_hash_torch(data, key).numpy().view(np.uint64)
    assert np.array_equal(got, umac.nh_hash_numpy(data, key))


def test_native_threads_split_blocks(monkeypatch):
    """Above PARALLEL_MIN_BYTES the C library's calls are split over threads: same bits."""
    monkeypatch.setattr(umac._cpu_umac._cpu, "PARALLEL_MIN_BYTES", CHUNK_BYTES)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    _use(monkeypatch, "native")
    key = umac.transfer_keys(SESSION, b"threads")
    data = _random(13 * CHUNK_BYTES, 4)
    assert np.array_equal(_nh("native", data, key), umac.nh_hash_numpy(data, key))


# ----------------------------------------------------------------------- the key schedule


def test_keys_depend_on_session_key_and_nonce():
    """Different nonces or session keys give unrelated NH and PRF keys; the same pair, the same."""
    base = umac.transfer_keys(SESSION, b"\x00" * 8)
    same = umac.transfer_keys(SESSION, b"\x00" * 8)
    assert np.array_equal(base.nh_key, same.nh_key) and base.mac_key == same.mac_key
    assert base.nh_key.shape == (KEY_WORDS,) and len(base.mac_key) == 32
    for other in (
        umac.transfer_keys(SESSION, b"\x01" + b"\x00" * 7),
        umac.transfer_keys(SESSION, b"\x00" * 9),  # the nonce's length is bound too
        umac.transfer_keys(bytes(range(1, 33)), b"\x00" * 8),
    ):
        assert (other.nh_key != base.nh_key).mean() > 0.99
        assert other.mac_key != base.mac_key
    assert "mac" not in repr(base) and str(base.mac_key) not in repr(base)


def test_keys_are_the_documented_derivation():
    """NH key = SHAKE256(HKDF-Expand(K, label | len(N) | N, 32)), PRF key = HKDF-Expand(K,
    label | len(N) | N, 32) (docs/authentication.md, Key schedule), spelled out with hashlib."""
    import hashlib
    import hmac

    nonce = b"pg payload" + (7).to_bytes(8, "little")
    ctx = bytes([len(nonce)]) + nonce
    seed = hmac.new(SESSION, b"tritonkv umac nh key v1" + ctx + b"\x01", hashlib.sha256).digest()
    mac = hmac.new(SESSION, b"tritonkv umac mac key v1" + ctx + b"\x01", hashlib.sha256).digest()
    keys = umac.transfer_keys(SESSION, nonce)
    assert keys.nh_key.tobytes() == hashlib.shake_256(seed).digest(4 * KEY_WORDS)
    assert keys.mac_key == mac


def test_hkdf_expand_matches_rfc5869_case_1():
    """HKDF-Expand against RFC 5869's test case 1 (its PRK, info and OKM)."""
    prk = bytes.fromhex("077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")
    okm = "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    assert _umac_core.hkdf_expand(prk, info, 42).hex() == okm


@pytest.mark.parametrize(
    ("session_key", "nonce", "error"),
    [
        ("x" * 32, b"n", TypeError),
        (b"short", b"n", ValueError),
        (SESSION, b"", ValueError),
        (SESSION, b"n" * 65, ValueError),
        (SESSION, 7, TypeError),
    ],
)
def test_bad_keys_and_nonces_are_refused(session_key, nonce, error):
    with pytest.raises(error, match="expected"):
        umac.transfer_keys(session_key, nonce)


def test_bad_arguments_are_refused():
    key = umac.transfer_keys(SESSION, b"args")
    with pytest.raises(TypeError, match="expected a sequence"):
        umac.payload_tag(key, torch.zeros(4))
    with pytest.raises(TypeError, match="expected a tensor"):
        umac.nh_hash([1, 2], key)
    with pytest.raises(TypeError, match="expected bytes"):
        umac.check_payload_tag(key, [torch.zeros(4)], "tag")


# ----------------------------------------------------------------------- forgeries refused


def _refused(key, tensors, tag) -> bool:
    try:
        umac.check_payload_tag(key, tensors, tag)
    except umac.TagMismatch:
        return True
    return False


@pytest.fixture(params=["torch", "native", "triton"])
def backend(request, monkeypatch):
    _use(monkeypatch, request.param)
    return request.param


def test_untouched_payload_passes(backend):
    key = umac.transfer_keys(SESSION, b"ok")
    tensors = [_random(3 * CHUNK_BYTES + 5, 1), _random(100, 2, torch.float32)]
    tag = umac.payload_tag(key, tensors)
    assert len(tag) == umac.TAG_BYTES
    assert not _refused(key, tensors, tag)
    copies = [t.clone() for t in tensors]
    assert not _refused(umac.transfer_keys(SESSION, b"ok"), copies, tag)


@_PROPERTY
@given(num_bytes=st.integers(1, 3 * CHUNK_BYTES), at=st.floats(0, 1), bit=st.integers(0, 7))
def test_one_flipped_bit_anywhere_is_refused(backend, num_bytes, at, bit):
    key = umac.transfer_keys(SESSION, b"flip")
    data = _random(num_bytes, num_bytes)
    tag = umac.payload_tag(key, [data])
    assert not _refused(key, [data], tag)
    where = min(int(at * num_bytes), num_bytes - 1)
    data[where] ^= 1 << bit
    assert _refused(key, [data], tag)


def test_wrong_key_is_refused(backend):
    data = _random(2 * CHUNK_BYTES, 5)
    tag = umac.payload_tag(umac.transfer_keys(SESSION, b"right"), [data])
    assert not _refused(umac.transfer_keys(SESSION, b"right"), [data], tag)
    assert _refused(umac.transfer_keys(bytes(range(1, 33)), b"right"), [data], tag)


def test_replayed_transfer_is_refused(backend):
    """Another transfer's payload with its own tag, presented as this transfer's: refused, for
    another nonce under the same session key and for the same nonce of another session."""
    mine, theirs = _random(CHUNK_BYTES + 9, 6), _random(CHUNK_BYTES + 9, 7)
    mine_key = umac.transfer_keys(SESSION, (5).to_bytes(8, "little"))
    their_key = umac.transfer_keys(SESSION, (4).to_bytes(8, "little"))
    their_tag = umac.payload_tag(their_key, [theirs])
    assert not _refused(their_key, [theirs], their_tag)
    assert _refused(mine_key, [theirs], their_tag)
    assert _refused(mine_key, [mine], their_tag)  # even the same bytes' tag of another nonce
    same_tag = umac.payload_tag(their_key, [mine])
    assert _refused(mine_key, [mine], same_tag)
    other_session = umac.transfer_keys(bytes(range(2, 34)), (5).to_bytes(8, "little"))
    assert _refused(other_session, [mine], umac.payload_tag(mine_key, [mine]))


def test_reordered_blocks_and_tensors_are_refused(backend):
    data = _random(4 * CHUNK_BYTES, 8)
    key = umac.transfer_keys(SESSION, b"order")
    tag = umac.payload_tag(key, [data])
    blocks = data.view(4, CHUNK_BYTES)
    assert not _refused(key, [data], tag)
    assert _refused(key, [blocks[[1, 0, 2, 3]].reshape(-1)], tag)  # two blocks swapped
    a, b = data[: 2 * CHUNK_BYTES], data[2 * CHUNK_BYTES :]
    pair_tag = umac.payload_tag(key, [a, b])
    assert not _refused(key, [a, b], pair_tag)
    assert _refused(key, [b, a], pair_tag)  # the payload's tensors in another order
    assert _refused(key, [data], pair_tag)  # the same bytes as one tensor
    words = data.clone().view(torch.int32).view(-1, 8)
    words[0, [0, 4]] = words[0, [4, 0]]  # a pair's two words swapped: NH with no key is blind
    assert _refused(key, [words.view(torch.uint8).reshape(-1)], tag)


def test_unkeyed_nh_misses_a_swapped_pair():
    """Control for the last check above: NH with an all-zero key sums m[j] * m[j + 4], which a
    swap of the two leaves unchanged; the key's addition is what sees it."""
    zero = umac.TransferKeys(np.zeros(KEY_WORDS, np.uint32), b"\0" * 32, b"z")
    data = _random(CHUNK_BYTES, 9)
    words = data.clone().view(torch.int32).view(-1, 8)
    words[0, [0, 4]] = words[0, [4, 0]]
    swapped = words.view(torch.uint8).reshape(-1)
    assert not torch.equal(swapped, data)
    assert np.array_equal(umac.nh_hash_numpy(swapped, zero), umac.nh_hash_numpy(data, zero))


@pytest.mark.parametrize("cut", [1, 4, CHUNK_BYTES, CHUNK_BYTES + 1])
def test_truncated_or_extended_payload_is_refused(backend, cut):
    data = _random(3 * CHUNK_BYTES - 2, 10)
    key = umac.transfer_keys(SESSION, b"length")
    tag = umac.payload_tag(key, [data])
    assert not _refused(key, [data], tag)
    assert _refused(key, [data[:-cut]], tag)
    assert _refused(key, [torch.cat([data, torch.zeros(cut, dtype=torch.uint8)])], tag)
    assert _refused(key, [data, torch.zeros(0, dtype=torch.uint8)], tag)  # an empty tensor more


def test_forged_tags_are_refused(backend):
    data = _random(CHUNK_BYTES, 11)
    key = umac.transfer_keys(SESSION, b"tag")
    tag = umac.payload_tag(key, [data])
    for forged in (bytes(16), tag[:-1] + bytes([tag[-1] ^ 1]), tag[:8], tag + b"\0"):
        assert _refused(key, [data], forged)


# ----------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_bytes", [5, CHUNK_BYTES, 3 * CHUNK_BYTES + 1, 64 << 20])
def test_triton_on_the_gpu_is_the_reference(monkeypatch, num_bytes):
    """The Triton kernel on CUDA tensors (bench/gpu_check.sh) against the NumPy reference and
    the torch twin on the same device; the tag equals the CPU's."""
    monkeypatch.delenv("TRITONKV_KERNELS", raising=False)
    key = umac.transfer_keys(SESSION, b"gpu")
    data = _random(num_bytes, 12)
    on_gpu = data.cuda()
    want = umac.nh_hash_numpy(data, key)
    assert np.array_equal(umac.nh_hash(on_gpu, key).cpu().numpy().view(np.uint64), want)
    assert np.array_equal(umac.nh_hash_torch(on_gpu, key).cpu().numpy().view(np.uint64), want)
    assert umac.payload_tag(key, [on_gpu]) == umac.payload_tag(key, [data])


def test_two_threads_launch_kernels_at_once_under_the_interpreter(monkeypatch):
    """The interpreter patches ``triton.language`` while a kernel runs, so two threads' kernels
    at once break each other (a KV server thread checking an entry's NH while the step packs the
    next one): every tritonkv launch takes one lock there. Both threads get the reference's bits,
    round after round."""
    import threading

    from support.kv_cases import bits, make_cache

    import tritonkv
    from tritonkv._dispatch import interpreter_lock, interpreting

    assert interpreting() and hasattr(interpreter_lock(), "acquire")
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    data, key = _random(3 * 4096 + 100, 7), umac.entry_keys(b"t" * 32, "entry")
    want_nh = umac.nh_hash_numpy(data, key)
    _, layers = make_cache("flash_attn_nhd", torch.bfloat16, num_layers=2, num_blocks=8)
    slots = torch.tensor([3, 4, 5, 17, 18, -1, 30])
    want, _ = tritonkv.pack_kv_torch(layers, slots)
    wrong = []

    def hashing():
        for _ in range(6):
            try:
                got = umac.nh_hash(data, key).numpy().view(np.uint64)
            except Exception as exc:  # (the interpreter's errors, when the kernels collide)
                wrong.append(repr(exc))
                return
            if not np.array_equal(got, want_nh):
                wrong.append("nh")

    thread = threading.Thread(target=hashing)
    thread.start()
    try:
        for _ in range(6):
            if not torch.equal(bits(tritonkv.pack_kv(layers, slots)[0]), bits(want)):
                wrong.append("pack")
    finally:
        thread.join()
    assert wrong == []
