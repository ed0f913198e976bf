"""vLLM's CUDA caches (MLA pages of FlashMLA and Triton MLA, and a gated-delta-net hybrid's
state pages overlaid on FlashAttention's in one allocation) move bit-exact by Triton: against
the torch twin on the same bytes, over the whole backing allocation, so a write to another
layer, block, group or to padding shows. On the CPU under the Triton interpreter here; on a GPU
in ``bench/gpu_check.sh`` (the ``gpu`` marker), from the geometry file, without vLLM."""

from __future__ import annotations

import pytest
import torch
from support.cuda_geometry import GEOMETRY_FILE, build, cases, connector_caches

from connector.vllm_connector.cache_views import PAGES_ONLY, StateCaches
from tritonkv import pack_kv, pack_state, unpack_kv, unpack_state

SENTINEL = 0xA5
NAMES = list(cases())


def _move(name: str, device) -> torch.Tensor:
    """One save and one load of every group of case ``name`` on ``device`` with the kernels
    ``TRITONKV_KERNELS`` selects: token rows of positions ``[bs + 3, 2 bs + 5)`` of three blocks
    (whole pages where the layout has no token rows), and three state rows (a state group);
    the destination allocation, all sentinel before, to the host."""
    _, src_groups = build(name, device, seed=1)
    dst_raw, dst_groups = build(name, device, fill=SENTINEL)
    for (group, src_tensors), (_, dst_tensors) in zip(src_groups, dst_groups, strict=True):
        src = connector_caches(group, src_tensors)
        dst = connector_caches(group, dst_tensors)
        if isinstance(src, StateCaches):  # blocks the attention group's moves leave alone
            n = src.num_slots
            packed, digest = pack_state(src.states, src.slots([n - 1, 1, 4]), digest=True)
            got = unpack_state(packed, dst.states, dst.slots([3, n - 3, 1]), digest=True)
            assert torch.equal(got, digest)
            continue
        nb, bs = src.num_slots // src.block_size, src.block_size
        src_blocks, dst_blocks = [nb - 2, 1, nb - 1], [nb - 1, 0, 2]
        pages = src.layout in PAGES_ONLY
        first, stop = (0, 3 * bs) if pages else (bs + 3, 2 * bs + 5)
        views = (src.pages, dst.pages) if pages else (src.layers, dst.layers)
        slots = src.slots(src_blocks, first, stop, 3 * bs)
        packed, _, digest = pack_kv(views[0], slots, digest=True)
        got = unpack_kv(packed, views[1], dst.slots(dst_blocks, first, stop, 3 * bs), digest=True)
        assert torch.equal(got, digest)
    return dst_raw.cpu()


def _check(monkeypatch, name: str, device: str, kernels: str) -> None:
    monkeypatch.setenv("TRITONKV_KERNELS", kernels)
    got = _move(name, device)
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    want = _move(name, "cpu")
    assert (want != SENTINEL).sum() > 0  # something moved: the comparison is not vacuous
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{name}: {bad.numel()} bytes differ, first at {bad[:8].tolist()}"


def test_the_geometry_file_holds_the_cases():
    """The file is there and names every case the GPU check needs (MLA and a state hybrid)."""
    assert GEOMETRY_FILE.exists()
    kinds = {g["kind"] for case in cases().values() for g in case["groups"]}
    assert kinds == {"mla", "attention", "state"} and len(NAMES) >= 6


def test_the_geometry_file_is_what_vllm_allocates():
    """The file equals what vLLM's allocation code gives now (rewrite it with
    ``PYTHONPATH=tests python -m support.vllm_layouts --write``)."""
    pytest.importorskip("vllm")
    from support.vllm_layouts import cuda_geometry

    assert cuda_geometry() == cases()


@pytest.mark.parametrize("name", NAMES)
def test_triton_moves_vllms_cuda_caches_as_the_twin(monkeypatch, name):
    _check(monkeypatch, name, "cpu", "triton")


def test_a_wrong_slot_shows(monkeypatch):
    """The negative control: a state row taken and landing one block off differs from the twin's."""
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    want = _move("gdn_hybrid-flash_attn", "cpu")
    real = StateCaches.slots
    monkeypatch.setattr(StateCaches, "slots", lambda self, s: real(self, [x - 1 for x in s]))
    assert not torch.equal(_move("gdn_hybrid-flash_attn", "cpu"), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_triton_moves_vllms_cuda_caches_as_the_twin(monkeypatch, name):
    _check(monkeypatch, name, "cuda", "auto")
