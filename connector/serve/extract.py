"""Prompts in, a dataset of hidden states out, through a vLLM server running TritonKVConnector with
``extract_hidden_states``: ``tritonkv-extract`` once installed (``python -m connector.serve.extract``
from a checkout).

Input: a JSONL file, one prompt a line: ``{"id": "a1", "prompt": "text"}`` or ``{"id": "a1",
"prompt_token_ids": [1, 2, 3]}`` (``id`` optional: the line number). Output folder: one
``<id>.safetensors`` per prompt (``hidden_states`` ``[num_tokens, num_hidden_states,
hidden_size]``, ``token_ids`` ``[num_tokens]`` int64: the connector's format), each written under
a temporary name and renamed, and ``index.jsonl`` (one line per prompt done: id, file, tokens).
Run it again on the same folder and it goes on where it stopped: prompts whose file exists are
skipped. Hidden states come over the network from the server's KV port (``--via network``, the
default; no shared storage) or from the file the server wrote (``--via files``, moved into the
dataset). A prompt that fails is reported and left out; the run goes on.

By default each prompt is answered with one token and its file holds the prompt's hidden states.
With ``--include-outputs --max-tokens N`` the server generates up to N tokens (greedy) and the file
holds every token the model was fed: the prompt and the response but its last token
(``kv_transfer_params["include_output_tokens"]``, as vLLM's ``ExampleHiddenStatesConnector``), the
usual data for training a speculator on the model's own answers.

Example::

    tritonkv-extract --url http://127.0.0.1:8000 --prompts prompts.jsonl \\
        --out dataset/ --concurrency 4 --secret-file /etc/tritonkv.secret
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ..hidden import HiddenStatesReader, read_hidden_file
from ..transport import load_secret
from .launch import http_json

__all__ = ["extract", "main", "read_prompts"]


def read_prompts(path: str | os.PathLike) -> list[tuple[str, dict]]:
    """``(id, request fields)`` of each line of a prompts JSONL file; ValueError naming the line."""
    out, seen = [], set()
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: expected a JSON object, got {exc}") from None
            if not isinstance(item, dict) or ("prompt" in item) == ("prompt_token_ids" in item):
                raise ValueError(
                    f"{path}:{number}: expected an object with one of 'prompt' (text) or "
                    "'prompt_token_ids' (a list of ints)"
                )
            pid = str(item.get("id", number))
            if not pid or "/" in pid or pid.startswith(".") or pid in seen:
                raise ValueError(f"{path}:{number}: id {pid!r}: expected unique file-name-safe ids")
            seen.add(pid)
            prompt = item.get("prompt", item.get("prompt_token_ids"))
            out.append((pid, {"prompt": prompt}))
    return out


def _save(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _one(url: str, model: str, pid: str, fields: dict, out: Path, via: str, readers, timeout_s):
    body = {"model": model, "temperature": 0, **fields}
    params = http_json(url + "/v1/completions", body, timeout_s=timeout_s).get("kv_transfer_params")
    if not params:
        raise RuntimeError("the reply has no kv_transfer_params: is the server's connector set up?")
    target = out / f"{pid}.safetensors"
    if via == "network":
        if "hidden_states_transfer_id" not in params:
            raise RuntimeError(
                f"the server does not serve hidden states (params: {sorted(params)})"
            )
        if "hidden_states_digest" not in params:  # what its reader must present
            raise RuntimeError(
                "the server's params name no hidden_states_digest, which its KV server wants "
                f"from a reader: upgrade its tritonkv (params: {sorted(params)})"
            )
        tensors = readers.get().load(
            params["hidden_states_host"],
            params["hidden_states_port"],
            params["hidden_states_transfer_id"],
            params["hidden_states_digest"],
        )
        _save(tensors, target)
    else:
        source = params.get("hidden_states_path")
        if not source:
            raise RuntimeError(f"the server writes no files (params: {sorted(params)})")
        tensors = read_hidden_file(source, timeout_s=timeout_s)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
        for leftover in (source, source + ".lock"):
            Path(leftover).unlink(missing_ok=True)
    return int(tensors["token_ids"].numel())


class _Readers:
    """A :class:`HiddenStatesReader` per client thread (each keeps its connections), all closed
    at the end."""

    def __init__(self, secret, timeout_s: float):
        self._args = {"secret": secret, "timeout_s": timeout_s}
        self._local = threading.local()
        self._all: list[HiddenStatesReader] = []
        self._lock = threading.Lock()

    def get(self) -> HiddenStatesReader:
        reader = getattr(self._local, "reader", None)
        if reader is None:
            reader = self._local.reader = HiddenStatesReader(**self._args)
            with self._lock:
                self._all.append(reader)
        return reader

    def __enter__(self) -> _Readers:
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            for reader in self._all:
                reader.close()


def extract(
    url: str,
    prompts: list[tuple[str, dict]],
    out: str | os.PathLike,
    *,
    model: str = "tiny",
    via: str = "network",
    concurrency: int = 4,
    secret: bytes | str | None = None,
    timeout_s: float = 300.0,
    progress=None,
    max_tokens: int = 1,
    include_outputs: bool = False,
) -> dict[str, int]:
    """Extract every prompt not yet in ``out``; returns ``{"done", "skipped", "failed",
    "tokens"}``. ``progress(done, total)`` is called after each prompt. Each request generates
    up to ``max_tokens``; ``include_outputs``: their hidden states are saved too (all but the
    last's: see the module docstring)."""
    if via not in ("network", "files"):
        raise ValueError(f"via: expected network|files, got {via!r}")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency: expected an int >= 1, got {concurrency!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected an int >= 1, got {max_tokens!r}")
    asked = {"max_tokens": max_tokens}
    if include_outputs:
        asked["kv_transfer_params"] = {"include_output_tokens": True}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [(pid, f) for pid, f in prompts if not (out / f"{pid}.safetensors").exists()]
    counts = {"done": 0, "skipped": len(prompts) - len(todo), "failed": 0, "tokens": 0}
    lock = threading.Lock()
    readers = _Readers(secret, timeout_s)
    with (
        readers,
        ThreadPoolExecutor(concurrency) as pool,
        open(out / "index.jsonl", "a") as index,
    ):
        futures = {
            pool.submit(_one, url, model, pid, {**asked, **f}, out, via, readers, timeout_s): pid
            for pid, f in todo
        }
        for future in as_completed(futures):
            pid = futures[future]
            with lock:
                try:
                    tokens = future.result()
                except Exception as exc:
                    counts["failed"] += 1
                    print(f"prompt {pid}: {type(exc).__name__}: {exc}", file=sys.stderr)
                else:
                    counts["done"] += 1
                    counts["tokens"] += tokens
                    index.write(json.dumps({"id": pid, "file": f"{pid}.safetensors",
                                            "num_tokens": tokens}) + "\n")  # fmt: skip
                    index.flush()
                if progress is not None:
                    progress(counts["done"] + counts["failed"], len(todo))
    return counts


def _bar(start: float):
    def show(done: int, total: int) -> None:
        rate = done / max(time.monotonic() - start, 1e-9)
        width = 30
        fill = width * done // max(total, 1)
        end = "\n" if done == total else ""
        print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} prompts, {rate:.1f}/s",
              end=end, file=sys.stderr, flush=True)  # fmt: skip

    return show


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the vLLM server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--prompts", required=True, help="JSONL file of prompts")
    parser.add_argument("--out", required=True, help="dataset folder (resumed if it exists)")
    parser.add_argument("--model", default="tiny", help="the served model name")
    parser.add_argument("--via", choices=("network", "files"), default="network")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--secret-file", default="", help="the KV server's shared secret")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens each request generates")
    parser.add_argument(
        "--include-outputs",
        action="store_true",
        help="save the generated tokens' hidden states too (all but the last)",
    )
    args = parser.parse_args(argv)
    try:  # the servers' loader and its checks (a private regular file, the size, the length)
        secret = load_secret(args.secret_file or None)
    except ValueError as exc:
        parser.error(str(exc))
    prompts = read_prompts(args.prompts)
    counts = extract(
        args.url, prompts, args.out, model=args.model, via=args.via,
        concurrency=args.concurrency, secret=secret, timeout_s=args.timeout_s,
        progress=_bar(time.monotonic()), max_tokens=args.max_tokens,
        include_outputs=args.include_outputs,
    )  # fmt: skip
    print(json.dumps(counts))
    if counts["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
