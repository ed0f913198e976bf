"""How a connection becomes a :class:`~connector.transport.pipe.TensorPipe`: the protocol of one
connection, and the routines both ends run (:func:`~connector.transport.connect.connect_pipe` on
one side, :class:`~connector.transport.listener.PipeListener` on the other).

Protocol of one connection::

    listener ↔ connector   CHALLENGE / RESPONSE / VERDICT: fixed-size mutual authentication by a
                           shared secret, before anything else is read (:mod:`connector.transport.auth`)
    connector → listener   HELLO      {"proto": 1, "transport": "gloo", "limit.*": its FrameLimits}
    listener  → connector  HELLO_ACK  {"transport", "store_port", "prefix", "limit.*"}
                                      (or ERROR {"error"}); "prefix" is 128 random bits, told
                                      only to an authenticated peer. It is no secret from a
                                      client of the store, which can list the keys (torch's
                                      TCPStore has no authentication; README, Security)
    both                   build the 2-rank process group (rank 0 = listener), unless "socket"
    either way, any number of messages, in order:
                           header (control socket) [+ inline payload | + payload chunks on the
                           process group, in frame.plan_chunks order, tag 0]
    either way             BYE (clean close), then the socket closes

The process group is built from the listener's own ``TCPStore`` under the connection's prefix,
each side through a store client of its own (so a rendezvous left hanging by a vanished peer
delays no other connection's). A listener that must refuse a connection before authenticating
(a KV server at one of its caps) sends an ERROR frame, with a short fixed text, instead of the
CHALLENGE; the connector reads at most 4 KiB of it and quotes at most 200 printable characters
(:func:`peer_text`). One that refuses a peer after it authenticated answers its HELLO with ERROR.

After authentication both sides call :func:`open_pipe`: the connector with the
:class:`Request` it makes, the listener with the :class:`Offer` it answers from. The deadlines
are listed in :mod:`connector.transport.pipe`.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

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
from .sockio import read_fixed, read_handshake_frame, send_all, send_error_frame
from .threads import transfer_thread

AUTH_TIMEOUT_S = 5.0  # the listener's cap on a connection's authentication
MAX_REFUSAL_BYTES = 4096  # the largest refusal (ERROR in place of the CHALLENGE) a connector reads
MAX_PEER_TEXT = 200  # characters of a peer's text that reach an exception (peer_text)
PROTO = 1  # the HELLO exchange's version


# ----------------------------------------------------------------------------------------------
# Authentication on the socket (the messages themselves: connector.transport.auth)
# ----------------------------------------------------------------------------------------------
def authenticate_connector(
    sock: socket.socket, secret: bytes | None, limits: FrameLimits, deadline: float, peer: str
) -> None:
    """The connector's side of the authentication. A listener that refused the connection
    before authenticating (an ERROR frame in place of the CHALLENGE) raises RemoteError."""
    raw = read_fixed(sock, len(MAGIC), deadline, peer, "auth challenge")
    if raw == MAGIC:  # a frame instead: the listener refused us before authenticating
        raise _read_refusal(sock, limits, deadline, peer)
    raw += read_fixed(sock, auth.CHALLENGE.size - len(MAGIC), deadline, peer, "auth challenge")
    required, nonce_l = auth.parse_challenge(raw, peer)
    response, nonce_c = auth.respond(secret, required, nonce_l, peer)
    try:
        send_all(sock, response, deadline, "auth response")
    except (TimeoutError, OSError) as e:
        raise PeerDeadError(f"cannot authenticate: {e}", peer=peer) from None
    raw = read_fixed(sock, auth.VERDICT.size, deadline, peer, "auth verdict")
    auth.check_verdict(secret, nonce_l, nonce_c, raw, peer)


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
) -> str | None:
    """The listener's side of the authentication, within :data:`AUTH_TIMEOUT_S` of ``t0``:
    a stranger gets a fixed-size exchange and nothing else. ``on_auth`` runs once the outcome is
    decided, before the peer hears of it, on every path past the start (see
    ``PipeListener.handshake``); a refusal raises it. Returns what ``on_auth`` returned for an
    authenticated peer: None, or why the listener refuses it anyway (told in place of HELLO_ACK)."""
    challenge, nonce_l = auth.challenge(secret is not None)
    auth_deadline = min(deadline, t0 + AUTH_TIMEOUT_S)
    refused = verdict = None
    try:
        send_all(sock, challenge, auth_deadline, "auth challenge")
        raw = read_fixed(sock, auth.RESPONSE.size, auth_deadline, peer, "auth response")
    except (TransferError, TimeoutError, OSError) as e:  # a peer that never finished
        detail = e.detail if isinstance(e, TransferError) else f"cannot send the challenge: {e}"
        refused = auth.AuthError(
            f"authentication not completed: {detail}", peer=peer, waited_s=time.monotonic() - t0
        )
    else:
        accepted, verdict = auth.check_response(secret, nonce_l, raw)
        if not accepted:
            refused = auth.AuthError(
                "the connector failed authentication (wrong secret)",
                peer=peer,
                waited_s=time.monotonic() - t0,
            )
    refusal = on_auth(refused) if on_auth is not None else None
    if verdict is not None:
        with contextlib.suppress(TimeoutError, OSError):
            send_all(sock, verdict, auth_deadline, "auth verdict")
    if refused is not None:
        raise refused from None
    return refusal


# ----------------------------------------------------------------------------------------------
# HELLO / HELLO_ACK, then the process group and the pipe
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """What the connector asks for: a ``transport``, from the listener on ``host``."""

    transport: str
    host: str


@dataclass(frozen=True)
class Offer:
    """What a listener answers from: the ``transports`` it accepts and its rendezvous store
    (the ``TCPStore`` server ``store()`` returns once HELLO arrived, None once the listener
    closed); ``conn_id`` numbers the connection's prefix. With a ``refusal`` (a server's cap on
    open connections), the HELLO is answered by an ERROR saying it, and PipeClosedError raised."""

    transports: frozenset[str]
    store_host: str
    store: Callable[[], object | None]
    conn_id: int
    refusal: str | None = None


@dataclass(frozen=True)
class _Agreed:
    """What the HELLO exchange settled: the transport, the peer's limits, and (not for
    ``socket``) where the rendezvous store is and the connection's prefix in it."""

    transport: str
    peer_limits: FrameLimits
    store_host: str = ""
    store_port: int = 0
    prefix: str = ""
    server: object = None  # the listener's store server, kept alive until the pipe is built


