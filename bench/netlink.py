"""A rate-limited link between two network namespaces, for ``bench.bench_pd --link``.

:func:`link` makes two namespaces of its own (unique names: this process's id and a random
suffix), joins them with a veth pair on a private /30 (``10.X.Y.1`` producer side, ``.2``
consumer side) and puts a token-bucket filter (``tc qdisc ... tbf``) on both ends' egress, so
each direction carries at most the rate. Both namespaces get their loopback up (a vLLM server
talks to its own engine over it). Everything is removed on exit, on error and on Ctrl-C
(deleting a namespace deletes the veth end in it, and so its peer). This kernel kind has no
``netem``: the link has a rate, not an added delay.

Needs root (or ``CAP_NET_ADMIN`` + ``CAP_SYS_ADMIN``) and iproute2's ``ip`` and ``tc``;
:func:`unavailable` says why not, where not. Servers are started inside with
:meth:`Link.prefix` (``ip netns exec NAME ...``); this process talks to them from inside a
namespace with :func:`entered`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
CMD_TIMEOUT_S = 20.0
LATENCY_MS = 50  # tbf's queue: a packet waits at most this long for tokens, else is dropped


class LinkUnavailable(RuntimeError):
    """This machine does not allow the namespaces, the veth pair or the rate limit."""


def _run(*cmd: str) -> str:
    """Run ``cmd`` (bounded); its stdout, or :class:`LinkUnavailable` with its stderr."""
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LinkUnavailable(f"{' '.join(cmd)}: {e}") from e
    if done.returncode:
        raise LinkUnavailable(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why :func:`link` cannot run here (None: it can, as far as can be told without trying)."""
    if os.geteuid() != 0:
        return "network namespaces need root (euid 0); run as root or leave out --link"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2's {' and '.join(missing)} not found on PATH"
    return None


def tbf_burst_bytes(rate_mbit: float) -> int:
    """The bucket size for ``rate_mbit``: 4 ms of traffic, at least 64 KiB (a GSO segment)."""
    return max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))


@dataclass
class Link:
    """Two namespaces joined by a rate-limited veth pair (made by :func:`link`)."""

    producer_ns: str
    consumer_ns: str
    producer_dev: str
    consumer_dev: str
    producer_ip: str
    consumer_ip: str
    rate_mbit: float = 0.0

    def prefix(self, side: str) -> list[str]:
        """The command prefix that runs a program inside ``side`` ("producer" / "consumer")."""
        return ["ip", "netns", "exec", self._ns(side)]

    def _ns(self, side: str) -> str:
        if side not in ("producer", "consumer"):
            raise ValueError(f"side: expected 'producer' or 'consumer', got {side!r}")
        return self.producer_ns if side == "producer" else self.consumer_ns

    def _dev(self, side: str) -> str:
        return self.producer_dev if self._ns(side) == self.producer_ns else self.consumer_dev

    def set_rate(self, rate_mbit: float) -> None:
        """Limit each direction to ``rate_mbit`` megabits per second (replaces any limit)."""
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit: expected a positive number, got {rate_mbit!r}")
        for side in ("producer", "consumer"):
            _run(
                "ip", "netns", "exec", self._ns(side), "tc", "qdisc", "replace", "dev",
                self._dev(side), "root", "tbf", "rate", f"{rate_mbit}mbit",
                "burst", str(tbf_burst_bytes(rate_mbit)), "latency", f"{LATENCY_MS}ms",
            )  # fmt: skip
        self.rate_mbit = rate_mbit

    def qdisc(self, side: str) -> str:
        """``tc qdisc show`` of ``side``'s veth end (what the kernel applies)."""
        return _run(
            "ip", "netns", "exec", self._ns(side), "tc", "qdisc", "show", "dev", self._dev(side)
        )

    def tx_bytes(self, side: str) -> int:
        """Bytes ``side``'s veth end has sent so far (the kernel's counter)."""
        path = f"/sys/class/net/{self._dev(side)}/statistics/tx_bytes"
        return int(_run("ip", "netns", "exec", self._ns(side), "cat", path))


def namespaces() -> set[str]:
    """The names of the network namespaces that exist now (``ip netns list``)."""
    return {line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()}


@contextlib.contextmanager
def link(rate_mbit: float) -> Iterator[Link]:
    """Make the namespaces and the rate-limited veth pair; remove them on exit (see module)."""
    reason = unavailable()
    if reason:
        raise LinkUnavailable(reason)
    tag = f"{os.getpid() % 100000:05d}{secrets.token_hex(2)}"  # veth names: at most 15 bytes
    a, b = secrets.randbelow(50) + 200, secrets.randbelow(64) * 4
    made = Link(
        producer_ns=f"tkv-p-{tag}",
        consumer_ns=f"tkv-c-{tag}",
        producer_dev=f"tkvp{tag}",
        consumer_dev=f"tkvc{tag}",
        producer_ip=f"10.{a}.{b // 256}.{b % 256 + 1}",
        consumer_ip=f"10.{a}.{b // 256}.{b % 256 + 2}",
    )
    created: list[str] = []
    try:
        for ns in (made.producer_ns, made.consumer_ns):
            _run("ip", "netns", "add", ns)
            created.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run(
            "ip", "link", "add", made.producer_dev, "netns", made.producer_ns,
            "type", "veth", "peer", "name", made.consumer_dev, "netns", made.consumer_ns,
        )  # fmt: skip
        for ns, dev, ip in (
            (made.producer_ns, made.producer_dev, made.producer_ip),
            (made.consumer_ns, made.consumer_dev, made.consumer_ip),
        ):
            _run("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
        made.set_rate(rate_mbit)
        yield made
    finally:
        for ns in reversed(created):
            with contextlib.suppress(LinkUnavailable):
                _run("ip", "netns", "del", ns)


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise LinkUnavailable(f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run this thread (and the threads it starts meanwhile) inside namespace ``ns``.

    Sockets opened inside stay there after the exit; the thread itself goes back to the
    namespace it came from.
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(home)
