"""Shared plumbing for the kernel modules: backend choice, input checks, sequence addressing.

Sequence addressing (used by every op)
    The flat batch holds ``num_tokens`` tokens; sequence ``i`` owns flat tokens
    ``query_start_loc[i] : query_start_loc[i + 1]`` (never ``seq_lens``: a decoding sequence of
    length 17 owns one flat token). Packing selects sequences ``seq_ids`` (in output order) and lays
    their tokens back to back: selected sequence ``j`` owns packed rows
    ``cu_seqlens[j] : cu_seqlens[j + 1]``, and packed row ``t`` of it comes from flat token
    ``src_start[j] + (t - cu_seqlens[j])``. Kernels find ``j`` for each row by a binary search over
    ``cu_seqlens``, so the index preparation is a few tiny device ops and no host synchronisation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

_INT_DTYPES = (torch.int32, torch.int64)
_BACKENDS = ("auto", "torch", "triton")
# Integer dtype of each width: copies move integer views, so every float format is copied bit-exactly.
# 16 bytes (CPU twins only, never a kernel): complex128, moved by plain loads and stores, whose bits
# are never interpreted.
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device: torch.device) -> bool:
    """Pick the backend for tensors on ``device`` from ``TRITONKV_BACKEND`` (auto|torch|triton).

    ``auto`` (default): Triton kernels for CUDA tensors, the torch twin otherwise. ``triton`` forces
    the kernels (on CPU tensors only valid with ``TRITON_INTERPRET=1``); ``torch`` forces the twin.
    """
    choice = os.environ.get("TRITONKV_BACKEND", "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        raise ValueError(f"TRITONKV_BACKEND: expected one of {_BACKENDS}, got {choice!r}")
    if choice == "torch":
        return False
    if choice == "triton":
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                "TRITONKV_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 set before "
                "tritonkv is imported"
            )
        return True
    return device.type == "cuda"


def checks_enabled(*tensors: object) -> bool:
    """Value checks (offsets, slots) run when they cost no device sync, or if ``TRITONKV_CHECK=1``."""
    if os.environ.get("TRITONKV_CHECK", "0") not in ("", "0"):
        return True
    return all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in tensors)


def autotune_configs(**fixed) -> list[triton.Config]:
    """Launch configs for the copy kernels: tokens per program × warps.

    One config (16 tokens, 4 warps) when interpreting, or when ``TRITONKV_AUTOTUNE=0`` is set
    before tritonkv is imported (no tuning pauses, e.g. for correctness tests); otherwise 13,
    among which Triton's autotuner picks per key at the key's first launch. One pipeline stage:
    the kernels have no loop whose loads could be pipelined.

    Args:
        fixed: extra constexprs every config carries (none today; kept for kernels that tile a
            second dimension).
    """
    if interpreting() or os.environ.get("TRITONKV_AUTOTUNE", "1").strip() == "0":
        return [triton.Config({"BLOCK_T": 16, **fixed}, num_warps=4)]
    return [
        triton.Config({"BLOCK_T": block_t, **fixed}, num_warps=warps, num_stages=1)
        for block_t in (4, 8, 16, 32, 64)
        for warps in (2, 4, 8)
        if not (block_t >= 32 and warps == 2)
    ]


def autotune_bench(fn, quantiles=None):
    """How the autotuner times a config: 5 ms warm-up, 25 ms of runs (Triton's default, 25 + 100
    ms, makes the first launch of each key pause for seconds on a serving GPU)."""
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


class TunedLaunch:
    """Launches of an autotuned kernel that skip the autotuner's per-call work once a key is tuned.

    Triton's autotuner rebuilds its key from every argument on every launch (a dict of all of
    them and the dtype of each tensor): on an H200 host that was about a tenth of a small call's
    host time. The first launch of each ``key`` goes through the autotuner, which times the
    configs and picks one; later launches of that key pass the picked config to the JIT function
    directly, as the autotuner itself would. ``key`` must hold everything the autotuner's key
    holds (its ``key`` arguments and the dtypes of the tensor arguments).
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.configs: dict[tuple, triton.Config] = {}

    def __call__(self, key: tuple, grid, *args, **kwargs) -> None:
        config = self.configs.get(key)
        if config is None:
            self.kernel[grid](*args, **kwargs)
            self.configs[key] = self.kernel.best_config
        else:
            self.kernel.best_config = config  # what the autotuner reports for the last launch
            self.kernel.fn[grid](*args, **kwargs, **config.all_kwargs())


