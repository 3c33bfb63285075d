"""Property tests: inputs Hypothesis makes up, each given to Go (one
long-lived helper, ``vectors -serve``, JSON lines on stdin and stdout) and
to Python, which must agree on every one: accept or refuse, and what an
accepted input gives. Example counts are sized for 2 cores (a few seconds
in all)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsp

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Go:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def ask(self, q: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(q).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the Go helper ended")
        out: dict[str, Any] = json.loads(line)
        return out


@pytest.fixture(scope="module")
def go() -> Iterator[Go]:
    binary = pathlib.Path(os.environ.get("KVSP_VECTORS_BIN", ROOT / "bin" / "kvsp-vectors"))
    if not binary.exists():
        pytest.fail(f"{binary} is missing: make test-python builds it")
    proc = subprocess.Popen([str(binary), "-serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        yield Go(proc)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)


GEOMETRY = {"layers": 4, "block_tokens": 16, "kv_heads": 2, "head_dim": 64, "elem": "fp16"}
VALID_HEADER = kvsp.new_header(kvsp.CODEC_RAW, 1, 2, kvsp.Geometry(4, 16, 2, 64, "fp16")).to_bytes()


@st.composite
def headers(draw: st.DrawFn) -> bytes:
    """A valid header with a few octets changed, cut or appended."""
    b = bytearray(VALID_HEADER)
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(b) - 1))
        b[i] = draw(st.sampled_from([0, 1, 2, 0xFF, 0x10, b[i] ^ 1]))
    cut = draw(st.integers(0, len(b)))
    return bytes(b[:cut]) + draw(st.binary(max_size=8))


@EXAMPLES
@given(b=headers(), known=st.booleans())
def test_header_agrees(go: Go, b: bytes, known: bool) -> None:
    g = kvsp.Geometry(4, 16, 2, 64, "fp16") if known else None
    want = go.ask({"op": "header", "hex": b.hex(), "geometry": GEOMETRY if known else None})
    try:
        h, n = kvsp.parse_header(b, g)
    except kvsp.KVSPError:
        assert not want["ok"], f"Python refused a header Go parsed: {b.hex()}"
        return
    assert want["ok"], f"Python parsed a header Go refused: {b.hex()}"
    got = {
        "codec": h.codec,
        "first_layer": h.first_layer,
        "token_count": h.token_count,
        "layers": [list(x) for x in h.layers],
        "len": n,
    }
    assert got == want["header"]


DESCRIPTOR = json.loads((ROOT / "examples" / "dev" / "descriptor.json").read_text())
VALUES: st.SearchStrategy[Any] = st.one_of(
    st.integers(-3, 1 << 33),
    st.sampled_from([0, 1, 2**53 - 1, 2**53, 2**64, 1.0, 1e3, -0.0, True, False, None, "", [], {}]),
    st.text(max_size=12),
    st.sampled_from(
        [
            "bf16",
            "fp8-e4m3",
            "rope;theta=500000",
            "rope;scaling=yarn",
            "none",
            "kvsp-layout-1",
            "sha-256:" + "ab" * 32,
            "sha-256:" + "AB" * 32,
        ]
    ),
)


@st.composite
def descriptors(draw: st.DrawFn) -> str:
    d: dict[str, Any] = dict(DESCRIPTOR)
    for m in draw(st.lists(st.sampled_from([*sorted(d), "adapters", "extra"]), max_size=3)):
        if draw(st.booleans()):
            d.pop(m, None)
        else:
            d[m] = draw(VALUES)
    return json.dumps(d)


@EXAMPLES
@given(text=descriptors())
def test_descriptor_agrees(go: Go, text: str) -> None:
    want = go.ask({"op": "descriptor", "json": text})
    try:
        got = str(kvsp.parse_descriptor(text.encode()).compat_id())
    except kvsp.InvalidError:
        assert not want["ok"], f"Python refused a descriptor Go accepted: {text}"
        return
    assert want["ok"] and got == want["value"], text


@EXAMPLES
@given(
    b=st.integers(1, 300),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=700),
    key=st.binary(min_size=32, max_size=70),
)
def test_block_keys_agree(go: Go, b: int, tokens: list[int], key: bytes) -> None:
    compat = "11" * 32
    want = go.ask({"op": "keys", "scope_key": key.hex(), "compat": compat, "b": b, "tokens": tokens})
    got = kvsp.block_keys(kvsp.ScopeKey(key), kvsp.CompatID.parse(compat), b, tokens)
    assert want["ok"] and [k.hex() for k in got] == want.get("keys", [])
    chain = kvsp.Chain(kvsp.ScopeKey(key), kvsp.CompatID.parse(compat), b)
    assert [k.hex() for k in chain.extend(tokens)] == want.get("keys", [])


URI_PARTS = st.sampled_from(
    [
        "https://",
        "HTTPS://",
        "http://",
        "moqt://",
        "https:",
        "//",
        "",
        "h.example",
        "H.Example",
        "127.0.0.1",
        "[::1]",
        "[::FFFF:1.2.3.4]",
        "[1.2.3.4]",
        ":443",
        ":0443",
        ":",
        ":65536",
        ":x",
        "/",
        "/a",
        "/./",
        "/../",
        "%41",
        "%2f",
        "%zz",
        "%",
        "?",
        "#",
        "@",
        "u@",
        " ",
        "é",
        '"',
        "[",
        "]",
        "~",
        "!$&'()*+,;=",
    ]
)


@EXAMPLES
@given(parts=st.lists(URI_PARTS, max_size=8))
def test_base_uri_agrees(go: Go, parts: list[str]) -> None:
    s = "".join(parts)
    want = go.ask({"op": "base_uri", "input": s})
    try:
        got = kvsp.normalize_base_uri(s)
    except kvsp.InvalidError:
        assert not want["ok"], f"Python refused a base URI Go normalized: {s!r}"
        return
    assert want["ok"] and got == want["value"], f"{s!r}: Python {got!r}, Go {want}"


REPLICA = {
    "block_key": "01" * 32,
    "compat_id": "02" * 32,
    "scope_id": "03" * 16,
    "holder": "https://h1.example/kvsp/",
    "codec": 1,
    "size": 65536,
    "digest": "sha-256:" + "ab" * 32,
    "layer_digests": ["04" * 32] * 4,
    "residency": [{"tier": "host", "layers": [0, 1]}, {"tier": "local-storage", "layers": [2, 3]}],
    "ttl_ms": 60000,
}


@st.composite
def replicas(draw: st.DrawFn) -> str:
    r: dict[str, Any] = json.loads(json.dumps(REPLICA))
    for m in draw(st.lists(st.sampled_from([*sorted(r), "moqt_namespace"]), max_size=3)):
        if draw(st.booleans()):
            r.pop(m, None)
        else:
            r[m] = draw(
                st.one_of(
                    VALUES, st.just([{"tier": "host", "layers": [draw(st.integers(0, 5)), draw(st.integers(0, 5))]}])
                )
            )
    return json.dumps(r)


@EXAMPLES
@given(text=replicas())
def test_replica_agrees(go: Go, text: str) -> None:
    want = go.ask({"op": "record", "type": "replica", "json": text})
    try:
        kvsp.ReplicaRecord.decode(text.encode())
    except kvsp.KVSPError as e:
        assert not want["ok"] and e.kind == want["kind"], f"{text}: Python {e!r}, Go {want}"
        return
    assert want["ok"], f"Python accepted a replica record Go refused: {text}"
