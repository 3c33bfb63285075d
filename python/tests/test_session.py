"""run_session across a SIGKILLed instance, from Python, with real
processes as Go's TestSessionSurvivesSIGKILL has them: the IS, the PC and
a holder in one ``kvsp serve``, three simulated instances in three more.
The instance serving a session is SIGKILLed mid-generation; the PC
detects it by its status TTL and migrates the session; run_session
delivers every index exactly once, in order, and the output equals an
uninterrupted run of the same request (R-SES-5, R-SES-8, R-SES-9,
R-SES-14, R-SES-16)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from serving import SERVER_ID, Proc, Served, free_ports, start_split

import kvsp
from kvsp.aio import AsyncClient

TINY = (
    '{"model": "sim/tiny", "tokenizer_digest": '
    '"sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c", '
    '"model_digest": "sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda", '
    '"layers": 4, "kv_heads": 2, "head_dim": 16, "kv_dtype": "bf16", "positional": "rope", '
    '"block_tokens": 16, "layout": "kvsp-layout-1"}'
)
COMMON = """http3: false
quicbulk: false
transport: h2
tls: {cert: server.pem, key: server.key, client_ca: ca.pem, client_cert: self.pem, client_key: self.key}
policy: policy.yaml
scopes: [{key_file: scope-a.key}]
"""
MAX_TOKENS, KILL_AT = 1200, 200
PROMPT = [13 * i + 1 for i in range(3 * 16 + 5)]  # 3 blocks and 5 tokens


@dataclass
class Cluster(Served):
    pc: str
    instances: dict[str, Proc]
    scope: kvsp.ScopeID
    compat: kvsp.CompatID
    reference: dict[str, list[int]]  # per sampler, an uninterrupted run's tokens

    def kill_serving(self, placed: kvsp.PlaceResponse) -> None:
        self.instances[placed.instance].kill()


def _run(c: Cluster, method: str, p: float | None = None, session: bytes | None = None) -> list[int]:
    got: list[int] = []
    c.client().run_session(
        c.pc, c.scope, c.compat, PROMPT, MAX_TOKENS, lambda i, t: got.append(t), method=method, p=p, seed=7,
        session=session,
    )  # fmt: skip
    return got


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    d: pathlib.Path = tmp_path_factory.mktemp("cluster")
    a, *xs = free_ports(4)
    base = "https://127.0.0.1:{}{}".format
    insts = sorted(base(x, "/ii/") for x in xs)  # placement breaks cost ties by URI
    roles = f"""index: {{base: {base(a, "/is/")}, max_ttl_ms: 600000, max_lookup_keys: 4096, backend: memory}}
holders:
  - base: {base(a, "/h1/")}
    index: {base(a, "/is/")}
    descriptors: [descriptor.json]
    tiers: [{{name: host, capacity: 256MiB, read_mbit_per_s: 400000}}]
    lease_quota: {{octets: 256MiB, max_ttl_ms: 60000, max_leases: 1024}}
controller: {{base: {base(a, "/pc/")}, index: {base(a, "/is/")}, state: memory, descriptors: [descriptor.json]}}
"""

    def inst(b: str) -> str:
        return f"""  - base: {b}
    controller: {base(a, "/pc/")}
    index: {base(a, "/is/")}
    holder: {base(a, "/h1/")}
    engine: {{kind: sim, descriptor: descriptor.json, prefill_tokens_per_s: 42000, decode_tokens_per_s: 1500}}
