"""Input checks shared by the ops: index tensors' type and shape, and when value checks run."""

from __future__ import annotations

import os

import torch

INT_DTYPES = (torch.int32, torch.int64)


def checks_enabled(*tensors: object) -> bool:
    """Value checks (offsets, slots) run when they cost no device sync, or if ``TRITONKV_CHECK=1``."""
    if os.environ.get("TRITONKV_CHECK", "0") not in ("", "0"):
        return True
    return all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in tensors)


def check_index(name: str, t: torch.Tensor | None, *, allow_none: bool = True) -> None:
    """Require a 1-D int32/int64 tensor (or None when allowed).

    Raises:
        TypeError: ``t`` is not a tensor (or None when not allowed), or not int32/int64.
        ValueError: ``t`` is not 1-D.
    """
    if t is None:
        if allow_none:
            return
        raise TypeError(f"{name}: expected a 1-D int32/int64 tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D int32/int64 tensor, got {type(t).__name__}")
    if t.dtype not in INT_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
