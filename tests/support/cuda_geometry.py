"""vLLM's CUDA caches rebuilt from their geometry alone, without vLLM (which the GPU check's
machine does not have): every tensor the GPU runner registers with the connector, as dtype,
shape, strides and offset into one backing allocation, read from ``tests/data/cuda_geometry.json``.
That file is written from vLLM's own allocation code (``support.vllm_layouts.cuda_geometry``;
``PYTHONPATH=tests python -m support.vllm_layouts --write``), and a test keeps it equal to it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from connector.vllm_connector.cache_views import RankCaches, StateCaches

GEOMETRY_FILE = Path(__file__).parents[1] / "data" / "cuda_geometry.json"


@functools.cache
def cases() -> dict:
    """Every case of the file, by name."""
    return json.loads(GEOMETRY_FILE.read_text())


def build(name: str, device, *, seed: int | None = None, fill: int = 0):
    """Case ``name``'s allocation on ``device``: its bytes random (``seed``) or all ``fill``.

    Returns:
        ``(raw, groups)``: the backing allocation ``[bytes]`` uint8, and per KV cache group
        ``(its geometry dict, its tensors as registered with the connector)``.
    """
    case = cases()[name]
    if seed is None:
        raw = torch.full((case["bytes"],), fill, dtype=torch.uint8, device=device)
    else:
        gen = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (case["bytes"],), generator=gen, dtype=torch.uint8).to(device)
    groups = []
    for group in case["groups"]:
        tensors = []
        for t in group["tensors"]:
            base = raw.view(getattr(torch, t["dtype"]))
            tensors.append(base.as_strided(t["shape"], t["stride"], t["offset"]))
        groups.append((group, tensors))
    return raw, groups


def connector_caches(group: dict, tensors: list[torch.Tensor]):
    """The connector's view of one group: :class:`RankCaches` of attention or MLA caches (as the
    worker makes them on a GPU), :class:`StateCaches` of a state group's ``[num_blocks, 1, 1,
    state_bytes]`` pages (one block's states as one row, as the facade's ``state_tensors``)."""
    if group["kind"] == "state":
        return StateCaches([t.view(t.shape[0], -1) for t in tensors], group["block_size"])
    return RankCaches(
        tensors,
        group["head_size"],
        group["block_size"],
        use_mla=group["kind"] == "mla",
        on_cpu=False,
        isa=None,
    )
