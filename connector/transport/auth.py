"""Mutual authentication of a tritonkv connection by a shared secret, before any frame is read,
and the keys of the session it opens.

Every connection to a :class:`~connector.transport.listener.PipeListener` (so every KV server)
starts with three fixed-size messages, before HELLO and before the listener reads or allocates
anything else (the whole protocol of a connection: :mod:`connector.transport.handshake`)::

    listener  → connector  CHALLENGE  "TKVA" | version (2) | flags | nonce_l (32 bytes)       38 bytes
    connector → listener   RESPONSE   "TKVA" | nonce_c (32) | address (64) | mac_c (32)      132 bytes
    listener  → connector  VERDICT    "TKVA" | status | mac_l (32)                             37 bytes

    mac_c = HMAC-SHA256(secret, "tritonkv-auth-2/connector" | nonce_l | nonce_c | address)
    mac_l = HMAC-SHA256(secret, "tritonkv-auth-2/listener"  | nonce_l | nonce_c | address)

``address`` is where the connector's TCP connection ends, as the connector sees it (the peer
address of its socket, ``"10.0.0.5:7000"`` or ``"[fd00::5]:7000"``, NUL-padded): the listener
accepts it only if it is where the connection arrived (the local address of its socket) or one
of its ``aliases`` (an address that reaches it through a NAT or port forward its operator
trusts). A relay at another address, holding no secret, cannot change the address without
breaking ``mac_c``, so the listener refuses it (status 2) and the connector learns why.
``flags`` bit 0 says the listener requires the secret. Both nonces are fresh random bytes, so a
recorded exchange replays into a wrong MAC on either side; the two MACs differ by their label, so
one side's answer cannot be reflected back as the other's. MACs are compared in constant time.
A listener without a secret (flags 0) accepts any well-formed response (the address is still
checked) and sends a zero MAC; a connector that has a secret refuses such a listener (it would
hand its KV to, or take KV from, anyone), and one without a secret cannot answer a listener that
requires one. Either mismatch is an :class:`AuthError` that says which side lacks the secret.

Both ends then derive the connection's session keys (:func:`session_keys`): one per direction,
from the secret, both nonces and the address, with which every later frame is authenticated
(:mod:`connector.transport.session`). Without a secret the keys are computable by anyone: the
framing then catches accidents, not attackers.

The secret: at least :data:`MIN_SECRET_BYTES` (32; ``openssl rand -hex 32`` gives 64), from
``TRITONKV_SECRET`` or a ``secret_file`` that only its owner may access (:func:`load_secret`).

What this protects: only holders of the secret can connect, read or write entries, and no
relay can sit between two of them; every header and inline payload of a session is
authenticated. What it does not: nothing is encrypted (someone on the network path can read KV
in flight), and payload bytes that travel on the process group (gloo, nccl) are not
authenticated, only their size and order (README, "Security").
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
from dataclasses import dataclass
from pathlib import Path

from .errors import ProtocolError, TransferError

MAGIC = b"TKVA"
VERSION = 2  # 2: the response carries the address the connector reached; session keys
NONCE_BYTES = 32
ADDRESS_BYTES = 64  # the address field of a RESPONSE, NUL-padded
MIN_SECRET_BYTES = 32  # `openssl rand -hex 32` gives 64
MAX_SECRET_FILE_BYTES = 4096
SECRET_ENV = "TRITONKV_SECRET"
FLAG_REQUIRED = 0x1

CHALLENGE = struct.Struct(f"<4sBB{NONCE_BYTES}s")  # 38 bytes
RESPONSE = struct.Struct(f"<4s{NONCE_BYTES}s{ADDRESS_BYTES}s32s")  # 132 bytes
VERDICT = struct.Struct("<4sB32s")  # 37 bytes
_ZERO_MAC = bytes(32)
_ACCEPTED, _REFUSED, _WRONG_ADDRESS = 0, 1, 2


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


def address_text(sockaddr) -> str:
    """A socket address as the RESPONSE carries it: ``"10.0.0.5:7000"``, ``"[fd00::5]:7000"``;
    an IPv4-mapped IPv6 address (``::ffff:10.0.0.5``, a dual-stack socket's view) as IPv4."""
    host, port = sockaddr[0], sockaddr[1]
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}"


def check_alias(alias: object) -> str:
    """An alias of a listener (``"host:port"`` with an IP address, as :func:`address_text`
    writes it), normalized; ValueError/TypeError naming what was given."""
    if not isinstance(alias, str):
        raise TypeError(f"alias: expected a str 'ip:port', got {type(alias).__name__}")
    host, sep, port = alias.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError
        text = address_text((host, int(port)))
    except ValueError:
        raise ValueError(
            f"alias: expected 'ip:port' (an IP address, e.g. '203.0.113.7:7000' or "
            f"'[2001:db8::7]:7000'; port 1-65535), got {alias!r}"
        ) from None
    return text


