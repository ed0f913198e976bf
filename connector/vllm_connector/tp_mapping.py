"""Which producer ranks a consumer rank takes its KV heads from, when the two sides run different
tensor-parallel sizes.

vLLM gives TP rank ``r`` of ``tp`` ranks the KV heads ``[r * H / tp, (r + 1) * H / tp)`` of a
model's ``H`` when ``H >= tp`` (``H`` divisible by ``tp``); when ``tp > H`` each head is replicated
on ``tp / H`` consecutive ranks and rank ``r`` holds head ``r // (tp / H)``. A consumer rank
needs exactly its own heads; each of them lives on one producer rank (or, replicated, on several:
one is picked, spreading consumer ranks over the replicas). Heads from one producer rank that are
consecutive on both sides form one :class:`HeadSource`: one load of that head slice, unpacked into
that head range. MLA's latent is replicated on every rank: one source, any producer rank.

Example: ``H = 8``, producer TP 2, consumer TP 4. Consumer rank 3 holds heads 6 and 7, which are
producer rank 1's local heads 2 and 3: one source ``HeadSource(1, (2, 4), (0, 2))``, and the load
carries 2 of producer rank 1's 4 heads. Consumer TP 1 instead takes ``(0, (0, 4), (0, 4))`` and
``(1, (0, 4), (4, 8))``: two loads, one per producer rank, each written into its half.

No vLLM import: the connector passes the sizes in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSource:
    """One load: heads ``src[0]:src[1]`` of producer rank ``rank``'s local heads, written into
    this consumer rank's local heads ``dst[0]:dst[1]`` (equally many)."""

    rank: int
    src: tuple[int, int]
    dst: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.src[1] - self.src[0]


def _check_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def _check_heads(num_kv_heads: int, tp: int, side: str) -> None:
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"{side} TP {tp} with {num_kv_heads} KV heads: expected one to divide the other "
            "(vLLM's rule for placing KV heads on ranks)"
        )


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV heads TP rank ``rank`` of ``tp_size`` holds (one, replicated, when
    ``tp_size > num_kv_heads``)."""
    _check_size("num_kv_heads", num_kv_heads)
    _check_size("tp_size", tp_size)
    _check_heads(num_kv_heads, tp_size, "a")
    if not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise ValueError(f"rank: expected 0 <= rank < {tp_size}, got {rank!r}")
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def plan_heads(
    num_kv_heads: int, producer_tp: int, consumer_tp: int, consumer_rank: int, *, mla: bool = False
) -> tuple[HeadSource, ...]:
    """The loads consumer rank ``consumer_rank`` makes (see the module docstring).

    Raises:
        ValueError: sizes that are not positive ints, a rank out of range, or a pairing vLLM's
            head placement cannot give (``producer_tp`` and ``consumer_tp`` must divide one
            another, and each must divide or be a multiple of ``num_kv_heads``), naming it.
    """
    for name, value in (("producer_tp", producer_tp), ("consumer_tp", consumer_tp)):
        _check_size(name, value)
    if producer_tp % consumer_tp and consumer_tp % producer_tp:
        raise ValueError(
            f"producer TP {producer_tp} and consumer TP {consumer_tp}: expected one to divide "
            "the other"
        )
    if not isinstance(consumer_rank, int) or not 0 <= consumer_rank < consumer_tp:
        raise ValueError(
            f"consumer_rank: expected 0 <= rank < {consumer_tp}, got {consumer_rank!r}"
        )
    if mla:  # the latent is on every rank
        return (HeadSource(consumer_rank % producer_tp, (0, 1), (0, 1)),)
    _check_size("num_kv_heads", num_kv_heads)
    _check_heads(num_kv_heads, producer_tp, "producer")
    _check_heads(num_kv_heads, consumer_tp, "consumer")
    wanted = rank_heads(num_kv_heads, consumer_tp, consumer_rank)
    sources: list[HeadSource] = []
    for dst, head in enumerate(wanted):
        if num_kv_heads >= producer_tp:
            per = num_kv_heads // producer_tp
            rank, src = head // per, head % per
        else:  # replicated on `replicas` producer ranks: spread consumer ranks over them
            replicas = producer_tp // num_kv_heads
            rank, src = head * replicas + consumer_rank % replicas, 0
        last = sources[-1] if sources else None
        if last and last.rank == rank and last.src[1] == src and last.dst[1] == dst:
            sources[-1] = HeadSource(rank, (last.src[0], src + 1), (last.dst[0], dst + 1))
        else:
            sources.append(HeadSource(rank, (src, src + 1), (dst, dst + 1)))
    return tuple(sources)
