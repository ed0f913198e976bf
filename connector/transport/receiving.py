"""The receiving half of a :class:`~connector.transport.pipe.TensorPipe` (part of the pipe, not
exported): the reader thread that reads headers and inline payloads ahead of ``recv``, and the
payload receiver whose waiter thread waits on process-group receives.

Receive buffers come from :func:`_alloc` (large CPU ones from
:data:`~connector.transport.buffers.RECV_POOL`), only once a header was validated.
"""

from __future__ import annotations

import collections
import datetime
import functools
import time
from dataclasses import dataclass

import torch

from tritonkv import umac

from ..logs import get_logger, hide_ids
from . import frame, staging
from .buffers import RECV_POOL, flat_bytes, staging_buffer
from .errors import (
    PayloadAuthError,
    PipeClosedError,
    ProtocolError,
    TransferError,
    TransferTimeout,
    classify_failure,
)
from .frame import Header, Kind, TensorSpec, kind_name, pieces, plan_chunks
from .sending import TAG
from .session import TAG_BYTES, FrameMac, Session
from .sockio import PeerClosed, read_frame, recv_into
from .state import _PipeState
from .threads import join_until, transfer_thread

log = get_logger("transport")


def _alloc(spec: TensorSpec, device) -> torch.Tensor:
    """Receive buffer for a validated spec: large CPU buffers come from ``RECV_POOL``."""
    dev = torch.device(device)
    if dev.type == "cpu" and spec.nbytes >= RECV_POOL.min_bytes:
        raw = RECV_POOL.alloc(spec.nbytes)
        if raw is not None:
            return raw.view(spec.dtype).view(spec.shape)
    return torch.empty(spec.shape, dtype=spec.dtype, device=dev)


def _read_inline_payload(
    sock, header: Header, mac: FrameMac, frame_timeout_s: float
) -> dict[str, torch.Tensor]:
    """Allocate CPU tensors for a validated header and fill them from the socket (at least
    ``frame_timeout_s`` + 1 s per 100 MiB), then check the payload tag (ProtocolError)."""
    tensors = {}
    deadline = time.monotonic() + frame_timeout_s + header.payload_bytes / (100 << 20)
    for s in header.specs:
        t = _alloc(s, "cpu")
        if s.nbytes:
            mv = memoryview(flat_bytes(t).numpy())
            recv_into(sock, mv, deadline, f"inline payload of tensor {s.name!r}")
            mac.update(mv)
        tensors[s.name] = t
    if header.payload_bytes:
        tag = bytearray(TAG_BYTES)
        recv_into(sock, memoryview(tag), deadline, "inline payload tag")
        mac.check_payload(bytes(tag), f"{kind_name(header.kind)} {header.key!r}")
    return tensors


def _target(spec: TensorSpec, dev, out) -> torch.Tensor:
    """Where ``spec``'s tensor lands: ``out[spec.name]`` if given (checked), else a new buffer.
    An ``out`` tensor must be on ``dev``'s kind of device: whether a payload is staged through
    host memory (gloo carries host memory only) is decided from ``dev``."""
    if out is not None and spec.name in out:
        t = out[spec.name]
        want = torch.device(dev).type
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != spec.dtype
            or tuple(t.shape) != spec.shape
            or not t.is_contiguous()
            or t.device.type != want
        ):
            got = (
                f"{t.dtype} {list(t.shape)} contiguous={t.is_contiguous()} on {t.device}"
                if isinstance(t, torch.Tensor)
                else type(t).__name__
            )
            raise ValueError(
                f"out[{spec.name!r}]: expected a contiguous {spec.dtype} tensor of shape "
                f"{list(spec.shape)} on {want} (recv's device), got {got}"
            )
        return t
    return _alloc(spec, dev)


def _place(spec: TensorSpec, t: torch.Tensor, dev, out) -> torch.Tensor:
    """An inline tensor ``t`` moved where the caller wants it (``out`` or ``dev``)."""
    if out is not None and spec.name in out:
        dst = _target(spec, dev, out)
        dst.copy_(t)
        return dst
    return t if t.device == dev else t.to(dev)