def _mac(secret: bytes, label: bytes, nonce_l: bytes, nonce_c: bytes, address: bytes) -> bytes:
    message = b"tritonkv-auth-2/" + label + nonce_l + nonce_c + address
    return hmac.new(secret, message, hashlib.sha256).digest()


def _address_field(address: str) -> bytes:
    raw = address.encode("ascii")
    if len(raw) > ADDRESS_BYTES:  # pragma: no cover - address_text is at most 47 characters
        raise ValueError(f"address: expected <= {ADDRESS_BYTES} bytes, got {address!r}")
    return raw.ljust(ADDRESS_BYTES, b"\0")


def session_keys(
    secret: bytes | None, nonce_l: bytes, nonce_c: bytes, address: str
) -> tuple[bytes, bytes]:
    """``(connector_to_listener, listener_to_connector)``: the session's two frame keys, bound to
    both nonces and the address the connector reached."""
    base = _mac(secret or b"", b"session", nonce_l, nonce_c, _address_field(address))
    return (
        hmac.new(base, b"connector->listener", hashlib.sha256).digest(),
        hmac.new(base, b"listener->connector", hashlib.sha256).digest(),
    )


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


def respond(
    secret: bytes | None, required: bool, nonce_l: bytes, address: str, peer: str
) -> tuple[bytes, bytes]:
    """The connector's RESPONSE to a CHALLENGE, for a connection that reached ``address``
    (:func:`address_text` of its socket's peer), and its nonce; AuthError if the two sides
    disagree on whether there is a secret."""
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
    field = _address_field(address)
    mac = _mac(secret, b"connector", nonce_l, nonce_c, field) if secret else _ZERO_MAC
    return RESPONSE.pack(MAGIC, nonce_c, field, mac), nonce_c


@dataclass(frozen=True)
class Outcome:
    """What the listener made of a RESPONSE: ``verdict`` to send; ``problem`` None when the
    peer passed (then ``nonce_c`` and ``address`` give the session keys), else why not."""

    verdict: bytes
    problem: str | None
    nonce_c: bytes = b""
    address: str = ""


def check_response(
    secret: bytes | None, nonce_l: bytes, raw: bytes, addresses: frozenset[str] | set[str]
) -> Outcome:
    """The listener's judgement of a RESPONSE it read (constant-time compare): the MAC first,
    then whether the address the connector reached is one of ``addresses`` (the connection's
    local address and the listener's aliases, as :func:`address_text` writes them)."""
    magic, nonce_c, field, mac = RESPONSE.unpack(raw)
    ok = magic == MAGIC
    if secret is not None:
        ok = hmac.compare_digest(mac, _mac(secret, b"connector", nonce_l, nonce_c, field)) and ok
    if not ok:
        problem = "the connector failed authentication (wrong secret)"
        return Outcome(VERDICT.pack(MAGIC, _REFUSED, _ZERO_MAC), problem)
    address = field.rstrip(b"\0").decode("ascii", "replace")
    if address not in addresses:
        problem = (
            f"the connector reached {_printable(address)!r}, not this listener's address "
            f"({', '.join(sorted(addresses))}): a relay in between, or an alias missing"
        )
        return Outcome(VERDICT.pack(MAGIC, _WRONG_ADDRESS, _ZERO_MAC), problem)
    mac_l = _mac(secret, b"listener", nonce_l, nonce_c, field) if secret else _ZERO_MAC
    return Outcome(VERDICT.pack(MAGIC, _ACCEPTED, mac_l), None, nonce_c, address)


def _printable(text: str) -> str:
    return "".join(c if " " <= c <= "~" else "?" for c in text[:ADDRESS_BYTES])


def check_verdict(
    secret: bytes | None, nonce_l: bytes, nonce_c: bytes, address: str, raw: bytes, peer: str
) -> None:
    """Raise AuthError unless the listener accepted us and (with a secret) proved it holds it."""
    magic, status, mac_l = VERDICT.unpack(raw)
    if magic != MAGIC or status not in (_ACCEPTED, _REFUSED, _WRONG_ADDRESS):
        raise ProtocolError(f"malformed auth verdict (magic {magic!r}, status {status})", peer=peer)
    if status == _REFUSED:
        raise AuthError(
            "the listener refused our secret (the two sides' secrets differ)", peer=peer
        )
    if status == _WRONG_ADDRESS:
        raise AuthError(
            f"the listener was not reached at its own address: this side connected to {address}, "
            "which the listener does not know as its own (a relay in between? behind a NAT or "
            "port forward you trust, give the listener this address as an alias)",
            peer=peer,
        )
    field = _address_field(address)
    if secret is not None and not hmac.compare_digest(
        mac_l, _mac(secret, b"listener", nonce_l, nonce_c, field)
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
