"""api/openapi.yaml against a fresh ``kvsp serve``, fuzzed by schemathesis.

One process serves every role (the IS, a holder, the PC, an instance on the
simulated engine) and the gateway (SmolLM2's tokenizer through llama.cpp,
placing on the simulated instance), with one identity per role (``kvsp
certs --per-role``). Every operation of the document is called with the
identity of a role its ``x-kvsp-roles`` allows (the gateway's with its
bearer key): the document's examples, schemathesis' coverage cases
(boundaries, missing members, other methods) and generated requests, valid
and invalid. Each answer must be documented for its operation and match
its schema and headers; no 5xx but a 503 with Retry-After; every error in
its surface's shape (problem details with a KVSP or about:blank type and
the HTTP status on KVSP roles, A-7; the OpenAI error object on the
gateway); every line of generate's NDJSON stream a GeneratedToken, the
last with its finish; every event of the gateway's SSE streams a chunk,
an error that ends it, or [DONE] last. A stateful run follows the
document's links (place, then generate; a lease, then its renewal and
release). Valid requests carry the deployment's scope and compat id most
of the time (a random one only reaches the scope check).

KVSP_API_FUZZ_EXAMPLES sets generated examples per operation and mode
(make test: 15; make nightly's api-fuzz stage: 200); KVSP_API_FUZZ_REPORT
names a JSON file for the figures (operations, requests, failures)."""

from __future__ import annotations

import base64
import collections
import contextlib
import copy
import hashlib
import io
import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import CheckContext
from schemathesis.config._checks import MissingRequiredHeaderConfig, NegativeDataRejectionConfig
from schemathesis.specs.openapi.checks import ignored_auth, missing_required_header, positive_data_acceptance
from serving import ROOT, Proc, binary, certs, free_ports

import kvsp
from kvsp import container


def _block() -> bytes:
    """A valid KVB1 container of the deployment's model (SmolLM2's
    geometry, every layer, zero KV): what a producer PUTs."""
    d = kvsp.parse_descriptor((ROOT / "examples" / "openai" / "descriptor.json").read_bytes())
    g = container.Geometry.of(d)
    out = io.BytesIO()
    w = container.Writer(out, container.new_header(1, 0, g.layers, g))
    zero = bytes(g.raw_section_len())
    for _ in range(g.layers):
        w.write_layer(zero, zero)
    w.close()
    return out.getvalue()