class _Reader:
    """The reader thread (``tkv-pipe[peer]-read``) and the inbox it fills ahead of ``recv``.

    It holds at most ``max_queued_frames`` headers and ``max_queued_bytes`` of inline payload
    (one message always), and waits for room before it allocates a payload. A bad frame breaks
    the pipe; the peer's goodbye or end of stream sets ``state.peer_gone``.
    """

    def __init__(self, state: _PipeState, sock, session: Session, transport: str, options, name):
        self._state = state
        self._sock = sock
        self._session = session
        self._transport = transport
        self._limits = options.limits
        self._frame_timeout_s = options.frame_timeout_s
        self._max_queued = options.max_queued_frames
        self._max_queued_bytes = options.max_queued_bytes
        self.inbox: collections.deque[tuple[Header, dict | None]] = collections.deque()
        self.queued_bytes = 0  # inline payload bytes held in the inbox
        self.thread = transfer_thread(self._loop, name)

    def _loop(self) -> None:
        st = self._state
        try:
            while True:
                got = read_frame(
                    self._sock, self._limits, None, self._frame_timeout_s, self._session
                )
                if got is None:
                    raise PeerClosed("peer closed the connection")
                header, mac = got
                if header.kind == Kind.BYE:
                    with st.cond:
                        st.peer_gone = "bye"
                        st.cond.notify_all()
                    return
                if not header.inline and header.payload_bytes and self._transport == "socket":
                    raise ProtocolError(
                        f"{kind_name(header.kind)} {header.key!r}: {header.payload_bytes} payload bytes "
                        "announced off the socket, but this pipe has no process group ('socket')"
                    )
                auth = None
                if not header.inline and header.payload_bytes:  # its umac tag follows
                    auth = self._payload_tag(mac.counter)
                with st.cond:
                    cap = st.max_payload
                if cap is not None and header.payload_bytes > cap:  # before any allocation
                    raise ProtocolError(
                        f"{kind_name(header.kind)}: {header.payload_bytes} payload bytes "
                        f"announced, this receiver expects at most {cap}"
                    )
                nbytes = header.payload_bytes if header.inline else 0
                with st.cond:  # room first: the inline payload is allocated only then
                    while self._full(nbytes) and not st.closing:
                        st.cond.wait()
                    if st.closing:
                        return
                tensors = None
                if header.inline:
                    tensors = _read_inline_payload(self._sock, header, mac, self._frame_timeout_s)
                with st.cond:
                    self.inbox.append((header, tensors, auth))
                    self.queued_bytes += nbytes
                    st.cond.notify_all()
        except PeerClosed as e:
            with st.cond:
                st.peer_gone = "eof"
                st.cond.notify_all()
            if not st.closing:
                log.info("tensor pipe: %s (peer %s)", e, st.peer)
        except ProtocolError as e:
            if not st.closing:
                log.warning("tensor pipe: protocol error from %s: %s", st.peer, hide_ids(str(e)))
                st.set_fatal(ProtocolError(str(e), peer=st.peer))
        except TimeoutError as e:
            if not st.closing:
                st.set_fatal(ProtocolError(f"incomplete frame: {e}", peer=st.peer))
        except OSError as e:
            with st.cond:
                st.peer_gone = st.peer_gone or "eof"
                st.cond.notify_all()
            if not st.closing:
                log.info("tensor pipe: socket error from %s: %s", st.peer, e)
        except Exception as e:  # e.g. MemoryError: the pipe breaks, its waiters wake, none hangs
            if not st.closing:
                log.exception("tensor pipe: reader for %s failed", st.peer)
                st.set_fatal(
                    TransferError(f"reading failed: {type(e).__name__}: {e}", peer=st.peer)
                )

    def _payload_tag(self, counter: int) -> tuple[bytes, int]:
        """The umac tag that follows a header announcing a process-group payload, with the
        frame's counter (the tag's nonce), within ``frame_timeout_s``."""
        tag = bytearray(TAG_BYTES)
        deadline = time.monotonic() + self._frame_timeout_s
        recv_into(self._sock, memoryview(tag), deadline, "payload tag")
        return bytes(tag), counter

    def _full(self, nbytes: int) -> bool:
        """No room to queue one more message of ``nbytes`` inline bytes (there always is for
        one). Holds ``state.cond``."""
        return bool(self.inbox) and (
            len(self.inbox) >= self._max_queued
            or self.queued_bytes + nbytes > self._max_queued_bytes
        )

    def next(
        self, deadline: float | None, t0: float, expect_key: str | None
    ) -> tuple[Header, dict | None, tuple[bytes, int] | None]:
        """The next header, its inline tensors (None when its payload travels on the process
        group) and the umac tag and counter of a process-group payload (else None), waiting
        until ``deadline`` (None: until it arrives, the peer goes or the pipe closes). A timeout
        breaks the pipe."""
        st = self._state
        with st.cond:
            while not self.inbox:
                st.check_usable(expect_key, unread=False)  # raises once the peer is gone too
                if deadline is None:
                    st.cond.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    err = TransferTimeout(
                        "no message arrived before the deadline",
                        peer=st.peer,
                        key=expect_key,
                        waited_s=time.monotonic() - t0,
                    )
                    st.fatal = st.fatal or err
                    st.counters["recv_timeouts"] += 1
                    raise err
                st.cond.wait(left)
            header, tensors, auth = self.inbox.popleft()
            if header.inline:
                self.queued_bytes -= header.payload_bytes
            st.cond.notify_all()
        return header, tensors, auth

    def join(self, deadline: float) -> None:
        join_until(self.thread, deadline)


