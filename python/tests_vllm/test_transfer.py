"""The worker's transfers (kvsp.vllm.transfer) against a real kvsp serve,
without an engine: blocks gathered out of one set of paged tensors (vLLM's
CPU layout) and PUT, found at the IS, then leased, fetched verified and
scattered into another set's pages, whole blocks at a time and layer by
layer; they read back octet for octet. A block the holder corrupts (its
failpoint) or no longer has invalidates its page and every later one of
its request, never earlier ones, and every layer is marked ready all the
same."""

from __future__ import annotations

import pathlib
import random
from collections.abc import Iterator

import deployment
import pytest
import torch

import kvsp
from kvsp.vllm import transfer
from kvsp.vllm.transfer import Counters, LoadBlock, LoadJob, SaveBlock, Transfers

LAYERS, HEADS, HD, BT, PAGE, PAGES = 4, 2, 64, 16, 32, 12
DESC = deployment.synthetic(LAYERS, HEADS, HD, BT, "fp32")
G = kvsp.Geometry.of(DESC)


def _tensors(seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(PAGES, HEADS, PAGE, 2 * HD) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGES, HEADS, PAGE, 2 * HD, generator=g) for _ in range(LAYERS)]


def _xfer(dep: deployment.Deployment, kv: list[torch.Tensor]) -> Transfers:
    x = Transfers(dep.client(), dep.holder, G, 30_000, 10.0, Counters())
    x.attach(kv, PAGE)
    for e in x.layer_ready:  # as the connector's start_load_kv leaves them for a layer-wise load
        e.clear()
    return x


def _store(dep: deployment.Deployment, n: int, seed: int) -> tuple[list[torch.Tensor], list[kvsp.BlockKey], LoadJob]:
    """n blocks of a request gathered from random pages 1.. (two blocks a
    page) and PUT; the job that loads them into pages 6.. of another."""
    src = _tensors(seed)
    tokens = [random.Random(seed).randrange(50_000) for _ in range(n * BT)]
    keys = kvsp.block_keys(dep.scope(), DESC.compat_id(), BT, tokens)
    sid = bytes(dep.scope().scope_id())
    saves = [SaveBlock("r", sid, bytes(k), 1 + j // 2, (j % 2) * BT) for j, k in enumerate(keys)]
    x = _xfer(dep, src)
    x.put(DESC.compat_id(), saves, [x.gather(layer, saves) for layer in range(LAYERS)])
    found = dep.published(keys)
    blocks = [
        LoadBlock(bytes(k), 6 + j // 2, (j % 2) * BT, reps[0].holder, reps[0].layer_digests)
        for j, (k, reps) in enumerate(zip(keys, found.replicas, strict=True))
    ]
    return src, keys, LoadJob("r", sid, blocks, False)


def _same(src: list[torch.Tensor], dst: list[torch.Tensor], n: int) -> bool:
    """Tokens 0..n*BT of pages 1.. of src are those of pages 6.. of dst."""
    pages = (n * BT + PAGE - 1) // PAGE
    return all(
        torch.equal(s[1 : 1 + pages].reshape(pages, HEADS, PAGE, -1)[:, :, : n * BT], d[6 : 6 + pages, :, : n * BT])
        if n * BT < PAGE
        else torch.equal(s[1 : 1 + pages], d[6 : 6 + pages])
        for s, d in zip(src, dst, strict=True)
    )


@pytest.fixture
def dep(tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> Iterator[deployment.Deployment]:
    d = deployment.start(tmp_path, DESC, getattr(request, "param", ""))
    yield d
    d.stop()


def test_round_trip(dep: deployment.Deployment) -> None:
    src, _, job = _store(dep, 6, 1)
    for layerwise in (False, True):
        dst = _tensors(None)
        x = _xfer(dep, dst)
        bad = x.load_layerwise(DESC.compat_id(), [job]) if layerwise else x.load(DESC.compat_id(), job)
        assert bad == set()
        assert _same(src, dst, 6)
        assert all(e.is_set() for e in x.layer_ready) == layerwise
        assert x.stats.take()["loaded_tokens"] == 6 * BT


@pytest.mark.parametrize("dep", ["holder/corrupt-on-read=3+1*return"], indirect=True)
@pytest.mark.parametrize("layerwise", [False, True])
def test_corrupted_block(dep: deployment.Deployment, layerwise: bool) -> None:
    """The fourth GET (block 3, in page 7 with block 2) is corrupted: pages
    7 to 8 are invalid, page 6 (blocks 0 and 1) is loaded."""
    src, _, job = _store(dep, 6, 2)
    dst = _tensors(None)
    x = _xfer(dep, dst)
    bad = x.load_layerwise(DESC.compat_id(), [job]) if layerwise else x.load(DESC.compat_id(), job)
    assert bad == {7, 8}
    assert _same(src, dst, 2)
    assert all(e.is_set() for e in x.layer_ready) == layerwise  # a layer-wise load never leaves the forward waiting
    st = x.stats.take()
    assert st["load_failures"] == 1 and st["load_failed_tokens"] == 3 * BT and st["loaded_tokens"] == 3 * BT


def test_missing_block(dep: deployment.Deployment) -> None:
    """A block the holder does not have (evicted after the lookup): from it on, invalid."""
    src, _, job = _store(dep, 4, 3)
    job.blocks[2] = LoadBlock(b"\x07" * 32, job.blocks[2].page, job.blocks[2].offset, dep.holder, None)
    for layerwise in (False, True):
        dst = _tensors(None)
        x = _xfer(dep, dst)
        bad = x.load_layerwise(DESC.compat_id(), [job]) if layerwise else x.load(DESC.compat_id(), job)
        assert bad == {7}
        assert _same(src, dst, 2)


def test_streams_cover_a_long_load(dep: deployment.Deployment, monkeypatch: pytest.MonkeyPatch) -> None:
    """More blocks than streams: read group by group, all in the end."""
    monkeypatch.setattr(transfer, "STREAMS", 4)
    src, _, job = _store(dep, 10, 4)
    dst = [torch.zeros(PAGES + 6, HEADS, PAGE, 2 * HD) for _ in range(LAYERS)]
    x = _xfer(dep, dst)
    assert x.load_layerwise(DESC.compat_id(), [job]) == set()
    assert _same(src, dst, 10)