"""

    (d / "descriptor.json").write_text(TINY)
    procs, by_uri = start_split(d, a, COMMON, roles, inst, insts)
    try:
        desc = kvsp.parse_descriptor(TINY.encode())
        key = kvsp.ScopeKey.from_hex((d / "scope-a.key").read_text())
        c = Cluster(d, base(a, "/"), base(a, "/pc/"), by_uri, key.scope_id(), desc.compat_id(), {})
        # The instances register with their first status records; b1 wins
        # the cost tie once it has.
        for _ in range(200):
            try:
                if c.client().controller(c.pc).place(c.scope, c.compat, PROMPT, 1).instance == insts[0]:
                    break
            except kvsp.KVSPError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail("the PC does not place on b1: " + procs[0].log()[-2000:])
        c.reference = {"greedy": _run(c, "greedy"), "top_p": _run(c, "top-p", 0.9)}
        assert len(c.reference["greedy"]) == MAX_TOKENS and c.reference["greedy"] != c.reference["top_p"]
        yield c
    finally:
        for pr in procs:
            pr.stop()
        if os.environ.get("KVSP_TEST_LOGS"):
            for pr in procs:
                print(pr.config.name, pr.log()[-4000:])


def test_run_session_survives_sigkill(cluster: Cluster) -> None:
    c = cluster
    tool = c.client()
    session = uuid.uuid4().bytes
    got: list[tuple[int, int]] = []
    killed: list[str] = []

    def deliver(i: int, t: int) -> None:
        got.append((i, t))
        if i == KILL_AT:
            at = tool.controller(c.pc).place(c.scope, c.compat, PROMPT, MAX_TOKENS, session=session)
            killed.append(at.instance)
            c.kill_serving(at)

    res = tool.run_session(c.pc, c.scope, c.compat, PROMPT, MAX_TOKENS, deliver, session=session)
    assert res.session == session and res.finish == "length"
    assert killed, "the session ended before the kill"
    assert [i for i, _ in got] == list(range(MAX_TOKENS))
    assert [t for _, t in got] == c.reference["greedy"]
    # The session finished: once the instance tells it (after the
    # done line went), the PC says so, at the epoch of the migration, rather
    # than continue it.
    for _ in range(250):
        try:
            tool.controller(c.pc).place(c.scope, c.compat, PROMPT, MAX_TOKENS, session=session)
        except kvsp.InvalidStateError as e:
            p = e.problem
            break
        time.sleep(0.02)
    else:
        pytest.fail("the PC does not say the session finished")
    assert p is not None and p.extensions.get("finish") == "length" and p.extensions.get("epoch", 0) >= 2


def test_asyncio_run_session_survives_sigkill(cluster: Cluster) -> None:
    """The asyncio form, with a seeded top-p sampler: the migrated session
    draws what the uninterrupted one drew (R-SES-14)."""
    c = cluster
    d = c.dir
    session = uuid.uuid4().bytes
    got: list[tuple[int, int]] = []
    killed: list[str] = []

    async def run() -> kvsp.client.SessionResult:
        ac = AsyncClient(
            cert=str(d / "client.pem"), key=str(d / "client.key"), ca=str(d / "ca.pem"), server_identity=SERVER_ID
        )

        async def deliver(i: int, t: int) -> None:
            got.append((i, t))
            if i == KILL_AT:
                at = await ac.controller(c.pc).place(
                    c.scope, c.compat, PROMPT, MAX_TOKENS, method="top-p", p=0.9, seed=7, session=session
                )
                killed.append(at.instance)
                c.kill_serving(at)

        return await ac.run_session(
            c.pc, c.scope, c.compat, PROMPT, MAX_TOKENS, deliver, method="top-p", p=0.9, seed=7, session=session
        )

    res = asyncio.run(run())
    assert res.session == session and res.finish == "length" and res.prefill is not None
    assert killed, "the session ended before the kill"
    assert [i for i, _ in got] == list(range(MAX_TOKENS))
    assert [t for _, t in got] == c.reference["top_p"]


def test_session_cursor() -> None:
    """What run_session delivers of the lines it reads (both forms share
    it): the next index only; an epoch lower than one seen is a fenced
    instance's (R-SES-9) and dropped, an index already delivered too
    (R-SES-5); a gap is the server's error, raised."""
    from kvsp.client import SessionCursor

    tok = kvsp.GeneratedToken
    cur = SessionCursor()
    lines = [tok(0, 1, 10), tok(1, 1, 11), tok(1, 2, 11), tok(2, 1, 99), tok(2, 2, 12), tok(0, 2, 10), tok(3, 3, 13)]
    assert [t.token for t in lines if cur.take(t)] == [10, 11, 12, 13]
    assert (cur.next, cur.epoch) == (4, 3)
    with pytest.raises(kvsp.InvalidError, match="token 5 arrived before 4"):
        cur.take(tok(5, 3, 15))
    at = kvsp.PlaceResponse(b"\1" * 16, 2, "https://a/ii/", 0, None, "g")
    assert not SessionCursor.moved(at, at)
    assert SessionCursor.moved(at, kvsp.PlaceResponse(b"\1" * 16, 3, "https://a/ii/", 0, None, "g"))
    assert SessionCursor.moved(at, kvsp.PlaceResponse(b"\1" * 16, 2, "https://b/ii/", 0, None, "g"))
