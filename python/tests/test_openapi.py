"""api/openapi.yaml is a valid OpenAPI 3.1 document, and its record schemas
agree with the shared vectors (testdata/vectors/core.json, written from the
Go implementation): every valid record of the vectors is valid under its
schema, and every invalid one is refused by it, but for the cases JSON
Schema cannot express, listed here with their reason (the document says the
same where it says it is wider than Go). Go's TestOpenAPIMatchesRouter
checks the document's paths against the router."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import OpenAPIV31SpecValidator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from test_properties import Go, go  # noqa: F401 (go: the Go helper fixture, bin/kvsp-vectors -serve)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC: dict[str, Any] = yaml.safe_load((ROOT / "api" / "openapi.yaml").read_text())
CORE: dict[str, Any] = json.loads((ROOT / "testdata" / "vectors" / "core.json").read_text())
VECTORS: list[dict[str, Any]] = CORE["records"]
BASE_URI = re.compile(DOC["components"]["schemas"]["BaseURI"]["pattern"])
BASE_URI_MAX = DOC["components"]["schemas"]["BaseURI"]["maxLength"]


def _base_uri_valid(uri: str) -> bool:
    return len(uri) <= BASE_URI_MAX and BASE_URI.fullmatch(uri) is not None


# The vectors' record types and the document's schemas.
SCHEMA_OF = {
    "replica": "ReplicaRecord",
    "checkpoint": "Checkpoint",
    "status": "InstanceStatus",
    "place_request": "PlaceRequest",
    "place_response": "PlaceResponse",
    "prefetch_directive": "PrefetchDirective",
    "prefetch_status": "PrefetchStatus",
    "reshard": "Reshard",
    "lookup_request": "LookupRequest",
    "lookup_response": "LookupResponse",
    "shard_map": "ShardMap",
    "generated_token": "GeneratedToken",
    "generate_request": "GenerateRequest",
    "lease_request": "LeaseRequest",
    "lease_response": "LeaseResponse",
    "map_update": "MapUpdate",
}

# Invalid vectors the schemas accept, and why JSON Schema cannot refuse
# them: kvsp's checks that span members, or JSON's text itself.
INTEGER = "JSON Schema takes 1.0 and 1e3 as integers; kvsp refuses a fraction or exponent (A-33)"
MOQT = "a moqt:// holder's namespace is five length-prefixed fields: no pattern counts them"
RANGE = "start < end is a comparison of two items"
WIDER: dict[str, str] = {
    "replica/codec 1.0": INTEGER,
    "replica/size 1e3": INTEGER,
    "replica/moqt namespace of four fields": MOQT,
    "replica/moqt namespace with a field truncated": MOQT,
    "replica/moqt namespace with octets after": MOQT,
    "replica/residency overlapping": "ranges compared across residency entries",
    "replica/residency first past last": "first <= last is a comparison of two items",
    "replica/layer digests fewer than the layers": "layer_digests against the residency's layers",
    "replica/duplicate member": "a duplicate member name is JSON text, not a JSON value (A-29)",
    "lookup_response/matched more than the replicas": "matched against the length of replicas",
    "checkpoint/output_offset off by one": "output_offset against the length of generated",
    "checkpoint/a token 1.0": INTEGER,
    "checkpoint/a token 1e2": INTEGER,
    "shard_map/a gap": "each shard starts where the one before ended",
    "shard_map/an empty range": RANGE,
    "reshard/overlapping retain and fetch": "ranges compared across lists",
    "reshard/overlapping releases": "ranges compared across a list",
    "reshard/an empty range": RANGE,
}


def test_document_is_openapi_3_1() -> None:
    errors = [e.message for e in OpenAPIV31SpecValidator(DOC).iter_errors()]
    assert errors == []
    assert DOC["openapi"].startswith("3.1.")


def _validator(name: str) -> Any:
    resource = Resource.from_contents(DOC, default_specification=DRAFT202012)
    registry: Registry[Any] = Registry().with_resource("urn:kvsp:openapi", resource)
    schema = {"$ref": f"urn:kvsp:openapi#/components/schemas/{name}"}
    cls = jsonschema.validators.validator_for({"$schema": "https://json-schema.org/draft/2020-12/schema"})
    return cls(schema, registry=registry)


def _decode(text: str) -> Any:
    # Python's json keeps the last of duplicate members; Go refuses them.
    return json.loads(text)


@pytest.mark.parametrize("case", VECTORS, ids=[f"{c['type']}/{c['name']}" for c in VECTORS])
def test_record_vector(case: dict[str, Any]) -> None:
    validator = _validator(SCHEMA_OF[case["type"]])
    try:
        value = _decode(case["json"])
    except ValueError:
        assert case.get("error"), "a valid vector that is not JSON"
        return  # not JSON: refused before any schema
    errors = list(validator.iter_errors(value))
    key = f"{case['type']}/{case['name']}"
    if not case.get("error"):
        assert errors == [], f"{key}: valid in Go, refused by the schema: {[e.message for e in errors]}"
    elif key in WIDER:
        assert errors == [], f"{key}: listed as wider than Go, but the schema refuses it now: drop it from WIDER"
    else:
        assert errors, f"{key}: refused by Go ({case['error']}), accepted by the schema"


def test_every_record_type_has_a_schema() -> None:
    assert {c["type"] for c in VECTORS} == set(SCHEMA_OF)
    for name in SCHEMA_OF.values():
        assert name in DOC["components"]["schemas"]


def test_wider_cases_are_vectors() -> None:
    keys = {f"{c['type']}/{c['name']}" for c in VECTORS if c.get("error")}
    assert set(WIDER) <= keys


@pytest.mark.parametrize("case", CORE["base_uris"], ids=[c["name"] for c in CORE["base_uris"]])
def test_base_uri_pattern_vector(case: dict[str, Any]) -> None:
    """BaseURI's pattern is kvsp's normalised form: a valid vector's
    normalised URI matches it; an input Go refuses, or one it would
    change, does not."""
    if case.get("valid"):
        assert _base_uri_valid(case["normalized"]), case["normalized"]
    if not case.get("valid") or case["normalized"] != case["input"]:
        assert not _base_uri_valid(case["input"]), case["input"]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(uri=st.from_regex(BASE_URI, fullmatch=True))
def test_base_uri_pattern_is_gos(go: Go, uri: str) -> None:  # noqa: F811 (the fixture)
    """What the pattern admits (what schemathesis sends as valid), Go
    takes as it is: a base URI already normalised (IPv6 literals too)."""
    got = go.ask({"op": "base_uri", "input": uri})
    assert got.get("ok") and got.get("value") == uri, (uri, got)
