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

__all__ = [
    "LAYER_SETS",
    "KVCacheSet",
    "LayerSet",
    "LayerSets",
    "Layers",
    "check_layers",
    "prepare_kv",
]

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
        entry = make_layer_set(layers)
        if key is not None:
            drop = partial(_drop, self._entries, key)
            entry.refs = [weakref.ref(t, drop) for t in _flat(layers)]
            self._entries[key] = entry
        return entry


def make_layer_set(layers: Layers) -> LayerSet:
    """Check ``layers`` and make its :class:`LayerSet` (held by no cache).

    Raises:
        TypeError, ValueError: as :func:`check_layers`.
    """
    shape, dtype, device, has_v = check_layers(layers)
    tensors = _flat(layers)
    width = widest_int_view(tensors, shape[3] * tensors[0].element_size(), widest=16)
    return LayerSet(shape, dtype, device, has_v, _signature(tensors), width)


def _drop(entries: dict, key: tuple, _ref: object) -> None:
    # ``entries`` is bound, not looked up: views freed at interpreter exit outlive module globals.
    entries.pop(key, None)


LAYER_SETS = LayerSets()


class KVCacheSet:
    """A ``layers`` argument prepared once (:func:`prepare_kv`), which the KV ops take in its place.

    It holds what every call derives from the views alone (their checks, integer views, the
    device table of layer addresses, the launch groups), so a call with it skips looking the views
    up and comparing their addresses, shapes and strides layer by layer: the host cost of a call no
    longer grows with the number of layers. It holds views of the caches' memory (keeping it
    allocated) and weak references to the caller's view objects.

    Refused, with a ``ValueError`` naming the fix (prepare again), once any of the caller's views
    has been freed (e.g. caches reallocated), and when a view no longer has the address, shape,
    strides, dtype or device it had when prepared: checked on every call whose value checks run
    (index tensors on the CPU, or ``TRITONKV_CHECK=1``; see :func:`tritonkv.pack_kv`), and by
    :meth:`check`. Views changed in place (``set_``, ``as_strided_``, ``resize_``) on a GPU call
    without value checks are not seen: prepare again after changing views (vLLM never does).

    Attributes:
        num_layers: number of ``(k, v)`` pairs.
        shape: the views' ``[num_blocks, num_kv_heads, block_size, head_size]``.
        dtype, device: the views'.
        has_v: whether the layers have V views (False for MLA).
    """

    def __init__(self, layers: Layers) -> None:
        self.layer_set = make_layer_set(layers)
        self.num_layers = len(layers)
        # Our own view objects of the same memory, which the integer views are made from.
        self.views = [(_alias(k), None if v is None else _alias(v)) for k, v in layers]
        self._freed = False
        self._refs = [weakref.ref(t, self._on_free) for t in _flat(layers)]

    def _on_free(self, _ref: object) -> None:
        self._freed = True

    shape = property(lambda self: self.layer_set.shape)
    dtype = property(lambda self: self.layer_set.dtype)
    device = property(lambda self: self.layer_set.device)
    has_v = property(lambda self: self.layer_set.has_v)

    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        return (
            f"KVCacheSet(num_layers={self.num_layers}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, device={self.device}, has_v={self.has_v})"
        )

    def resolve(self, *, full_check: bool) -> LayerSet:
        """The prepared :class:`LayerSet`, after the O(1) check that no view was freed and, with
        ``full_check``, :meth:`check`.

        Raises:
            ValueError: as :meth:`check`.
        """
        if self._freed or full_check:
            self.check()
        return self.layer_set

    def check(self) -> None:
        """Check that every view prepared is alive and unchanged (address, shape, strides, dtype,
        device).

        Raises:
            ValueError: a view was freed or changed; the message names the first such layer.
        """
        tensors = [ref() for ref in self._refs]
        per_layer = 1 + self.has_v
        if any(t is None for t in tensors):
            first = next(i for i, t in enumerate(tensors) if t is None) // per_layer
            raise ValueError(
                f"KVCacheSet: the view of layer {first} it was prepared from has been freed (the "
                "caches were reallocated?): call prepare_kv on the current views"
            )
        now, was = _signature(tensors), self.layer_set.signature
        if now != was:
            pairs = list(zip(now, was, strict=True))  # (now, then) of each property
            changed = (i for i in range(len(tensors)) if any(n[i] != w[i] for n, w in pairs))
            first = next(changed) // per_layer
            raise ValueError(
                f"KVCacheSet: the view of layer {first} no longer has the address, shape, "
                "strides, dtype or device it was prepared with: call prepare_kv on the current "
                "views"
            )


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new view object of exactly ``t``'s elements."""
    return t.as_strided(t.shape, t.stride(), t.storage_offset())


def prepare_kv(layers: Layers) -> KVCacheSet:
    """Prepare ``layers`` once for many :func:`tritonkv.pack_kv` / :func:`tritonkv.unpack_kv` /
    :func:`tritonkv.kv_digest` calls: pass the result as their ``layers`` argument.

    Args:
        layers: per-layer ``(k, v)`` views, as :func:`tritonkv.pack_kv` takes them. Keep them
            alive while the handle is used: it is refused once one is freed.

    Returns:
        A :class:`KVCacheSet`.

    Raises:
        TypeError, ValueError: as :func:`tritonkv.pack_kv` for a bad ``layers``.
    """
    return KVCacheSet(layers)
