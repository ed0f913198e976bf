"""The consumer's KV client: loads entries from a :class:`~connector.kvstore.server.KVServer`.

One request at a time per client (thread-safe, serialised), one pipe per client, connected
lazily and again after a broken connection. Deadlines: ``timeout_s`` (30 s) per request,
``connect_timeout_s`` (10 s).
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time

import torch

from tritonkv import umac

from ..transport import (
    EntryTag,
    Kind,
    Message,
    PipeClosedError,
    PipeOptions,
    ProtocolError,
    RemoteError,
    TensorPipe,
    TransferError,
    TransferTimeout,
    auth,
    check_timeout,
    connect_pipe,
    default_transport,
)
from .errors import ClientBusyError, KeyMissError
from .protocol import DIGEST, EXISTED, REASON, WAIT_MS, Op, Part, check_key, op_name

__all__ = ["KVClient"]

_COUNTERS = ("requests", "hits", "misses", "timeouts", "errors", "connects", "bytes_received")


class KVClient:
    """Consumer side: loads entries from a :class:`~connector.kvstore.server.KVServer`.

    Args:
        host, port: the server.
        device: where tensors land (default ``"cpu"``).
        transport: ``"nccl"`` for a CUDA device, else ``"gloo"`` by default; ``"socket"`` for
            inline TCP.
        timeout_s: default deadline per request (30 s).
        connect_timeout_s: deadline of a connection's handshake (10 s).
        secret: the server's shared secret (:mod:`connector.transport.auth`).
        options: the pipe's :class:`~connector.transport.options.PipeOptions`.

    Connects lazily and reconnects after a broken connection (every timeout or transport error
    closes the connection, so a late reply can never answer the wrong request).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        device: str | torch.device = "cpu",
        transport: str | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        secret: bytes | str | None = None,
        options: PipeOptions | None = None,
    ):
        self.secret = auth.check_secret(secret)
        self.host = host
        self.port = port
        self.peer = f"{host}:{port}"
        self.device = torch.device(device)
        self.transport = default_transport(self.device) if transport is None else transport
        self.timeout_s = check_timeout("timeout_s", timeout_s)
        self.connect_timeout_s = check_timeout("connect_timeout_s", connect_timeout_s)
        self.options = options
        self._lock = threading.Lock()
        self._pipe: TensorPipe | None = None
        self._closed = False
        self._c = collections.Counter()

    def stats(self) -> dict[str, int]:
        """requests, hits, misses, timeouts, errors, connects, bytes_received, and
        group_device_bytes (the device memory NCCL's communicator of the open connection took,
        measured at connect; 0 for gloo and socket)."""
        out = dict.fromkeys(_COUNTERS, 0)
        out.update(self._c)
        pipe = self._pipe
        out["group_device_bytes"] = pipe.group_device_bytes if pipe is not None else 0
        return out

    def _drop_pipe(self) -> None:
        if self._pipe is not None:
            self._pipe.close(timeout_s=1.0)
            self._pipe = None

    def _connect(self, deadline: float, key: str) -> TensorPipe:
        if self._pipe is not None and self._pipe.broken is None and not self._pipe.closed:
            return self._pipe
        self._drop_pipe()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("no time left to connect", peer=self.peer, key=key)
        self._pipe = connect_pipe(
            self.host,
            self.port,
            transport=self.transport,
            device=self.device,
            connect_timeout_s=min(self.connect_timeout_s, left),
            secret=self.secret,
            options=self.options,
        )
        self._c["connects"] += 1
        if self._closed:  # close() ran meanwhile and may have missed this pipe
            self._pipe.close(timeout_s=1.0)
            raise PipeClosedError("client is closed", peer=self.peer, key=key)
        return self._pipe

    def _request(
        self, kind: Op, key: str, meta=None, timeout_s=None, out=None, max_bytes=None, entry=None
    ):
        """Send one request, return ``(reply, t0)``: its reply (of ``key``; an ERROR reply is
        raised as RemoteError) and when the request began. A reply announcing more than
        ``max_bytes`` payload bytes (None: only the limits) is refused before it is allocated.
        ``entry`` (not None): the reply may hold the entry ``key``, hashed as it was packed
        (checked under its NH key, :func:`tritonkv.umac.entry_keys`; by the caller if
        ``entry`` is True: ``Message.entry_tag``)."""
        timeout_s = self.timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        if not self._lock.acquire(timeout=timeout_s):
            self._c["timeouts"] += 1
            raise ClientBusyError(
                "client busy with other requests",
                peer=self.peer,
                key=key,
                waited_s=time.monotonic() - t0,
            )
        try:
            if self._closed:
                raise PipeClosedError("client is closed", peer=self.peer, key=key)
            self._c["requests"] += 1
            try:
                pipe = self._connect(deadline, key)
                pipe.expect_payload(max_bytes)  # before the request: the reply may come at once
                left = max(0.001, deadline - time.monotonic())
                pipe.send(key, None, meta, kind=kind, timeout_s=left)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout("deadline passed", peer=self.peer, key=key,
                                          waited_s=time.monotonic() - t0)  # fmt: skip
                keys = None if entry is None else umac.entry_keys(self.secret, key)
                reply: Message = pipe.recv(
                    left, out=out, expect_key=key, entry_keys=keys, defer_entry_check=bool(entry)
                )
            except TransferError as e:
                self._c["timeouts" if isinstance(e, TransferTimeout) else "errors"] += 1
                self._drop_pipe()
                # name the key the caller asked for and the whole time this request waited
                raise e.with_context(
                    key=e.key or key or None, waited_s=time.monotonic() - t0
                ) from e
            if reply.key != key:
                self._drop_pipe()
                raise ProtocolError(
                    f"reply for key {reply.key!r} ({op_name(reply.kind)})", peer=self.peer, key=key
                )
            if reply.kind == Kind.ERROR:
                self._c["errors"] += 1
                raise RemoteError(
                    f"server error: {reply.meta.get('error')}",
                    peer=self.peer,
                    key=key,
                    waited_s=time.monotonic() - t0,
                )
            return reply, t0
        finally:
            self._lock.release()

    def get(
        self,
        key: str,
        timeout_s: float | None = None,
        *,
        wait_s: float = 0.0,
        out: dict[str, torch.Tensor] | None = None,
        part: Part | None = None,
        digest: str | None = None,
        max_bytes: int | None = None,
        defer_entry_check: bool = False,
    ) -> tuple[dict[str, torch.Tensor], dict] | tuple[dict[str, torch.Tensor], dict, EntryTag]:
        """Load entry ``key``: ``(tensors on self.device, meta)``.

        ``part``: only that slice of one tensor (the others whole); the entry is claimed once the
        parts loaded, by any consumers, cover the whole dim (:class:`Part`). ``digest``: the one
        the entry was put with (any other gets the MISS of a key never put).

        ``max_bytes``: the most payload bytes the caller expects (None: only the pipe's limits).
        A DATA header announcing more is refused before anything is allocated: ProtocolError
        naming both numbers, and the connection is closed (as after any protocol error).

        ``wait_s``: how long the server may wait for the key to be put (capped by its
        ``max_get_wait_s``); must be below ``timeout_s`` (default ``self.timeout_s``). ``out``:
        tensors to fill in place (see TensorPipe.recv). Raises KeyMissError (with the server's
        reason), TransferTimeout, PeerDeadError, RemoteError, ProtocolError.

        ``defer_entry_check``: the entry's tensors the producer hashed as it packed them are
        not hashed on arrival; ``(tensors, meta, entry_tag)`` is returned, and the caller must
        check ``entry_tag`` (an :class:`~connector.transport.EntryTag`, None when nothing is
        left to check) before anything made of them is used, e.g. with the NH its unpack
        computes (PayloadAuthError, and the next request reconnects).
        """
        key = check_key(key)
        eff = self.timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or wait_s < 0:
            raise ValueError(f"wait_s: expected a number >= 0, got {wait_s!r}")
        if wait_s >= eff:
            raise ValueError(f"wait_s: expected < timeout_s={eff:g}, got {wait_s:g}")
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
        ):
            raise ValueError(f"max_bytes: expected an int >= 0 or None, got {max_bytes!r}")
        meta = {WAIT_MS: math.ceil(wait_s * 1000), **(part.meta() if part is not None else {})}
        meta.update(_digest_meta(digest))
        reply, t0 = self._request(
            Op.GET, key, meta, eff, out, max_bytes, entry=bool(defer_entry_check)
        )
        if reply.kind == Op.MISS:
            self._c["misses"] += 1
            raise KeyMissError(
                "producer does not hold the key",
                reason=str(reply.meta.get(REASON, "unknown")),
                peer=self.peer,
                key=key,
                waited_s=time.monotonic() - t0,
            )
        if reply.kind != Op.DATA:
            raise ProtocolError(f"expected DATA or MISS, got {op_name(reply.kind)}", peer=self.peer,
                                key=key)  # fmt: skip
        self._c["hits"] += 1
        self._c["bytes_received"] += sum(t.nbytes for t in reply.tensors.values())
        if defer_entry_check:
            return reply.tensors, reply.meta, reply.entry_tag
        return reply.tensors, reply.meta

    def discard(
        self, key: str, timeout_s: float | None = None, *, digest: str | None = None
    ) -> bool:
        """Ask the server to discard ``key`` (put with ``digest``); True if it held it (for that
        digest)."""
        key = check_key(key)
        reply, _ = self._request(
            Op.DISCARD, key, meta=_digest_meta(digest), timeout_s=timeout_s, max_bytes=0
        )
        return bool(reply.meta.get(EXISTED))

    def close(self) -> None:
        """Close the connection (goodbye to the server). Idempotent. Does not wait for a request
        another thread has in flight: that request raises PipeClosedError at once."""
        self._closed = True
        pipe = self._pipe  # no lock: a request in flight holds it until its deadline
        if pipe is not None:
            with contextlib.suppress(Exception):
                pipe.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _digest_meta(digest) -> dict:
    """The request meta presenting ``digest`` (None: none); TypeError for a non-str."""
    if digest is None:
        return {}
    if not isinstance(digest, str):
        raise TypeError(f"digest: expected str or None, got {type(digest).__name__}")
    return {DIGEST: digest}
