"""Read the hidden states a vLLM server with ``TritonKVConnector`` took (``extract_hidden_states``).

A finished request's ``kv_transfer_params`` (in the OpenAI response of vLLM's server, or
``RequestOutput.kv_transfer_params`` offline) say where its prompt's hidden states are:

- ``hidden_states_path``: a safetensors file, vLLM's ``ExampleHiddenStatesConnector`` format
  (read with :func:`read_hidden_file`, or the reader of vLLM's example connector);
- ``hidden_states_transfer_id``, ``hidden_states_host``, ``hidden_states_port``,
  ``hidden_states_digest``: the producer's KV server holds them (read with
  :func:`load_hidden_states`, or many with a :class:`HiddenStatesReader`, which keeps its
  connections; no shared storage needed). The entry is delivered once, then discarded; unread
  ones expire after the server's ``ttl_s``.

Either way you get ``{"hidden_states": [num_tokens, num_hidden_states, hidden_size] (the model's
dtype), "token_ids": [num_tokens] int64}``. Example, from a training job on another host::

    import json, urllib.request
    from connector.hidden import load_hidden_states
    from connector.transport import load_secret

    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
    req = urllib.request.Request(
        "http://server:8000/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"})
    params = json.load(urllib.request.urlopen(req))["kv_transfer_params"]
    states = load_hidden_states(
        params["hidden_states_host"], params["hidden_states_port"],
        params["hidden_states_transfer_id"], params["hidden_states_digest"],
        secret=load_secret("/etc/tritonkv.secret"))
    states["hidden_states"].shape  # torch.Size([num_tokens, num_hidden_states, hidden_size])

The digest a reader presents. The producer binds the served entry to its request's prompt
digest, as it binds a KV entry (:func:`~connector.vllm_connector.handoff.request_digest`: the
token ids, LoRA adapter, ``cache_salt`` and multimodal inputs), and its KV server serves or
discards the entry only for a request presenting that digest. To any other the entry does not
exist: the same MISS as an unknown transfer id, after the same wait, and the entry stays for the
right reader. The producer returns the digest as ``hidden_states_digest`` beside the transfer id,
to the client that sent the request, as the KV hand-off returns ``prompt_digest``; the reader is
not asked to compute it, because the client often cannot: one that sent text or chat messages
does not hold the token ids (the server's tokenizer and chat template made them), nor the
identifiers vLLM gives images (hashes of the processed inputs), and a digest computed wrongly
would be answered exactly as an entry that is gone. So the binding guards against readers that
hold a transfer id without its request's params: a transfer id alone (from a trace, a proxy's
log, another process) reads nothing, and a transfer id paired with another request's digest
(mixed-up params) is refused. The digest is not a secret (whoever knows the prompt, adapter and
salt computes it): what keeps hidden states private is the shared secret, the unguessable
transfer id, and handing a request's ``kv_transfer_params`` only to whoever sent it; whoever
holds the secret and those params can read the entry, once. A reader that sent token ids and
wants the hidden states of exactly that prompt may present its own :func:`prompt_digest` of
them instead (equal to ``hidden_states_digest`` for token ids without LoRA, ``cache_salt`` or
multimodal inputs): the server then serves only a prompt equal to its own.

Integrity: a producer with ``digest`` on (the default) stores each tensor's digest with the entry
and in the file's header; both readers check them on receipt and raise
:class:`~connector.integrity.DigestMismatch` (a ValueError) naming the transfer or
file and the check (``receipt``, ``file``) when the bytes differ from what the producer packed.

The server authenticates every connection with the shared secret it was started with
(``TRITONKV_SECRET`` or ``secret_file``; :mod:`connector.transport.auth`); pass the same.
"""

from __future__ import annotations

import collections
import re
import threading

import torch

from ..integrity import DigestMismatch, check_hidden
from ..kvstore import KeyMissError, KVClient
from ..transport import PeerDeadError, PipeClosedError, auth, check_timeout
from ..vllm_connector.handoff import prompt_digest
from .files import read_hidden_file

__all__ = [
    "DigestMismatch",
    "HiddenStatesReader",
    "load_hidden_states",
    "prompt_digest",
    "read_hidden_file",
]

#: a prompt digest as the producer returns it (``hidden_states_digest``) and :func:`prompt_digest`
#: makes it
_DIGEST = re.compile(r"[0-9a-f]{32}")


def check_digest(digest) -> str:
    """``digest`` if it is a prompt digest (32 lowercase hex digits); TypeError (None, not a
    str) or ValueError (another form) naming what was expected."""
    want = (
        "the request's hidden_states_digest (32 lowercase hex digits, from its kv_transfer_params)"
    )
    if digest is None:
        raise TypeError(
            f"digest: expected {want}, got None: the server serves hidden states only to a "
            "reader presenting their prompt's digest (a producer of tritonkv 0.1.0 returns none)"
        )
    if not isinstance(digest, str):
        raise TypeError(f"digest: expected {want}, got {type(digest).__name__}")
    if not _DIGEST.fullmatch(digest):
        shown = digest if len(digest) <= 40 else digest[:40] + "..."
        raise ValueError(f"digest: expected {want}, got {shown!r} ({len(digest)} characters)")
    return digest


