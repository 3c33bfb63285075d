"""The shared vectors (testdata/vectors/core.json, written by make vectors from
the Go implementation): every one must give in Python what it gives in Go.
Go's TestSharedVectors runs the same file and the same count."""

from __future__ import annotations

import io
import json
import pathlib
from typing import Any

import pytest

import kvsp

VECTORS = pathlib.Path(__file__).resolve().parents[2] / "testdata" / "vectors" / "core.json"
DATA: dict[str, Any] = json.loads(VECTORS.read_text())


def _ids(cases: list[dict[str, Any]]) -> list[str]:
    return [c["name"] for c in cases]


def test_count() -> None:
    sections = [
        "descriptors",
        "scope_keys",
        "block_keys",
        "layer_digests",
        "replica_digests",
        "repr_digest_fields",
        "new_headers",
        "headers",
        "containers",
        "problems",
        "base_uris",
        "records",
        "fp8_sections",
    ]
    assert sum(len(DATA[s]) for s in sections) == DATA["count"] >= 518


@pytest.mark.parametrize("case", DATA["descriptors"], ids=_ids(DATA["descriptors"]))
def test_descriptor(case: dict[str, Any]) -> None:
    data = bytes.fromhex(case["json_hex"]) if case.get("json_hex") else case["json"].encode("utf-8")
    if case.get("error"):
        with pytest.raises(kvsp.InvalidError):
            kvsp.parse_descriptor(data).compat_id()
        return
    d = kvsp.parse_descriptor(data)
    assert d.jcs().decode("utf-8") == case["jcs"]
    assert str(d.compat_id()) == case["compat_id"]


@pytest.mark.parametrize("case", DATA["scope_keys"], ids=_ids(DATA["scope_keys"]))
def test_scope_key(case: dict[str, Any]) -> None:
    if case.get("error"):
        with pytest.raises(kvsp.InvalidError):
            kvsp.ScopeKey.from_hex(case["text"])
        return
    assert str(kvsp.ScopeKey.from_hex(case["text"]).scope_id()) == case["scope_id"]


@pytest.mark.parametrize("case", DATA["block_keys"], ids=_ids(DATA["block_keys"]))
def test_block_keys(case: dict[str, Any]) -> None:
    key = kvsp.ScopeKey.from_hex(case["scope_key"])
    compat = kvsp.CompatID.parse(case["compat_id"])
    keys = kvsp.block_keys(key, compat, case["block_tokens"], case["tokens"])
    assert [k.hex() for k in keys] == case["keys"]
    chain = kvsp.Chain(key, compat, case["block_tokens"])
    incremental = []
    for t in case["tokens"]:
        if chain.push(t):
            last = chain.last()
            assert last is not None
            incremental.append(last.hex())
    assert incremental == case["keys"]


@pytest.mark.parametrize("case", DATA["layer_digests"], ids=_ids(DATA["layer_digests"]))
def test_layer_digest(case: dict[str, Any]) -> None:
    k, v = bytes.fromhex(case["k_hex"]), bytes.fromhex(case["v_hex"])
    assert kvsp.layer_digest(memoryview(k), memoryview(v)).hex() == case["digest"]


@pytest.mark.parametrize("case", DATA["replica_digests"], ids=_ids(DATA["replica_digests"]))
def test_replica_digest(case: dict[str, Any]) -> None:
    d = kvsp.replica_digest(bytes.fromhex(x) for x in case["layers"])
    assert d.hex() == case["digest"]
    assert kvsp.repr_digest(d) == case["repr_digest"]


@pytest.mark.parametrize("case", DATA["repr_digest_fields"], ids=_ids(DATA["repr_digest_fields"]))
def test_repr_digest_field(case: dict[str, Any]) -> None:
    if case.get("error"):
        with pytest.raises(kvsp.InvalidError):
            kvsp.parse_repr_digest(case["field"])
        return
    assert kvsp.parse_repr_digest(case["field"]).hex() == case["digest"]


def _geometry(g: dict[str, Any] | None) -> kvsp.Geometry | None:
    if g is None:
        return None
    return kvsp.Geometry(g["layers"], g["block_tokens"], g["kv_heads"], g["head_dim"], g["elem"])


@pytest.mark.parametrize("case", DATA["new_headers"], ids=_ids(DATA["new_headers"]))
def test_new_header(case: dict[str, Any]) -> None:
    g = _geometry(case["geometry"])
    assert g is not None
    if case.get("error"):
        with pytest.raises(kvsp.InvalidError):
            kvsp.new_header(case["codec"], case["first"], case["count"], g)
        return
    assert kvsp.new_header(case["codec"], case["first"], case["count"], g).to_bytes().hex() == case["hex"]


