"""The sending half of a :class:`~connector.transport.pipe.TensorPipe` (part of the pipe, not
exported): the queue of outgoing messages, the in-flight byte budget and the sender thread."""

from __future__ import annotations

import collections
import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tritonkv import umac

from ..logs import get_logger, hide_ids
from . import staging
from .buffers import flat_bytes, staging_buffer
from .errors import PeerDeadError, PipeClosedError, TransferTimeout, classify_failure
from .frame import FLAG_INLINE, Kind, encode_header, encode_meta, pieces, plan_chunks, spec_of
from .sockio import PeerClosed, send_all, send_frame
from .state import _PipeState
from .threads import join_until, transfer_thread

log = get_logger("transport")

TAG = 0  # the process-group tag of every payload chunk


@dataclass
class _Outgoing:
    """One queued message: its encoded header and the tensors of its payload."""

    header: bytes
    key: str
    specs: tuple
    tensors: list  # contiguous tensors in spec order
    inline: bool
    nbytes: int
    on_done: Callable[[BaseException | None], None] | None
    bye: bool = False
    reported: bool = False  # on_done already called (exactly once per message)
    copies: object = None  # staged device tensors: their staging.DeviceCopies, and
    ready: object = None  # the event recorded on the caller's stream when queued
    entry_nh: dict | None = None  # name -> NH outputs under the entry's key (process group only)


def _outgoing(
    pipe,
    kind: Kind,
    key: str,
    tensors: dict[str, torch.Tensor] | None,
    meta: dict | None,
    on_done: Callable[[BaseException | None], None] | None,
    entry_nh: dict[str, torch.Tensor] | None = None,
) -> _Outgoing:
    """One message as ``pipe``'s sender writes it: tensors made contiguous (on the pipe's device
    for ``nccl``; gloo and socket carry host memory, so the sender thread stages a device tensor
    through pinned host buffers, see :mod:`.staging`, after an event recorded here on the
    caller's stream), inline or not, small ones packed; the tensors of ``entry_nh`` marked as
    hashed under their entry's key when the payload goes on the process group (an inline one
    has its frame's MAC). Raises TypeError for what is not a tensor dict, ValueError for what
    the peer's limits refuse or NH outputs of the wrong shape."""
    tensors = {} if tensors is None else tensors
    if not isinstance(tensors, dict):
        raise TypeError(
            f"tensors: expected dict[str, Tensor] or None, got {type(tensors).__name__}"
        )
    meta_bytes = encode_meta(meta, pipe.peer_limits)
    names = list(tensors)
    flat = []
    copies = None
    for n in names:
        spec_of(n, tensors[n])  # type checks
        t = tensors[n]
        if pipe.transport == "nccl":
            flat.append((t if t.device.type == "cuda" else t.to(pipe.device)).contiguous())
        else:
            flat.append(t.contiguous())
            copies = copies or staging.copies_for(t.device)
    total = sum(t.numel() * t.element_size() for t in flat)
    inline = goes_inline(pipe, total, staged=copies is not None)
    small = [
        i for i, t in enumerate(flat) if 0 < t.numel() * t.element_size() <= pipe.pack_max_bytes
    ]
    pack = set(small) if (not inline and len(small) >= 2) else set()
    specs = tuple(
        spec_of(n, t, packed=i in pack) for i, (n, t) in enumerate(zip(names, flat, strict=False))
    )
    entry_nh = None if inline else _check_entry_nh(entry_nh, tensors)
    specs = tuple(
        spec_of(s.name, t, s.packed, entry_nh=entry_nh is not None and s.name in entry_nh)
        for s, t in zip(specs, flat, strict=True)
    )
    flags = FLAG_INLINE if inline else 0
    # what the peer would refuse raises here (ValueError): it never breaks the pipe
    header = encode_header(kind, key, meta_bytes, specs, flags, limits=pipe.peer_limits, check=True)
    ready = None if copies is None else copies.ready()
    out = _Outgoing(header, key, specs, flat, inline, total, on_done, copies=copies, ready=ready)
    out.entry_nh = entry_nh
    return out


def goes_inline(pipe, nbytes: int, staged: bool = False) -> bool:
    """Whether a message of ``nbytes`` payload bytes travels inline on ``pipe``'s control
    connection (under the frames' MAC), not on its process group (under a umac tag); ``staged``:
    its tensors are copied through host memory first, which only the process group's are."""
    return pipe.transport == "socket" or (nbytes <= pipe.inline_max_bytes and not staged)