def check_index(name: str, t: torch.Tensor | None, *, allow_none: bool = True) -> None:
    """Require a 1-D int32/int64 tensor (or None when allowed)."""
    if t is None:
        if allow_none:
            return
        raise TypeError(f"{name}: expected a 1-D int32/int64 tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D int32/int64 tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")


@dataclass
class SeqIndex:
    """Where each selected sequence's rows come from and go to (all on the data device, int64).

    Attributes:
        cu_seqlens: ``[num_sel + 1]`` packed-row offsets of the selected sequences.
        src_start: ``[num_sel]`` flat token index of each selected sequence's first packed row.
        num_sel: number of selected sequences.
    """

    cu_seqlens: torch.Tensor
    src_start: torch.Tensor
    num_sel: int

    @property
    def search_steps(self) -> int:
        """Binary-search steps that find a row's sequence among ``num_sel`` (0 for one sequence)."""
        return max(self.num_sel - 1, 0).bit_length()

    def to(self, device: torch.device) -> SeqIndex:
        """This index on ``device``, moved in one copy."""
        both = torch.cat([self.cu_seqlens, self.src_start]).to(device, non_blocking=True)
        num = self.cu_seqlens.numel()
        return SeqIndex(both[:num], both[num:], self.num_sel)

    def total(self) -> int:
        """Packed rows in all (reads ``cu_seqlens[-1]``: a host sync on CUDA)."""
        return int(self.cu_seqlens[-1])

    def runs(self, max_runs: int) -> list[tuple[int, int, int]] | None:
        """``(first flat token, first packed row, rows)`` of each stretch of consecutive rows.

        Selected sequences that follow each other in both the flat batch and the packed tensor
        form one stretch. None when there are more than ``max_runs`` stretches. Reads the index
        on the host (the CPU twins' shortcut: a few slice copies instead of a row gather).
        """
        if self.num_sel > 64 * max_runs:  # surely too many: don't pay for the host copies
            return None
        cu_seqlens, src_start = self.cu_seqlens.tolist(), self.src_start.tolist()
        runs: list[list[int]] = []
        for j, src in enumerate(src_start):
            rows = cu_seqlens[j + 1] - cu_seqlens[j]
            if not rows:
                continue
            if runs and runs[-1][0] + runs[-1][2] == src:
                runs[-1][2] += rows
            else:
                if len(runs) == max_runs:
                    return None
                runs.append([src, cu_seqlens[j], rows])
        return [(src, row, rows) for src, row, rows in runs]

    def flat_tokens(self, num_rows: int) -> torch.Tensor:
        """``[num_rows]`` int64 flat token index of every packed row (the torch twins' addressing)."""
        if self.cu_seqlens.device.type == "cpu" and num_rows == self.total():
            cu_seqlens, src_start = self.cu_seqlens.numpy(), self.src_start.numpy()
            shift = np.repeat(src_start - cu_seqlens[:-1], np.diff(cu_seqlens))
            return torch.from_numpy(shift + np.arange(num_rows))
        rows = torch.arange(num_rows, device=self.cu_seqlens.device)
        seq = torch.searchsorted(self.cu_seqlens[1:], rows, right=True)
        seq = seq.clamp_(max=max(self.num_sel - 1, 0))
        return self.src_start[seq] + (rows - self.cu_seqlens[seq])