@dataclass(frozen=True)
class EntryCheck:
    """What a recv expects of tensors hashed as a stored entry (``send(entry_nh=)``): their
    entry's NH key (:func:`tritonkv.umac.entry_keys`), and whether the caller checks them itself
    after using them (``defer``: :class:`EntryTag`), e.g. with the NH its unpack computes."""

    keys: umac.TransferKeys
    defer: bool = False


class EntryTag:
    """The umac tag of a received payload whose entry-hashed tensors (``names``) the caller
    checks itself once it computed their NH under ``entry_keys`` (``recv(defer_entry_check=
    True)``; the payload's other tensors were checked on arrival). Until :meth:`check` passed,
    those tensors' bytes are unauthenticated: nothing computed from them may be kept if it
    fails. A failed check counts in the pipe's ``payload_auth_failures`` and breaks the pipe."""

    def __init__(self, receiver, keys, tag: bytes, parts: list, entry_keys, key):
        self._receiver, self._keys, self._tag, self._parts = receiver, keys, tag, parts
        self._key = key
        self.entry_keys = entry_keys
        self.names = tuple(name for name, _, outputs in parts if outputs is None)

    def check(self, outputs: dict[str, torch.Tensor]) -> None:
        """Check the tag with ``outputs``: for each of :attr:`names`, the NH outputs of the
        bytes used (``[num_chunks, 2]`` int64, any device: read on the host).

        Raises:
            PayloadAuthError: they are not what the sender's tag says.
        """
        parts = [
            (nbytes, outputs[name] if done is None else done) for name, nbytes, done in self._parts
        ]
        try:
            umac.check_tag(umac.tag_of_outputs(self._keys, parts), self._tag, len(parts))
        except umac.TagMismatch as e:
            raise self._receiver.refused(e, self._key) from None


@dataclass
class _WorkSlot:
    work: object
    timeout_s: float
    done: bool = False
    exc: BaseException | None = None