class HiddenStatesReader:
    """Loads many requests' hidden states over connections it keeps, one per producer address.

    Each connection is authenticated once, then carries one request after another, where
    :func:`load_hidden_states` pays a handshake (and the server a connection) per request: use
    this when reading a dataset's worth. One request at a time per reader (thread-safe,
    serialised); give each client thread its own. A connection the server closed while it was
    idle is made again once, transparently (no entry is claimed by a request that never reached
    the server).

    Args: as :func:`load_hidden_states` (``secret``, ``timeout_s``, ``connect_timeout_s``,
    ``transport``), for every request; ``max_peers``: connections kept at most (the least
    recently used one is closed beyond that).
    """

    def __init__(
        self,
        *,
        secret: bytes | str | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        transport: str = "socket",
        max_peers: int = 8,
    ):
        if isinstance(max_peers, bool) or not isinstance(max_peers, int) or max_peers < 1:
            raise ValueError(f"max_peers: expected an int >= 1, got {max_peers!r}")
        self._client_args = {
            "transport": transport,
            "timeout_s": check_timeout("timeout_s", timeout_s),
            "connect_timeout_s": check_timeout("connect_timeout_s", connect_timeout_s),
            "secret": auth.check_secret(secret),
        }
        self.max_peers = max_peers
        self._clients: collections.OrderedDict[tuple[str, int], KVClient] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def load(
        self, host: str, port: int, transfer_id: str, digest: str, *, wait_s: float | None = None
    ) -> dict[str, torch.Tensor]:
        """One request's hidden states (see :func:`load_hidden_states` for the arguments and
        what is returned and raised)."""
        if wait_s is None:
            wait_s = self._client_args["timeout_s"] / 2
        if not isinstance(transfer_id, str) or not transfer_id:
            raise TypeError(f"transfer_id: expected a non-empty str, got {transfer_id!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"port: expected an int in 1..65535, got {port!r}")
        digest = check_digest(digest)
        with self._lock:
            client = self._client(host, port)
            kept = client.stats()["connects"] > 0  # a request over a connection made before
            try:
                try:
                    tensors, meta = client.get(transfer_id, wait_s=wait_s, digest=digest)
                except (PeerDeadError, PipeClosedError):
                    if not kept:
                        raise
                    # the server closed the kept connection (idle, restarted): once on a new one
                    tensors, meta = client.get(transfer_id, wait_s=wait_s, digest=digest)
            except KeyMissError as e:
                raise KeyMissError(
                    f"no hidden states of this transfer for digest {digest[:8]}: gone, never "
                    "taken, or not their digest (a wrong hidden_states_digest gets the answer of "
                    "an unknown transfer id, and the entry stays for the right one)",
                    reason=e.reason,
                    peer=e.peer,
                    key=e.key,
                    waited_s=e.waited_s,
                ) from None
        if meta.get("kind") != "hidden_states" or set(tensors) != {"hidden_states", "token_ids"}:
            raise ValueError(
                f"transfer {transfer_id[:8]}: expected hidden states, got an entry of kind "
                f"{meta.get('kind')!r} with tensors {sorted(tensors)}"
            )
        check_hidden(meta, tensors, "receipt", f"hidden states of transfer {transfer_id[:8]}: ")
        return {"hidden_states": tensors["hidden_states"], "token_ids": tensors["token_ids"]}

    def _client(self, host: str, port: int) -> KVClient:
        client = self._clients.pop((host, port), None)
        if client is None:
            client = KVClient(host, port, **self._client_args)
            while len(self._clients) >= self.max_peers:
                self._clients.popitem(last=False)[1].close()
        self._clients[(host, port)] = client  # most recently used last
        return client

    def close(self) -> None:
        """Close every kept connection (idempotent)."""
        with self._lock:
            while self._clients:
                self._clients.popitem()[1].close()

    def __enter__(self) -> HiddenStatesReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_hidden_states(
    host: str,
    port: int,
    transfer_id: str,
    digest: str,
    *,
    secret: bytes | str | None = None,
    timeout_s: float = 30.0,
    connect_timeout_s: float = 10.0,
    wait_s: float | None = None,
    transport: str = "socket",
) -> dict[str, torch.Tensor]:
    """Load one request's hidden states from the producer's KV server, over a connection of its
    own (many requests: :class:`HiddenStatesReader` keeps its connections).

    Args:
        host, port: ``hidden_states_host`` and ``hidden_states_port`` of its params.
        transfer_id: its ``hidden_states_transfer_id``.
        digest: its ``hidden_states_digest``, the prompt digest the entry is bound to (or a
            reader's own :func:`prompt_digest` of the token ids it sent: module docstring).
        secret: the server's shared secret (None: a server started without one).
        timeout_s: the deadline of the whole load (connect and transfer).
        connect_timeout_s: the deadline of the connection's handshake.
        wait_s: how long the server may wait for the entry to appear (below ``timeout_s``;
            default half of it). The producer delivers a request's hidden states off its step,
            so they may arrive just after the response that names them; a save that failed
            ends the wait at once (a MISS).
        transport: ``socket`` (inline TCP, any host) or ``gloo``.

    Returns:
        ``{"hidden_states": [num_tokens, num_hidden_states, hidden_size], "token_ids":
        [num_tokens] int64}`` on the CPU.

    Raises:
        TypeError, ValueError: arguments of the wrong type or range (a ``digest`` of None or
            not 32 lowercase hex digits among them).
        connector.kvstore.KeyMissError: the server holds no entry of ``transfer_id`` for
            ``digest`` (its save failed, never taken, already read, expired, its request was
            aborted, or ``digest`` is not the one it is bound to: answered as an unknown
            transfer id, after ``wait_s``, and the entry stays for the right digest); the
            reason says which it knows.
        DigestMismatch: what arrived differs from what the producer packed (check
            ``receipt``); the entry was delivered (and discarded) all the same.
        connector.transport.TransferTimeout, PeerDeadError, ...: the load failed in time.
    """
    reader = HiddenStatesReader(
        secret=secret, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, transport=transport
    )
    with reader:
        return reader.load(host, port, transfer_id, digest, wait_s=wait_s)