def _check_entry_nh(entry_nh, tensors: dict) -> dict | None:
    """``entry_nh`` (None, or name -> ``[umac.num_chunks(nbytes), 2]`` int64 NH outputs of
    that tensor of ``tensors``) if well-formed; TypeError / ValueError otherwise."""
    if entry_nh is None:
        return None
    if not isinstance(entry_nh, dict):
        raise TypeError(
            f"entry_nh: expected dict[str, Tensor] or None, got {type(entry_nh).__name__}"
        )
    for name, outputs in entry_nh.items():
        if name not in tensors:
            raise ValueError(f"entry_nh: {name!r} is not a tensor of the message")
        t = tensors[name]
        want = (umac.num_chunks(t.numel() * t.element_size()), umac.ITERATIONS)
        if (
            not isinstance(outputs, torch.Tensor)
            or outputs.dtype != torch.int64
            or tuple(outputs.shape) != want
        ):
            got = (
                f"{outputs.dtype} {list(outputs.shape)}"
                if isinstance(outputs, torch.Tensor)
                else type(outputs).__name__
            )
            raise ValueError(
                f"entry_nh[{name!r}]: expected int64 NH outputs {list(want)}, got {got}"
            )
    return entry_nh


class _Sender:
    """The sender thread (``tkv-pipe[peer]-send``) and what it sends.

    ``submit`` only queues (within the pipe's ``max_inflight_bytes`` of queued or in-flight
    payload); the thread writes each header on the control socket, then the payload inline or
    as process-group sends (``pipe.process_group``, read per message), within ``io_timeout_s``.
    A failure breaks the pipe (``state.fatal``); every message's ``on_done`` runs exactly once.
    """

    def __init__(self, pipe, state: _PipeState, sock, name: str):
        self._pipe = pipe
        self._state = state
        self._sock = sock
        self.max_inflight_bytes = pipe.max_inflight_bytes
        self.io_timeout_s = pipe.io_timeout_s
        self.outq: collections.deque[_Outgoing] = collections.deque()
        self.inflight = 0  # payload bytes queued or in flight
        self.current: _Outgoing | None = None  # the message the thread is writing
        self.thread = transfer_thread(self._loop, name)

    @property
    def busy(self) -> bool:
        """Messages are queued or in flight. Holds ``state.cond``."""
        return bool(self.outq or self.inflight)

    def submit(self, item: _Outgoing, timeout_s: float, check_usable: Callable[[str], None]):
        """Queue ``item`` once the in-flight budget has room for it (a message larger than the
        budget is admitted when nothing else is in flight); TransferTimeout after ``timeout_s``.
        ``check_usable(key)`` raises if the pipe cannot be used (checked on every wake-up)."""
        st = self._state
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        total = item.nbytes
        with st.cond:
            while True:
                check_usable(item.key)
                if self.inflight == 0 or self.inflight + total <= self.max_inflight_bytes:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    st.counters["send_timeouts"] += 1
                    raise TransferTimeout(
                        f"send blocked: {self.inflight} bytes in flight, budget "
                        f"{self.max_inflight_bytes}, message {total} bytes",
                        peer=st.peer,
                        key=item.key,
                        waited_s=time.monotonic() - t0,
                    )
                st.cond.wait(left)
            self.inflight += total
            self.outq.append(item)
            st.cond.notify_all()

    def flush(self, timeout_s: float) -> None:
        """Wait until every queued message has left; raises the pipe's error or TransferTimeout."""
        st = self._state
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        with st.cond:
            while self.busy:
                st.raise_fatal()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(
                        f"flush: {self.inflight} bytes still in flight",
                        peer=st.peer,
                        waited_s=time.monotonic() - t0,
                    )
                st.cond.wait(left)
            st.raise_fatal()

    def _loop(self) -> None:
        st = self._state
        while True:
            with st.cond:
                while not self.outq:
                    if st.closed:  # close() gave up on a send stuck here and dropped the BYE
                        return
                    st.cond.wait()
                item = self.outq.popleft()
                self.current = item
            if item.bye:
                self.send_bye()
                return
            err = None
            if st.fatal is not None:
                err = PipeClosedError(
                    f"not sent, pipe is broken: {st.fatal}", peer=st.peer, key=item.key
                )
            else:
                t0 = time.monotonic()
                try:
                    self._write(item, t0 + self.io_timeout_s)
                except BaseException as e:
                    waited = time.monotonic() - t0
                    err = classify_failure(e, peer=st.peer, key=item.key, waited=waited)
                    if isinstance(e, PeerClosed):
                        err = PeerDeadError(str(e), peer=st.peer, key=item.key, waited_s=waited)
                    log.warning("tensor pipe send failed: %s", hide_ids(str(err)))
                    st.set_fatal(err)
            with st.cond:
                self.inflight -= item.nbytes
                self.current = None
                if err is None:
                    st.counters["msgs_sent"] += 1
                    st.counters["bytes_sent"] += item.nbytes
                st.cond.notify_all()
            self.report(item, err)

    def send_bye(self) -> None:
        """Say goodbye on the control socket (best effort, within 1 s; not on a broken pipe)."""
        if self._state.fatal is None:
            with contextlib.suppress(Exception):
                bye = encode_header(Kind.BYE)
                send_frame(self._sock, self._pipe.session, bye, time.monotonic() + 1.0, "BYE")

    def report(self, item: _Outgoing, err: BaseException | None) -> None:
        """Run ``item.on_done`` exactly once."""
        with self._state.cond:
            if item.reported or item.on_done is None:
                return
            item.reported = True
        try:
            item.on_done(err)
        except Exception:
            log.exception("tensor pipe on_done callback failed")

    def _write(self, item: _Outgoing, deadline: float) -> None:
        # the sender thread is the pipe's only writer: frames are sealed in the order they leave
        mac = self._pipe.session.sending(item.header)
        head = item.header + mac.header_tag()
        if not item.inline and item.nbytes:  # a process-group payload: its umac tag follows
            head += self._payload_tag(item, mac.counter)
        send_all(self._sock, head, deadline, f"header of {item.key!r}")
        if item.inline:
            what = f"inline payload of {item.key!r}"
            for t in item.tensors:
                ps = self._pieces(item, flat_bytes(t), staging.copies_for(t.device), deadline, what)
                with contextlib.closing(ps):
                    for piece in ps:
                        view = piece.numpy()
                        mac.update(view)
                        send_all(self._sock, view, deadline, what)
            if item.nbytes:
                send_all(self._sock, mac.payload_tag(), deadline, what)
            return
        pipe = self._pipe
        pg = pipe.process_group
        what = f"payload of {item.key!r}"
        for chunk in plan_chunks(item.specs):
            if chunk.members:  # assembled where it can be sent from
                src, copies = self._packed(item, chunk, deadline, what), None
            else:
                src = flat_bytes(item.tensors[chunk.index])
                copies = None if pipe.transport == "nccl" else staging.copies_for(src.device)
            with contextlib.closing(self._pieces(item, src, copies, deadline, what)) as ps:
                for piece in ps:  # the next piece's staging copy runs while this one is sent
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"timed out before sending {what}")
                    work = pg.send([piece], pipe.peer_rank, TAG)
                    work.wait(datetime.timedelta(seconds=left))
                    if pipe.transport == "nccl":
                        torch.cuda.current_stream(piece.device).synchronize()

    def _payload_tag(self, item: _Outgoing, counter: int) -> bytes:
        """The :mod:`tritonkv.umac` tag of ``item``'s tensors (in header order) under the keys of
        frame ``counter`` (:meth:`~.session.Session.payload_keys`): a pass over the payload on
        its device before anything is sent (on this thread's stream, after what the caller's
        stream had queued when the message was queued; the tag's read synchronises)."""
        if isinstance(item.ready, torch.cuda.Event):  # staged CUDA tensors
            torch.cuda.current_stream(item.copies.device).wait_event(item.ready)
        keys = self._pipe.session.payload_keys(counter, sending=True)
        given = item.entry_nh or {}
        parts = [
            (s.nbytes, given[s.name] if s.entry_nh else umac.nh_hash(t, keys))
            for s, t in zip(item.specs, item.tensors, strict=True)
        ]
        return umac.tag_of_outputs(keys, parts)

    def _pieces(self, item: _Outgoing, src: torch.Tensor, copies, deadline: float, what: str):
        """``src`` (uint8, 1-D) as the pieces that go out: staged to the host by ``copies`` (not
        None) piece by piece, the next piece's copy overlapping this one's send."""
        if copies is not None:
            yield from staging.to_host_pieces(copies, src, item.ready, deadline, what)
            return
        for off, n in pieces(src.numel()):
            yield src[off : off + n]

    def _packed(self, item: _Outgoing, chunk, deadline: float, what: str) -> torch.Tensor:
        """The packed chunk's bytes in one buffer: where the tensors are (the pipe's device for
        nccl), or in pinned host memory when they are staged (copied straight into it)."""
        if item.copies is None:
            buf = torch.empty(chunk.nbytes, dtype=torch.uint8, device=item.tensors[0].device)
        else:
            buf = staging_buffer(chunk.nbytes)
        pairs = []
        for i, off in chunk.members:
            src = flat_bytes(item.tensors[i])
            pairs.append((buf[off : off + src.numel()], src))
        # without staging (nccl: on the sender's stream, which the send then synchronizes)
        staging.copy_all(item.copies, pairs, item.ready, deadline, what)
        return buf

    # ------------------------------------------------------------------------- for close()
    def on_thread(self) -> bool:
        """The caller is the sender thread (an ``on_done`` callback)."""
        return threading.current_thread() is self.thread

    def queue_bye(self) -> None:
        """Queue the goodbye behind every message queued so far. Holds ``state.cond``."""
        self.outq.append(_Outgoing(b"", "", (), [], True, 0, None, bye=True))

    def join(self, deadline: float) -> None:
        join_until(self.thread, deadline)

    def take_unsent(self) -> list[_Outgoing]:
        """Messages that never left, and the one stuck on the thread (if it still runs): the
        queue is emptied and their bytes leave the budget; the caller reports them."""
        with self._state.cond:
            pending = [it for it in self.outq if not it.bye]
            self.outq.clear()
            for it in pending:
                self.inflight -= it.nbytes
            if self.current is not None and self.thread.is_alive():
                pending.insert(0, self.current)
        return pending
