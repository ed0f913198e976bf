"""The end-to-end tests' comparison of bfloat16 answers (support.e2e), without servers: a
difference passes only where the reference's two likeliest tokens nearly tied."""

from __future__ import annotations

from support.e2e import NEAR_TIE, confident_difference


def _choice(text: str, margins: list[float]) -> dict:
    words = text.split()
    tops = [
        {w: -0.5, f"other{i}": -0.5 - m}
        for i, (w, m) in enumerate(zip(words, margins, strict=True))
    ]
    return {"text": text, "logprobs": {"top_logprobs": tops}}


def test_only_a_near_tie_may_differ():
    ref = _choice(" a b c d", [2.0, NEAR_TIE / 2, 3.0, 3.0])
    assert confident_difference(" a b c d", ref) is None
    assert confident_difference(" a x y z", ref) is None  # first differs at the near tie
    assert "token 0" in confident_difference(" x b c d", ref)  # the reference was sure there
    assert "token 2" in confident_difference(" a b x d", ref)
    assert confident_difference(" a b", ref) is not None  # shorter: never the same answer
