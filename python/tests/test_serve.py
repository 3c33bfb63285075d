"""The Python clients against a real ``kvsp serve`` (real TLS on loopback,
a real holder and IS, the process's policy): a producer stores a block,
the holder publishes it, a client finds it by lookup and fetches it whole
and by layer range, verified; another scope, a tampered digest and a
server naming another identity are refused."""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Iterator

import pytest
from serving import ROOT, SERVER_ID, Proc, Served, certs, free_ports

import kvsp
from kvsp.client import BlockRef, IdentityError


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(tmp_path_factory, {})


@pytest.fixture(scope="module")
def served_bitrot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A holder whose next block GET flips a bit half-way through the body,
    after the stored digest was computed (RELIABILITY F1's failpoint)."""
    yield from _serve(tmp_path_factory, {"KVSP_FAILPOINTS": "holder/corrupt-on-read=1*return"})


def _serve(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Iterator[Served]:
    """The development deployment (examples/dev) in one process."""
    d = tmp_path_factory.mktemp("serve")
    port, metrics = free_ports(2)
    conf = (ROOT / "examples" / "dev" / "kvsp.yaml").read_text()
    (d / "kvsp.yaml").write_text(conf.replace("8443", str(port)).replace("9090", str(metrics)))
    shutil.copy(ROOT / "examples" / "dev" / "descriptor.json", d / "descriptor.json")
    certs(d / "kvsp.yaml")
    proc = Proc(d / "kvsp.yaml", port, env).start()
    try:
        yield Served(d, f"https://127.0.0.1:{port}/")
    finally:
        proc.stop()


def _block(desc: kvsp.Descriptor, seed: int) -> tuple[bytes, kvsp.Digests, list[tuple[bytes, bytes]]]:
    g = kvsp.Geometry.of(desc)
    n = g.raw_section_len()
    layers = [
        (bytes((seed + i + j) % 251 for j in range(n)), bytes((seed * 7 + i + j) % 253 for j in range(n)))
        for i in range(desc.layers)
    ]
    out = io.BytesIO()
    w = kvsp.Writer(out, kvsp.new_header(kvsp.CODEC_RAW, 0, desc.layers, g))
    for k, v in layers:
        w.write_layer(k, v)
    return out.getvalue(), w.close(), layers


def test_store_lookup_fetch_verify(served: Served) -> None:
    desc = kvsp.parse_descriptor((served.dir / "descriptor.json").read_bytes())
    compat = desc.compat_id()
    key = kvsp.ScopeKey.from_hex((served.dir / "scope-a.key").read_text())
    tokens = [128000, 791, 6460, 374, 264, 1296, 315, 279]
    keys = kvsp.block_keys(key, compat, desc.block_tokens, tokens)
    data, digests, layers = _block(desc, 3)
    ref = BlockRef(compat, key.scope_id(), keys[0])
    holder_base, is_base = served.base + "h1/", served.base + "is/"

    producer = served.client("self")  # the process's identity: a producer (S13)
    assert producer.holder(holder_base).put_block(ref, data, digests.container) is True
    assert producer.holder(holder_base).put_block(ref, data, digests.container) is False  # 412: kept

    tool = served.client()
    index = tool.index(is_base)
    found = None
    for _ in range(200):  # the holder publishes after the PUT
        found = index.lookup(key.scope_id(), compat, keys)
        if found.matched:
            break
        time.sleep(0.02)
    assert found is not None and found.matched == 1
    rec = found.replicas[0][0]
    assert (
        rec.holder == holder_base
        and rec.digest == kvsp.replica_digest(digests.layers)
        and rec.size == desc.layers * 2 * len(layers[0][0])
    )
    assert rec.layer_digests is not None and list(rec.layer_digests) == digests.layers

    g = kvsp.Geometry.of(desc)
    with tool.holder(holder_base).get_block(ref, g, layer_digests=rec.layer_digests) as s:
        got = [(layer.index, bytes(layer.k), bytes(layer.v)) for layer in s]
        assert s.digests.container == digests.container
    assert got == [(i, k, v) for i, (k, v) in enumerate(layers)]

    # The connection the whole GET used serves the next request.
    idle = tool._idle[("127.0.0.1", int(served.base.split(":")[2].strip("/")))]
    assert len(idle) == 1
    first = idle[0]
    with tool.holder(holder_base).get_block(ref, g, layers=(5, 7), layer_digests=rec.layer_digests) as s:
        assert s._conn is first
        part = [(layer.index, bytes(layer.k)) for layer in s]
    assert part == [(i, layers[i][0]) for i in (5, 6, 7)]

    # Expected layer digests that differ: the layer is refused, not yielded.
    wrong = list(rec.layer_digests)
    wrong[2] = bytes(32)
    with tool.holder(holder_base).get_block(ref, g, layer_digests=wrong) as s, pytest.raises(kvsp.DigestMismatchError):
        for _ in s:
            pass


def test_refusals(served: Served) -> None:
    desc = kvsp.parse_descriptor((served.dir / "descriptor.json").read_bytes())
    other = kvsp.ScopeKey(bytes(range(32, 64)))
    tool = served.client()
    with pytest.raises(kvsp.ScopeDeniedError):
        tool.index(served.base + "is/").lookup(other.scope_id(), desc.compat_id(), [kvsp.BlockKey(bytes([1]) * 32)])
    key = kvsp.ScopeKey.from_hex((served.dir / "scope-a.key").read_text())
    ref = BlockRef(desc.compat_id(), key.scope_id(), kvsp.BlockKey(bytes([9]) * 32))
    with pytest.raises(kvsp.NotFoundError):
        tool.holder(served.base + "h1/").get_block(ref, kvsp.Geometry.of(desc))
    # The tool client is no producer: its PUT is refused (S13).
    data, digests, _ = _block(desc, 5)
    with pytest.raises(kvsp.ForbiddenError):
        tool.holder(served.base + "h1/").put_block(ref, data, digests.container)
    # A server that does not present the expected identity.
    with pytest.raises(IdentityError):
        served.client(identity="spiffe://kvsp.local/node/elsewhere").index(served.base + "is/").lookup(
            key.scope_id(), desc.compat_id(), [ref.key]
        )


def test_place_and_generate(served: Served) -> None:
    """A request placed by the PC runs at the instance it names; its tokens
    come labelled and in order; the same greedy request twice gives the
    same tokens, the second reusing the first's blocks."""
    desc = kvsp.parse_descriptor((served.dir / "descriptor.json").read_bytes())
    key = kvsp.ScopeKey.from_hex((served.dir / "scope-a.key").read_text())
    tool = served.client()
    prompt = list(range(1000, 1000 + 4 * desc.block_tokens + 3))
    runs = []
    for _ in range(2):
        placed = tool.controller(served.base + "pc/").place(key.scope_id(), desc.compat_id(), prompt, 6)
        assert placed.instance == served.base + "ii1/" and placed.epoch >= 1 and placed.grant
        lines = list(tool.instance(placed.instance).generate(placed, key.scope_id(), desc.compat_id(), prompt, 6))
        assert [t.index for t in lines] == list(range(6))
        assert all(t.epoch == placed.epoch for t in lines)
        assert lines[0].prefill is not None and sum(lines[0].prefill) == len(prompt)
        runs.append(lines)
    assert [t.token for t in runs[0]] == [t.token for t in runs[1]]
    first, second = runs[0][0].prefill, runs[1][0].prefill
    assert first is not None and second is not None and second[0] >= 4 * desc.block_tokens > first[0]
    # A generate without its grant is refused (S14).
    placed = tool.controller(served.base + "pc/").place(key.scope_id(), desc.compat_id(), prompt, 6)
    forged = kvsp.PlaceResponse(placed.session, placed.epoch, placed.instance, placed.matched, placed.directive, "")
    with pytest.raises(kvsp.ForbiddenError):
        list(tool.instance(placed.instance).generate(forged, key.scope_id(), desc.compat_id(), prompt, 6))


def test_asyncio_clients(served: Served) -> None:
    """kvsp.aio: the same lookup, verified GET, place and generate over
    asyncio, and the same refusals."""
    import asyncio

    from kvsp.aio import AsyncClient

    desc = kvsp.parse_descriptor((served.dir / "descriptor.json").read_bytes())
    key = kvsp.ScopeKey.from_hex((served.dir / "scope-a.key").read_text())
    compat, g = desc.compat_id(), kvsp.Geometry.of(desc)
    keys = kvsp.block_keys(key, compat, desc.block_tokens, [7, 7, 7, 7, 8, 8, 8, 8])
    data, digests, layers = _block(desc, 11)
    ref = BlockRef(compat, key.scope_id(), keys[0])
    d = served.dir

    async def run() -> None:
        c = AsyncClient(
            cert=str(d / "client.pem"), key=str(d / "client.key"), ca=str(d / "ca.pem"), server_identity=SERVER_ID
        )
        node = AsyncClient(
            cert=str(d / "self.pem"), key=str(d / "self.key"), ca=str(d / "ca.pem"), server_identity=SERVER_ID
        )
        assert await node.holder(served.base + "h1/").put_block(ref, data, digests.container) is True
        assert await node.holder(served.base + "h1/").put_block(ref, data, digests.container) is False
        with pytest.raises(kvsp.ForbiddenError):
            await c.holder(served.base + "h1/").put_block(ref, data, digests.container)
        lease = await c.holder(served.base + "h1/").lease(key.scope_id(), compat, [keys[0]], 1000)
        assert lease.block_keys == (keys[0],)
        await c.holder(served.base + "h1/").release_lease(lease.lease)
        assert await node.instance(served.base + "ii1/").set_state("active") == "active"
        with pytest.raises(kvsp.ForbiddenError):
            await c.instance(served.base + "ii1/").set_state("draining")
        found = None
        for _ in range(200):
            found = await c.index(served.base + "is/").lookup(key.scope_id(), compat, keys)
            if found.matched:
                break
            await asyncio.sleep(0.02)
        assert found is not None and found.matched == 1
        rec = found.replicas[0][0]
        got = kvsp.Digests([])
        out = [
            (layer.index, bytes(layer.k), bytes(layer.v))
            async for layer in c.holder(rec.holder).get_block(ref, g, layer_digests=rec.layer_digests, digests=got)
        ]
        assert out == [(i, k, v) for i, (k, v) in enumerate(layers)] and got.container == digests.container
        part = [layer.index async for layer in c.holder(rec.holder).get_block(ref, g, layers=(30, 31))]
        assert part == [30, 31]
        wrong = list(rec.layer_digests or [])
        wrong[0] = bytes(32)
        with pytest.raises(kvsp.DigestMismatchError):
            _ = [layer async for layer in c.holder(rec.holder).get_block(ref, g, layer_digests=wrong)]
        prompt = list(range(2000, 2000 + 3 * desc.block_tokens))
        placed = await c.controller(served.base + "pc/").place(key.scope_id(), compat, prompt, 5)
        lines = [t async for t in c.instance(placed.instance).generate(placed, key.scope_id(), compat, prompt, 5)]
        assert [t.index for t in lines] == list(range(5)) and lines[0].prefill is not None
        with pytest.raises(kvsp.ScopeDeniedError):
            await c.index(served.base + "is/").lookup(kvsp.ScopeKey(bytes(range(40, 72))).scope_id(), compat, keys)
        other = AsyncClient(
            cert=str(d / "client.pem"), key=str(d / "client.key"), ca=str(d / "ca.pem"), server_identity="spiffe://x/y"
        )
        with pytest.raises(IdentityError):
            await other.index(served.base + "is/").lookup(key.scope_id(), compat, keys)

    asyncio.run(run())


def test_a_flipped_bit_is_refused(served_bitrot: Served) -> None:
    """A bit flipped at the holder as it serves (its failpoint, once): the
    layer it lands in is refused by its digest, never yielded; the next
    GET, served intact, verifies."""
    served = served_bitrot
    desc = kvsp.parse_descriptor((served.dir / "descriptor.json").read_bytes())
    key = kvsp.ScopeKey.from_hex((served.dir / "scope-a.key").read_text())
    compat, g = desc.compat_id(), kvsp.Geometry.of(desc)
    keys = kvsp.block_keys(key, compat, desc.block_tokens, [5] * desc.block_tokens)
    data, digests, layers = _block(desc, 21)
    ref = BlockRef(compat, key.scope_id(), keys[0])
    assert served.client("self").holder(served.base + "h1/").put_block(ref, data, digests.container)
    h = served.client().holder(served.base + "h1/")
    seen: list[int] = []
    with h.get_block(ref, g, layer_digests=digests.layers) as s, pytest.raises(kvsp.DigestMismatchError):
        for layer in s:
            seen.append(layer.index)
            assert (bytes(layer.k), bytes(layer.v)) == layers[layer.index]  # what was yielded is intact
    assert len(seen) < desc.layers
    with h.get_block(ref, g, layer_digests=digests.layers) as s:
        assert [layer.index for layer in s] == list(range(desc.layers))


def test_run_session_delivers_each_index_once(served: Served) -> None:
    """run_session: placed, run and delivered in order, each index once; the
    tokens equal a plain place and generate's. (Across a SIGKILLed
    instance: test_session.py.)"""
    desc = kvsp.parse_descriptor((served.dir / "descriptor.json").read_bytes())
    key = kvsp.ScopeKey.from_hex((served.dir / "scope-a.key").read_text())
    prompt = list(range(3000, 3000 + 2 * desc.block_tokens + 1))
    tool = served.client()
    got: list[tuple[int, int]] = []
    res = tool.run_session(
        served.base + "pc/", key.scope_id(), desc.compat_id(), prompt, 7, lambda i, t: got.append((i, t))
    )
    assert len(res.session) == 16 and any(res.session) and res.finish == "length"
    assert res.prefill is not None and sum(res.prefill) == len(prompt)
    assert [i for i, _ in got] == list(range(7))
    placed = tool.controller(served.base + "pc/").place(key.scope_id(), desc.compat_id(), prompt, 7)
    plain = [
        t.token for t in tool.instance(placed.instance).generate(placed, key.scope_id(), desc.compat_id(), prompt, 7)
    ]
    assert [t for _, t in got] == plain


def test_instance_and_controller_roles(served: Served) -> None:
    """The rest of the PC's and the instance's API from Python: a prefetch
    directive loads a stored block (its status resource says so), the
    instance's state changes and changes back, a checkpoint of a placed
    session is acknowledged; each refused to a client without the role
    (S13), and a malformed record refused before it is sent."""
    import uuid

    desc = kvsp.parse_descriptor((served.dir / "descriptor.json").read_bytes())
    key = kvsp.ScopeKey.from_hex((served.dir / "scope-a.key").read_text())
    compat, scope = desc.compat_id(), key.scope_id()
    node, tool = served.client("self"), served.client()
    h1, ii1, pc = served.base + "h1/", served.base + "ii1/", served.base + "pc/"
    prompt = list(range(4000, 4000 + 2 * desc.block_tokens + 1))
    keys = kvsp.block_keys(key, compat, desc.block_tokens, prompt)
    data, digests, _ = _block(desc, 31)
    assert node.holder(h1).put_block(BlockRef(compat, scope, keys[0]), data, digests.container)

    d = uuid.uuid4()
    directive = {
        "directive": str(d),
        "request_ref": "pytest",
        "scope_id": scope.hex(),
        "compat_id": compat.hex(),
        "blocks": [{"block_key": keys[0].hex(), "sources": [h1]}],
        "layer_order": "ascending",
        "deadline_ms": 10000,
        "lease_ms": 5000,
    }
    with pytest.raises(kvsp.ForbiddenError):
        tool.instance(ii1).prefetch(directive)
    loc = node.instance(ii1).prefetch(directive)
    assert loc.endswith(str(d))
    for _ in range(500):
        st = node.instance(ii1).prefetch_status(d.bytes)
        if st.state != "pending":
            break
        time.sleep(0.02)
    assert st.state == "complete" and st.loaded == (keys[0],), st
    with pytest.raises(kvsp.InvalidError, match="blocks"):
        node.instance(ii1).prefetch({**directive, "blocks": []})

    with pytest.raises(kvsp.ForbiddenError):
        tool.instance(ii1).set_state("draining")
    assert node.instance(ii1).set_state("draining") in ("draining", "sleeping")  # idle: asleep at once
    assert node.instance(ii1).set_state("active") == "active"

    placed = tool.controller(pc).place(scope, compat, prompt, 4)
    assert placed.session is not None
    checkpoint = {
        "session": str(uuid.UUID(bytes=placed.session)),
        "epoch": placed.epoch,
        "compat_id": compat.hex(),
        "scope_id": scope.hex(),
        "prompt_blocks": [k.hex() for k in keys],
        "prompt_tail": prompt[len(keys) * desc.block_tokens :],
        "generated": [7, 8],
        "output_offset": 2,
        "sampler": {"method": "greedy", "params": {}, "seed": 0, "step": 2, "deterministic": True},
    }
    with pytest.raises(kvsp.ForbiddenError):
        tool.controller(pc).put_checkpoint(checkpoint)
    assert node.controller(pc).put_checkpoint(checkpoint) == 2
    with pytest.raises(kvsp.InvalidError, match="output_offset"):
        node.controller(pc).put_checkpoint({**checkpoint, "output_offset": None})
    with pytest.raises(kvsp.InvalidError, match="status: running: required"):
        node.controller(pc).put_status({"instance": ii1, "epoch": 1, "state": "sleepy", "ttl_ms": 3000})
    status = next(
        json.loads(v["json"])
        for v in json.loads((ROOT / "testdata" / "vectors" / "core.json").read_text())["records"]
        if v["type"] == "status" and not v.get("error")
    )
    with pytest.raises(kvsp.ForbiddenError):  # only an instance reports its status
        tool.controller(pc).put_status({**status, "instance": ii1})

    # A lease holds the stored block (and only blocks of the caller's scope).
    lease = tool.holder(h1).lease(scope, compat, [keys[0]], 2000)
    assert lease.block_keys == (keys[0],) and 0 < lease.ttl_ms <= 2000 and lease.lease
    tool.holder(h1).release_lease(lease.lease)
    with pytest.raises(kvsp.NotFoundError):
        tool.holder(h1).release_lease(lease.lease)
    with pytest.raises(kvsp.ScopeDeniedError):
        tool.holder(h1).lease(kvsp.ScopeKey(bytes(range(64, 96))).scope_id(), compat, [keys[0]], 2000)
