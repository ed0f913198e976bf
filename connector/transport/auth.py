"""Mutual authentication of a tritonkv connection by a shared secret, before any frame is read.

Every connection to a :class:`~connector.transport.listener.PipeListener` (so every KV server)
starts with three fixed-size messages, before HELLO and before the listener reads or allocates
anything else (the whole protocol of a connection: :mod:`connector.transport.handshake`)::

    listener  → connector  CHALLENGE  "TKVA" | version (1) | flags | nonce_l (32 bytes)   38 bytes
    connector → listener   RESPONSE   "TKVA" | nonce_c (32 bytes) | mac_c (32 bytes)       68 bytes
    listener  → connector  VERDICT    "TKVA" | status (0 accepted, 1 refused) | mac_l      37 bytes

    mac_c = HMAC-SHA256(secret, "tritonkv-auth-1/connector" | nonce_l | nonce_c)
    mac_l = HMAC-SHA256(secret, "tritonkv-auth-1/listener"  | nonce_l | nonce_c)

``flags`` bit 0 says the listener requires the secret. Both nonces are fresh random bytes, so a
recorded exchange replays into a wrong MAC on either side; the two MACs differ by their label, so
one side's answer cannot be reflected back as the other's. MACs are compared in constant time.
A listener without a secret (flags 0) accepts any response and sends a zero MAC; a connector that
has a secret refuses such a listener (it would hand its KV to, or take KV from, anyone), and one
without a secret cannot answer a listener that requires one. Either mismatch is an
:class:`AuthError` that says which side lacks the secret.

The secret: at least :data:`MIN_SECRET_BYTES` (32; ``openssl rand -hex 32`` gives 64), from
``TRITONKV_SECRET`` or a ``secret_file`` that only its owner may access (:func:`load_secret`).

What this protects: only holders of the secret can connect, read or write entries, or learn a
connection's process-group prefix (sent after authentication, in HELLO_ACK). What it does not:
the traffic itself is neither encrypted nor integrity-protected after the handshake, so someone on
the network path can read KV in flight or tamper with an authenticated connection. Run untrusted
links through a VPN or TLS tunnel (README, "Security").
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import shlex
import stat
import struct
import threading
import time
from pathlib import Path

from .errors import ProtocolError, TransferError

MAGIC = b"TKVA"
VERSION = 1
NONCE_BYTES = 32
MIN_SECRET_BYTES = 32  # `openssl rand -hex 32` gives 64
MAX_SECRET_FILE_BYTES = 4096
SECRET_ENV = "TRITONKV_SECRET"
FLAG_REQUIRED = 0x1

CHALLENGE = struct.Struct(f"<4sBB{NONCE_BYTES}s")  # 38 bytes
RESPONSE = struct.Struct(f"<4s{NONCE_BYTES}s32s")  # 68 bytes
VERDICT = struct.Struct("<4sB32s")  # 37 bytes
_ZERO_MAC = bytes(32)
_ACCEPTED, _REFUSED = 0, 1


class AuthError(TransferError):
    """The connection failed mutual authentication (wrong or missing secret on one side)."""


def check_secret(secret: bytes | str | None, what: str = "secret") -> bytes | None:
    """``secret`` as bytes (a str is UTF-8 encoded), or None; ValueError if too short."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise TypeError(f"{what}: expected bytes, str or None, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{what}: expected at least {MIN_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`), "
            f"got {len(secret)}"
        )
    return secret


def load_secret(secret_file: str | os.PathLike | None = None) -> bytes | None:
    """The shared secret: the contents of ``secret_file`` (trailing newlines stripped) when given,
    else the ``TRITONKV_SECRET`` environment variable, else None. Never logged.

    ``secret_file`` must be a regular file that neither group nor others may access (mode 0600 or
    0400, as for an ssh key), of at most :data:`MAX_SECRET_FILE_BYTES`; anything else is a
    ValueError naming the file, what it is and how to fix it. The checks are on the file opened
    (a symlink is followed, then the descriptor is examined), so no rename between a check and the
    read can slip another file in; a FIFO or a device is refused without waiting on it.
    """
    if secret_file:
        path = Path(secret_file)
        return check_secret(_read_secret_file(path), f"secret_file {str(path)!r}")
    env = os.environ.get(SECRET_ENV)
    return check_secret(env, SECRET_ENV) if env else None


def _read_secret_file(path: Path) -> bytes:
    name = repr(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"secret_file: cannot read {name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"secret_file {name}: expected a regular file, got {_file_kind(st)}")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ValueError(
                f"secret_file {name}: mode {mode:04o} lets group or others access it: expected "
                f"no access for them (0600 or 0400); run `chmod 600 {shlex.quote(str(path))}`"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_SECRET_FILE_BYTES:
        raise ValueError(
            f"secret_file {name}: expected at most {MAX_SECRET_FILE_BYTES} bytes, got more"
        )
    return raw.rstrip(b"\r\n")


def _file_kind(st: os.stat_result) -> str:
    kinds = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
             stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}  # fmt: skip
    return kinds.get(stat.S_IFMT(st.st_mode), f"file type {stat.S_IFMT(st.st_mode):#o}")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names a loopback address (so only this machine can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another name: it may resolve to anything


def _mac(secret: bytes, label: bytes, nonce_l: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(
        secret, b"tritonkv-auth-1/" + label + nonce_l + nonce_c, hashlib.sha256
    ).digest()


def challenge(required: bool) -> tuple[bytes, bytes]:
    """The listener's CHALLENGE and its nonce."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return CHALLENGE.pack(MAGIC, VERSION, FLAG_REQUIRED if required else 0, nonce), nonce


def parse_challenge(raw: bytes, peer: str) -> tuple[bool, bytes]:
    """``(required, nonce_l)`` of a CHALLENGE; ProtocolError for anything else."""
    magic, version, flags, nonce = CHALLENGE.unpack(raw)
    if magic != MAGIC or version != VERSION or flags & ~FLAG_REQUIRED:
        raise ProtocolError(
            f"expected a tritonkv auth challenge (magic {MAGIC!r}, version {VERSION}), got magic "
            f"{magic!r} version {version} flags {flags:#x}: not a tritonkv listener, or another "
            "protocol version",
            peer=peer,
        )
    return bool(flags & FLAG_REQUIRED), nonce


def respond(secret: bytes | None, required: bool, nonce_l: bytes, peer: str) -> tuple[bytes, bytes]:
    """The connector's RESPONSE to a CHALLENGE and its nonce; AuthError if the two sides disagree
    on whether there is a secret."""
    if required and secret is None:
        raise AuthError(
            f"the listener requires the shared secret and this side has none (set {SECRET_ENV}, "
            "or secret_file in kv_connector_extra_config)",
            peer=peer,
        )
    if secret is not None and not required:
        raise AuthError(
            "the listener does not authenticate (no secret set there) but this side has a "
            "secret: refusing an unauthenticated peer; give both sides the same secret",
            peer=peer,
        )
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    mac = _mac(secret, b"connector", nonce_l, nonce_c) if secret else _ZERO_MAC
    return RESPONSE.pack(MAGIC, nonce_c, mac), nonce_c


def check_response(secret: bytes | None, nonce_l: bytes, raw: bytes) -> tuple[bool, bytes]:
    """``(accepted, VERDICT to send)`` for a RESPONSE the listener read (constant-time compare)."""
    magic, nonce_c, mac = RESPONSE.unpack(raw)
    ok = magic == MAGIC
    if secret is not None:
        ok = hmac.compare_digest(mac, _mac(secret, b"connector", nonce_l, nonce_c)) and ok
    if not ok:
        return False, VERDICT.pack(MAGIC, _REFUSED, _ZERO_MAC)
    mac_l = _mac(secret, b"listener", nonce_l, nonce_c) if secret else _ZERO_MAC
    return True, VERDICT.pack(MAGIC, _ACCEPTED, mac_l)


def check_verdict(
    secret: bytes | None, nonce_l: bytes, nonce_c: bytes, raw: bytes, peer: str
) -> None:
    """Raise AuthError unless the listener accepted us and (with a secret) proved it holds it."""
    magic, status, mac_l = VERDICT.unpack(raw)
    if magic != MAGIC or status not in (_ACCEPTED, _REFUSED):
        raise ProtocolError(f"malformed auth verdict (magic {magic!r}, status {status})", peer=peer)
    if status == _REFUSED:
        raise AuthError(
            "the listener refused our secret (the two sides' secrets differ)", peer=peer
        )
    if secret is not None and not hmac.compare_digest(
        mac_l, _mac(secret, b"listener", nonce_l, nonce_c)
    ):
        raise AuthError("the listener's proof of the secret is wrong: refusing it", peer=peer)


class FailureLog:
    """Counts authentication failures and says whether to log one: at most once per peer host per
    ``interval_s``, remembering at most ``max_hosts`` hosts (a stranger cannot grow it unbounded)."""

    def __init__(self, interval_s: float = 60.0, max_hosts: int = 1024):
        self.interval_s = interval_s
        self.max_hosts = max_hosts
        self.count = 0
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def failed(self, peer: str) -> bool:
        """Record one failure from ``peer`` ("host:port"); True if it should be logged now."""
        host = peer.rsplit(":", 1)[0]
        now = time.monotonic()
        with self._lock:
            self.count += 1
            last = self._last.get(host)
            if last is not None and now - last < self.interval_s:
                return False
            if len(self._last) >= self.max_hosts:
                self._last = {h: t for h, t in self._last.items() if now - t < self.interval_s}
                if len(self._last) >= self.max_hosts:
                    return False
            self._last[host] = now
            return True