class _PayloadReceiver:
    """Receives payloads from the process group (``pipe.process_group``, read per chunk) into the
    caller's tensors. Its waiter thread (``tkv-pipe[peer]-wait``, only with a process group)
    waits on each posted receive, so that ``recv`` can give up on a dead peer or a deadline; a
    receive given up on is cancelled first (:meth:`_cancel`)."""

    def __init__(self, pipe, state: _PipeState, name: str):
        self._pipe = pipe
        self._state = state
        self._dead_grace_s = pipe.dead_grace_s
        self._waitq: collections.deque[_WorkSlot] = collections.deque()
        self._hashed: tuple[int | None, dict] = (None, {})  # frame counter, NH of landed pieces
        self.thread = None
        if pipe.process_group is not None:
            self.thread = transfer_thread(self._loop, name)

    def receive(
        self, header: Header, dev, out, deadline, t0, key, auth=None, entry=None
    ) -> dict[str, torch.Tensor]:
        """Every tensor of a header whose payload travels on the process group, by name, each
        chunk in :func:`~.frame.pieces`. Gloo carries host memory: for a device ``dev`` each
        piece lands in a pinned staging buffer and is copied to the device while the next one
        arrives, after what the caller's stream had queued when this began (:mod:`.staging`);
        done when this returns.

        With ``auth`` (the header's umac tag and frame counter), a host tensor received straight
        into its place is hashed piece by piece: each piece while the next one arrives (kept for
        :meth:`authenticate`, which hashes the rest), under the frame's NH key or, for a tensor
        hashed as a stored entry, ``entry.keys`` (none when the caller checks it: ``entry.defer``)."""
        if entry is None and any(s.entry_nh for s in header.specs):
            raise ProtocolError(
                f"{kind_name(header.kind)} {key!r}: tensors hashed under their entry's key, "
                "but this receiver expects no entry",
                peer=self._state.peer,
                key=key,
            )
        copies = None if self._pipe.transport == "nccl" else staging.copies_for(dev)
        after = None if copies is None else copies.ready()
        what = f"payload of {key!r}"
        tensors = {s.name: _target(s, dev, out) for s in header.specs}
        self._hashed = (None, {})
        piecewise = auth is not None and frame.PIECE_BYTES % umac.CHUNK_BYTES == 0
        if piecewise:
            self._hashed = (auth[1], {})
            frame_keys = self._pipe.session.payload_keys(auth[1], sending=False)
        entry_nh = {s.name for s in header.specs if s.entry_nh}

        def receive(buf: torch.Tensor, name: str | None = None) -> None:
            if name in entry_nh and entry.defer:
                name = None  # hashed by the caller
            keys = None if name is None else (entry.keys if name in entry_nh else frame_keys)
            landed = None  # the last piece received, not hashed yet
            for off, n in pieces(buf.numel()):
                hash_landed = None
                if name is not None and landed is not None:
                    hash_landed = functools.partial(self._hash_piece, name, landed, keys)
                self._receive_chunk(buf[off : off + n], deadline, t0, key, hash_landed)
                landed = buf[off : off + n]
            if name is not None and landed is not None:
                self._hash_piece(name, landed, keys)

        for chunk in plan_chunks(header.specs):
            if not chunk.members:
                target = flat_bytes(tensors[header.specs[chunk.index].name])
                if copies is None:
                    on_host = piecewise and target.device.type == "cpu"
                    receive(target, header.specs[chunk.index].name if on_host else None)
                else:
                    staging.to_device_pieces(copies, target, after, receive, deadline, what)
                continue
            if copies is not None:
                buf = staging_buffer(chunk.nbytes)
            else:
                buf = _alloc(TensorSpec("packed", 6, (chunk.nbytes,), chunk.nbytes), dev)
            receive(buf)
            pairs = []
            for i, off in chunk.members:
                s = header.specs[i]
                part = buf[off : off + s.nbytes]
                if copies is not None or (out is not None and s.name in out):
                    pairs.append((flat_bytes(tensors[s.name]), part))
                else:  # zero-copy view into the packed chunk (offsets are 64-byte aligned)
                    tensors[s.name] = part.view(s.dtype).view(s.shape)
            staging.copy_all(copies, pairs, after, deadline, what)
        return tensors

    def _hash_piece(self, name: str, piece: torch.Tensor, keys) -> None:
        """NH of one landed piece of tensor ``name`` (pieces start at multiples of 4 KiB)."""
        self._hashed[1].setdefault(name, []).append(umac.nh_hash(piece, keys))

    def authenticate(
        self, header: Header, tensors: dict, auth: tuple[bytes, int], key, entry=None
    ) -> EntryTag | None:
        """Check the received ``tensors`` (in header order) against the umac tag the header
        brought (``auth``: tag and frame counter), with the NH of the pieces :meth:`receive`
        hashed as they landed (under ``entry.keys`` for tensors hashed as a stored entry).
        PayloadAuthError if they differ. With ``entry.defer`` and such tensors, nothing is
        checked here: the :class:`EntryTag` the caller checks."""
        tag, counter = auth
        keys = self._pipe.session.payload_keys(counter, sending=False)
        hashed = self._hashed[1] if self._hashed[0] == counter else {}
        self._hashed = (None, {})
        parts = []
        for s in header.specs:
            done = hashed.get(s.name)
            if s.entry_nh and entry.defer:
                parts.append((s.name, s.nbytes, None))
                continue
            nh_keys = entry.keys if s.entry_nh else keys
            outputs = torch.cat(done) if done else umac.nh_hash(tensors[s.name], nh_keys)
            parts.append((s.name, s.nbytes, outputs))
        pending = EntryTag(self, keys, tag, parts, entry and entry.keys, key)
        if pending.names:
            return pending
        pending.check({})
        return None

    def refused(self, e: umac.TagMismatch, key) -> PayloadAuthError:
        """The error of a payload whose tag did not match, counted; the pipe is broken."""
        st = self._state
        with st.cond:
            st.counters["payload_auth_failures"] += 1
        err = PayloadAuthError(f"{e}; closing the connection", peer=st.peer, key=key)
        st.set_fatal(err)
        return err

    def _receive_chunk(
        self, buf: torch.Tensor, deadline: float, t0: float, key, meanwhile=None
    ) -> None:
        """Receive one payload chunk into ``buf``, giving up early when the peer's socket closed
        or the pipe closes; ``meanwhile()`` runs once the receive is posted (hashing the piece
        before). Before it raises, the receive is cancelled (see :meth:`_cancel`): nothing
        lands in ``buf`` (possibly the caller's ``out``) afterwards."""
        st = self._state
        pipe = self._pipe
        pg = pipe.process_group
        if pg is None:  # close() let go of it
            raise PipeClosedError(
                "pipe closed during receive", peer=st.peer, key=key, waited_s=time.monotonic() - t0
            )
        if deadline - time.monotonic() <= 0:
            raise TransferTimeout(
                "deadline passed before the payload arrived",
                peer=st.peer,
                key=key,
                waited_s=time.monotonic() - t0,
            )
        try:  # gloo may refuse the receive at once (the peer's pair already closed)
            work = pg.recv([buf], pipe.peer_rank, TAG)
        except Exception as e:
            if st.peer_gone is not None:
                raise st.gone_error(key, time.monotonic() - t0) from None
            raise classify_failure(e, peer=st.peer, key=key, waited=time.monotonic() - t0) from None
        slot = _WorkSlot(work, deadline - time.monotonic())
        with st.cond:
            self._waitq.append(slot)
            st.cond.notify_all()
        failed = None
        if meanwhile is not None:
            try:
                meanwhile()
            except Exception as e:  # raised once the posted receive is over, as below
                failed = TransferError(f"hashing a received piece failed: {e!r}", peer=st.peer)
        with st.cond:
            err = self._await(slot, deadline, t0, key) or failed
        if err is not None:
            self._cancel(slot.work)
            raise err

    def _await(self, slot: _WorkSlot, deadline: float, t0: float, key: str | None):
        """The error that ends the wait for ``slot`` (None: it completed). Holds ``state.cond``."""
        st = self._state
        grace_deadline = None
        while not slot.done:
            if st.closing:
                return PipeClosedError(
                    "pipe closed during receive",
                    peer=st.peer,
                    key=key,
                    waited_s=time.monotonic() - t0,
                )
            if st.peer_gone is not None and grace_deadline is None:
                grace_deadline = time.monotonic() + self._dead_grace_s
            wake = deadline if grace_deadline is None else min(deadline, grace_deadline)
            left = wake - time.monotonic()
            if left <= 0:
                break
            st.cond.wait(left)
        if slot.done and slot.exc is None:
            return None
        waited = time.monotonic() - t0
        if not slot.done:
            if grace_deadline is not None and time.monotonic() >= grace_deadline:
                return st.gone_error(key, waited)
            st.counters["recv_timeouts"] += 1
            return TransferTimeout(
                "payload did not arrive before the deadline",
                peer=st.peer,
                key=key,
                waited_s=waited,
            )
        if st.peer_gone is not None:
            return st.gone_error(key, waited)
        return classify_failure(slot.exc, peer=st.peer, key=key, waited=waited)

    def _cancel(self, work) -> None:
        """Make sure a receive that recv gives up on writes nothing more (the pipe is broken).

        gloo: a wait that times out makes gloo close the connection, under the lock its reading
        thread holds while it writes into receive buffers, before the wait returns; so once the
        1 ms wait below returned (completed, failed or timed out), no byte lands any more. (A
        process-group ``abort`` is a no-op for gloo, and torch does not expose ``Work.abort``.)
        nccl: the group is aborted.
        """
        try:
            if self._pipe.transport == "nccl":
                pg = self._pipe.process_group
                if pg is not None:
                    pg.abort()
            else:
                work.wait(datetime.timedelta(milliseconds=1))
        except Exception:  # the failure is what was asked for
            pass

    def _loop(self) -> None:
        st = self._state
        while True:
            with st.cond:
                while not self._waitq and not st.closed:
                    st.cond.wait()
                if not self._waitq:
                    return
                slot = self._waitq[0]
            exc = None
            try:
                slot.work.wait(datetime.timedelta(seconds=slot.timeout_s))
                if self._pipe.transport == "nccl":
                    torch.cuda.current_stream(self._pipe.device).synchronize()
            except BaseException as e:
                exc = e
            with st.cond:
                self._waitq.popleft()
                slot.exc = exc
                slot.done = True
                st.cond.notify_all()

    def start(self) -> None:
        if self.thread is not None:
            self.thread.start()

    def join(self, deadline: float) -> None:
        join_until(self.thread, deadline)

    @property
    def waiting(self) -> bool:
        """The waiter thread still runs (it may hold a receive the group cannot cancel)."""
        return self.thread is not None and self.thread.is_alive()
