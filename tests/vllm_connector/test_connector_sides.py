"""The connector's sides and what they share import without vLLM: only
``connector/vllm_connector/connector.py`` may import it (it adapts vLLM's calls to them)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.vllm_fixtures import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

PACKAGE = REPO_ROOT / "connector" / "vllm_connector"
HIDDEN = REPO_ROOT / "connector" / "hidden"
# Every module of the package but the facade (the package itself imports it only lazily), the
# hidden-state room, and the leaf modules both use.
SIDES = (
    tuple(
        f"connector.vllm_connector.{p.stem}" if p.stem != "__init__" else "connector.vllm_connector"
        for p in sorted(PACKAGE.glob("*.py"))
        if p.stem != "connector"
    )
    + tuple(
        f"connector.hidden.{p.stem}" if p.stem != "__init__" else "connector.hidden"
        for p in sorted(HIDDEN.glob("*.py"))
    )
    + ("connector.integrity", "connector.streams", "connector.steps")
)

# Any ``import vllm`` (or of a submodule) fails, as where vLLM is not installed.
BLOCK_VLLM = """
import importlib.abc, sys

class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, NoVllm())
"""


def test_the_sides_import_without_vllm() -> None:
    assert {f"connector.vllm_connector.{m}" for m in ("producer", "consumer", "cache_views")} | {
        "connector.hidden.worker",
        "connector.hidden.reader",
    } <= set(SIDES)
    script = (
        BLOCK_VLLM
        + f"import importlib\nfor name in {SIDES!r}:\n    importlib.import_module(name)\n"
        + "from connector.vllm_connector.scheduler import SchedulerSide\n"
        + "from connector.vllm_connector.worker import WorkerSide\n"
        + "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)\n"
        + "try:\n    import vllm\nexcept ImportError:\n    print('blocked')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=90
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("blocked")  # the blocker held


def test_only_the_facade_imports_vllm() -> None:
    """Statically: no module of the package but ``connector.py`` (and the plugin, which registers
    it with vLLM, lazily) names vLLM in an import."""
    import ast

    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name in ("connector.py", "plugin.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "vllm"]
    assert offenders == []
