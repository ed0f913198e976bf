"""Tests of the process launcher the demo and the end-to-end tests start servers with."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from connector.serve.launch import Cluster, _ephemeral_ports, free_port_run, vllm_env

pytestmark = pytest.mark.timeout(60)


def test_start_failure_names_the_first_error(tmp_path: Path) -> None:
    """A process that dies while starting is reported with its first error, not just its tail.

    vLLM ends a failed start with "See root cause above"; the cause is often far above the tail.
    """
    script = (
        "print('(Worker_TP1) ERROR bind failed'); print('OSError: address in use'); "
        "[print(f'teardown {i}') for i in range(200)]; raise SystemExit(3)"
    )
    with Cluster(tmp_path) as cluster:
        proc = cluster.start("dying", [sys.executable, "-c", script], env={}, url="http://x")
        proc.popen.wait(30)
        with pytest.raises(RuntimeError, match="dying exited with code 3") as err:
            cluster.wait_ready([proc])
    msg = str(err.value)
    assert "ERROR bind failed" in msg and "OSError: address in use" in msg
    assert "teardown 199" in msg and "teardown 100" not in msg


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_each_process_leads_its_own_group_in_the_callers_session(tmp_path: Path) -> None:
    """stop() signals a process's whole group (a child it started goes too), and the process
    stays in this session, so the kernel's autogroup scheduling does not split the cores
    between the servers of one cluster (see Cluster)."""
    script = (
        "import os, subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(os.getpgid(0), os.getsid(0), child.pid, flush=True); time.sleep(60)"
    )
    with Cluster(tmp_path) as cluster:
        proc = cluster.start("grouped", [sys.executable, "-c", script], env=dict(os.environ))
        deadline = time.monotonic() + 30
        while not proc.log_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        pgid, sid, child = (int(x) for x in proc.log_text().split())
        assert pgid == proc.popen.pid != os.getpgid(0)
        assert sid == os.getsid(0)
        assert _alive(child)
    assert proc.popen.poll() is not None
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_the_soaks_fd_count_covers_a_servers_whole_group(tmp_path: Path) -> None:
    """connector.serve.soak counts the descriptors of a server and of the children it started
    (its process group), and nothing of this process's."""
    from connector.serve.soak import fd_count

    child = tmp_path / "child.py"
    child.write_text(
        "import sys, time\n"
        "files = [open(sys.executable, 'rb') for _ in range(40)]\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    server = tmp_path / "server.py"
    server.write_text(
        "import subprocess, sys, time\n"
        "files = [open(sys.executable, 'rb') for _ in range(int(sys.argv[1]))]\n"
        f"subprocess.Popen([sys.executable, {str(child)!r}])\n"
        "time.sleep(60)\n"
    )
    counts = []
    with Cluster(tmp_path) as cluster:
        for n in (0, 25):
            proc = cluster.start(f"fds{n}", [sys.executable, str(server), str(n)], env={})
            deadline = time.monotonic() + 30
            while "ready" not in proc.log_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            counts.append(fd_count(proc))
    assert counts[1] - counts[0] == 25, counts
    assert counts[0] >= 40 + 2 * 3, counts  # the child's files and both processes' stdio


def test_free_ports_are_outside_the_ephemeral_range() -> None:
    """Ports for servers that bind late are drawn where no outgoing connection can take them.

    An ephemeral port (bind to port 0) is free only until the OS hands it out again, e.g. as the
    local end of a health check, which holds it in TIME_WAIT for a minute: a TP=2 start failed so.
    """
    ephemeral = _ephemeral_ports()
    for count in (1, 2, 8):
        base = free_port_run(count)
        assert base + count - 1 < ephemeral.start, (base, count, ephemeral)
        servers = [socket.create_server(("127.0.0.1", p)) for p in range(base, base + count)]
        for s in servers:
            s.close()


def test_free_ports_above_an_ephemeral_range_that_starts_low(monkeypatch) -> None:
    import connector.serve.launch as launch

    monkeypatch.setattr(launch, "_ephemeral_ports", lambda: range(1024, 60000))
    assert 60000 <= free_port_run(4) <= 65532
    monkeypatch.setattr(launch, "_ephemeral_ports", lambda: range(1024, 65536))
    with pytest.raises(RuntimeError, match="no run of 4 ports outside the ephemeral range"):
        free_port_run(4)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_cluster_stop_removes_the_shared_memory_vllm_tp_groups_leave(tmp_path: Path) -> None:
    ours, other = (f"vllm_dist_{uuid.uuid4().hex}" for _ in range(2))
    segments = [
        Path("/dev/shm") / f"{n}-tp:0-[0-1]-cpushm_{r}" for n in (ours, other) for r in (0, 1)
    ]
    script = f"print('rank=0 distributed_init_method=file:///tmp/x/{ours} backend=gloo')"
    try:
        for seg in segments:
            seg.write_bytes(b"x")
        with Cluster(tmp_path) as cluster:
            cluster.start("vllm", [sys.executable, "-c", script], env={}).popen.wait(30)
        assert [seg.exists() for seg in segments] == [False, False, True, True]
    finally:
        for seg in segments:
            seg.unlink(missing_ok=True)


def test_servers_by_plugin_name_with_another_interpreter_proxy_and_cwd(tmp_path: Path) -> None:
    """What the packaging test starts an installed tritonkv with: the connector named by the
    plugin's name alone, servers run by another interpreter, the proxy by its console script,
    everything in a working directory of its own. By default: the module path of this package."""
    fake = tmp_path / "fake-python"  # records how it was called instead of starting vLLM
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$PWD" "$0" "$@"\n')
    fake.chmod(0o755)
    outside = tmp_path / "outside"
    outside.mkdir()

    def argv(proc) -> list[str]:
        proc.popen.wait(30)
        return proc.log_text().splitlines()

    def transfer_config(lines: list[str]) -> dict:
        return json.loads(lines[lines.index("--kv-transfer-config") + 1])

    with Cluster(tmp_path / "default", python=str(fake)) as cluster:
        lines = argv(cluster.start_vllm("p", tmp_path, 1, role="kv_producer", kv_port=2))
        assert transfer_config(lines)["kv_connector_module_path"] == "connector.vllm_connector"
        proxy = argv(cluster.start_proxy(3, ["http://p"], ["http://d"]))
        assert proxy[1:4] == [str(fake), "-m", "connector.serve.proxy"]
    script = str(tmp_path / "tritonkv-proxy")
    with Cluster(
        tmp_path / "by-name",
        python=str(fake),
        connector_module=None,
        proxy_cmd=[str(fake), script],
        cwd=outside,
    ) as cluster:
        lines = argv(cluster.start_vllm("c", tmp_path, 1, role="kv_consumer", kv_port=2))
        assert lines[0] == str(outside)
        assert lines[1:4] == [str(fake), "-m", "vllm.entrypoints.openai.api_server"]
        config = transfer_config(lines)
        assert config["kv_connector"] == "TritonKVConnector" and config["kv_role"] == "kv_consumer"
        assert "kv_connector_module_path" not in config
        proxy = argv(cluster.start_proxy(3, ["http://p"], ["http://d"]))
        assert proxy[0] == str(outside) and proxy[1:5] == [str(fake), script, "--port", "3"]


def test_servers_and_proxy_run_under_a_prefix_and_listen_on_the_host(tmp_path: Path) -> None:
    """What ``bench_pd --link`` starts: ``ip netns exec NAME`` before each command, the server's
    HTTP address and URL on the namespace's own address."""
    fake = tmp_path / "fake-prefix"  # stands for `ip netns exec NAME`: records its arguments
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$0" "$@"\n')
    fake.chmod(0o755)
    with Cluster(tmp_path / "prefixed") as cluster:
        server = cluster.start_vllm(
            "p", tmp_path, 7, role=None, host="10.9.8.1", prefix=[str(fake), "ns-a"]
        )
        server.popen.wait(30)
        lines = server.log_text().splitlines()
        assert lines[:3] == [str(fake), "ns-a", cluster.python]
        assert lines[lines.index("--host") + 1] == "10.9.8.1"
        assert server.url == "http://10.9.8.1:7"
        proxy = cluster.start_proxy(3, [server.url], ["http://d"], prefix=[str(fake), "ns-b"])
        proxy.popen.wait(30)
        assert proxy.log_text().splitlines()[:2] == [str(fake), "ns-b"]


def test_servers_share_vllms_model_inspections_and_nothing_else(tmp_path, monkeypatch) -> None:
    """Each server's cache folder is its own, but for vLLM's ``modelinfos`` (what its model
    registry learned by importing the model in a child process): a link to one per-user folder,
    so only the first server started runs that child. Where the folder cannot be made, a server
    keeps its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    shared = tmp_path / "xdg" / "tritonkv" / "vllm-modelinfos"
    envs = [vllm_env(tmp_path / name) for name in ("a", "b")]
    for name, env in zip("ab", envs, strict=True):
        cache = Path(env["VLLM_CACHE_ROOT"])
        assert cache == tmp_path / name / "cache"
        assert (cache / "modelinfos").resolve() == shared.resolve()
    assert oct(shared.stat().st_mode & 0o777) == oct(0o700)
    (Path(envs[0]["VLLM_CACHE_ROOT"]) / "modelinfos" / "m.json").write_text("{}")
    assert (Path(envs[1]["VLLM_CACHE_ROOT"]) / "modelinfos" / "m.json").read_text() == "{}"

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # not a folder: no link
    env = vllm_env(tmp_path / "c")
    assert not (Path(env["VLLM_CACHE_ROOT"]) / "modelinfos").exists()