def seq_index(
    query_start_loc: torch.Tensor | None,
    seq_ids: torch.Tensor | Sequence[int] | None,
    num_tokens: int,
    device: torch.device,
    *,
    last_only: bool = False,
) -> SeqIndex:
    """Validate the addressing inputs and build the :class:`SeqIndex` for them.

    Args:
        query_start_loc: ``[num_seqs + 1]`` int32/int64 flat-batch offsets, or None (one sequence
            holding all ``num_tokens`` tokens).
        seq_ids: selected sequences in output order (tensor or list of ints), or None for all.
        num_tokens: tokens in the flat batch (rows of ``slot_mapping`` / ``hidden_states``).
        device: where the kernels run; index tensors are moved there.
        last_only: select only each sequence's last query token.
    """
    check_index("query_start_loc", query_start_loc)
    if query_start_loc is None:
        query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int64)
    if query_start_loc.numel() < 1:
        raise ValueError("query_start_loc: expected [num_seqs + 1] offsets, got an empty tensor")
    if seq_ids is not None and not isinstance(seq_ids, torch.Tensor):
        # A Sequence, not any iterable: an iterator would be used up by this very check.
        if not isinstance(seq_ids, Sequence) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in seq_ids
        ):
            raise TypeError(
                "seq_ids: expected a list of ints or a 1-D int32/int64 tensor, got "
                f"{type(seq_ids).__name__} {seq_ids!r:.80}"
            )
        seq_ids = torch.tensor(list(seq_ids), dtype=torch.int64)
    check_index("seq_ids", seq_ids)
    on_host = [t.device.type == "cpu" for t in (query_start_loc, seq_ids) if t is not None]
    if all(on_host):
        index = _host_seq_index(query_start_loc, seq_ids, num_tokens, last_only)
        return index if device.type == "cpu" else index.to(device)
    if checks_enabled(query_start_loc, seq_ids):
        _check_offsets(*_host_offsets(query_start_loc, seq_ids), num_tokens, last_only)
    if device.type == "cpu":  # CPU data, offsets on a GPU: address on the host
        seq_ids = None if seq_ids is None else seq_ids.cpu()
        return _host_seq_index(query_start_loc.cpu(), seq_ids, num_tokens, last_only)
    return _device_seq_index(query_start_loc, seq_ids, device, last_only)


_INDEX_BLOCK = 1024  # selected sequences per step of the index kernel's loop


