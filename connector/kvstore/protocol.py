"""The KV store's requests and replies: frame kinds of the pipe's user range
(:data:`connector.transport.frame.APP_KIND_MIN` up), carried by a :class:`TensorPipe`."""

from __future__ import annotations

import enum

from ..transport.frame import APP_KIND_MIN


class Op(enum.IntEnum):
    """Request and reply kinds of the KV store (frame kind codes)."""

    GET = APP_KIND_MIN  # client → server: key, {"wait_ms"}
    DATA = APP_KIND_MIN + 1  # server → client: key, tensors, entry meta
    MISS = APP_KIND_MIN + 2  # server → client: key, {"reason"}
    ACK = APP_KIND_MIN + 3  # server → client: result of PUT / DISCARD / MATCH in meta
    DISCARD = APP_KIND_MIN + 4  # client → server: key
    PUT = APP_KIND_MIN + 5  # client → server: key, tensors, entry meta
    MATCH = APP_KIND_MIN + 6  # client → server: tensor "token_ids" (int64)


def op_name(kind: int) -> str:
    """``GET``, ... for the store's kinds, the frame kind's name otherwise."""
    try:
        return Op(kind).name
    except ValueError:
        return kind.name if isinstance(kind, enum.Enum) else f"kind {kind}"
