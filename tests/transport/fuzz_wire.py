"""Coverage-guided fuzz target (atheris, libFuzzer) for what a tritonkv listener or client reads from
the network: the authentication exchange, frame prefixes, header bodies, metadata and inline
payloads, through the same functions the pipe's threads call.

    python tests/transport/fuzz_wire.py [libFuzzer options] CORPUS_DIR      # `make fuzz`: 10 minutes

An input's first byte picks the target:

0. frames of a session: the harness seals each frame of the input (its header, and an inline
   payload it announces) with the session's tags (:mod:`connector.transport.session`), so that
   what lies behind the tag check is fuzzed; the bytes arrive on a socket; ``sockio.read_frame``
   reads headers one after another and ``receiving._read_inline_payload`` the inline payloads
   (what the reader thread's loop calls; the target drives these private functions directly,
   without a pipe around them);
1. the listener's side of the authentication: a 132-byte RESPONSE to a known challenge;
2. the connector's side: a 38-byte CHALLENGE, then a 37-byte VERDICT;
3. metadata: ``wire.decode_meta`` and the limits a peer announces in it;
4. a hand-off (``kv_transfer_params``, which any client of a decode server sets): JSON laid over
   a real hand-off, through ``handoff_problems`` and ``parse_handoff``; whatever parses must be
   dialable (every TP rank's port in range, ``tp_size`` bounded) and every problem short;
5. frames as they come, unsealed: ``read_frame`` must accept none (a forged tag);
6. the rendezvous: sealed frames read by a ``ChannelStore`` waiting for a key (what gloo's
   rendezvous calls during a handshake).

A finding is any exception other than the transport's own refusals (ProtocolError, AuthError, end
of stream), an input that takes over a second (``-timeout=1``), an allocation above the limits
announced (checked: every payload the decoder lets through fits ``LIMITS``), or a forged
authentication or frame accepted. ``CORPUS_DIR`` is seeded with valid frames and exchanges when
empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time

import atheris
import torch  # imported before instrumenting: only tritonkv's modules are instrumented

# Run as a script: the checkout's connector/ (installed as tritonkv_connector) from the repo root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

with atheris.instrument_imports():
    from connector.kvstore.protocol import Op
    from connector.transport import auth, errors, receiving, rendezvous, sockio
    from connector.transport import frame as wire
    from connector.transport.session import Session
    from connector.vllm_connector.handoff import (
        MAX_TP_SIZE,
        build_handoff,
        handoff_problems,
        parse_handoff,
        prompt_digest,
    )

# Small announced limits, so that anything the decoder accepts is cheap to allocate and check.
LIMITS = wire.FrameLimits(
    max_body_bytes=1 << 16,
    max_key_bytes=256,
    max_meta_bytes=1 << 12,
    max_tensors=64,
    max_name_bytes=64,
    max_message_bytes=1 << 20,
)
SECRET = b"fuzz-shared-secret-0123456789abc"
NONCE_L = bytes(range(32))
ADDRESS = "127.0.0.1:7000"
KEYS = auth.session_keys(SECRET, NONCE_L, bytes(32), ADDRESS)
REFUSALS = (errors.ProtocolError, auth.AuthError, sockio.PeerClosed)


def _session() -> Session:
    """The listener's end of a fixed session (fresh counters)."""
    return Session.pair(*KEYS, listener=True)


def seal(data: bytes) -> bytes:
    """``data`` as the connector's end of the fixed session sends it: each frame with its tag and
    the tag of an inline payload it announces; bytes past what parses as frames left as they are
    (the receiver must refuse them)."""
    sender, out, pos = Session.pair(*KEYS, listener=False), [], 0
    while pos + wire.PREFIX_SIZE <= len(data):
        prefix = data[pos : pos + wire.PREFIX_SIZE]
        try:
            kind, flags, body_len = wire.decode_prefix(prefix, LIMITS)
        except errors.ProtocolError:
            break
        header = data[pos : pos + wire.PREFIX_SIZE + body_len]
        pos += len(header)
        mac = sender.sending(header)
        out += [header, mac.header_tag()]
        try:
            h = wire.decode_body(kind, flags, header[wire.PREFIX_SIZE :], LIMITS)
        except errors.ProtocolError:
            break
        if h.inline and h.payload_bytes:
            payload = data[pos : pos + h.payload_bytes]
            pos += len(payload)
            mac.update(payload)
            out += [payload, mac.payload_tag()]
    return b"".join(out) + data[pos:]


