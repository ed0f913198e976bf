"""What the scheduler side tells the workers each step (plain data: vLLM may serialise it).

The facade wraps a step's lists in its ``TritonKVMetadata`` (vLLM's ``KVConnectorMetadata``
type); these are the items. Each names its entry by transfer id and by ``prompt_digest``
(:func:`.handoff.prompt_digest` of the prompt): the producer binds the entry to it, and its KV
server serves or discards the entry only for a request presenting it. No vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Chunk:
    """One chunk of a prompt published while its prefill runs (the overlapped flow): prompt
    positions ``[start, stop)``, ``start`` a block boundary, stored under
    ``chunk_key(transfer_id, index)``; ``final``: the last one (``stop`` is the prompt's length)."""

    index: int
    start: int
    stop: int
    final: bool

    def as_meta(self) -> dict:
        """How the entry's meta carries it: the fields under :data:`CHUNK_FIELDS` (the wire's
        meta is flat)."""
        return dict(zip(CHUNK_FIELDS, (self.index, self.start, self.stop, self.final), strict=True))


#: The entry meta keys of a chunk (:meth:`Chunk.as_meta`).
CHUNK_FIELDS = ("chunk_index", "chunk_start", "chunk_stop", "chunk_final")
#: The entry meta key of the first prompt position a KV cache group's entry holds (absent: 0).
FIRST_KEY = "first_position"


@dataclass(frozen=True)
class GroupPart:
    """One KV cache group's part of a save or load (:mod:`.groups`): the group's index, its
    block ids for the request, and the first prompt position the group moves."""

    group: int
    block_ids: list[int]
    first: int = 0


@dataclass
class SaveSpec:
    """Producer worker: pack prompt positions ``[first, num_tokens)`` of ``block_ids`` as
    ``transfer_id`` (with ``chunk``: only the chunk's positions, as its key), bound to
    ``prompt_digest``. ``groups``: a model of several KV cache groups saves one entry per
    group (each :class:`GroupPart`; ``block_ids`` is group 0's); empty for one group."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_digest: str = field(kw_only=True)
    chunk: Chunk | None = field(default=None, kw_only=True)
    group: int = field(default=0, kw_only=True)
    first: int = field(default=0, kw_only=True)
    groups: list[GroupPart] = field(default_factory=list, kw_only=True)
    debug_fault: str = field(default="", kw_only=True)  # tests only (integrity.FAULTS)

    @property
    def saved_tokens(self) -> int:
        """The prompt positions this save holds: the prompt's, or its chunk's."""
        if self.chunk is None:
            return self.num_tokens - self.first
        return self.chunk.stop - self.chunk.start


@dataclass
class LoadSpec:
    """Consumer worker: load ``transfer_id`` (presenting the hand-off's ``prompt_digest``) and
    write its rows ``[start, start + count)``. ``wait_s`` > 0 (an overlapped hand-off): the
    producer's server may wait that long for the entry to be stored, and the load is async.
    ``chunked``: the producer publishes the prompt in chunks (:class:`Chunk`), loaded one after
    the other, each waiting up to ``wait_s``. ``fingerprint``: the hand-off's, which the entry's
    own must equal (None: not checked). ``groups``: a model of several KV cache groups loads
    one entry per group (each :class:`GroupPart`, written from its ``first`` position on;
    ``block_ids`` is group 0's); empty for one group. ``group`` and ``first``: the one group
    a per-group part of such a load writes (:func:`group_loads`)."""

    req_id: str
    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    start: int
    count: int
    num_tokens: int
    producer_tp: int = 1  # the producer's TP size: which of its ranks hold this rank's heads
    corrupt: bool = False
    prompt_digest: str = field(kw_only=True)
    fingerprint: str | None = field(default=None, kw_only=True)
    wait_s: float = field(default=0.0, kw_only=True)
    chunked: bool = field(default=False, kw_only=True)
    group: int = field(default=0, kw_only=True)
    first: int = field(default=0, kw_only=True)
    groups: list[GroupPart] = field(default_factory=list, kw_only=True)
    debug_fault: str = field(default="", kw_only=True)  # tests only (integrity.FAULTS)


def group_saves(spec: SaveSpec) -> list[SaveSpec]:
    """``spec`` as one save per KV cache group (itself when it names none)."""
    parts = spec.groups or [GroupPart(spec.group, spec.block_ids, spec.first)]
    return [
        replace(spec, group=p.group, block_ids=p.block_ids, first=p.first, groups=[]) for p in parts
    ]


def group_loads(spec: LoadSpec) -> list[LoadSpec]:
    """``spec`` as one load per KV cache group (itself when it names none): each writes the
    claimed positions ``[start, start + count)`` from its group's ``first`` on."""
    if not spec.groups:
        return [spec]
    stop = spec.start + spec.count
    loads = []
    for p in spec.groups:
        start = min(max(spec.start, p.first), stop)
        loads.append(
            replace(
                spec,
                group=p.group,
                block_ids=p.block_ids,
                first=p.first,
                start=start,
                count=stop - start,
                groups=[],
            )
        )
    return loads


@dataclass
class DiscardSpec:
    """Consumer worker: tell ``host:port + tp_rank`` to discard ``transfer_id`` (presenting the
    hand-off's ``prompt_digest``), which no request here will load."""

    transfer_id: str
    host: str
    port: int
    producer_tp: int = 1
    prompt_digest: str = field(kw_only=True)
