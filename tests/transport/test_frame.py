"""Wire format: round trips, and every malformed header rejected before allocation."""

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.transport import frame as wire
from connector.transport.errors import ProtocolError
from connector.transport.frame import (
    CODE_TO_DTYPE,
    PREFIX,
    FrameLimits,
    Kind,
    TensorSpec,
    decode_header,
    encode_header,
    encode_meta,
    plan_chunks,
    spec_of,
)

pytestmark = pytest.mark.timeout(60)

DTYPES = tuple(CODE_TO_DTYPE.values())
SHAPES = ((), (0,), (3, 0, 2), (5, 123, 3), (1,) * 8)


def _header(specs, kind=Kind.MSG, key="req-1", meta=None, flags=0):
    return encode_header(kind, key, meta, specs, flags)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype, shape):
    t = torch.empty(shape, dtype=dtype)
    spec = spec_of("t", t)
    h = decode_header(_header([spec], meta={"a": 1, "b": "x", "c": True, "d": 0.5, "e": None}))
    assert h.kind == Kind.MSG and h.key == "req-1"
    assert h.meta == {"a": 1, "b": "x", "c": True, "d": 0.5, "e": None}
    assert h.specs == (spec,)
    assert h.specs[0].dtype == dtype and h.specs[0].shape == shape


def test_every_dtype_code_is_stable():
    # codes are part of the wire format: never renumber
    assert wire.DTYPE_TO_CODE[torch.float32] == 1
    assert wire.DTYPE_TO_CODE[torch.bfloat16] == 3
    assert wire.DTYPE_TO_CODE[torch.int64] == 9
    assert wire.DTYPE_TO_CODE[torch.float8_e4m3fn] == 11
    assert wire.DTYPE_TO_CODE[torch.float8_e5m2] == 12


@settings(max_examples=60, deadline=None)
@given(
    key=st.text(max_size=40),
    shapes=st.lists(st.lists(st.integers(0, 7), max_size=4), max_size=6),
    meta=st.dictionaries(
        st.text(max_size=8),
        st.one_of(st.integers(-(2**60), 2**60), st.booleans(), st.text(max_size=10), st.none()),
        max_size=5,
    ),
)
def test_round_trip_property(key, shapes, meta):
    specs = [
        spec_of(f"t{i}", torch.empty(s, dtype=DTYPES[i % len(DTYPES)]), packed=i % 2 == 0)
        for i, s in enumerate(shapes)
    ]
    h = decode_header(_header(specs, key=key, meta=meta))
    assert (h.key, h.meta, list(h.specs)) == (key, meta, specs)


# ---------------------------------------------------------------------------------- rejections
def _spec(code=1, shape=(4,), nbytes=16, name="t"):
    return TensorSpec(name, code, shape, nbytes)


BAD_HEADERS = {
    "unknown-dtype-code": lambda: _header([_spec(code=250)]),
    "2^40-byte-tensor": lambda: _header([_spec(code=6, shape=(1 << 40,), nbytes=1 << 40)]),
    "nbytes-disagrees-with-shape": lambda: _header([_spec(nbytes=17)]),
    "negative-dim": lambda: _header([_spec(shape=(-4,), nbytes=16)]),
    "rank-9": lambda: _header([_spec(shape=(1,) * 9, nbytes=4)]),
    "duplicate-names": lambda: _header([_spec(), _spec()]),
    "empty-name": lambda: _header([_spec(name="")]),
    "sum-over-cap": lambda: _header(
        [_spec(code=6, shape=(3 << 30,), nbytes=3 << 30, name=n) for n in "ab"]
    ),
    "bad-magic": lambda: b"XXXX" + _header([])[4:],
    "bad-version": lambda: _header([])[:4] + b"\x09" + _header([])[5:],
    "unknown-kind": lambda: _header([])[:5] + b"\x05" + _header([])[6:],  # below APP_KIND_MIN
    "unknown-flags": lambda: _header([], flags=0x80),
    "body-too-long": lambda: PREFIX.pack(wire.MAGIC, wire.VERSION, wire.Kind.MSG, 0, 1 << 30),
    "truncated-body": lambda: _header([_spec()])[:-3],
    "trailing-bytes": lambda: (
        lambda h: h[:8] + struct.pack("<I", len(h) - 12 + 1) + h[12:] + b"!"
    )(_header([])),
    "meta-not-json": lambda: _header([], meta=b"{nope"),
    "meta-not-object": lambda: _header([], meta=b"[1,2]"),
    "meta-nested": lambda: _header([], meta=b'{"a":{"b":1}}'),
    "meta-nan": lambda: _header([], meta=b'{"a":NaN}'),
    "meta-overflowing-number": lambda: _header([], meta=b'{"a":-1e999}'),
    "key-not-utf8": lambda: (lambda h: h[:14] + b"\xff" + h[15:])(_header([], key="abc")),
}


