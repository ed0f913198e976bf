"""What a consumer rank accepts of a loaded entry, checked from its own caches only: the prompt
positions it holds (:func:`entry_span`: a whole prompt, one KV cache group's part of it, or one
chunk), the most bytes a reply may announce (:func:`expected_bytes`, refused before it is
allocated), and its format, shape and dtype (:func:`check_entry`). No vLLM import.
"""

from __future__ import annotations

import math

import torch

from .cache_views import PAGES_ONLY, RankCaches, StateCaches, packed_shape
from .handoff import shown
from .metadata import CHUNK_FIELDS, FIRST_KEY, LoadSpec
from .tp_mapping import HeadSource


def entry_span(spec: LoadSpec, meta: dict, chunk: tuple[int, int] | None) -> tuple[int, int, bool]:
    """``(start, stop, final)``: the prompt positions a loaded entry holds, and whether it is
    the last of ``spec``'s transfer; ``chunk``: ``(index, start)`` of the chunk loaded (its
    predecessor ended at ``start``), None for a whole prompt. ValueError when the entry's meta
    does not say what was asked: the chunk's index, positions from ``start`` to at most the
    prompt's end, ``final`` there."""
    if chunk is None:
        first = meta.get(FIRST_KEY, 0)
        if first != spec.first or type(first) is not int:
            raise ValueError(
                f"the entry holds positions from {shown(first)} on ({FIRST_KEY}), expected "
                f"{spec.first} (this KV cache group's first: window and block size)"
            )
        return first, spec.num_tokens, True
    said = [meta.get(key) for key in CHUNK_FIELDS]
    index, start = chunk
    if (
        any(type(x) is not int for x in said[:3])
        or said[:2] != [index, start]
        or not start < said[2] <= spec.num_tokens
        or said[3] is not (said[2] == spec.num_tokens)
    ):
        raise ValueError(
            f"chunk {index} says {shown(said)} ({', '.join(CHUNK_FIELDS)}), expected [{index}, "
            f"{start}, stop, final] with {start} < stop <= {spec.num_tokens} (the prompt's "
            "length), final at that end"
        )
    return start, said[2], said[3]


def _entry_views(
    caches: RankCaches,
    tp_size: int,
    spec: LoadSpec,
    source: HeadSource,
    kv_format,
    span: tuple[int, int, bool] | None = None,
) -> tuple[list, int]:
    """``(views, rows)`` an entry of ``kv_format`` fills for ``source``'s heads, from this side's
    own caches (``tp_size``: this side's), holding prompt positions ``span`` (:func:`entry_span`;
    default: the whole prompt); ValueError if this cache cannot take that format."""
    block_size = caches.block_size
    start, stop, _ = span or (spec.first, spec.num_tokens, True)
    if kv_format == "pages":
        if spec.producer_tp != tp_size:
            raise ValueError(
                f"the producer (TP {spec.producer_tp}) sent whole pages, which hold another "
                f"TP size's heads than this cache's (TP {tp_size}): set \"kv_format\": "
                '"tokens" on the producer'
            )
        if caches.pages is None:
            raise ValueError(
                f"the producer sent whole pages, which this cache (layout {caches.layout}) has "
                'not: set "kv_format": "tokens" on the producer'
            )
        if start % block_size:
            raise ValueError(f"whole pages from position {start}, not a multiple of {block_size}")
        return caches.pages, -(-stop // block_size) * block_size - start
    if kv_format == "tokens":
        if caches.layout in PAGES_ONLY:
            raise ValueError(
                f"the producer sent token rows, which cannot be placed in this cache "
                f'({PAGES_ONLY[caches.layout]}): set "kv_format": "pages" (or "auto") on '
                "the producer"
            )
        return caches.head_views(source.dst), stop - start
    raise ValueError(f"entry's kv_format is {kv_format!r}, expected 'tokens' or 'pages'")


def expected_bytes(caches: RankCaches, tp_size: int, spec: LoadSpec, source: HeadSource) -> int:
    """The most bytes a load of ``source``'s heads of ``spec`` may hold for this rank: the
    packed KV of token rows (``num_tokens`` × the bytes of a row of those heads over every layer)
    or of whole pages (the prompt's blocks × ``block_size`` rows × a page row's bytes), the larger
    of those this cache can take. From this side's caches only, never from the producer; a reply
    announcing more is refused before it is allocated."""
    if isinstance(caches, StateCaches):  # one state row
        return caches.row_bytes
    sizes = [0]
    for kv_format in ("tokens", "pages"):
        try:
            views, rows = _entry_views(caches, tp_size, spec, source, kv_format)
        except ValueError:
            continue
        sizes.append(math.prod(packed_shape(views, rows)) * views[0][0].element_size())
    return max(sizes)


def check_entry(
    caches: RankCaches,
    tp_size: int,
    spec: LoadSpec,
    source: HeadSource,
    meta: dict,
    packed,
    span: tuple[int, int, bool] | None = None,
) -> tuple[str, torch.Tensor]:
    """``(kv_format, packed)`` if a loaded entry (its ``meta`` and ``packed`` KV, holding prompt
    positions ``span``: :func:`entry_span`) fits ``caches`` for ``source``'s heads, else
    ValueError saying what differs (``tp_size``: this side's)."""
    if spec.fingerprint is not None and meta.get("fingerprint") != spec.fingerprint:
        raise ValueError(
            f"the entry's fingerprint {meta.get('fingerprint')!r} is not the hand-off's "
            f"{spec.fingerprint!r}"
        )
    kv_format = meta.get("kv_format")
    if isinstance(caches, StateCaches):
        want = (1, caches.row_bytes)
        if kv_format != "state" or packed is None or tuple(packed.shape) != want:
            got = "nothing" if packed is None else f"{tuple(packed.shape)}"
            raise ValueError(
                f"a state group's entry holds {got} of kv_format {shown(kv_format)}, expected "
                f"{want} uint8 of kv_format 'state'"
            )
        if packed.dtype != torch.uint8:
            raise ValueError(f"a state group's entry holds {packed.dtype}, expected uint8")
        return kv_format, packed
    views, rows = _entry_views(caches, tp_size, spec, source, kv_format, span)
    if kv_format == "pages" and meta.get("page_kind") != caches.page_kind:
        raise ValueError(
            f"the producer sent whole pages of kind {meta.get('page_kind')!r}, this "
            f"cache's pages are {caches.page_kind!r} (layout {caches.layout}): set "
            '"kv_format": "tokens" on the producer to move KV between unlike caches'
        )
    k0 = views[0][0]
    want = packed_shape(views, rows)
    if packed is None or tuple(packed.shape) != want or packed.dtype != k0.dtype:
        got = "nothing" if packed is None else f"{tuple(packed.shape)} {packed.dtype}"
        raise ValueError(f"entry holds {got}, expected {want} {k0.dtype}")
    return kv_format, packed
