"""Bad input raises TypeError/ValueError naming what was expected and what was given."""

from __future__ import annotations

import pytest
import torch
from support.kv_cases import make_cache

from tritonkv import pack_hidden, pack_kv, unpack_hidden, unpack_kv

QSL = torch.tensor([0, 18, 19, 20])
SLOTS = torch.arange(20)
_, LAYERS = make_cache("flash_attn_nhd", torch.float16)  # 2 layers, 6 blocks of 8: 48 slots
PACKED = torch.zeros(2, 2, 20, 2, 8, dtype=torch.float16)
HIDDEN = torch.zeros(20, 16)


@pytest.fixture(params=("torch", "triton"), autouse=True)
def kernels(request, monkeypatch):
    monkeypatch.setenv("TRITONKV_KERNELS", request.param)


def _k_other_dtype():
    k, v = LAYERS[1]
    return [LAYERS[0], (k.float(), v.float())]


CASES = [
    # layers
    ("layers not a sequence", lambda: pack_kv(torch.zeros(3), SLOTS), TypeError, "sequence of"),
    ("no layers", lambda: pack_kv([], SLOTS), ValueError, "at least one"),
    ("not a pair", lambda: pack_kv([LAYERS[0][0]], SLOTS), TypeError, r"\(k, v\) pair"),
    ("3-D k", lambda: pack_kv([(torch.zeros(2, 2, 2), None)], SLOTS), ValueError, "4-D"),
    (
        "k/v mismatch",
        lambda: pack_kv([(LAYERS[0][0], LAYERS[0][1][:, :1])], SLOTS),
        ValueError,
        "k and v must match",
    ),
    (
        "layer dtypes differ",
        lambda: pack_kv(_k_other_dtype(), SLOTS),
        ValueError,
        "share shape, dtype",
    ),
    (
        "v present then absent",
        lambda: pack_kv([LAYERS[0], (LAYERS[1][0], None)], SLOTS),
        ValueError,
        "V presence",
    ),
    # index tensors
    ("float slot_mapping", lambda: pack_kv(LAYERS, SLOTS.float()), TypeError, "int32 or int64"),
    ("2-D slot_mapping", lambda: pack_kv(LAYERS, SLOTS.view(4, 5)), ValueError, "1-D"),
    (
        "float query_start_loc",
        lambda: pack_kv(LAYERS, SLOTS, QSL.float()),
        TypeError,
        "int32 or int64",
    ),
    (
        "decreasing offsets",
        lambda: pack_kv(LAYERS, SLOTS, torch.tensor([0, 5, 3])),
        ValueError,
        "non-decreasing",
    ),
    (
        "offset past num_tokens",
        lambda: pack_kv(LAYERS, SLOTS, torch.tensor([0, 21])),
        ValueError,
        "past num_tokens",
    ),
    ("seq_ids out of range", lambda: pack_kv(LAYERS, SLOTS, QSL, [3]), ValueError, r"in \[0, 3\)"),
    ("negative seq_id", lambda: pack_kv(LAYERS, SLOTS, QSL, [-1]), ValueError, r"in \[0, 3\)"),
    ("seq_ids of strings", lambda: pack_kv(LAYERS, SLOTS, QSL, ["0"]), TypeError, "ints"),
    (
        "slot past the cache",
        lambda: pack_kv(LAYERS, torch.full((20,), 48), QSL),
        ValueError,
        r"\[-1, 48\)",
    ),
    (
        "slot below -1",
        lambda: pack_kv(LAYERS, torch.full((20,), -2), QSL),
        ValueError,
        r"\[-1, 48\)",
    ),
    # packed / out
    (
        "out wrong shape",
        lambda: pack_kv(LAYERS, SLOTS, QSL, out=PACKED[:, :1]),
        ValueError,
        "expected shape",
    ),
    (
        "out wrong dtype",
        lambda: pack_kv(LAYERS, SLOTS, QSL, out=PACKED.float()),
        ValueError,
        "dtype",
    ),
    (
        "out wrong rows",
        lambda: pack_kv(LAYERS, SLOTS, QSL, [0], out=PACKED),
        ValueError,
        "expected 18 rows",
    ),
    (
        "out not contiguous",
        lambda: pack_kv(
            LAYERS, SLOTS, QSL, out=PACKED.transpose(3, 4).contiguous().transpose(3, 4)
        ),
        ValueError,
        "contiguous",
    ),
    ("packed None", lambda: unpack_kv(None, LAYERS, SLOTS), TypeError, "got None"),
    (
        "packed wrong rows",
        lambda: unpack_kv(PACKED[:, :, :5].contiguous(), LAYERS, SLOTS, QSL),
        ValueError,
        "expected 20 rows",
    ),
    # hidden states
    ("hidden 1-D", lambda: pack_hidden(torch.zeros(20), QSL), ValueError, "hidden_size"),
    ("hidden not a tensor", lambda: pack_hidden([[0.0]], QSL), TypeError, "tensor"),
    ("hidden without offsets", lambda: pack_hidden(HIDDEN, None), TypeError, "got None"),
    (
        "hidden out wrong width",
        lambda: pack_hidden(HIDDEN, QSL, out=torch.zeros(20, 15)),
        ValueError,
        "contiguous",
    ),
    (
        "last_only on an empty sequence",
        lambda: pack_hidden(HIDDEN, torch.tensor([0, 0, 20]), last_only=True),
        ValueError,
        "at least one",
    ),
    (
        "unpack_hidden wrong rows",
        lambda: unpack_hidden(torch.zeros(3, 16), HIDDEN, QSL),
        ValueError,
        "expected 20 rows",
    ),
]


@pytest.mark.parametrize("call,error,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_unknown_kernels_name(monkeypatch):
    monkeypatch.setenv("TRITONKV_KERNELS", "cuda-please")
    with pytest.raises(
        ValueError, match=r"TRITONKV_KERNELS: expected one of .*auto.*torch.*triton.*cuda-please"
    ):
        pack_kv(LAYERS, SLOTS)
