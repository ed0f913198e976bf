"""Building the CPU's small C libraries (``_native/*.c``) on first use, for ctypes.

The machine's C compiler (``TRITONKV_CC``, default ``cc``; ``TRITONKV_NATIVE=0`` turns the
libraries off) builds each into a per-user cache directory (``TRITONKV_CACHE_DIR``, default
``$XDG_CACHE_HOME/tritonkv`` or ``~/.cache/tritonkv``; a private folder under the temporary
directory where that cannot be made) under a name keyed by the source, the flags, the
compiler's version and the machine. A library is written under a temporary name and renamed into
place, so processes that build at once each see a whole file; a cached file that does not load
or fails its loader's self-check is built again.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

COMPILE_TIMEOUT_S = 60.0

T = TypeVar("T")


class Unavailable(Exception):
    """Why a library cannot be had (its loader's warning says this)."""


def load_or_build(
    source: Path, stem: str, flag_sets: Sequence[tuple[str, ...]], open_lib: Callable[[Path], T]
) -> T:
    """``open_lib`` of the cached build of ``source`` (``<stem>-<key>.so``), built first where
    there is none or it does not open; each of ``flag_sets`` in turn until one builds and opens.

    Raises:
        Unavailable: no compiler, no writable cache, or no flag set builds a library that opens
            (the first reason).
    """
    cc = _compiler()
    version = _run([cc, "--version"])
    if version.returncode:
        raise Unavailable(f"{cc} --version exited with {version.returncode}")
    folder = _cache_folder()
    why = None
    for flags in flag_sets:
        parts = [source.read_bytes(), " ".join(flags).encode(), version.stdout.encode()]
        parts.append(f"{platform.system()}-{platform.machine()}".encode())
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
        path = folder / f"{stem}-{key}.so"
        if path.exists():
            try:
                return open_lib(path)
            except Unavailable:
                pass  # corrupt or foreign: build it again (below)
        try:
            _build(cc, source, path, flags)
            return open_lib(path)
        except Unavailable as exc:
            why = why or exc
    raise why or Unavailable("no flags to build with")


def _cache_folder() -> Path:
    explicit = os.environ.get("TRITONKV_CACHE_DIR")
    if explicit:
        folder = Path(explicit)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        folder = (Path(xdg) if xdg else Path.home() / ".cache") / "tritonkv"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        folder = Path(tempfile.gettempdir()) / f"tritonkv-{os.getuid()}"
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
        except OSError:
            raise Unavailable(f"no writable cache directory ({exc})") from None
    return folder


def _compiler() -> str:
    if os.environ.get("TRITONKV_NATIVE", "1").strip() == "0":
        raise Unavailable("disabled by TRITONKV_NATIVE=0")
    name = os.environ.get("TRITONKV_CC", "cc").strip() or "cc"
    path = shutil.which(name)
    if path is None:
        raise Unavailable(f"no C compiler {name!r} on PATH (TRITONKV_CC)")
    return path


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{cmd[0]} failed: {exc}") from None


def _build(cc: str, source: Path, path: Path, flags: tuple[str, ...]) -> None:
    """Compile into a temporary file beside ``path``, then rename it into place (atomic)."""
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        done = _run([cc, *flags, "-o", tmp, str(source)])
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise Unavailable(f"{cc} exited with {done.returncode}: {' | '.join(tail)}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