BLOCK = _block()
# Block bodies: a real container, one cut short, and random octets.
schemathesis.openapi.media_type(
    "application/kvsp-block", st.one_of(st.just(BLOCK), st.just(BLOCK[:-1]), st.binary(max_size=512))
)
DOC_PATH = ROOT / "api" / "openapi.yaml"
SCHEMA = schemathesis.openapi.from_path(str(DOC_PATH))
EXAMPLES = int(os.environ.get("KVSP_API_FUZZ_EXAMPLES", "15"))
SCHEMA.config.generation.update(max_examples=EXAMPLES, modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
# The coverage phase (every boundary, every member missing, methods the
# path does not serve) draws its cases when pytest collects them, a
# million-token prompt and a 5.6 MB tokens_le32 among them: a minute and a
# half here, so it runs in make nightly's long run (KVSP_API_FUZZ_PHASES).
PHASES = os.environ.get("KVSP_API_FUZZ_PHASES", "examples,fuzzing").split(",")
SCHEMA.config.phases.update(phases=PHASES)
SCHEMA.config.output.sanitization.update(enabled=False)  # the deployment's keys are made for the test
DOC: dict[str, Any] = SCHEMA.raw_schema
PROBLEM_TYPE = "https://iana.org/assignments/kvsp#"
# Which identity calls an operation: the first of these its x-kvsp-roles
# allows (a client where a client may; the holder and the instance speak
# for the deployment's holder and instance).
PREFERENCE = ["client", "holder", "instance", "controller", "producer", "index"]
MODEL = "smollm2-135m-instruct"
# Our own checks replace these two: no 5xx but a 503 with Retry-After;
# valid requests accepted but for what the schema cannot say.
EXCLUDED = [schemathesis.checks.not_a_server_error, positive_data_acceptance]
# A bound past this deployment's (max_tokens, a lookup's keys) is 413
# a rejection too.
# A request without its required header (the gateway's Authorization) is
# refused 401, or 429 once its peer failed 20 times in the minute (the
# gateway's documented lockout, which a long run reaches).
SCHEMA.config.checks.missing_required_header = MissingRequiredHeaderConfig(
    expected_statuses=["400", "401", "403", "406", "415", "422", "428", "429"]
)
SCHEMA.config.checks.negative_data_rejection = NegativeDataRejectionConfig(
    expected_statuses=["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]
)


@dataclass
class Deployment:
    dir: pathlib.Path
    origin: str
    gateway: str
    api_key: str
    scope: str
    compat: str
    proc: Proc

    def base(self, role: str) -> str:
        path = {"index": "/is", "holder": "/h1", "controller": "/pc", "instance": "/ii1"}
        return self.gateway if role == "gateway" else self.origin + path[role]

    def identity(self, role: str) -> tuple[str, str]:
        return str(self.dir / f"role-{role}.pem"), str(self.dir / f"role-{role}.key")

    def call_kwargs(self, case: Any) -> dict[str, Any]:
        """base_url, the CA, and the caller: a role's certificate or the
        gateway's bearer key."""
        op = case.operation.definition.raw
        kw: dict[str, Any] = {"verify": str(self.dir / "ca.pem"), "timeout": 30}
        if "gateway" in op.get("tags", []):
            kw["base_url"] = self.gateway
            kw["headers"] = {**(case.headers or {}), "Authorization": f"Bearer {self.api_key}"}
        else:
            kw["base_url"] = self.base(op["x-kvsp-role"])
            allowed = op["x-kvsp-roles"]
            kw["cert"] = self.identity(next(r for r in PREFERENCE if r in allowed))
        return kw


FIGURES: dict[str, Any] = {"requests": 0, "by_operation": collections.Counter(), "failures": []}


def _config(port: int, gw: int, metrics: int, lib: str, model: str) -> str:
    o = f"https://127.0.0.1:{port}"
    return f"""listen: 127.0.0.1:{port}
http3: false
transport: h2
metrics_listen: 127.0.0.1:{metrics}
tls: {{cert: server.pem, key: server.key, client_ca: ca.pem, client_cert: self.pem, client_key: self.key}}
policy: policy.yaml
scopes: [{{key_file: scope-a.key}}]
gateway:
  listen: 127.0.0.1:{gw}
  controller: {o}/pc/
  library: {lib}
  models: [{{id: {MODEL}, model: {model}, context_tokens: 4096, default_max_tokens: 16, max_tokens: 64}}]
index: {{base: {o}/is/, max_ttl_ms: 600000, max_lookup_keys: 4096, backend: memory}}
controller: {{base: {o}/pc/, index: {o}/is/, state: memory, descriptors: [descriptor.json]}}
holders:
  - base: {o}/h1/
    index: {o}/is/
    descriptors: [descriptor.json]
    tiers: [{{name: host, capacity: 256MiB, read_mbit_per_s: 400000}}]
    lease_quota: {{octets: 64MiB, max_ttl_ms: 60000, max_leases: 256}}
instances:
  - base: {o}/ii1/
    controller: {o}/pc/
    index: {o}/is/
    holder: {o}/h1/
    engine: {{kind: sim, descriptor: descriptor.json, prefill_tokens_per_s: 420000, decode_tokens_per_s: 31000,
              context_tokens: 4096}}
    links: [{{holder: {o}/h1/, mbit_per_s: 100000, rtt_us: 20}}]
"""


@contextlib.contextmanager
def _deploy(d: pathlib.Path) -> Iterator[Deployment]:
    """A fresh kvsp serve of every role and the gateway, in d."""
    model = os.environ.get("KVSP_SMOLLM2", str(ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    lib = os.environ.get("KVSP_LLAMACPP_LIB", str(ROOT / ".cache" / "llama.cpp"))
    if not pathlib.Path(model).exists():
        pytest.fail(f"{model} is missing: make deps installs SmolLM2")
    port, gw, metrics = free_ports(3)
    (d / "kvsp.yaml").write_text(_config(port, gw, metrics, lib, model))
    # The simulated instance serves SmolLM2's descriptor: the gateway
    # places on it what SmolLM2's tokenizer made.
    shutil.copy(ROOT / "examples" / "openai" / "descriptor.json", d / "descriptor.json")
    certs(d / "kvsp.yaml", "--per-role")
    kvsp = str(binary())
    scope = subprocess.run([kvsp, "keys", "scope", str(d / "scope-a.key")], check=True, capture_output=True, text=True)
    compat = subprocess.run(
        [kvsp, "keys", "compat", str(d / "descriptor.json")], check=True, capture_output=True, text=True
    )
    proc = Proc(d / "kvsp.yaml", port).start()
    try:
        yield Deployment(
            dir=d,
            origin=f"https://127.0.0.1:{port}",
            gateway=f"https://127.0.0.1:{gw}",
            api_key=(d / "api-key.txt").read_text().strip(),
            scope=scope.stdout.strip(),
            compat=compat.stdout.strip(),
            proc=proc,
        )
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Deployment]:
    failed_before = request.session.testsfailed
    try:
        with _deploy(tmp_path_factory.mktemp("api")) as dep:
            yield dep
    finally:
        report = os.environ.get("KVSP_API_FUZZ_REPORT")
        if report:
            out = {
                "operations": len(FIGURES["by_operation"]),
                "requests": FIGURES["requests"],
                # The checks' failures, or the tests that failed if more
                # (a check schemathesis runs outside _run's reach).
                "failures": max(len(FIGURES["failures"]), request.session.testsfailed - failed_before),
                "examples": EXAMPLES,
                "phases": PHASES,
                "by_operation": dict(FIGURES["by_operation"]),
                "stateful_steps": FIGURES.get("stateful", {}),
                "failed": FIGURES["failures"][:50],
            }
            pathlib.Path(report).write_text(json.dumps(out, indent=2) + "\n")
            # The nightly report's row (internal/figures' line, read by
            # internal/nightly verdict from make api-fuzz's log).
            row = {
                "row": "api-fuzz",
                "requests": out["requests"],
                "held": f"{out['operations']} operations, {out['requests']} requests, {out['failures']} failures",
                "detail": {"operations": out["operations"], "failures": out["failures"], "examples": EXAMPLES},
            }
            print("\nkvsp-figures " + json.dumps(row))


def _resource_id(base: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(base.encode()).digest()).rstrip(b"=").decode()


def _ints(v: Any) -> Any:
    """Whole floats as integers: JSON Schema counts 36.0 as an integer,
    kvsp does not (A-33), and schemathesis generates them for valid data."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
        return int(v)
    if isinstance(v, list):
        return [_ints(x) for x in v]
    if isinstance(v, dict):
        return {k: _ints(x) for k, x in v.items()}
    return v


def realistic(case: Any, dep: Deployment) -> None:
    """A valid case as a caller of this deployment would send it, three
    times in four: its scope and compat id, the path's ids agreeing with
    the body's (what the schemas cannot say), the holder and instance its
    identity speaks for. Invalid cases are sent as generated."""
    if case.meta is None or case.meta.generation.mode != GenerationMode.POSITIVE:
        return
    body = case.body if isinstance(case.body, dict) else None
    if body is not None:
        case.body = body = _ints(body)
    rng = random.Random(json.dumps([case.path_parameters, case.body], sort_keys=True, default=str))
    if rng.random() < 0.25:
        return
    pp = case.path_parameters if case.path_parameters is not None else {}
    if "scope" in pp:
        pp["scope"] = dep.scope
    if "compat" in pp:
        pp["compat"] = dep.compat
    if body is None:
        return
    for k in ("scope_id",):
        if k in body:
            body[k] = dep.scope
    if "compat_id" in body:
        body["compat_id"] = dep.compat
    if isinstance(body.get("checkpoint"), dict):
        body["checkpoint"]["scope_id"], body["checkpoint"]["compat_id"] = dep.scope, dep.compat
    op = case.operation.definition.raw.get("operationId")
    holder, inst = dep.base("holder") + "/", dep.base("instance") + "/"
    if op == "publishReplica":
        body["holder"] = holder
        pp["holder"] = _resource_id(holder)
    if op in ("publishReplica", "stateProducerDigest") and "block_key" in body:
        pp["key"] = body["block_key"]
    if op == "stateProducerDigest":
        body["producer"] = inst
    if op == "putStatus":
        # The live instance's, below its epoch (a stale report, 409): a
        # fuzzed epoch above it would stand for the instance until its
        # TTL, and the gateway would have nowhere to place.
        body["instance"] = inst
        body["epoch"] = 1
        pp["instance"] = _resource_id(inst)
    if op == "putCheckpoint" and "session" in body:
        pp["session"] = body["session"]
    if op == "postResume" and isinstance(body.get("checkpoint"), dict) and "session" in body["checkpoint"]:
        pp["session"] = body["checkpoint"]["session"]
    if op == "putMap" and isinstance(body.get("map"), dict) and "map" in body["map"]:
        pp["map"] = body["map"]["map"]


def _schema_of(case: Any, status: int, media: str) -> Any:
    resp = case.operation.definition.raw["responses"].get(str(status))
    if resp is None:
        return None
    if "$ref" in resp:
        resp = DOC["components"]["responses"][resp["$ref"].rsplit("/", 1)[1]]
    content = resp.get("content", {}).get(media)
    if content is None:
        return None
    return {"$ref": "#/x", "x": content["schema"], "components": DOC["components"]}


def _validate(schema: Any, value: Any, what: str) -> None:
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(value))
    assert not errors, f"{what}: {errors[0].message[:300]}"


@schemathesis.check
def no_5xx_but_503_with_retry_after(ctx: CheckContext, response: Any, case: Any) -> bool | None:
    s = response.status_code
    if s >= 500 and not (s == 503 and response.headers.get("retry-after")):
        raise AssertionError(f"{case.operation.label}: {s} ({response.text[:200]!r})")
    if s == 429 and not response.headers.get("retry-after"):
        raise AssertionError(f"{case.operation.label}: 429 without Retry-After")
    return None


@schemathesis.check
def errors_in_their_surface_shape(ctx: CheckContext, response: Any, case: Any) -> bool | None:
    s = response.status_code
    if s < 400:
        return None
    gateway = "gateway" in case.operation.definition.raw.get("tags", [])
    ctype = (response.headers.get("content-type") or [""])[0].split(";")[0]
    no_store = (response.headers.get("cache-control") or [""])[0] == "no-store"
    assert no_store, f"{s} without Cache-Control: no-store"
    if gateway:
        assert ctype == "application/json", f"gateway {s} as {ctype}"
        err = json.loads(response.content)["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str), f"gateway {s}: {err}"
        return None
    assert ctype == "application/problem+json", f"{s} as {ctype}"
    p = json.loads(response.content)
    assert p.get("status") == s, f"problem status {p.get('status')} under HTTP {s}"
    t = p.get("type")
    assert t == "about:blank" or (isinstance(t, str) and t.startswith(PROBLEM_TYPE + "kvsp-")), f"problem type {t!r}"
    assert isinstance(p.get("title"), str), "problem without a title"
    return None


@schemathesis.check
def streams_conform(ctx: CheckContext, response: Any, case: Any) -> bool | None:
    if response.status_code != 200:
        return None
    ctype = (response.headers.get("content-type") or [""])[0].split(";")[0]
    if ctype == "application/x-ndjson":
        schema = _schema_of(case, 200, ctype)
        lines = response.content.decode().splitlines()
        assert lines, "an empty token stream"
        for i, line in enumerate(lines):
            _validate(schema, json.loads(line), f"line {i}")
        assert "finish" in json.loads(lines[-1]), "the stream's last line has no finish"
    elif ctype == "text/event-stream":
        chunk = _schema_of(case, 200, ctype)["x"]["properties"]["data"]["anyOf"][1]["contentSchema"]
        schema = {"$ref": "#/x", "x": chunk, "components": DOC["components"]}
        events = [e for e in response.content.decode().split("\n\n") if e.strip()]
        datas = [line[6:] for e in events for line in e.split("\n") if line.startswith("data: ")]
        assert datas, "an empty event stream"
        for i, d in enumerate(datas[:-1]):
            assert d != "[DONE]", "[DONE] before the end"
            _validate(schema, json.loads(d), f"event {i}")
        last = datas[-1]
        if last != "[DONE]":
            assert "error" in json.loads(last), "a stream that ends with neither [DONE] nor an error"
    return None


# A valid request (under its schema) that kvsp refuses with 400 or 413
# must be refused for one of the checks the document says JSON Schema
# cannot express ("Wider than Go") or a bound of this deployment: these
# are their details. Anything else is the schema or kvsp being wrong.
WIDER_THAN_SCHEMA = re.compile(
    "|".join(
        [
            r"first exceeds last|with a <= b",  # a range's ends (LayerRange, TokenRange, ?layers=a-b)
            r"not contiguous|multiples of block_tokens",  # a shard map's shards, in the model's blocks
            r"container|KVB1",  # a block body's structure (a KVB1 container for the compat id's geometry)
            r"start < end",
            r"overlap",  # ranges against each other
            r"must equal the number of generated tokens",  # output_offset
            r"path and record disagree|the path's .* is not the",  # path ids against the body's
            r"layer_digests|residency|moqt_namespace",  # a replica against the model; a MOQT namespace
            r"past .* layers",
            r"does not speak for|not authorized to (publish|state|withdraw)",
            r"at most \d+",  # this deployment's bounds
            r"context length|max_tokens.*(model|at most)|context_length_exceeded",
            r"(instances'|engine's) context of \d+",  # the deployment's context window (B14)
        ]
    )
)
POSITIVE_OK = {*range(200, 400), 401, 403, 404, 409, 412, 422, 429, 503}


@schemathesis.check
def valid_requests_accepted(ctx: CheckContext, response: Any, case: Any) -> bool | None:
    """schemathesis' positive_data_acceptance, less the refusals the
    document says a schema cannot foresee (WIDER_THAN_SCHEMA)."""
    if case.meta is None or case.meta.generation.mode != GenerationMode.POSITIVE:
        return None
    s = response.status_code
    if s in POSITIVE_OK:
        return None
    detail = response.text
    if s in (400, 413) and WIDER_THAN_SCHEMA.search(detail):
        return None
    raise AssertionError(f"a request valid under its schema refused {s}: {detail[:300]}")


def excluded(case: Any) -> list[Any]:
    """The checks left out: ours replace two; on the gateway, the ones that
    send bad keys over and over (its per-peer lockout answers them 429
    after 20 a minute, by design; python/tests/test_gateway.py checks
    its 401s)."""
    if "gateway" in case.operation.definition.raw.get("tags", []):
        return [*EXCLUDED, ignored_auth, missing_required_header]
    return EXCLUDED


def _run(case: Any, dep: Deployment) -> None:
    op = case.operation.definition.raw
    if op.get("x-kvsp-requires") == "rdma":
        return  # served by a holder with an RDMA device only (TestOpenAPIMatchesRouter mounts it)
    realistic(case, dep)
    kw = dep.call_kwargs(case)
    FIGURES["requests"] += 1
    FIGURES["by_operation"][case.operation.label] += 1
    session = requests.Session()
    try:
        response = case.call(session=session, **kw)
        case.validate_response(response, transport_kwargs={**kw, "session": session}, excluded_checks=excluded(case))
    except Exception as e:
        FIGURES["failures"].append(f"{case.operation.label}: {str(e)[:300]}")
        raise
    finally:
        session.close()
        _restore(case, dep)


def _restore(case: Any, dep: Deployment) -> None:
    if case.operation.definition.raw.get("operationId") == "putState":
        # The instance active again, for the operations after this one.
        requests.put(
            dep.base("instance") + "/state",
            json={"state": "active"},
            headers={"Content-Type": "application/kvsp+json"},
            cert=dep.identity("controller"),
            verify=str(dep.dir / "ca.pem"),
            timeout=10,
        ).raise_for_status()


# make test's short run sends the same requests each time (a failure
# there is the code's, not the draw's); make api-fuzz draws afresh.
RANDOM = "KVSP_API_FUZZ_EXAMPLES" in os.environ


@SCHEMA.parametrize()
@settings(
    derandomize=not RANDOM,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
    phases=[Phase.explicit, Phase.generate],
)
def test_operation(case: Any, deployment: Deployment) -> None:
    _run(case, deployment)


def test_roles_not_listed_are_refused(deployment: Deployment) -> None:
    """x-kvsp-roles is the router's: every role it does not list is
    refused 403 about:blank before the body is read."""
    checked = 0
    for path, item in DOC["paths"].items():
        for method, op in item.items():
            if method not in ("get", "put", "post", "delete") or "x-kvsp-roles" not in op:
                continue
            if op.get("x-kvsp-requires") == "rdma":
                continue
            for role in sorted(set(PREFERENCE) - set(op["x-kvsp-roles"])):
                url = deployment.base(op["x-kvsp-role"]) + path.replace("{", "x").replace("}", "")
                r = requests.request(
                    method.upper(),
                    url,
                    cert=deployment.identity(role),
                    verify=str(deployment.dir / "ca.pem"),
                    data=b"{}" if method in ("put", "post") else None,
                    headers={"Content-Type": "application/kvsp+json"},
                    timeout=10,
                )
                assert r.status_code == 403, f"{role} {method} {path}: {r.status_code}"
                assert r.json()["type"] == "about:blank"
                checked += 1
    assert checked >= 50


@pytest.mark.skipif(
    not RANDOM,
    reason="make api-fuzz follows the links: a walk of 15 examples may follow none to a success, and a "
    "derandomized walk's seed is its code's digest",
)
def test_stateful(deployment: Deployment, tmp_path: pathlib.Path) -> None:
    """The document's links, followed: a replica published, then looked
    up; a lease granted, then renewed and released; a request placed, then
    generated at its instance; a directive posted, then its progress. On a
    deployment of its own: the walk is the links', not the leftovers of
    the operations fuzzed before it (placements holding the instance's
    room, leases the holder's quota)."""
    with _deploy(tmp_path) as dep:
        _walk(dep)


def _placeable(dep: Deployment) -> None:
    """Waits until the PC places on the instance (its first status record
    arrived), then runs that placement, which leaves the instance's room
    as it was."""
    kw: dict[str, Any] = {
        "verify": str(dep.dir / "ca.pem"),
        "timeout": 10,
        "cert": dep.identity("client"),
        "headers": {"Content-Type": "application/kvsp+json"},
    }
    q = {"scope_id": dep.scope, "compat_id": dep.compat, "tokens": [1, 2, 3], "max_tokens": 1}
    for _ in range(200):
        r = requests.post(dep.base("controller") + "/place", data=json.dumps(q), **kw)
        if r.status_code == 200:
            pl = r.json()
            g = requests.post(
                pl["instance"] + "generate",
                data=json.dumps({**q, "session": pl["session"], "epoch": pl["epoch"], "grant": pl["grant"]}),
                **kw,
            )
            assert g.status_code == 200, g.text
            return
        # No status record yet: no instance serves the compat id (409), or
        # none has room (503).
        assert r.status_code in (409, 503), r.text
        time.sleep(0.02)
    raise AssertionError("the PC placed nothing for 4 s after kvsp serve started")


def _walk(dep: Deployment) -> None:
    # Without the RDMA reads (served with an RDMA device only; the
    # filters of schemathesis 4.32 drop every link with them).
    doc = copy.deepcopy(DOC)
    doc["paths"] = {p: item for p, item in doc["paths"].items() if not p.startswith("/rdma/")}
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.output.sanitization.update(enabled=False)

    steps: collections.Counter[str] = collections.Counter()

    class Machine(schema.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            # Each walk from the same start: hypothesis replays a walk's
            # prefix to extend it, and a link is only there if the answer
            # that made it is the same again.
            dep.proc.stop()
            dep.proc.start()
            _placeable(dep)

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            realistic(case, dep)
            FIGURES["requests"] += 1
            FIGURES["by_operation"][case.operation.label] += 1
            return dep.call_kwargs(case)

        def after_call(self, response: Any, case: Any) -> None:
            steps[f"{case.operation.label} {response.status_code}"] += 1
            _restore(case, dep)

        def validate_response(self, response: Any, case: Any, additional_checks: Any = None, **kwargs: Any) -> None:
            try:
                case.validate_response(
                    response, transport_kwargs={**dep.call_kwargs(case)}, excluded_checks=excluded(case)
                )
            except Exception as e:
                FIGURES["failures"].append(f"stateful {case.operation.label}: {str(e)[:300]}")
                raise

    Machine.run(
        settings=settings(
            # 50 walks in make api-fuzz: a run follows about 10 links to a
            # success (3 in 15 walks, measured on three seeds).
            max_examples=max(15, EXAMPLES // 4),
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
    )
    FIGURES["stateful"] = dict(steps)
    # The links were followed: what only a link's values reach, reached.
    followed = [
        s
        for s in steps
        if s.startswith(
            ("POST /generate 200", "PUT /leases/{id} 200", "DELETE /leases/{id} 204", "GET /prefetch/{id} 200")
        )
    ]
    assert followed, f"no link followed to a success: {sorted(steps.items())}"
