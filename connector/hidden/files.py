"""Hidden-state files, written off vLLM's step: the format and lock protocol of vLLM's
``ExampleHiddenStatesConnector``, so pipelines that read its files read these unchanged.

A request's file is a safetensors file at ``kv_transfer_params["hidden_states_path"]`` holding

- ``hidden_states``: ``[num_tokens, num_hidden_states, hidden_size]``, the model's dtype: row
  ``t`` holds, for each chosen layer (``eagle_aux_hidden_state_layer_ids``), the hidden state of
  prompt token ``t``;
- ``token_ids``: ``[num_tokens]`` int64, the prompt's token ids.

Beside it, ``<path>.lock``: created, and locked exclusively (``flock``), on the step that packs the
request (before vLLM can tell anyone the path), and released once the file is complete; a reader
takes a shared lock first (vLLM's ``load_hidden_states``, or :func:`read_hidden_file`, which also
has a deadline). The file is written under a temporary name in the same folder and renamed into
place, so a crash never leaves a half-written file under the final name. A write that failed
leaves no file, only ``<path>.error`` with the reason (what :func:`read_hidden_file` raises).

Integrity (the connector's ``digest`` option, on by default): the writer is given each tensor's
digest as the pack made it (:data:`~connector.integrity.HIDDEN_DIGEST_KEYS`), checks the tensors it is
about to write against them (a mismatch: no file, an ``.error`` naming the check ``write``) and
stores them in the file's safetensors header (``__metadata__``). Readers of the tensors
(safetensors' ``load_file``, vLLM's ``load_hidden_states``) ignore that header field: the keys,
dtypes, shapes and bytes of the tensors are Example's. :func:`read_hidden_file` checks them
(check ``file``).

:class:`HiddenFileWriter` is one thread with a queue bounded in bytes: a request whose tensors
would overflow it is refused at once (its ``.error`` says so), never waited for on the step. The
thread runs on the connector's ``transfer_cpus`` when they are set, like the KV server's.
No vLLM import.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import stat
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from ..integrity import check_hidden
from ..logs import get_logger
from ..transport import transfer_thread

log = get_logger("connector")

__all__ = ["HiddenFileWriter", "private_folder", "read_hidden_file"]

#: How the writer opens what it creates beside a file: never through a symlink planted there.
_CREATE = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def private_folder(path: str | None = None) -> str:
    """The default folder of hidden-state files (``shared_storage_path`` left empty):
    ``<temp dir>/tritonkv-hidden-<uid>``, which only its owner may enter (0700). Made if missing;
    one that exists must be a directory (not a symlink) owned by this user that group and others
    cannot access, else ValueError naming what it is (anyone else could read, replace or plant
    links among the files)."""
    path = path or os.path.join(tempfile.gettempdir(), f"tritonkv-hidden-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory (or a symlink)"
        raise ValueError(
            f"hidden-state files: {path!r} is {what} of uid {st.st_uid} with "
            f"mode {stat.S_IMODE(st.st_mode):04o}: expected a directory of uid {os.getuid()} with "
            "mode 0700 (remove it, or set shared_storage_path to a folder of your choosing)"
        )
    return path


def _error_path(path: str) -> str:
    return path + ".error"


def _write_error(path: str, why: str) -> None:
    with contextlib.suppress(OSError):  # the disk may fail
        fd = os.open(_error_path(path), _CREATE, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(why + "\n")


@dataclass
class _Job:
    path: str
    tensors: dict[str, torch.Tensor] | None  # None: delete the request's files
    lock_fd: int | None = None
    digests: dict[str, str] | None = None  # integrity.HIDDEN_DIGEST_KEYS -> 16 hex digits
    nbytes: int = 0
    done: threading.Event = field(default_factory=threading.Event)


class HiddenFileWriter:
    """Writes requests' hidden-state files on one background thread (see the module docstring).

    Args:
        max_bytes: the most tensor bytes queued and not yet written; a request beyond is refused.
        name: the thread's name.
    """

    def __init__(self, max_bytes: int, *, name: str = "tritonkv-hidden-writer"):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes: expected an int > 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._queued_bytes = 0
        self._closed = False
        self._counts = collections.Counter()
        self._thread = transfer_thread(self._run, name)  # on transfer_cpus, if set
        self._thread.start()

    # ------------------------------------------------------------------ the step's side

    @staticmethod
    def lock(path: str) -> int:
        """Create ``path``'s folder and ``<path>.lock``, lock it exclusively and return its
        descriptor (which :meth:`submit` hands to the writer; closing it releases the lock).
        A stale ``.error`` of an earlier attempt is removed. Raises OSError."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(_error_path(path))
        fd = os.open(path + ".lock", _CREATE, 0o644)  # a symlink there: OSError (ELOOP)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.close(fd)
            raise
        return fd

    def submit(
        self,
        path: str,
        tensors: dict[str, torch.Tensor],
        lock_fd: int | None,
        digests: dict[str, str] | None = None,
    ) -> bool:
        """Queue ``tensors`` (host tensors, complete) for ``path`` (``lock_fd`` from
        :meth:`lock`, released once written; ``digests``: what they must match, stored in the
        header). Never blocks. False (and the request's ``.error`` written, its lock released)
        if the queue has no room or the writer is closed."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._cond:
            room = self.max_bytes - self._queued_bytes
            if not self._closed and nbytes <= room:
                self._jobs.append(_Job(path, tensors, lock_fd, digests, nbytes))
                self._queued_bytes += nbytes
                self._cond.notify_all()
                return True
            self._counts["refused"] += 1
        why = (
            "the hidden-state writer is closed"
            if self._closed
            else f"the hidden-state writer's queue is full: this request's {nbytes} bytes, "
            f"{room} of hidden_writer_bytes={self.max_bytes} free (the disk is slower than "
            "extraction)"
        )
        self.refuse(path, lock_fd, why)
        return False

    @staticmethod
    def refuse(path: str, lock_fd: int | None, why: str) -> None:
        """``path`` will not be written: its ``.error`` says ``why`` (what
        :func:`read_hidden_file` raises), its lock (``lock_fd``) is released."""
        _write_error(path, why)
        if lock_fd is not None:
            os.close(lock_fd)
        log.error("tritonkv: hidden states of %s not written: %s", path, why)

    def delete(self, path: str) -> None:
        """Remove ``path``'s file, lock and error marker, after any write of it queued before
        (an aborted request's). Never blocks."""
        with self._cond:
            self._jobs.append(_Job(path, None))
            self._cond.notify_all()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued so far is done; False if ``timeout_s`` passed first."""
        with self._cond:
            last = self._jobs[-1] if self._jobs else None
        return last is None or last.done.wait(timeout_s)

    def stats(self) -> dict[str, int]:
        """``written``, ``failed``, ``refused``, ``deleted`` so far, and ``queued_bytes``."""
        with self._cond:
            out = {k: self._counts[k] for k in ("written", "failed", "refused", "deleted")}
            out["queued_bytes"] = self._queued_bytes
            return out

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued (at most ``timeout_s``), then stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error(
                    "tritonkv: the hidden-state writer did not finish within %.0f s; %d jobs "
                    "left unwritten",
                    timeout_s,
                    len(self._jobs),
                )

    # ----------------------------------------------------------------- the thread's side

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs[0]
            try:
                if job.tensors is None:
                    self._delete(job.path)
                else:
                    self._write(job)
            finally:
                with self._cond:
                    self._jobs.popleft()
                    self._queued_bytes -= job.nbytes
                job.done.set()

    def _write(self, job: _Job) -> None:
        folder, name = os.path.split(os.path.abspath(job.path))
        tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            from safetensors.torch import save_file  # (missing: each file fails, not the thread)

            if job.digests:  # what reaches the disk is what the pack made
                check_hidden(job.digests, job.tensors, "write", f"{job.path}: ")
            save_file(job.tensors, tmp, metadata=job.digests or None)
            os.replace(tmp, job.path)
            with self._cond:
                self._counts["written"] += 1
        except Exception as exc:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            why = f"writing {job.path} failed: {type(exc).__name__}: {exc}"
            _write_error(job.path, why)
            with self._cond:
                self._counts["failed"] += 1
            log.error("tritonkv: hidden states not written: %s", why)
        finally:
            job.tensors = None  # the pack's memory goes once every file of it is written
            if job.lock_fd is not None:
                os.close(job.lock_fd)  # releases LOCK_EX: readers go on

    def _delete(self, path: str) -> None:
        removed = False
        for p in (path, path + ".lock", _error_path(path)):
            with contextlib.suppress(FileNotFoundError, OSError):
                os.remove(p)
                removed = True
        if removed:
            with self._cond:
                self._counts["deleted"] += 1


def read_hidden_file(path: str, timeout_s: float = 60.0) -> dict[str, torch.Tensor]:
    """Read a hidden-state file (``{"hidden_states", "token_ids"}``) once it is complete, and
    check the digests its header holds (none: a producer with ``digest`` off).

    Waits, at most ``timeout_s``, for the writer's lock on ``<path>.lock`` (taking a shared lock
    as vLLM's ``load_hidden_states`` does, but with a deadline).

    Raises:
        TimeoutError: the file was still being written after ``timeout_s``.
        FileNotFoundError: no lock file (nothing was ever to be written there), or no file.
        RuntimeError: the write failed or was refused (the reason, from ``<path>.error``).
        connector.integrity.DigestMismatch: the file's tensors differ from what
            the producer packed (check ``file``).
    """
    from safetensors import safe_open

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s: expected a number > 0, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    with open(path + ".lock") as lock:
        pause = 0.002
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"hidden states {path}: still being written after {timeout_s:g} s "
                        "(waited for the writer's lock on its .lock file)"
                    ) from None
                time.sleep(min(pause, left))  # flock has no timeout of its own
                pause = min(2 * pause, 0.05)
        if not os.path.exists(path) and os.path.exists(_error_path(path)):
            with open(_error_path(path)) as f:
                raise RuntimeError(f"hidden states {path}: {f.read().strip()}")
        with safe_open(path, framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    check_hidden(header, tensors, "file", f"hidden states {path}: ")
    return tensors