@pytest.mark.parametrize("case", DATA["headers"], ids=_ids(DATA["headers"]))
def test_header(case: dict[str, Any]) -> None:
    b = bytes.fromhex(case["hex"])
    g = _geometry(case["geometry"])
    if case.get("error"):
        with pytest.raises(kvsp.InvalidError):
            kvsp.parse_header(b, g)
        return
    h, n = kvsp.parse_header(memoryview(b), g)
    assert (h.codec, h.first_layer, h.token_count, n) == (
        case["codec"],
        case["first_layer"],
        case["token_count"],
        case["len"],
    )
    assert [list(x) for x in h.layers] == case["layers"]
    assert h.to_bytes() == b[:n]


@pytest.mark.parametrize("case", DATA["containers"], ids=_ids(DATA["containers"]))
def test_container(case: dict[str, Any]) -> None:
    data = bytes.fromhex(case["hex"])
    g = _geometry(case["geometry"])
    assert g is not None
    expect = [bytes.fromhex(x) for x in case["expect_layer_digests"]] if case.get("expect_layer_digests") else None
    whole = bytes.fromhex(case["expect_container_digest"]) if case.get("expect_container_digest") else None
    r = kvsp.Reader(io.BytesIO(data), g, layer_digests=expect, container_digest=whole)
    got: list[tuple[int, str]] = []
    sections: list[tuple[bytes, bytes]] = []
    try:
        for layer in r:
            got.append((layer.index, layer.digest.hex()))
            assert kvsp.layer_digest(layer.k, layer.v) == layer.digest
            sections.append((bytes(layer.k), bytes(layer.v)))
    except kvsp.KVSPError:
        assert case.get("error"), "refused a container Go reads"
        assert got == [(x["index"], x["digest"]) for x in case["layers"]]
        return
    assert not case.get("error"), "read a container Go refuses"
    assert got == [(x["index"], x["digest"]) for x in case["layers"]]
    assert r.digests.container.hex() == case["container_digest"]
    # The writer makes the same octets and digests from the same layers.
    assert r.header is not None
    out = io.BytesIO()
    w = kvsp.Writer(out, r.header)
    for k, v in sections:
        w.write_layer(k, v)
    d = w.close()
    assert out.getvalue() == data
    assert d.container.hex() == case["container_digest"]
    assert [x.hex() for x in d.layers] == [x["digest"] for x in case["layers"]]


@pytest.mark.parametrize("case", DATA["problems"], ids=_ids(DATA["problems"]))
def test_problem(case: dict[str, Any]) -> None:
    body = case["body"].encode("utf-8")
    if case.get("error"):
        with pytest.raises(kvsp.InvalidError):
            kvsp.parse_problem(body, case["http_status"])
        return
    p = kvsp.parse_problem(body, case["http_status"])
    assert (p.type, p.status) == (case["type"], case["status"])
    e = kvsp.problem_error(p)
    assert e.kind == case["kind"]
    assert e.problem is p
    assert isinstance(e, kvsp.KVSPError)


@pytest.mark.parametrize("case", DATA["base_uris"], ids=_ids(DATA["base_uris"]))
def test_base_uri(case: dict[str, Any]) -> None:
    valid = True
    try:
        kvsp.validate_base_uri("uri", case["input"])
    except kvsp.InvalidError:
        valid = False
    assert valid == case["valid"]
    if case.get("error"):
        with pytest.raises(kvsp.InvalidError):
            kvsp.normalize_base_uri(case["input"])
        return
    n = kvsp.normalize_base_uri(case["input"])
    assert n == case["normalized"]
    assert kvsp.resource_id(n) == case["resource_id"]


@pytest.mark.parametrize("case", DATA["records"], ids=[f"{c['type']}: {c['name']}" for c in DATA["records"]])
def test_record(case: dict[str, Any]) -> None:
    cls = kvsp.RECORDS[case["type"]]
    data = case["json"].encode("utf-8")
    if case.get("error"):
        with pytest.raises(kvsp.KVSPError) as e:
            cls.decode(data)
        assert e.value.kind == case["kind"]
        return
    cls.decode(data)


@pytest.mark.parametrize("case", DATA["fp8_sections"], ids=_ids(DATA["fp8_sections"]))
def test_fp8(case: dict[str, Any]) -> None:
    g = _geometry(case["geometry"])
    assert g is not None
    raw = bytes.fromhex(case["raw_hex"])
    if case.get("error"):
        with pytest.raises(kvsp.KVSPError):
            kvsp.fp8_from_raw(raw, g)
        return
    sec = kvsp.fp8_from_raw(raw, g)
    assert sec.hex() == case["fp8_hex"]
    assert kvsp.fp8_to_raw(sec, g).hex() == case["back_hex"]
