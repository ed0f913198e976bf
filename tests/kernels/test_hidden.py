"""pack_hidden / unpack_hidden on both kernels (Triton and the torch twin), bit-exact against plain row indexing."""

from __future__ import annotations

import pytest
import torch
from support.kv_cases import DTYPE_IDS, DTYPES, assert_bits_equal, random_bits_

from tritonkv import pack_hidden, unpack_hidden

SEED_QSL = torch.tensor([0, 18, 19, 20])


@pytest.fixture(params=("torch", "triton"))
def kernels(request, monkeypatch):
    monkeypatch.setenv("TRITONKV_KERNELS", request.param)
    return request.param


def _hidden(dtype, rows=22, width=40, strided=False, sentinel=False):
    """Random (or sentinel-filled) hidden states; ``strided`` takes columns of a wider buffer."""
    buffer = torch.empty(rows, width + 9 if strided else width, dtype=dtype)
    if sentinel:
        buffer.view(torch.uint8).fill_(0x5A)
    else:
        random_bits_(buffer, torch.Generator().manual_seed(0))
    return buffer[:, 3 : 3 + width] if strided else buffer


def _expected_rows(seq_ids, last_only):
    qsl = SEED_QSL.tolist()
    if last_only:
        return [qsl[s + 1] - 1 for s in seq_ids]
    return [t for s in seq_ids for t in range(qsl[s], qsl[s + 1])]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("last_only", [False, True], ids=["all_rows", "last_only"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pack_unpack_hidden(kernels, dtype, last_only, strided):
    hidden = _hidden(dtype, strided=strided)
    seq_ids = [2, 0]
    rows = _expected_rows(seq_ids, last_only)
    packed, cu_seqlens = pack_hidden(hidden, SEED_QSL, seq_ids, last_only=last_only)
    assert_bits_equal(packed, hidden[rows], "pack_hidden")
    assert cu_seqlens.tolist() == ([0, 1, 2] if last_only else [0, 1, 19])

    # Rows 20 and 21 are past the batch, and strided buffers have gaps: all must stay untouched.
    dst = _hidden(dtype, strided=strided, sentinel=True)
    expected = _hidden(dtype, strided=strided, sentinel=True)
    unpack_hidden(packed, dst, SEED_QSL, seq_ids, last_only=last_only)
    expected[rows] = hidden[rows]
    assert_bits_equal(dst, expected, "unpack_hidden")
    if strided:  # the gap columns of the underlying buffer too
        assert_bits_equal(
            dst.as_strided((22, 49), (49, 1), 0), expected.as_strided((22, 49), (49, 1), 0), "gaps"
        )


def test_out_argument(kernels):
    hidden = _hidden(torch.bfloat16)
    out = torch.zeros(3, 40, dtype=torch.bfloat16)
    packed, _ = pack_hidden(hidden, SEED_QSL, last_only=True, out=out)
    assert packed is out
    assert_bits_equal(out, hidden[[17, 18, 19]], "out=")


def test_wide_hidden_spans_several_column_tiles(kernels):
    hidden = _hidden(torch.float32, rows=20, width=2500)  # > 1024 columns per program
    packed, _ = pack_hidden(hidden, SEED_QSL, [1, 0])
    assert_bits_equal(packed, hidden[[18, *range(18)]], "wide")


@pytest.mark.parametrize("num_seqs", [3, 40, 200], ids=lambda n: f"{n}seqs")
@pytest.mark.parametrize("order", ["ascending", "shuffled"])
def test_many_sequences(kernels, num_seqs, order):
    """Few stretches (slice copies on CPU) and many (the row gather): the same rows either way."""
    gen = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(0, 4, (num_seqs,), generator=gen)  # 0-token sequences included
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    num_tokens = int(qsl[-1]) + 2  # two rows past the batch
    picked = torch.randperm(num_seqs, generator=gen)[: max(2, 3 * num_seqs // 4)]
    seq_ids = picked.sort().values if order == "ascending" else picked
    rows = [t for s in seq_ids.tolist() for t in range(qsl[s], qsl[s + 1])]
    hidden = _hidden(torch.bfloat16, rows=num_tokens, width=24)
    packed, cu_seqlens = pack_hidden(hidden, qsl, seq_ids)
    assert_bits_equal(packed, hidden[rows], "pack_hidden")
    assert cu_seqlens.tolist() == [0, *lens[seq_ids].cumsum(0).tolist()]

    dst = _hidden(torch.bfloat16, rows=num_tokens, width=24, sentinel=True)
    expected = dst.clone()
    expected[rows] = hidden[rows]
    unpack_hidden(packed, dst, qsl, seq_ids)
    assert_bits_equal(dst, expected, "unpack_hidden")


def test_seq_ids_must_be_a_sequence(kernels):
    """An iterator would be used up by the type check and then select nothing: rejected."""
    with pytest.raises(TypeError, match=r"expected a list of ints .*, got map"):
        pack_hidden(_hidden(torch.float16), SEED_QSL, map(int, "20"))


def test_zero_hidden_size_is_rejected_and_zero_rows_work(kernels):
    with pytest.raises(ValueError, match=r"hidden_size > 0, got shape \(3, 0\)"):
        pack_hidden(torch.zeros(3, 0), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="hidden_size > 0"):
        unpack_hidden(torch.zeros(3, 0), torch.zeros(3, 0), torch.tensor([0, 3]))
    hidden = _hidden(torch.float16, rows=0)
    packed, cu_seqlens = pack_hidden(hidden, torch.tensor([0, 0]))
    assert packed.shape == (0, 40) and cu_seqlens.tolist() == [0, 0]
    unpack_hidden(packed, hidden, torch.tensor([0, 0]))
