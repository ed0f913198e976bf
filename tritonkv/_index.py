"""Sequence addressing, used by every op: where each selected sequence's rows come from and go to.

The flat batch holds ``num_tokens`` tokens; sequence ``i`` owns flat tokens
``query_start_loc[i] : query_start_loc[i + 1]`` (never ``seq_lens``: a decoding sequence of length
17 owns one flat token). Packing selects sequences ``seq_ids`` (in output order) and lays their
tokens back to back: selected sequence ``j`` owns packed rows ``cu_seqlens[j] : cu_seqlens[j + 1]``,
and packed row ``t`` of it comes from flat token ``src_start[j] + (t - cu_seqlens[j])``.

Example: ``query_start_loc = [0, 18, 19, 20]`` (an 18-token prefill, two decodes) and
``seq_ids = [2, 0]`` give ``cu_seqlens = [0, 1, 19]`` and ``src_start = [19, 0]``: packed row 5
is flat token ``0 + (5 - 1) = 4``.

:func:`seq_index` builds the :class:`SeqIndex` (NumPy on the host, or one launch of
``_seq_index_kernel`` for offsets on the GPU: no host sync); kernels find ``j`` for each row with
:func:`flat_token`, a binary search over ``cu_seqlens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from ._checks import check_index, checks_enabled
from ._dispatch import interpreter_lock
from ._launch import DIRECT, DirectLaunch, current_device, int_spec, pointer_spec


class SeqIndex:
    """Where each selected sequence's rows come from and go to (all on the data device, int64).

    Made of its two tensors, or (the index kernel's output, :meth:`in_buffer`) of one buffer that
    holds ``cu_seqlens`` then ``src_start``: their slices are then made only when asked for, as
    the copy kernels need their addresses alone (:meth:`addresses`; each slice costs the host a
    torch op).

    Attributes:
        cu_seqlens: ``[num_sel + 1]`` packed-row offsets of the selected sequences.
        src_start: ``[num_sel]`` flat token index of each selected sequence's first packed row.
        num_sel: number of selected sequences.
    """

    def __init__(self, cu_seqlens: torch.Tensor, src_start: torch.Tensor, num_sel: int) -> None:
        self._cu_seqlens, self._src_start, self.num_sel = cu_seqlens, src_start, num_sel
        self._buffer: torch.Tensor | None = None

    @classmethod
    def in_buffer(cls, buffer: torch.Tensor, num_sel: int) -> SeqIndex:
        """The index held by ``buffer``: ``[2 * num_sel + 1]`` int64, contiguous, ``cu_seqlens``
        then ``src_start``."""
        index = cls(None, None, num_sel)
        index._buffer = buffer
        return index

    @property
    def cu_seqlens(self) -> torch.Tensor:
        if self._cu_seqlens is None:
            self._cu_seqlens = self._buffer[: self.num_sel + 1]
        return self._cu_seqlens

    @property
    def src_start(self) -> torch.Tensor:
        if self._src_start is None:
            self._src_start = self._buffer[self.num_sel + 1 :]
        return self._src_start

    def addresses(self) -> tuple[int, int]:
        """Device addresses of ``cu_seqlens`` and ``src_start`` (making no tensor)."""
        if self._buffer is not None:
            first = self._buffer.data_ptr()
            return first, first + (self.num_sel + 1) * self._buffer.element_size()
        return self._cu_seqlens.data_ptr(), self._src_start.data_ptr()

    @property
    def search_steps(self) -> int:
        """Binary-search steps that find a row's sequence among ``num_sel`` (0 for one sequence)."""
        return max(self.num_sel - 1, 0).bit_length()

    def to(self, device: torch.device) -> SeqIndex:
        """This index on ``device``, moved in one copy."""
        both = to_device_async(torch.cat([self.cu_seqlens, self.src_start]), device)
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

    Raises:
        TypeError: ``query_start_loc`` / ``seq_ids`` of the wrong type or dtype.
        ValueError: empty, decreasing or out-of-range offsets; ``seq_ids`` out of range; with
            ``last_only``, a selected sequence without query tokens. Values are checked when the
            offsets are on the host, or with ``TRITONKV_CHECK=1``.
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
        index = host_seq_index(query_start_loc, seq_ids, num_tokens, last_only)
        return index if device.type == "cpu" else index.to(device)
    if checks_enabled(query_start_loc, seq_ids):
        _check_offsets(*_host_offsets(query_start_loc, seq_ids), num_tokens, last_only)
    if device.type == "cpu":  # CPU data, offsets on a GPU: address on the host
        seq_ids = None if seq_ids is None else seq_ids.cpu()
        return host_seq_index(query_start_loc.cpu(), seq_ids, num_tokens, last_only)
    return device_seq_index(query_start_loc, seq_ids, device, last_only)


INDEX_BLOCK = 1024  # selected sequences per step of the index kernel's loop


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


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` and contiguous: ``t`` itself when it already is (no torch op)."""
    if t.device == device and t.is_contiguous():
        return t
    return to_device_async(t, device).contiguous()


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` copied to ``device`` without the host waiting: a host tensor goes through pinned
    memory (a copy from pageable memory to a CUDA device first waits for its stream to drain)."""
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        t = t.contiguous().pin_memory()
    return t.to(device, non_blocking=True)


# The index kernel's direct launches (:mod:`tritonkv._launch`), by what Triton specialises on.
_INDEX_LAUNCHES: dict[tuple, DirectLaunch] = {}
_INDEX_VARYING = ("query_start_loc_ptr", "seq_ids_ptr", "out_ptr", "num_sel")


def device_seq_index(query_start_loc, seq_ids, device: torch.device, last_only: bool) -> SeqIndex:
    """:func:`seq_index` for index tensors on the GPU: one launch of a one-program kernel and no
    host sync (each torch op of the same work costs the host more than this launch does).

    Every tensor of the result is contiguous: the kernels read them with stride 1.
    """
    qsl = on_device(query_start_loc, device)
    num_sel = qsl.numel() - 1 if seq_ids is None else seq_ids.numel()
    ids = qsl if seq_ids is None else on_device(seq_ids, device)
    if num_sel == 0:  # (an empty tensor has no address to pass)
        out = torch.zeros(1, dtype=torch.int64, device=device)
        return SeqIndex(out, out[1:], 0)
    out = torch.empty(2 * num_sel + 1, dtype=torch.int64, device=device)
    values = (qsl, ids, out, num_sel)
    device_index = current_device() if DIRECT else None
    spec = (qsl.dtype, ids.dtype, seq_ids is not None, last_only, device_index, int_spec(num_sel))
    spec += (pointer_spec(qsl.data_ptr()), pointer_spec(ids.data_ptr()))
    spec += (pointer_spec(out.data_ptr()),)
    direct = _INDEX_LAUNCHES.get(spec)
    if direct is not None:
        direct((1, 1, 1), values, device_index)
    else:
        kwargs = dict(zip(_INDEX_VARYING, values, strict=True))
        kwargs |= {"HAS_IDS": seq_ids is not None, "LAST_ONLY": last_only, "BLOCK": INDEX_BLOCK}
        with interpreter_lock():
            compiled = _seq_index_kernel[(1,)](**kwargs)
        direct = DirectLaunch.make(compiled, _seq_index_kernel, kwargs, _INDEX_VARYING)
        if direct is not None:
            _INDEX_LAUNCHES[spec] = direct
    return SeqIndex.in_buffer(out, num_sel)


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


def host_seq_index(query_start_loc, seq_ids, num_tokens: int, last_only: bool) -> SeqIndex:
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


@triton.jit
def flat_token(
    rows,  # [BLOCK_T] int64 packed rows
    row_ok,  # [BLOCK_T] whether each row exists (< num_rows)
    cu_seqlens_ptr,  # [num_sel + 1] int64
    src_start_ptr,  # [num_sel] int64
    num_sel,
    search_steps,
):
    """``[BLOCK_T]`` int64 flat-batch token of each packed row (see the module docstring)."""
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