@triton.jit(do_not_specialize=["num_sel"])
def _seq_index_kernel(
    query_start_loc_ptr,  # [num_seqs + 1] int32/int64
    seq_ids_ptr,  # [num_sel] int32/int64 (read only with HAS_IDS)
    out_ptr,  # [2 * num_sel + 1] int64: cu_seqlens [num_sel + 1], then src_start [num_sel]
    num_sel,
    HAS_IDS: tl.constexpr,
    LAST_ONLY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: the selected sequences' packed-row offsets and first flat tokens."""
    tl.store(out_ptr, tl.full([], 0, tl.int64))
    done = tl.full([], 0, tl.int64)  # packed rows of the sequences before this step
    for first in range(0, num_sel, BLOCK):
        j = first + tl.arange(0, BLOCK).to(tl.int64)
        ok = j < num_sel
        if HAS_IDS:
            seq = tl.load(seq_ids_ptr + j, mask=ok, other=0).to(tl.int64)
        else:
            seq = j
        end = tl.load(query_start_loc_ptr + seq + 1, mask=ok, other=0).to(tl.int64)
        if LAST_ONLY:
            start = end - 1
            rows = ok.to(tl.int64)
        else:
            start = tl.load(query_start_loc_ptr + seq, mask=ok, other=0).to(tl.int64)
            rows = end - start
        tl.store(out_ptr + 1 + j, done + tl.cumsum(rows, 0), mask=ok)
        tl.store(out_ptr + 1 + num_sel + j, start, mask=ok)
        done += tl.sum(rows, 0)


def _device_seq_index(query_start_loc, seq_ids, device: torch.device, last_only: bool) -> SeqIndex:
    """:func:`seq_index` for index tensors on the GPU: one launch of a one-program kernel and no
    host sync (each torch op of the same work costs the host more than this launch does).

    Every tensor of the result is contiguous: the kernels read them with stride 1.
    """
    qsl = query_start_loc.to(device, non_blocking=True).contiguous()
    num_sel = qsl.numel() - 1 if seq_ids is None else seq_ids.numel()
    ids = qsl if seq_ids is None else seq_ids.to(device, non_blocking=True).contiguous()
    if num_sel == 0:  # (an empty tensor has no address to pass)
        out = torch.zeros(1, dtype=torch.int64, device=device)
        return SeqIndex(out, out[1:], 0)
    out = torch.empty(2 * num_sel + 1, dtype=torch.int64, device=device)
    _seq_index_kernel[(1,)](
        qsl,
        ids,
        out,
        num_sel,
        HAS_IDS=seq_ids is not None,
        LAST_ONLY=last_only,
        BLOCK=_INDEX_BLOCK,
    )
    return SeqIndex(out[: num_sel + 1], out[num_sel + 1 :], num_sel)


def _host_offsets(query_start_loc, seq_ids) -> tuple[np.ndarray, np.ndarray]:
    """Host int64 copies of the offsets and of the selected sequences (all if ``seq_ids`` is None)."""
    qsl = query_start_loc.cpu().numpy().astype(np.int64, copy=False)
    if seq_ids is None:
        return qsl, np.arange(qsl.size - 1)
    return qsl, seq_ids.cpu().numpy().astype(np.int64, copy=False)


def _check_offsets(qsl: np.ndarray, chosen: np.ndarray, num_tokens: int, last_only: bool) -> None:
    """Offsets non-negative, non-decreasing, within ``num_tokens``; ``chosen`` among them."""
    num_seqs = qsl.size - 1
    if qsl[0] < 0 or bool((qsl[1:] < qsl[:-1]).any()):
        raise ValueError(
            f"query_start_loc: expected non-negative, non-decreasing offsets, got {qsl.tolist()}"
        )
    if qsl[-1] > num_tokens:
        raise ValueError(
            f"query_start_loc: last offset {int(qsl[-1])} is past num_tokens={num_tokens}"
        )
    if chosen.size and (chosen.min() < 0 or chosen.max() >= num_seqs):
        raise ValueError(f"seq_ids: expected values in [0, {num_seqs}), got {chosen.tolist()}")
    if last_only:
        lens = qsl[chosen + 1] - qsl[chosen]
        if bool((lens <= 0).any()):
            raise ValueError(
                "last_only: every selected sequence needs at least one query token, got "
                f"lengths {lens.tolist()} for seq_ids {chosen.tolist()}"
            )


def _host_seq_index(query_start_loc, seq_ids, num_tokens: int, last_only: bool) -> SeqIndex:
    """:func:`seq_index` for CPU tensors, with NumPy (tiny arrays: a fraction of torch's cost)."""
    qsl, chosen = _host_offsets(query_start_loc, seq_ids)
    _check_offsets(qsl, chosen, num_tokens, last_only)
    starts, ends = qsl[chosen], qsl[chosen + 1]
    cu_seqlens = np.zeros(chosen.size + 1, dtype=np.int64)
    if last_only:
        cu_seqlens[1:] = np.arange(1, chosen.size + 1)
        starts = ends - 1
    else:
        np.cumsum(ends - starts, out=cu_seqlens[1:])
    return SeqIndex(torch.from_numpy(cu_seqlens), torch.from_numpy(starts), int(chosen.size))


def widest_int_view(tensors: Sequence[torch.Tensor], row_bytes: int, widest: int = 8) -> int:
    """Largest access width in bytes (16, 8, 4, 2 or 1; at most ``widest``) that every tensor's last
    dim allows.

    A width wider than the element size qualifies when each tensor's last dim has stride 1 and the
    width divides ``row_bytes`` (the last dim's size in bytes), every other byte stride and every
    tensor's address, so integer views of that width address exactly the same bytes. The element
    size itself always qualifies.
    """
    itemsize = tensors[0].element_size()
    patterns = {(t.stride(), t.element_size()) for t in tensors}  # few: every layer is alike
    addresses = [t.data_ptr() for t in tensors]
    for w in (16, 8, 4, 2):
        if w > widest or w <= itemsize or row_bytes % w:
            continue
        if all(a % w == 0 for a in addresses) and all(
            strides[-1] == 1 and all(s * size % w == 0 for s in strides[:-1])
            for strides, size in patterns
        ):
            return w
    return itemsize


def as_int(t: torch.Tensor, width: int) -> torch.Tensor:
    """View ``t`` as integers of ``width`` bytes (same bytes, last dim rescaled)."""
    if width < t.element_size():
        raise ValueError(f"as_int: width {width} below the element size {t.element_size()}")
    return t.view(_INT_OF_SIZE[width])


@triton.jit
def _flat_token(rows, row_ok, cu_seqlens_ptr, src_start_ptr, num_sel, search_steps):
    """Flat-batch token index of each packed row (see ``_common``'s addressing note)."""
    # Binary search, one bit at a time: the largest seq with cu_seqlens[seq] <= row.
    seq = tl.zeros_like(rows)
    for i in range(search_steps):
        cand = seq + (1 << (search_steps - 1 - i))
        ok = row_ok & (cand < num_sel)
        start = tl.load(cu_seqlens_ptr + cand, mask=ok, other=0)
        seq = tl.where(ok & (start <= rows), cand, seq)
    first_row = tl.load(cu_seqlens_ptr + seq, mask=row_ok, other=0)
    src_start = tl.load(src_start_ptr + seq, mask=row_ok, other=0)
    return src_start + (rows - first_row)