@contextlib.contextmanager
def _arriving(data: bytes):
    """The receiving end of a socket pair holding ``data``, then end of stream."""
    a, b = socket.socketpair()
    try:
        for s in (a, b):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        b.setblocking(False)
        yield b
    finally:
        a.close()
        b.close()


def _read_frames(data: bytes) -> int:
    """How many frames the reader accepted from ``data``."""
    session = _session()
    accepted = 0
    with _arriving(data) as b:
        while True:
            deadline = time.monotonic() + 0.5  # all bytes are there: a wait is a hang
            got = sockio.read_frame(b, LIMITS, deadline, 0.5, session)
            if got is None:
                return accepted
            header, mac = got
            accepted += 1
            assert header.payload_bytes <= LIMITS.max_message_bytes, header
            if header.kind in (wire.Kind.HELLO, wire.Kind.HELLO_ACK):
                wire.limits_from_meta(header.meta, LIMITS)
            if header.inline:
                tensors = receiving._read_inline_payload(b, header, mac, 0.5)
                assert sum(t.nbytes for t in tensors.values()) == header.payload_bytes
            else:
                chunks = wire.plan_chunks(header.specs)
                assert sum(c.nbytes for c in chunks) <= 2 * LIMITS.max_message_bytes + 4096


def _frames(data: bytes) -> None:
    _read_frames(seal(data))


def _unsealed(data: bytes) -> None:
    try:
        accepted = _read_frames(data)
    except REFUSALS:
        return
    assert accepted == 0, "an unsealed frame was accepted"


def _rendezvous(data: bytes) -> None:
    with _arriving(seal(data)) as b:
        deadline = time.monotonic() + 0.5
        store = rendezvous.ChannelStore(b, _session(), LIMITS, deadline, 0.5, "fuzz")
        with contextlib.suppress(errors.PeerDeadError):
            value = store.get("0/1")
            assert len(value) <= rendezvous.MAX_VALUE_BYTES


def _listener_auth(data: bytes) -> None:
    raw = data[: auth.RESPONSE.size].ljust(auth.RESPONSE.size, b"\0")
    outcome = auth.check_response(SECRET, NONCE_L, raw, {ADDRESS})
    assert outcome.problem is not None, "a forged response was accepted"
    assert len(outcome.verdict) == auth.VERDICT.size
    outcome = auth.check_response(None, NONCE_L, raw, {ADDRESS})  # no secret: the address counts
    field = raw[4 + auth.NONCE_BYTES :][: auth.ADDRESS_BYTES].rstrip(b"\0")
    assert (outcome.problem is None) == (raw.startswith(auth.MAGIC) and field == ADDRESS.encode())


def _connector_auth(data: bytes) -> None:
    challenge = data[: auth.CHALLENGE.size].ljust(auth.CHALLENGE.size, b"\0")
    verdict = data[auth.CHALLENGE.size :][: auth.VERDICT.size].ljust(auth.VERDICT.size, b"\0")
    required, nonce_l = auth.parse_challenge(challenge, "fuzz")
    for secret in (SECRET, None):
        try:
            response, nonce_c = auth.respond(secret, required, nonce_l, ADDRESS, "fuzz")
        except auth.AuthError:
            continue
        assert len(response) == auth.RESPONSE.size
        try:
            auth.check_verdict(secret, nonce_l, nonce_c, ADDRESS, verdict, "fuzz")
        except REFUSALS:
            continue
        assert secret is None, "a forged verdict was accepted"


def _meta(data: bytes) -> None:
    meta = wire.decode_meta(data)
    assert isinstance(meta, dict)
    wire.limits_from_meta(meta, LIMITS)


