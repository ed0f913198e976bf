"""Tensor pipe: ordered tensor messages between two endpoints that never hang.

One :class:`TensorPipe` is one connection between two endpoints, built by
:func:`~connector.transport.connect.connect_pipe` (connector side) or
:meth:`~connector.transport.listener.PipeListener.accept` (listener side); how a connection is
set up, and what travels on it, is written once in :mod:`connector.transport.handshake`. It has
two channels:

- a **control socket** (plain TCP) carrying every frame header (see :mod:`connector.transport.frame`:
  fixed, versioned binary header, validated before any allocation; metadata is JSON inside that
  framing, no pickle), plus small payloads inline, each frame with the tag of the connection's
  authenticated session (:mod:`connector.transport.session`);
- a **data process group** of two ranks (listener = rank 0, connector = rank 1): ``gloo`` for CPU
  tensors, ``nccl`` for CUDA tensors, same code. The default process group is never touched.
  Transport ``socket`` sends every payload inline on the control socket instead (no
  torch.distributed; a fallback, and what the raw-socket tests speak).

Messages are delivered in the order they were sent. Several small tensors of one message travel as
one packed payload chunk; large ones travel alone, straight into the receiver's tensors.

Each end announces the :class:`~connector.transport.frame.FrameLimits` it accepts in the handshake
(``limit.*`` keys; the receiver's defaults stand in for keys a peer leaves out), and ``send`` checks
every message against the peer's: what the peer would refuse raises ValueError at the call and
never breaks the pipe.

Threads per pipe (:attr:`TensorPipe.threads`): a **sender** (``send`` only queues; the sender
writes headers and runs the process-group sends, holding at most ``max_inflight_bytes`` of
queued/in-flight payload; :mod:`connector.transport.sending`), a **reader** (reads and validates
headers and inline payloads ahead of ``recv``, holding at most ``max_queued_frames`` (64) frames and
``max_queued_bytes`` (64 MiB) of inline payload, one message always; it waits for room before it
allocates a payload) and a **waiter** (waits on process-group receives so the caller can give up on
a dead peer; both in :mod:`connector.transport.receiving`). An error in the sender or reader thread
breaks the pipe and is raised to the caller on its next ``send``/``recv``/``flush``; ``on_done``
callbacks see it too. Any timeout or error breaks the pipe for good (a late payload could otherwise
land in the wrong message): open a new one.

Large CPU receive buffers come from :data:`~connector.transport.buffers.RECV_POOL`, which hands a
buffer out again only once nothing references it (first-touch page faults of fresh 64 MiB buffers
cost about as much as the gloo transfer itself on a small machine); ``recv(out=...)`` receives into
caller-owned tensors.

Deadlines (defaults; ``connect_timeout_s`` is an argument of ``connect_pipe`` and
``PipeListener``, the others fields of :class:`~connector.transport.options.PipeOptions`):

- ``connect_timeout_s`` = 10 s: TCP connect + authentication + HELLO exchange + process-group
  setup (the listener gives the authentication itself at most 5 s of it).
- ``send_timeout_s`` = 30 s: how long ``send`` blocks when the in-flight budget is exhausted.
- ``recv_timeout_s`` = 30 s: default deadline of ``recv`` (header and payload together).
- ``io_timeout_s`` = 60 s: the sender thread's deadline for writing one message (header + payload).
- ``frame_timeout_s`` = 10 s: once a frame's first byte arrived, its header (and inline payload,
  at least 10 s + 1 s per 100 MiB) must complete within this, else ProtocolError.
- ``dead_grace_s`` = 1 s: after the peer's socket closed, how long a pending payload receive may
  still complete before ``PeerDeadError``.
- ``close_timeout_s`` = 5 s: ``close`` flushes queued sends and joins threads within this.

A peer that dies (killed process, closed or reset socket) is reported as :class:`PeerDeadError`
within ``dead_grace_s`` of the kernel closing its socket; a peer that stops answering is reported
as :class:`TransferTimeout` at the deadline. Errors name the peer, the key and the time waited.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tritonkv import umac

from .errors import PipeClosedError, TransferError, TransferTimeout
from .frame import FrameLimits, Kind
from .options import DEFAULT_OPTIONS, PipeOptions, check_options, check_timeout, check_transport
from .receiving import EntryCheck, EntryTag, _PayloadReceiver, _place, _Reader
from .sending import _outgoing, _Sender
from .session import Session
from .state import _PipeState

__all__ = ["Message", "TensorPipe"]


@dataclass
class Message:
    """One received message: its kind, key, named tensors and metadata."""

    kind: Kind | int
    key: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    #: the tag its caller checks (``recv(defer_entry_check=True)`` and entry-hashed tensors)
    entry_tag: EntryTag | None = None


class TensorPipe:
    """One end of an ordered tensor-message connection (see the module docstring).

    Build with :func:`~connector.transport.connect.connect_pipe` (connector side) or
    :meth:`~connector.transport.listener.PipeListener.accept` (listener side). ``send`` is
    asynchronous (background sender thread, in-flight byte budget); ``recv`` blocks up to its
    deadline. Thread-safe: several threads may ``send``; ``recv`` calls are serialised.

    ``process_group`` is read for every payload, so a wrapper set after construction (tests
    observing the group) is what the threads use.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        peer: str,
        transport: str,
        session: Session,
        process_group=None,
        peer_rank: int = 0,
        device: str | torch.device = "cpu",
        options: PipeOptions = DEFAULT_OPTIONS,
        peer_limits: FrameLimits | None = None,
    ):
        check_transport(transport)
        if transport != "socket" and process_group is None:
            raise ValueError(f"transport {transport!r} needs a process_group, got None")
        self.peer = peer
        self.transport = transport
        self.process_group = process_group
        self.peer_rank = peer_rank
        self.device = torch.device(device)
        #: device memory of the process group's communicator (nccl), measured at connect
        self.group_device_bytes = 0
        self.options = options = check_options(options)
        self.limits = options.limits  # what this end accepts
        self.peer_limits = options.limits if peer_limits is None else peer_limits  # the peer's
        self.max_inflight_bytes = options.max_inflight_bytes
        self.send_timeout_s = options.send_timeout_s
        self.recv_timeout_s = options.recv_timeout_s
        self.io_timeout_s = options.io_timeout_s
        self.frame_timeout_s = options.frame_timeout_s
        self.dead_grace_s = options.dead_grace_s
        self.close_timeout_s = options.close_timeout_s
        self.inline_max_bytes = options.inline_max_bytes
        self.pack_max_bytes = options.pack_max_bytes
        self.session = session

        self._sock = sock
        sock.setblocking(False)
        self._state = _PipeState(peer)
        self._state.max_payload = options.max_payload_bytes  # before the reader's first frame
        self._recv_lock = threading.Lock()
        name = f"tkv-pipe[{peer}]"
        self._sender = _Sender(self, self._state, sock, f"{name}-send")
        self._reader = _Reader(self._state, sock, session, transport, options, f"{name}-read")
        self._receiver = _PayloadReceiver(self, self._state, f"{name}-wait")
        self._receiver.start()
        self._sender.thread.start()
        self._reader.thread.start()

    # ---------------------------------------------------------------------------------- state
    @property
    def closed(self) -> bool:
        return self._state.closing or self._state.closed

    @property
    def broken(self) -> TransferError | None:
        """The error that broke the pipe, or None while it is usable."""
        return self._state.fatal

    @property
    def threads(self) -> dict[str, threading.Thread]:
        """The pipe's threads by role: ``"send"``, ``"read"`` and, with a process group,
        ``"wait"`` (named ``tkv-pipe[peer]-<role>``), for callers that must know they ended."""
        out = {"send": self._sender.thread, "read": self._reader.thread}
        if self._receiver.thread is not None:
            out["wait"] = self._receiver.thread
        return out

    def stats(self) -> dict[str, int]:
        """Counters: messages/bytes sent and received (payload bytes), in-flight bytes, what
        the reader holds ahead of ``recv`` (``queued_frames``, ``queued_bytes`` of inline payload),
        process-group payloads refused by their umac tag (``payload_auth_failures``), and the
        device memory NCCL's communicator took (``group_device_bytes``, 0 otherwise)."""
        with self._state.cond:
            out = dict(self._state.counters)
            out["inflight_bytes"] = self._sender.inflight
            out["queued_frames"] = len(self._reader.inbox)
            out["queued_bytes"] = self._reader.queued_bytes
        out["group_device_bytes"] = self.group_device_bytes
        keys = ("msgs_sent", "msgs_received", "bytes_sent", "bytes_received")
        for k in (*keys, "payload_auth_failures"):
            out.setdefault(k, 0)
        return out

    def _check_usable(self, key: str | None) -> None:
        """Raise unless the pipe can be used (see ``_PipeState.check_usable``). Holds the cond."""
        self._state.check_usable(key, unread=bool(self._reader.inbox))

    # ----------------------------------------------------------------------------------- send
    def send(
        self,
        key: str = "",
        tensors: dict[str, torch.Tensor] | None = None,
        meta: dict | None = None,
        *,
        kind: Kind = Kind.MSG,
        timeout_s: float | None = None,
        on_done: Callable[[BaseException | None], None] | None = None,
        entry_nh: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Queue one message. Returns once queued; the sender thread writes it.

        Blocks while more than ``max_inflight_bytes`` of payload is queued or in flight (a single
        message larger than the budget is admitted when nothing else is in flight), up to
        ``timeout_s`` (default ``send_timeout_s``), then raises TransferTimeout. Raises the error
        that broke the pipe, if any. A message the peer's limits (``peer_limits``, announced in
        the handshake) refuse raises ValueError, and the pipe stays usable.
        ``on_done(exc_or_None)`` runs on the sender thread once the payload left (or failed). The
        tensors must not be modified until then. Over gloo and socket a CUDA tensor is read (to
        be staged through host memory) after what the calling thread's current stream had
        queued when ``send`` was called.

        ``entry_nh``: NH outputs (``[num_chunks, 2]`` int64) of a stored entry's tensors under
        its key (:func:`tritonkv.umac.entry_keys`), made when packed: the tag comes from them.
        """
        timeout_s = (
            self.send_timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        )
        item = _outgoing(self, kind, key, tensors, meta, on_done, entry_nh)
        self._sender.submit(item, timeout_s, self._check_usable)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued message has left; raises the pipe's error or TransferTimeout."""
        timeout_s = (
            self.io_timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        )
        self._sender.flush(timeout_s)

    # ----------------------------------------------------------------------------------- recv
    def expect_payload(self, max_bytes: int | None) -> None:
        """Cap the payload of the messages received from now on at ``max_bytes`` (None: only
        ``limits``): the reader refuses a header announcing more before it allocates anything, and
        the pipe breaks with a ProtocolError naming both numbers. A client sets it before each
        request, from what it expects the reply to hold (its read-ahead may meet the reply first).
        """
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
        ):
            raise ValueError(f"max_bytes: expected an int >= 0 or None, got {max_bytes!r}")
        with self._state.cond:
            self._state.max_payload = max_bytes

    def recv(
        self,
        timeout_s: float | None = None,
        *,
        device: str | torch.device | None = None,
        out: dict[str, torch.Tensor] | None = None,
        expect_key: str | None = None,
        idle: bool = False,
        entry_keys: umac.TransferKeys | None = None,
        defer_entry_check: bool = False,
    ) -> Message:
        """Receive the next message (header and payload) within ``timeout_s`` (default
        ``recv_timeout_s``). Tensors land on ``device`` (default: the pipe's device); a tensor named
        in ``out`` with matching dtype, shape and device kind (contiguous) is filled in place.

        ``idle=True`` (servers): wait for the next header without a deadline (until it arrives, the
        peer goes or the pipe closes), then give its payload ``timeout_s``.

        ``entry_keys``: the NH key of the entry expected, for tensors sent with ``entry_nh`` (else
        a ProtocolError); ``defer_entry_check``: the caller checks ``Message.entry_tag``.

        Over gloo and socket a CUDA tensor is written (from host staging) after what the calling
        thread's current stream had queued when the payload began, and is complete on return.

        Raises TransferTimeout, PeerDeadError, PipeClosedError or ProtocolError, naming the peer,
        the key (``expect_key`` before a header arrived) and the time waited. After any error,
        ValueError for a bad ``out`` included, the pipe is broken.

        When it raises while a payload receive is posted (deadline, dead peer, ``close`` from
        another thread), that receive is cancelled first (gloo closes the connection, nccl
        aborts the group): nothing is written into ``out`` after recv raised, though a tensor of
        ``out`` may hold part of the payload.
        """
        timeout_s = (
            self.recv_timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        )
        dev = self.device if device is None else torch.device(device)
        t0 = time.monotonic()
        deadline = None if idle else t0 + timeout_s
        if not self._recv_lock.acquire(timeout=-1 if idle else timeout_s):
            raise TransferTimeout(
                "recv: another recv held the pipe",
                peer=self.peer,
                key=expect_key,
                waited_s=time.monotonic() - t0,
            )
        try:
            header, inline_tensors, auth = self._reader.next(deadline, t0, expect_key)
            if idle:
                t0 = time.monotonic()
                deadline = t0 + timeout_s
            key = header.key or expect_key
            entry_tag = None
            try:
                if header.inline:
                    tensors = {
                        s.name: _place(s, inline_tensors[s.name], dev, out) for s in header.specs
                    }
                else:
                    entry = entry_keys and EntryCheck(entry_keys, defer_entry_check)
                    receiver = self._receiver
                    tensors = receiver.receive(header, dev, out, deadline, t0, key, auth, entry)
                    if auth is not None:
                        entry_tag = receiver.authenticate(header, tensors, auth, key, entry)
            except TransferError as e:
                self._state.set_fatal(e)
                raise
            except BaseException as e:
                err = TransferError(f"receive aborted: {e!r}", peer=self.peer, key=key)
                self._state.set_fatal(err)
                raise
            with self._state.cond:
                self._state.counters["msgs_received"] += 1
                self._state.counters["bytes_received"] += header.payload_bytes
            return Message(header.kind, header.key, tensors, header.meta, entry_tag)
        finally:
            self._recv_lock.release()

    # ---------------------------------------------------------------------------------- close
    def close(self, timeout_s: float | None = None) -> None:
        """Flush queued sends (bounded), say goodbye, stop the threads, drop the process group.
        Idempotent; never raises for transport reasons; returns within about ``timeout_s``
        (default ``close_timeout_s``) plus one second. Fine inside an ``on_done`` callback (on the
        sender thread): it then neither waits for the sends queued behind it nor joins itself."""
        st, sender = self._state, self._sender
        with st.cond:
            if st.closing or st.closed:
                return
        timeout_s = self.close_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout_s
        on_sender = sender.on_thread()
        with st.cond:
            while (
                sender.busy
                and not on_sender  # only this very thread could send them
                and st.fatal is None
                and st.peer_gone is None  # a gone peer will not receive: do not wait
                and time.monotonic() < deadline
            ):
                st.cond.wait(max(0.0, deadline - time.monotonic()))
            if st.closing:  # a concurrent close() got here first
                return
            st.closing = True
            if st.fatal is None and sender.busy:
                st.fatal = PipeClosedError("pipe closed with sends pending", peer=self.peer)
            if not on_sender:
                sender.queue_bye()
            st.cond.notify_all()
        if on_sender:
            sender.send_bye()
        elif st.fatal is None:
            sender.join(deadline)  # it writes the BYE
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(deadline)
        sender.join(deadline)  # a send stuck on the socket failed at the shutdown
        with st.cond:
            st.closed = True
            st.cond.notify_all()
        self._receiver.join(deadline)
        with contextlib.suppress(OSError):
            self._sock.close()
        if self.transport == "nccl" and st.fatal is not None:
            # a pending NCCL op with a dead peer never finishes on its own
            with contextlib.suppress(Exception):
                self.process_group.abort()
        if not self._receiver.waiting:
            self.process_group = None
        # sends that never left (or are stuck in a process-group send): tell their owners now
        for it in sender.take_unsent():
            sender.report(
                it,
                PipeClosedError(
                    "pipe closed before the send completed", peer=self.peer, key=it.key
                ),
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"TensorPipe(peer={self.peer}, transport={self.transport}, closed={self.closed})"
