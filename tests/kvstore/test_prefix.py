"""The longest-prefix lookup: chained block hashes, the index, and KVBuffer.match_prefix."""

import pytest
import torch

from connector.kvstore import MAX_PREFIX_TOKENS, KVBuffer, block_hashes
from connector.kvstore.prefix import PrefixIndex


def _t(nbytes: int) -> dict:
    return {"x": torch.zeros(nbytes, dtype=torch.uint8)}


@pytest.mark.timeout(30)
def test_match_prefix_longest_block_prefix():
    buf = KVBuffer(1 << 20, block_size=4)
    a = list(range(12))  # 3 blocks
    b = [*range(8), 100, 101, 102, 103, 7]  # shares 2 blocks with a, 1 own, 1 partial token
    buf.put("A", _t(4), token_ids=a)
    buf.put("B", _t(4), token_ids=torch.tensor(b))
    assert buf.match_prefix([*a, 5, 5]) == (12, "A")
    assert buf.match_prefix(b) == (12, "B")
    assert buf.match_prefix(list(range(6))) == (4, "B")  # most recent entry holding the prefix
    assert buf.match_prefix([9, 9, 9, 9, 1]) == (0, None)
    assert buf.match_prefix([0, 1, 2]) == (0, None)  # no full block
    buf.discard("B")
    assert buf.match_prefix(b) == (8, "A")
    assert buf.match_prefix(list(range(6))) == (4, "A")
    s = buf.stats()
    assert s["prefix_hits"] == 5 and s["prefix_misses"] == 2


@pytest.mark.timeout(60)
def test_match_prefix_caps_tokens_and_hashes_tensors_without_lists(monkeypatch):
    """Token ids used to go through tolist(), several times their size in memory: at most
    MAX_PREFIX_TOKENS are taken, and a tensor is hashed in place."""
    buf = KVBuffer(1 << 20, block_size=4)
    buf.put("A", _t(4), token_ids=torch.arange(12))
    too_many = torch.zeros(MAX_PREFIX_TOKENS + 1, dtype=torch.int64)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("tolist() called"))
        assert buf.match_prefix(torch.arange(14)) == (12, "A")
        with pytest.raises(ValueError, match=rf"at most {MAX_PREFIX_TOKENS} tokens .*got "):
            buf.match_prefix(too_many)
        with pytest.raises(ValueError, match=rf"at most {MAX_PREFIX_TOKENS} tokens"):
            buf.put("B", _t(4), token_ids=too_many)
    assert "B" not in buf


def test_block_hashes_chain_depends_on_whole_prefix():
    h1 = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    h2 = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(h1) == 2 and h1[0] != h2[0] and h1[1] != h2[1]  # same 2nd block, other prefix
    assert block_hashes([1, 2, 3, 4, 5], 4) == h1[:1]


def test_block_hashes_refuse_what_is_not_token_ids():
    with pytest.raises(TypeError, match=r"expected a 1-D integer tensor, got torch.float32"):
        block_hashes(torch.zeros(8), 4)
    with pytest.raises(TypeError, match="expected a sequence of ints, got str"):
        block_hashes("abcd", 4)
    with pytest.raises(TypeError, match="expected ints that fit in int64"):
        block_hashes([1 << 70, 0, 0, 0], 4)


def test_prefix_index_forgets_removed_keys():
    index = PrefixIndex(block_size=2)
    index.add("a", index.hashes([1, 2, 3, 4]))
    index.add("b", index.hashes([1, 2, 9, 9]))
    index.add("none", [])  # nothing to index
    assert index.longest(index.hashes([1, 2, 3, 4, 5])) == (4, "a")
    assert index.longest(index.hashes([1, 2])) == (2, "b")  # the most recent of the two
    index.remove("b")
    index.remove("never-added")
    assert index.longest(index.hashes([1, 2])) == (2, "a")
    index.remove("a")
    assert index.longest(index.hashes([1, 2, 3, 4])) == (0, None)
    with pytest.raises(ValueError, match="block_size: expected a positive int, got 0"):
        PrefixIndex(0)