HANDOFF = build_handoff(
    transfer_id="0123456789abcdef" * 2,
    host="10.0.0.1",
    engine_port=14600,
    num_tokens=3,
    prompt_digest=prompt_digest([1, 2, 3]),
    fingerprint="fp",
    tp_size=2,
)


def _handoff(data: bytes) -> None:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # not JSON: vLLM's API refuses it before us
        return
    params = {**HANDOFF, **value} if isinstance(value, dict) else value
    spec = parse_handoff(params)
    if not isinstance(params, dict):
        assert spec is None
        return
    problems = handoff_problems(params)
    assert all(len(p) < 400 for p in problems), problems
    if spec is not None:
        assert problems == [], problems
        assert 1 <= spec.producer_tp <= MAX_TP_SIZE
        assert spec.port >= 1 and spec.port + spec.producer_tp - 1 <= 65535, spec


TARGETS = (_frames, _listener_auth, _connector_auth, _meta, _handoff, _unsealed, _rendezvous)


def one_input(data: bytes) -> None:
    if not data:
        return
    with contextlib.suppress(*REFUSALS):
        TARGETS[data[0] % len(TARGETS)](data[1:])


def seeds() -> list[bytes]:
    """Valid inputs for every target: frames of each kind (inline payloads included), a correct
    authentication exchange, announced limits."""
    frames = [
        wire.encode_header(wire.Kind.HELLO, "", {"proto": 2, **wire.limits_meta(LIMITS)}),
        wire.encode_header(wire.Kind.HELLO_ACK, "", {"transport": "gloo"}),
        wire.encode_header(Op.GET, "transfer-1", {"wait_ms": 100}),
        wire.encode_header(Op.MISS, "k", {"reason": "expired"}),
        wire.encode_header(wire.Kind.ERROR, "k", {"error": "no"}),
        wire.encode_header(Op.DISCARD, "k"),
        wire.encode_header(wire.Kind.BYE, ""),
    ]
    kv = {"kv": torch.arange(24, dtype=torch.int16).view(2, 3, 4), "cu": torch.tensor([0, 3])}
    specs = [wire.spec_of(name, t) for name, t in kv.items()]
    payload = b"".join(t.numpy().tobytes() for t in kv.values())
    data = wire.encode_header(Op.DATA, "k", {"kv_format": "tokens"}, specs, wire.FLAG_INLINE)
    frames.append(data + payload)
    frames.append(wire.encode_header(Op.DATA, "k", {}, specs))  # payload on the group
    challenge, nonce_l = auth.challenge(True)
    response, nonce_c = auth.respond(SECRET, True, nonce_l, ADDRESS, "seed")
    verdict = auth.check_response(SECRET, nonce_l, response, {ADDRESS}).verdict
    sets = [
        wire.encode_header(wire.Kind.RENDEZVOUS, "0/0", {"value": "ab" * 85}),
        wire.encode_header(wire.Kind.RENDEZVOUS, "0/1", {"value": "cd" * 85}),
        wire.encode_header(wire.Kind.RENDEZVOUS, "", {"done": True}),
    ]
    return [
        b"\0" + b"".join(frames),
        *[b"\0" + f for f in frames],
        b"\1" + response,
        b"\2" + challenge + verdict,
        b"\3" + wire.encode_meta(wire.limits_meta(LIMITS)),
        b"\4" + json.dumps(HANDOFF).encode(),
        b"\4" + json.dumps({"remote_port": 65535, "tp_size": 2}).encode(),
        b"\5" + b"".join(frames),
        b"\6" + b"".join(sets),
    ]


def main(argv: list[str]) -> None:
    corpus = next((a for a in argv[1:] if not a.startswith("-")), None)
    if corpus is not None:
        os.makedirs(corpus, exist_ok=True)
        if not os.listdir(corpus):
            for i, seed in enumerate(seeds()):
                with open(os.path.join(corpus, f"seed-{i:02d}"), "wb") as f:
                    f.write(seed)
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
