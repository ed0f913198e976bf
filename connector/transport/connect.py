"""The connector side: :func:`connect_pipe` (the protocol: :mod:`connector.transport.handshake`)."""

from __future__ import annotations

import socket
import time

import torch

from . import auth
from .errors import PeerDeadError, TransferTimeout
from .handshake import Request, authenticate_connector, open_pipe
from .options import PipeOptions, check_options, check_timeout, check_transport
from .pipe import TensorPipe
from .sockio import configure


def connect_pipe(
    host: str,
    port: int,
    *,
    transport: str = "gloo",
    device: str | torch.device = "cpu",
    connect_timeout_s: float = 10.0,
    secret: bytes | str | None = None,
    options: PipeOptions | None = None,
) -> TensorPipe:
    """Connect to a :class:`~connector.transport.listener.PipeListener` and return the
    connector-side pipe (rank 1).

    ``secret``: the shared secret (:mod:`connector.transport.auth`; at least 32 bytes), which the
    listener must hold too; None only for a listener that has none.

    Raises PeerDeadError (refused / closed), TransferTimeout (no answer within
    ``connect_timeout_s``), AuthError (secrets differ, or only one side has one), RemoteError
    (the listener refused the transport) or ProtocolError.
    """
    secret = auth.check_secret(secret)
    check_transport(transport)
    connect_timeout_s = check_timeout("connect_timeout_s", connect_timeout_s)
    options = check_options(options)
    peer = f"{host}:{port}"
    t0 = time.monotonic()
    deadline = t0 + connect_timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except TimeoutError:
        raise TransferTimeout(
            "connect timed out", peer=peer, waited_s=time.monotonic() - t0
        ) from None
    except OSError as e:
        raise PeerDeadError(
            f"cannot connect: {e}", peer=peer, waited_s=time.monotonic() - t0
        ) from None
    try:
        configure(sock)
        authenticate_connector(sock, secret, options.limits, deadline, peer)
        return open_pipe(
            sock,
            peer,
            Request(transport, host),
            device=device,
            options=options,
            t0=t0,
            deadline=deadline,
        )
    except BaseException:
        sock.close()
        raise
