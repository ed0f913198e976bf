"""``connector.serve.extract``: prompts JSONL -> dataset, over the network or from files, resumable,
a failing prompt reported and left out (a corrupted one too, naming the digest check). Against a
stand-in server (plain HTTP in a thread) that puts made-up hidden states where TritonKVConnector
would: a KV server and files."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load_file

from connector.hidden import prompt_digest
from connector.hidden.files import HiddenFileWriter
from connector.integrity import flip_bit, hidden_meta
from connector.kvstore import KVBuffer, KVServer
from connector.serve.extract import extract, read_prompts
from tritonkv.digest import digest_hex, tensor_digest

SECRET = "e" * 40


def _states(ids: list[int]) -> dict[str, torch.Tensor]:
    n = len(ids)
    return {
        "hidden_states": torch.arange(n * 2 * 4, dtype=torch.float32).reshape(n, 2, 4) + ids[0],
        "token_ids": torch.tensor(ids, dtype=torch.int64),
    }


@pytest.fixture
def stand_in(tmp_path):
    buffer = KVBuffer(1 << 20)
    kv = KVServer(buffer, "127.0.0.1", 0, secret=SECRET)
    writer = HiddenFileWriter(1 << 20)
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            return None

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append(body)
            ids = body["prompt"]
            if ids == [13]:  # the prompt this server fails
                self.send_response(500)
                self.end_headers()
                return
            tid = f"t{len(calls)}"
            path = str(tmp_path / "server" / f"{tid}.safetensors")
            states = _states(ids)
            digests = hidden_meta(*(digest_hex(tensor_digest(t)) for t in states.values()))
            if ids == [17]:  # the prompt whose states a bit flip corrupts after their digest
                flip_bit(states["hidden_states"][None, None])
            meta = {"kind": "hidden_states", **digests}
            buffer.put(tid, states, meta, digest=prompt_digest(ids))
            writer.submit(path, states, HiddenFileWriter.lock(path), digests)
            params = {
                "hidden_states_path": path,
                "hidden_states_transfer_id": tid,
                "hidden_states_host": "127.0.0.1",
                "hidden_states_port": kv.port,
                "hidden_states_digest": prompt_digest(ids),
            }
            if ids == [19]:  # the prompt of a producer that names no digest (tritonkv 0.1.0)
                del params["hidden_states_digest"]
            data = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": params}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{http.server_address[1]}", calls, kv
    http.shutdown()
    writer.close()
    kv.close()
    buffer.close()


def _prompts_file(tmp_path, items) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return str(path)


@pytest.mark.parametrize("via", ["network", "files"])
def test_extract_and_resume(stand_in, tmp_path, via) -> None:
    url, calls, _ = stand_in
    items = [
        {"id": "a", "prompt_token_ids": [3, 4, 5]},
        {"id": "b", "prompt_token_ids": [7, 8]},
        {"id": "bad", "prompt_token_ids": [13]},
    ]
    prompts = read_prompts(_prompts_file(tmp_path, items))
    out = tmp_path / "dataset"
    seen = []
    counts = extract(url, prompts, out, via=via, secret=SECRET, concurrency=2,
                     progress=lambda d, t: seen.append((d, t)))  # fmt: skip
    assert counts == {"done": 2, "skipped": 0, "failed": 1, "tokens": 5}
    assert seen[-1] == (3, 3)
    for pid, ids in (("a", [3, 4, 5]), ("b", [7, 8])):
        got = load_file(str(out / f"{pid}.safetensors"))
        assert torch.equal(got["hidden_states"], _states(ids)["hidden_states"])
        assert got["token_ids"].tolist() == ids
    assert not (out / "bad.safetensors").exists()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    assert sorted(i["id"] for i in index) == ["a", "b"]
    asked = len(calls)
    again = extract(url, prompts, out, via=via, secret=SECRET)  # resumed: only "bad" again
    assert again == {"done": 0, "skipped": 2, "failed": 1, "tokens": 0}
    assert len(calls) == asked + 1 and calls[-1]["prompt"] == [13]
    assert calls[0]["max_tokens"] == 1 and "kv_transfer_params" not in calls[0]


def test_include_outputs_asks_for_whole_sequences(stand_in, tmp_path) -> None:
    url, calls, _ = stand_in
    prompts = read_prompts(_prompts_file(tmp_path, [{"id": "w", "prompt_token_ids": [3, 4]}]))
    counts = extract(url, prompts, tmp_path / "dataset", secret=SECRET, max_tokens=8,
                     include_outputs=True)  # fmt: skip
    assert counts["done"] == 1
    assert calls[-1]["max_tokens"] == 8
    assert calls[-1]["kv_transfer_params"] == {"include_output_tokens": True}
    with pytest.raises(ValueError, match="max_tokens"):
        extract(url, prompts, tmp_path / "d2", max_tokens=0)


def test_network_reads_keep_one_connection_per_client_thread(stand_in, tmp_path) -> None:
    url, _, kv = stand_in
    items = [{"id": f"p{i}", "prompt_token_ids": [20 + i, 3]} for i in range(12)]
    prompts = read_prompts(_prompts_file(tmp_path, items))
    counts = extract(url, prompts, tmp_path / "dataset", via="network", secret=SECRET,
                     concurrency=2)  # fmt: skip
    assert counts == {"done": 12, "skipped": 0, "failed": 0, "tokens": 24}
    assert 1 <= kv.stats()["connections"] <= 2  # one per client thread, not one per prompt


def test_bad_inputs(tmp_path) -> None:
    with pytest.raises(ValueError, match=":2: expected an object"):
        read_prompts(_prompts_file(tmp_path, [{"prompt": "x"}, {"text": "y"}]))
    with pytest.raises(ValueError, match="unique"):
        read_prompts(
            _prompts_file(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
        )
    with pytest.raises(ValueError, match="via"):
        extract("http://127.0.0.1:1", [], tmp_path, via="disk")


@pytest.mark.parametrize(("via", "check"), [("network", "receipt"), ("files", "write")])
def test_a_corrupted_prompt_is_reported_by_its_id_and_check(stand_in, tmp_path, capsys, via, check):
    url, _, _ = stand_in
    items = [
        {"id": "good", "prompt_token_ids": [3, 4]},
        {"id": "flipped", "prompt_token_ids": [17]},
    ]
    out = tmp_path / "dataset"
    counts = extract(url, read_prompts(_prompts_file(tmp_path, items)), out, via=via, secret=SECRET)
    assert counts == {"done": 1, "skipped": 0, "failed": 1, "tokens": 2}
    err = capsys.readouterr().err
    assert "prompt flipped: " in err and f"digest check '{check}' failed" in err, err
    assert not (out / "flipped.safetensors").exists()


def test_params_without_a_digest_fail_that_prompt_naming_it(stand_in, tmp_path, capsys) -> None:
    """Over the network the reader presents the params' ``hidden_states_digest``: params without
    one (an older producer's) fail that prompt, saying so; the others are extracted."""
    url, _, _ = stand_in
    items = [{"id": "good", "prompt_token_ids": [3, 4]}, {"id": "old", "prompt_token_ids": [19]}]
    out = tmp_path / "dataset"
    counts = extract(url, read_prompts(_prompts_file(tmp_path, items)), out, secret=SECRET)
    assert counts == {"done": 1, "skipped": 0, "failed": 1, "tokens": 2}
    err = capsys.readouterr().err
    assert "prompt old: RuntimeError" in err and "no hidden_states_digest" in err, err


def test_the_secret_file_passes_the_servers_checks(stand_in, tmp_path, capsys) -> None:
    """``--secret-file`` is read as the servers read theirs (``load_secret``): a file others may
    read is refused before anything is sent; a private one extracts."""
    from connector.serve.extract import main

    url = stand_in[0]
    prompts = _prompts_file(tmp_path, [{"id": "p", "prompt_token_ids": [3, 4]}])
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o644)
    args = ["--url", url, "--prompts", str(prompts), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--secret-file", str(secret)])
    assert exit_.value.code == 2 and "lets group or others access it" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    secret.chmod(0o600)
    main([*args, "--secret-file", str(secret)])
    assert (tmp_path / "out" / "p.safetensors").is_file()
