"""The rendezvous of a connection's process group, over its own authenticated control socket.

Gloo and NCCL build a group from a key-value store: each rank sets what the other must know (gloo:
its pair's socket address; NCCL: the communicator's unique id) and waits for the other's. A
``TCPStore`` would be one more port, with no authentication, that lists its keys to anyone. Here
the store is :class:`ChannelStore`: both ranks' stores mirror each other through RENDEZVOUS
frames on the connection's control socket, sealed like every frame of the session
(:mod:`connector.transport.session`), during the handshake only::

    either way   RENDEZVOUS key=<store key>  {"value": hex}   a set (each key once, <= 4 KiB)
    either way   RENDEZVOUS key=""            {"done": true}   no more sets from this side

After the group is built, each side sends the other a 16-byte token over the group itself,
derived from the session key of its direction (:meth:`Session.token
<connector.transport.session.Session.token>`), and checks the one it receives: whoever else
reached gloo's pair listener first (it authenticates nothing) fails the handshake there. For
NCCL this first send and receive also creates the communicator, while the store still answers.
Then both send ``done`` and read up to the peer's; from there on the socket is the pipe's.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time

import torch
import torch.distributed as dist

from .errors import ProtocolError
from .frame import FrameLimits, Kind, encode_header
from .session import Session
from .sockio import read_handshake_frame, send_frame

MAX_KEYS = 32  # sets one side may make in a rendezvous
MAX_VALUE_BYTES = 4096  # gloo's address is ~170 bytes, an NCCL unique id 128
PROBE = b"tritonkv-rendezvous-probe"


class ChannelStore(dist.Store):
    """A two-rank ``torch.distributed.Store`` over one connection's control socket, for the
    handshake's thread only (not thread-safe beyond a lock; see the module docstring). Every
    blocking call ends by ``deadline`` with TimeoutError."""

    def __init__(
        self,
        sock,
        session: Session,
        limits: FrameLimits,
        deadline: float,
        frame_timeout_s: float,
        peer: str,
    ):
        super().__init__()
        self._sock = sock
        self._session = session
        self._limits = limits
        self._deadline = deadline
        self._frame_timeout_s = frame_timeout_s
        self._peer = peer
        self._values: dict[str, bytes] = {}
        self._ours: set[str] = set()
        self._theirs = 0
        self._peer_done = False
        self._closed = False
        self._lock = threading.RLock()
        self.failure: BaseException | None = None  # what ended a call gloo or NCCL made, if any

    # ------------------------------------------------------------------ the Store methods used
    def set(self, key, value) -> None:
        with self._lock, self._noted():
            value = bytes(value.encode() if isinstance(value, str) else value)
            self._check_open(key)
            if len(value) > MAX_VALUE_BYTES or key in self._values or len(self._ours) >= MAX_KEYS:
                raise ValueError(
                    f"rendezvous set {key!r}: expected a new key (at most {MAX_KEYS}) and a value "
                    f"of at most {MAX_VALUE_BYTES} bytes, got {len(value)} bytes"
                )
            self._values[key] = value
            self._ours.add(key)
            frame = encode_header(Kind.RENDEZVOUS, key, {"value": value.hex()})
            send_frame(self._sock, self._session, frame, self._deadline, "a rendezvous set")

    def get(self, key) -> bytes:
        with self._lock, self._noted():
            self._await([key])
            return self._values[key]

    def wait(self, keys, timeout=None) -> None:  # our deadline stands for ``timeout``
        with self._lock, self._noted():
            self._await(list(keys))

    def check(self, keys) -> bool:
        with self._lock:
            return all(k in self._values for k in keys)

    # ------------------------------------------------------------------------------- the rest
    @contextlib.contextmanager
    def _noted(self):
        """Keep the first error of a call: gloo and NCCL rethrow it as a RuntimeError."""
        try:
            yield
        except BaseException as e:
            self.failure = self.failure or e
            raise

    def _check_open(self, key: str) -> None:
        if self._closed:
            raise RuntimeError(f"rendezvous store used after the handshake (key {key!r})")

    def _await(self, keys: list[str]) -> None:
        for key in keys:
            self._check_open(key)
        while not all(k in self._values for k in keys):
            if self._peer_done:
                raise ProtocolError(
                    f"peer ended the rendezvous without setting {sorted(set(keys) - set(self._values))}",
                    peer=self._peer,
                )
            self._read_one(f"rendezvous keys {keys}")

    def _read_one(self, what: str) -> None:
        h = read_handshake_frame(
            self._sock,
            self._limits,
            self._deadline,
            self._frame_timeout_s,
            self._peer,
            what,
            self._session,
        )
        if h.kind != Kind.RENDEZVOUS:
            raise ProtocolError(f"expected RENDEZVOUS, got {h.kind!r}", peer=self._peer)
        if h.meta.get("done") is True and not h.key:
            self._peer_done = True
            return
        value = h.meta.get("value")
        if not isinstance(value, str) or len(value) > 2 * MAX_VALUE_BYTES or not h.key:
            raise ProtocolError("malformed rendezvous set", peer=self._peer)
        if h.key in self._values or self._theirs >= MAX_KEYS:
            raise ProtocolError(
                f"peer set rendezvous key {h.key!r} twice, or more than {MAX_KEYS} keys",
                peer=self._peer,
            )
        try:
            self._values[h.key] = bytes.fromhex(value)
        except ValueError:
            raise ProtocolError("rendezvous value is not hex", peer=self._peer) from None
        self._theirs += 1

    def finish(self) -> None:
        """Say ``done`` and read up to the peer's; the store is closed afterwards."""
        with self._lock:
            self._check_open("")
            frame = encode_header(Kind.RENDEZVOUS, "", {"done": True})
            send_frame(self._sock, self._session, frame, self._deadline, "the rendezvous end")
            while not self._peer_done:
                self._read_one("the peer's rendezvous end")
            self._closed = True


def probe(pg, session: Session, rank: int, device, deadline: float, peer: str) -> None:
    """Each side sends its token over the new group and checks the peer's (module docstring);
    ``device``: where the group's tensors live (CUDA for NCCL, the CPU for gloo)."""
    dev = torch.device(device)
    mine = torch.frombuffer(bytearray(session.token(PROBE)), dtype=torch.uint8).to(dev)
    theirs = torch.zeros_like(mine)
    left = datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))
    if rank == 0:  # an order both sides agree on (NCCL pairs a send with its receive)
        pg.send([mine], 1, 0).wait(left)
        pg.recv([theirs], 1, 0).wait(left)
    else:
        pg.recv([theirs], 0, 0).wait(left)
        pg.send([mine], 0, 0).wait(left)
    if not session.peer_token_ok(PROBE, bytes(theirs.cpu().numpy())):
        raise ProtocolError(
            "the data connection of the process group is not the authenticated peer's (another "
            "party reached the group's pair listener first?)",
            peer=peer,
        )
