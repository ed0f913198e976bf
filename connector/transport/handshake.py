"""How a connection becomes a :class:`~connector.transport.pipe.TensorPipe`: the protocol of one
connection, and the routines both ends run (:func:`~connector.transport.connect.connect_pipe` on
one side, :class:`~connector.transport.listener.PipeListener` on the other).

Protocol of one connection::

    listener ↔ connector   CHALLENGE / RESPONSE / VERDICT: fixed-size mutual authentication by a
                           shared secret, bound to the address the connector reached, before
                           anything else is read (:mod:`connector.transport.auth`); it gives the
                           session keys. Every frame from here on carries a session tag
                           (:mod:`connector.transport.session`)
    connector → listener   HELLO      {"proto": 2, "transport": "gloo", "limit.*": its FrameLimits}
    listener  → connector  HELLO_ACK  {"transport", "limit.*"}  (or ERROR {"error"})
    both                   unless "socket": the 2-rank process group (rank 0 = listener), its
                           store carried by RENDEZVOUS frames on this socket, then a keyed probe
                           over the group (:mod:`connector.transport.rendezvous`)
    either way, any number of messages, in order:
                           header (control socket) [+ inline payload | + payload chunks on the
                           process group, in frame.plan_chunks order, tag 0]
    either way             BYE (clean close), then the socket closes

No other port is opened for a connection than gloo's own pair listener (bound to the address of
the connection's socket, authenticating nothing: the probe is what proves the group's peer).
A listener that must refuse a connection before authenticating (a KV server at one of its caps)
sends an ERROR frame, with a short fixed text, instead of the CHALLENGE; the connector reads at
most 4 KiB of it and quotes at most 200 printable characters (:func:`peer_text`). One that
refuses a peer after it authenticated answers its HELLO with ERROR.

After authentication both sides call :func:`open_pipe`: the connector with the
:class:`Request` it makes, the listener with the :class:`Offer` it answers from. The deadlines
are listed in :mod:`connector.transport.pipe`.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..logs import get_logger
from . import auth
from .errors import (
    PeerDeadError,
    PipeClosedError,
    ProtocolError,
    RemoteError,
    TransferError,
    classify_failure,
)
from .frame import (
    MAGIC,
    PREFIX_SIZE,
    FrameLimits,
    Kind,
    decode_body,
    decode_prefix,
    encode_header,
    kind_name,
    limits_from_meta,
    limits_meta,
)
from .options import PipeOptions
from .pipe import TensorPipe
from .rendezvous import ChannelStore, probe
from .session import Session
from .sockio import read_fixed, read_handshake_frame, send_all, send_error_frame, send_frame
from .threads import transfer_thread

log = get_logger("transport")

AUTH_TIMEOUT_S = 5.0  # the listener's cap on a connection's authentication
MAX_REFUSAL_BYTES = 4096  # the largest refusal (ERROR in place of the CHALLENGE) a connector reads
MAX_PEER_TEXT = 200  # characters of a peer's text that reach an exception (peer_text)
NCCL_WATCHDOG_S = 6 * 3600  # an NCCL group's own timeout (see _build_process_group)
PROTO = 2  # the HELLO exchange's version (2: no store port, no prefix)


# ----------------------------------------------------------------------------------------------
# Authentication on the socket (the messages themselves: connector.transport.auth)
# ----------------------------------------------------------------------------------------------
def authenticate_connector(
    sock: socket.socket, secret: bytes | None, limits: FrameLimits, deadline: float, peer: str
) -> Session:
    """The connector's side of the authentication; returns the session. A listener that refused
    the connection before authenticating (an ERROR frame in place of the CHALLENGE) raises
    RemoteError."""
    raw = read_fixed(sock, len(MAGIC), deadline, peer, "auth challenge")
    if raw == MAGIC:  # a frame instead: the listener refused us before authenticating
        raise _read_refusal(sock, limits, deadline, peer)
    raw += read_fixed(sock, auth.CHALLENGE.size - len(MAGIC), deadline, peer, "auth challenge")
    required, nonce_l = auth.parse_challenge(raw, peer)
    address = auth.address_text(sock.getpeername())
    response, nonce_c = auth.respond(secret, required, nonce_l, address, peer)
    try:
        send_all(sock, response, deadline, "auth response")
    except (TimeoutError, OSError) as e:
        raise PeerDeadError(f"cannot authenticate: {e}", peer=peer) from None
    raw = read_fixed(sock, auth.VERDICT.size, deadline, peer, "auth verdict")
    auth.check_verdict(secret, nonce_l, nonce_c, address, raw, peer)
    return Session.pair(*auth.session_keys(secret, nonce_l, nonce_c, address), listener=False)


def peer_text(value: object) -> str:
    """Text a peer sent (a refusal's reason, a header's meta), fit for an exception or a log line
    whoever the peer is: printable ASCII only (any other character, control characters among
    them, becomes ``?``), at most :data:`MAX_PEER_TEXT` characters (a longer one is cut and ends
    in ``...``). Anything but a str is named by its type only."""
    if not isinstance(value, str):
        return f"<{type(value).__name__}>"
    cut = value[: MAX_PEER_TEXT + 1]
    text = "".join(c if " " <= c <= "~" else "?" for c in cut)
    return text if len(text) <= MAX_PEER_TEXT else text[: MAX_PEER_TEXT - 3] + "..."


def _read_refusal(sock, limits: FrameLimits, deadline: float, peer: str) -> TransferError:
    """The error for a listener's refusal before authentication: an ERROR frame, whose magic was
    read already, of at most :data:`MAX_REFUSAL_BYTES` (a larger one is not read). Whatever the
    stranger wrote reaches the error only through :func:`peer_text`."""
    raw = MAGIC + read_fixed(sock, PREFIX_SIZE - len(MAGIC), deadline, peer, "refusal")
    try:
        kind, flags, body_len = decode_prefix(raw, limits)
        if kind != Kind.ERROR:
            raise ProtocolError(f"expected an auth challenge or an ERROR, got {kind_name(kind)}")
        if body_len > MAX_REFUSAL_BYTES:
            return RemoteError(
                f"listener refused, giving a reason of {body_len} bytes (over "
                f"{MAX_REFUSAL_BYTES}: not read)",
                peer=peer,
            )
        body = read_fixed(sock, body_len, deadline, peer, "refusal")
        h = decode_body(kind, flags, body, limits)
    except ProtocolError as e:
        raise ProtocolError(f"malformed refusal: {peer_text(e.detail)}", peer=peer) from None
    return RemoteError(f"listener refused: {peer_text(h.meta.get('error'))}", peer=peer)


def authenticate_listener(
    sock: socket.socket,
    secret: bytes | None,
    t0: float,
    deadline: float,
    peer: str,
    on_auth: Callable[[auth.AuthError | None], str | None] | None,
    aliases: frozenset[str] = frozenset(),
) -> tuple[str | None, Session]:
    """The listener's side of the authentication, within :data:`AUTH_TIMEOUT_S` of ``t0``:
    a stranger gets a fixed-size exchange and nothing else. The connector must have reached the
    socket's own local address or one of ``aliases``. ``on_auth`` runs once the outcome is
    decided, before the peer hears of it, on every path past the start (see
    ``PipeListener.handshake``); a refusal raises it. Returns what ``on_auth`` returned for an
    authenticated peer (None, or why the listener refuses it anyway: told in place of
    HELLO_ACK) and the session."""
    challenge, nonce_l = auth.challenge(secret is not None)
    auth_deadline = min(deadline, t0 + AUTH_TIMEOUT_S)
    refused = verdict = outcome = None
    try:
        send_all(sock, challenge, auth_deadline, "auth challenge")
        raw = read_fixed(sock, auth.RESPONSE.size, auth_deadline, peer, "auth response")
    except (TransferError, TimeoutError, OSError) as e:  # a peer that never finished
        detail = e.detail if isinstance(e, TransferError) else f"cannot send the challenge: {e}"
        refused = auth.AuthError(
            f"authentication not completed: {detail}", peer=peer, waited_s=time.monotonic() - t0
        )
    else:
        addresses = aliases | {auth.address_text(sock.getsockname())}
        outcome = auth.check_response(secret, nonce_l, raw, addresses)
        verdict = outcome.verdict
        if outcome.problem is not None:
            refused = auth.AuthError(outcome.problem, peer=peer, waited_s=time.monotonic() - t0)
    refusal = on_auth(refused) if on_auth is not None else None
    if verdict is not None:
        with contextlib.suppress(TimeoutError, OSError):
            send_all(sock, verdict, auth_deadline, "auth verdict")
    if refused is not None:
        raise refused from None
    keys = auth.session_keys(secret, nonce_l, outcome.nonce_c, outcome.address)
    return refusal, Session.pair(*keys, listener=True)


# ----------------------------------------------------------------------------------------------
# HELLO / HELLO_ACK, then the process group and the pipe
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """What the connector asks for: a ``transport``, from its ``device`` (:func:`device_uuid`).
    For ``nccl`` it also takes ``gloo`` (staged through host memory), which the listener picks
    when both ends share one GPU."""

    transport: str
    device: str = ""


@dataclass(frozen=True)
class Offer:
    """What a listener answers from: the ``transports`` it accepts and its ``device``
    (:func:`device_uuid`). With a ``refusal`` (a server's cap on open connections), the HELLO is
    answered by an ERROR saying it, and PipeClosedError raised."""

    transports: frozenset[str]
    device: str = ""
    refusal: str | None = None


def open_pipe(
    sock: socket.socket,
    peer: str,
    side: Request | Offer,
    session: Session,
    *,
    device: str | torch.device,
    options: PipeOptions,
    t0: float,
    deadline: float,
) -> TensorPipe:
    """After authentication: the HELLO exchange as ``side``'s end needs it (a :class:`Request`:
    the connector, rank 1; an :class:`Offer`: the listener, rank 0), the 2-rank process group
    unless the transport is ``socket``, and the pipe, all before ``deadline``. ``t0`` is when
    the connection began (for the time waited that errors report)."""
    if isinstance(side, Request):
        rank, (transport, peer_limits) = (
            1,
            _hello_as_connector(sock, peer, side, session, options, t0, deadline),
        )
    else:
        rank, (transport, peer_limits) = (
            0,
            _hello_as_listener(sock, peer, side, session, options, deadline),
        )
    pg, group_bytes = None, 0
    if transport != "socket":
        try:
            pg, group_bytes = make_process_group(
                transport,
                sock,
                session,
                rank,
                device,
                options,
                deadline,
                peer,
            )
        except TransferError:
            raise
        except Exception as e:
            raise classify_failure(e, peer=peer, key=None, waited=time.monotonic() - t0) from None
    pipe = TensorPipe(
        sock,
        peer=peer,
        transport=transport,
        session=session,
        process_group=pg,
        peer_rank=1 - rank,
        device=device,
        peer_limits=peer_limits,
        options=options,
    )
    pipe.group_device_bytes = group_bytes
    return pipe


def _hello_as_connector(
    sock, peer: str, req: Request, session: Session, options: PipeOptions, t0: float, deadline
) -> tuple[str, FrameLimits]:
    limits = options.limits
    try:
        hello = {"proto": PROTO, "transport": req.transport, "device": req.device}
        if req.transport == "nccl":
            hello["fallback"] = "gloo"
        hello.update(limits_meta(limits))
        send_frame(sock, session, encode_header(Kind.HELLO, "", hello), deadline, "HELLO")
    except (TimeoutError, OSError) as e:
        raise PeerDeadError(
            f"cannot send HELLO: {e}", peer=peer, waited_s=time.monotonic() - t0
        ) from None
    h = read_handshake_frame(
        sock, limits, deadline, options.frame_timeout_s, peer, "HELLO_ACK", session
    )
    if h.kind == Kind.ERROR:
        raise RemoteError(
            f"listener refused: {peer_text(h.meta.get('error'))}",
            peer=peer,
            waited_s=time.monotonic() - t0,
        )
    transport = h.meta.get("transport")
    takes = {req.transport} | ({"gloo"} if req.transport == "nccl" else set())
    if h.kind != Kind.HELLO_ACK or transport not in takes:
        raise ProtocolError(
            f"expected HELLO_ACK for transport {req.transport!r}, got {kind_name(h.kind)} "
            f"{peer_text(str(h.meta))}",
            peer=peer,
        )
    if transport != req.transport:
        log.info("nccl refused by %s (both ends on one GPU, %s): using gloo", peer, req.device)
    return transport, limits_from_meta(h.meta, limits)


def _hello_as_listener(
    sock, peer: str, offer: Offer, session: Session, options: PipeOptions, deadline: float
) -> tuple[str, FrameLimits]:
    limits = options.limits
    h = read_handshake_frame(
        sock, limits, deadline, options.frame_timeout_s, peer, "HELLO", session
    )
    if h.kind != Kind.HELLO:
        raise ProtocolError(f"expected HELLO, got {kind_name(h.kind)}", peer=peer)
    if offer.refusal is not None:  # read the HELLO first: closing on unread bytes resets
        send_error_frame(sock, offer.refusal, session)
        raise PipeClosedError(f"refused after authentication: {offer.refusal}", peer=peer)
    transport = h.meta.get("transport")
    if h.meta.get("proto") != PROTO or transport not in offer.transports:
        msg = (
            f"expected proto {PROTO} and transport in {sorted(offer.transports)}, got proto "
            f"{peer_text(repr(h.meta.get('proto')))} transport {peer_text(repr(transport))}"
        )
        send_error_frame(sock, msg, session)
        raise ProtocolError(msg, peer=peer)
    peer_limits = limits_from_meta(h.meta, limits)
    device = h.meta.get("device")
    if transport == "nccl" and offer.device and device == offer.device:
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): gloo, staged through
        # host memory, if the connector takes it and this listener does
        if h.meta.get("fallback") != "gloo" or "gloo" not in offer.transports:
            msg = f"both ends are on GPU {offer.device}: NCCL cannot connect them; use gloo"
            send_error_frame(sock, msg, session)
            raise ProtocolError(msg, peer=peer)
        transport = "gloo"
    ack = {"transport": transport, **limits_meta(limits)}
    send_frame(sock, session, encode_header(Kind.HELLO_ACK, "", ack), deadline, "HELLO_ACK")
    return transport, peer_limits


# ----------------------------------------------------------------------------------------------
# Process groups
# ----------------------------------------------------------------------------------------------
def make_process_group(
    transport: str,
    sock: socket.socket,
    session: Session,
    rank: int,
    device,
    options: PipeOptions,
    deadline: float,
    peer: str,
):
    """``(group, device bytes)``: a two-rank process group (never the default group), its store
    carried over ``sock`` (:mod:`connector.transport.rendezvous`), probed, within ``deadline``;
    for nccl, the device memory its communicator took outside PyTorch's allocator, measured as
    the drop of the device's free memory across the build and the probe (0 for gloo; anything
    else allocating on the device meanwhile is counted too).

    Gloo's rendezvous does not always honour its own timeout (a connect inside a busy vLLM TP
    worker was seen taking 38 s past a 5 s deadline), so the group is built on a helper thread and
    abandoned with a TimeoutError at the deadline (the caller then closes the socket, which ends
    the helper's reads); the thread ends when gloo gives up.
    """
    result: dict[str, object] = {}
    timeout_s = max(0.1, deadline - time.monotonic())

    store = ChannelStore(sock, session, options.limits, deadline, options.frame_timeout_s, peer)

    def build() -> None:
        try:
            local_host = sock.getsockname()[0]
            free = free_device_bytes(device) if transport == "nccl" else None
            pg = _build_process_group(transport, store, rank, local_host, timeout_s)
            probe(pg, session, rank, device if transport == "nccl" else "cpu", deadline, peer)
            store.finish()
            if free is not None:
                result["bytes"] = max(0, free - free_device_bytes(device))
            result["pg"] = pg
        except BaseException as e:  # handed to the caller below (the store's own error first)
            result["error"] = store.failure or e

    worker = transfer_thread(build, "tkv-pg-rendezvous")  # gloo's own threads start from it
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"{transport} rendezvous not done within {timeout_s:.1f} s")
    error = result.get("error")
    if isinstance(error, TimeoutError) or (
        isinstance(error, RuntimeError) and "timeout" in str(error).lower()
    ):
        msg = f"{transport} rendezvous not done within {timeout_s:.1f} s ({error})"
        raise TimeoutError(msg) from error
    if error is not None:
        raise error
    return result["pg"], result.get("bytes", 0)


def free_device_bytes(device) -> int:
    """Free memory of a CUDA ``device`` as the driver reports it."""
    return torch.cuda.mem_get_info(torch.device(device))[0]


def _build_process_group(transport: str, store, rank: int, local_host: str, timeout_s: float):
    from torch.distributed import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_s)
    if transport == "gloo":
        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
        opts._timeout = timeout
        return ProcessGroupGloo(store, rank, 2, opts)
    if transport == "nccl":  # pragma: no cover - needs two GPUs
        from torch.distributed import ProcessGroupNCCL

        # The group's own timeout is what NCCL's watchdog enforces, and by default (async error
        # handling) it kills the whole process when one operation outlives it. The pipe's
        # deadlines end a slow or stuck transfer first (and abort the group), so the watchdog
        # gets a timeout no transfer of ours can reach: it never kills vLLM for a slow link.
        opts = ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=NCCL_WATCHDOG_S)
        return ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"transport: expected 'gloo' or 'nccl' for a process group, got {transport!r}")