@pytest.mark.parametrize("name", list(BAD_HEADERS))
def test_malformed_header_rejected(name, monkeypatch):
    allocations = []
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocations.append(a))
    raw = BAD_HEADERS[name]()
    with pytest.raises(ProtocolError):
        decode_header(raw)
    assert allocations == []


def test_error_names_field_and_values():
    with pytest.raises(ProtocolError, match=r"unknown dtype code 250"):
        decode_header(_header([_spec(code=250)]))
    with pytest.raises(ProtocolError, match=r"expected <= 4294967296 bytes per frame"):
        decode_header(_header([_spec(code=6, shape=(1 << 40,), nbytes=1 << 40)]))


def test_limits_are_configurable():
    small = FrameLimits(max_message_bytes=100, max_tensors=1)
    raw = _header([_spec(code=6, shape=(101,), nbytes=101)])
    with pytest.raises(ProtocolError, match="per frame"):
        decode_header(raw, small)
    with pytest.raises(ProtocolError, match="tensor count"):
        decode_header(_header([_spec(name="a"), _spec(name="b")]), small)
    with pytest.raises(ValueError, match="positive int"):
        FrameLimits(max_tensors=0)


# ------------------------------------------------------------------------------- user errors
def test_encode_meta_rejects_bad_values():
    with pytest.raises(TypeError, match=r"meta\['x'\]: expected int, float, str, bool or None"):
        encode_meta({"x": [1, 2]})
    with pytest.raises(TypeError, match="meta keys"):
        encode_meta({1: 2})
    with pytest.raises(ValueError, match="finite"):
        encode_meta({"x": float("nan")})
    with pytest.raises(ValueError, match="JSON bytes"):
        encode_meta({"x": "y" * 70_000})


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_spec_of_rejects_non_tensors_and_odd_dtypes():
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        spec_of("x", [1, 2])
    with pytest.raises(TypeError, match="cannot travel"):
        spec_of("x", torch.empty(2, dtype=torch.complex32))


def test_plan_chunks_packs_small_tensors_at_aligned_offsets():
    specs = [
        TensorSpec("a", 6, (10,), 10, wire.TFLAG_PACKED),
        TensorSpec("b", 6, (1 << 20,), 1 << 20),
        TensorSpec("e", 6, (0,), 0, wire.TFLAG_PACKED),
        TensorSpec("c", 6, (3,), 3, wire.TFLAG_PACKED),
    ]
    chunks = plan_chunks(specs)
    assert chunks[0].members == ((0, 0), (3, 64)) and chunks[0].nbytes == 67
    assert chunks[1].index == 1 and chunks[1].nbytes == 1 << 20
    assert len(chunks) == 2


def test_kinds_of_the_pipe_user_pass_through_as_ints_and_others_are_refused():
    for code in (wire.APP_KIND_MIN, 255):
        raw = encode_header(code, "k", {})
        h = decode_header(raw)
        assert h.kind == code and not isinstance(h.kind, wire.Kind)
        assert wire.kind_name(h.kind) == f"kind {code}"
    assert decode_header(encode_header(wire.Kind.BYE)).kind is wire.Kind.BYE
    for code in (0, 3, wire.APP_KIND_MIN - 1):
        with pytest.raises(ProtocolError, match=f"unknown frame kind {code}"):
            decode_header(encode_header(code, "k", {}))