def open_pipe(
    sock: socket.socket,
    peer: str,
    side: Request | Offer,
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
        rank, agreed = 1, _hello_as_connector(sock, peer, side, options, t0, deadline)
    else:
        rank, agreed = 0, _hello_as_listener(sock, peer, side, options, deadline)
    pg, refs = None, ()
    if agreed.transport != "socket":
        from torch.distributed import PrefixStore, TCPStore

        try:
            # A store client of its own: a TCPStore client runs one request at a time, so a
            # rendezvous left waiting by a vanished peer would hold up every other one.
            left = datetime.timedelta(seconds=max(0.1, deadline - time.monotonic()))
            store = TCPStore(agreed.store_host, agreed.store_port, None, False, left)
            refs = (store,)
            pg = make_process_group(
                agreed.transport,
                PrefixStore(agreed.prefix, store),
                rank,
                sock.getsockname()[0],
                max(0.1, deadline - time.monotonic()),
            )
        except Exception as e:
            raise classify_failure(e, peer=peer, key=None, waited=time.monotonic() - t0) from None
    return TensorPipe(
        sock,
        peer=peer,
        transport=agreed.transport,
        process_group=pg,
        peer_rank=1 - rank,
        device=device,
        peer_limits=agreed.peer_limits,
        extra_refs=refs,
        options=options,
    )


def _hello_as_connector(
    sock, peer: str, req: Request, options: PipeOptions, t0: float, deadline: float
) -> _Agreed:
    limits = options.limits
    try:
        hello = {"proto": PROTO, "transport": req.transport, **limits_meta(limits)}
        send_all(sock, encode_header(Kind.HELLO, "", hello), deadline, "HELLO")
    except (TimeoutError, OSError) as e:
        raise PeerDeadError(
            f"cannot send HELLO: {e}", peer=peer, waited_s=time.monotonic() - t0
        ) from None
    h = read_handshake_frame(sock, limits, deadline, options.frame_timeout_s, peer, "HELLO_ACK")
    if h.kind == Kind.ERROR:
        raise RemoteError(
            f"listener refused: {peer_text(h.meta.get('error'))}",
            peer=peer,
            waited_s=time.monotonic() - t0,
        )
    if h.kind != Kind.HELLO_ACK or h.meta.get("transport") != req.transport:
        raise ProtocolError(
            f"expected HELLO_ACK for transport {req.transport!r}, got {kind_name(h.kind)} "
            f"{peer_text(str(h.meta))}",
            peer=peer,
        )
    peer_limits = limits_from_meta(h.meta, limits)
    if req.transport == "socket":
        return _Agreed("socket", peer_limits)
    store_port = h.meta.get("store_port")
    prefix = h.meta.get("prefix")
    if not isinstance(store_port, int) or not isinstance(prefix, str) or not prefix:
        raise ProtocolError(
            f"HELLO_ACK lacks store_port/prefix: {peer_text(str(h.meta))}", peer=peer
        )
    return _Agreed(req.transport, peer_limits, req.host, store_port, prefix)


def _hello_as_listener(
    sock, peer: str, offer: Offer, options: PipeOptions, deadline: float
) -> _Agreed:
    limits = options.limits
    h = read_handshake_frame(sock, limits, deadline, options.frame_timeout_s, peer, "HELLO")
    if h.kind != Kind.HELLO:
        raise ProtocolError(f"expected HELLO, got {kind_name(h.kind)}", peer=peer)
    if offer.refusal is not None:  # read the HELLO first: closing on unread bytes resets
        send_error_frame(sock, offer.refusal)
        raise PipeClosedError(f"refused after authentication: {offer.refusal}", peer=peer)
    transport = h.meta.get("transport")
    if h.meta.get("proto") != PROTO or transport not in offer.transports:
        msg = (
            f"expected proto {PROTO} and transport in {sorted(offer.transports)}, got proto "
            f"{peer_text(repr(h.meta.get('proto')))} transport {peer_text(repr(transport))}"
        )
        send_error_frame(sock, msg)
        raise ProtocolError(msg, peer=peer)
    peer_limits = limits_from_meta(h.meta, limits)
    if transport == "socket":
        agreed = _Agreed("socket", peer_limits)
        ack = {"transport": "socket"}
    elif (server := offer.store()) is None:
        raise PipeClosedError("listener closed during the handshake", peer=peer)
    else:
        prefix = f"tkv/{offer.conn_id}-{secrets.token_hex(16)}/"
        agreed = _Agreed(transport, peer_limits, offer.store_host, server.port, prefix, server)
        ack = {"transport": transport, "store_port": server.port, "prefix": prefix}
    ack.update(limits_meta(limits))
    send_all(sock, encode_header(Kind.HELLO_ACK, "", ack), deadline, "HELLO_ACK")
    return agreed


# ----------------------------------------------------------------------------------------------
# Process groups
# ----------------------------------------------------------------------------------------------
def make_process_group(transport: str, store, rank: int, local_host: str, timeout_s: float):
    """Two-rank process group on ``store`` (never the default group), built within ``timeout_s``.

    Gloo's rendezvous does not always honour its own timeout (a connect inside a busy vLLM TP
    worker was seen taking 38 s past a 5 s deadline), so the group is built on a helper thread and
    abandoned with a TimeoutError at the deadline; the thread ends when gloo gives up.
    """
    result: dict[str, object] = {}

    def build() -> None:
        try:
            result["pg"] = _build_process_group(transport, store, rank, local_host, timeout_s)
        except BaseException as e:  # handed to the caller below
            result["error"] = e

    worker = transfer_thread(build, "tkv-pg-rendezvous")  # gloo's own threads start from it
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"{transport} rendezvous not done within {timeout_s:.1f} s")
    error = result.get("error")
    if isinstance(error, torch.distributed.DistStoreError) and "timeout" in str(error).lower():
        # gloo's own wait on the store ended first (same deadline): the same TimeoutError
        msg = f"{transport} rendezvous not done within {timeout_s:.1f} s ({error})"
        raise TimeoutError(msg) from error
    if error is not None:
        raise error
    return result["pg"]


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

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"transport: expected 'gloo' or 'nccl' for a process group, got {transport!r}")
