"""The ``layers`` argument of the KV ops: validated, and what every call derives from it alone.

A :class:`LayerSet` is made once per set of view objects (checked, widened to integer views,
grouped for the kernel launches or planned for the torch twin) and reused while the caller passes
the same view objects unchanged; :data:`LAYER_SETS` holds them.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from . import _cpu_digest, _kv_torch, _kv_triton
from ._intview import as_int, widest_int_view

__all__ = ["LAYER_SETS", "LayerSet", "LayerSets", "Layers", "check_layers"]

Layers = Sequence[tuple[torch.Tensor, "torch.Tensor | None"]]

_VIEW_DIMS = ("num_blocks", "num_kv_heads", "block_size", "head_size")


def check_layers(layers: Layers) -> tuple[torch.Size, torch.dtype, torch.device, bool]:
    """Validate ``layers``; return the common view shape, dtype, device and whether V exists.

    Raises:
        TypeError: not a sequence of ``(Tensor, Tensor or None)`` pairs.
        ValueError: no layers, views not 4-D, K and V or layers that differ, or a dimension of
            size 0 (the message names it).
    """
    if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
        raise TypeError(f"layers: expected a sequence of (k, v) pairs, got {type(layers).__name__}")
    if len(layers) == 0:
        raise ValueError("layers: expected at least one (k, v) pair, got none")
    first = None
    for i, pair in enumerate(layers):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"layers[{i}]: expected a (k, v) pair, got {type(pair).__name__}")
        k, v = pair
        if not isinstance(k, torch.Tensor) or (v is not None and not isinstance(v, torch.Tensor)):
            raise TypeError(f"layers[{i}]: expected (Tensor, Tensor or None), got {pair!r:.80}")
        if k.dim() != 4:
            raise ValueError(
                f"layers[{i}]: expected 4-D views [num_blocks, num_kv_heads, block_size, "
                f"head_size], got k of shape {tuple(k.shape)}"
            )
        if v is not None and (v.shape, v.dtype, v.device) != (k.shape, k.dtype, k.device):
            raise ValueError(
                f"layers[{i}]: k and v must match, got k {tuple(k.shape)} {k.dtype} {k.device} "
                f"and v {tuple(v.shape)} {v.dtype} {v.device}"
            )
        this = (k.shape, k.dtype, k.device, v is not None)
        if first is None:
            first = this
        elif this != first:
            raise ValueError(
                f"layers[{i}]: all layers must share shape, dtype, device and V presence; layer 0 "
                f"is {first[:3]} has_v={first[3]}, layer {i} is {this[:3]} has_v={this[3]}"
            )
    for name, size in zip(_VIEW_DIMS, first[0], strict=True):
        if size == 0:
            raise ValueError(
                f"layers: expected {name} > 0, got views of shape {tuple(first[0])} "
                f"[{', '.join(_VIEW_DIMS)}]"
            )
    return first


@dataclass
class LayerSet:
    """A validated ``layers`` argument and what every call derives from it alone: checked, widened
    and planned once, then reused while the caller passes the same view objects unchanged."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    has_v: bool
    signature: tuple  # address, shape, strides, dtype and device of every view when this was made
    width: int  # widest integer access (bytes) the views allow
    refs: list = field(default_factory=list)  # weak references that drop this entry
    _derived: dict[tuple[str, int], object] = field(default_factory=dict)  # (what, width) -> it

    def _memo(self, what: str, width: int, make: Callable[[], object]):
        key = (what, width)
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def views(self, width: int, layers: Layers) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The integer views of ``width`` bytes."""
        return self._memo(
            "views",
            width,
            lambda: [
                (as_int(k, width), None if v is None else as_int(v, width)) for k, v in layers
            ],
        )

    def launches(self, width: int, layers: Layers) -> list[_kv_triton.LaunchGroup]:
        """The kernel launches (GPU)."""
        return self._memo(
            "launches", width, lambda: _kv_triton.launch_groups(self.views(width, layers))
        )

    def plan(self, width: int, layers: Layers) -> list[_kv_torch.Group]:
        """The twin's copy plan."""
        return self._memo("plan", width, lambda: _kv_torch.plan(self.views(width, layers)))

    def row_table(self, layers: Layers) -> _cpu_digest.RowTable:
        """The byte addressing of the flat views ``[k0, v0, k1, v1, ...]`` (CPU fused digest)."""
        return self._memo("row_table", 0, lambda: _cpu_digest.RowTable.of(_flat(layers)))


# What a layer set's entry is checked against on every call: one pass of each over the flat views
# (a getter mapped over them costs half of a per-view tuple; the host cost per call is dominated by
# this for models of many layers).
_SIGNATURE = (
    torch.Tensor.data_ptr,
    operator.attrgetter("shape"),
    torch.Tensor.stride,
    operator.attrgetter("dtype"),
    operator.attrgetter("device"),
)


def _flat(layers: Layers) -> list[torch.Tensor]:
    return [t for t in itertools.chain.from_iterable(layers) if t is not None]


def _signature(tensors: list[torch.Tensor]) -> tuple:
    return tuple(tuple(map(get, tensors)) for get in _SIGNATURE)


class LayerSets:
    """The :class:`LayerSet` of each set of view objects, by the ids of those objects.

    An entry holds weak references to the caller's views and goes when any of them is freed (so a
    view's id is never reused while its entry lives), and only then: never while they all live, as
    a CUDA graph captured with its device address table replays with that table. It holds no
    reference to the views themselves, only views of the same memory, which the caller's views keep
    alive anyway.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, LayerSet] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> set[tuple]:
        """The keys of the entries now held (``(num_layers, *ids of the views)``), as a new set."""
        return set(self._entries)

    def lookup(self, layers: Layers) -> LayerSet:
        """The :class:`LayerSet` of ``layers``, held when these very view objects were seen and
        still have the same address, shape, strides, dtype and device; otherwise checked and made
        anew (replacing the entry of these objects).

        Raises:
            TypeError, ValueError: as :func:`check_layers`.
        """
        try:
            if isinstance(layers, torch.Tensor):
                raise TypeError  # (iterating it would make a view of every row)
            tensors = _flat(layers)
            key = (len(layers), *map(id, tensors))  # with V in all layers or none: the layout
        except (TypeError, ValueError):  # not a sequence of pairs: check_layers says what is wrong
            tensors, key = None, None
        entry = self._entries.get(key) if key is not None else None
        if entry is not None and entry.signature == _signature(tensors):
            return entry
        shape, dtype, device, has_v = check_layers(layers)
        tensors = _flat(layers)
        width = widest_int_view(tensors, shape[3] * tensors[0].element_size(), widest=16)
        entry = LayerSet(shape, dtype, device, has_v, _signature(tensors), width)
        if key is not None:
            drop = partial(_drop, self._entries, key)
            entry.refs = [weakref.ref(t, drop) for t in tensors]
            self._entries[key] = entry
        return entry


def _drop(entries: dict, key: tuple, _ref: object) -> None:
    # ``entries`` is bound, not looked up: views freed at interpreter exit outlive module globals.
    entries.pop(key, None)


LAYER_SETS = LayerSets()
