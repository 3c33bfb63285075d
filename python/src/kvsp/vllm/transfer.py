"""Moving blocks between kvsp and vLLM's pages, for the connector's worker
side (and its benchmark): lease, verified GET and scatter into the pages;
gather out of them, build KVB1 containers and PUT. Needs torch and
:mod:`kvsp`, not vLLM."""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .. import CODEC_RAW, CompatID, Geometry, ScopeID, Writer, new_header
from ..client import BlockRef, Client
from ..errors import IncompatibleError
from ..ids import BlockKey
from . import pages
from .model import KV_DTYPES

log = logging.getLogger("kvsp.vllm")
STREAMS = 8  # blocks of a layer-wise load read at once, a connection each


@dataclass
class LoadBlock:
    key: bytes
    page: int
    offset: int  # tokens into the page
    holder: str
    layer_digests: tuple[bytes, ...] | None


@dataclass
class LoadJob:
    req_id: str
    scope_id: bytes
    blocks: list[LoadBlock]
    layerwise: bool


@dataclass
class SaveBlock:
    req_id: str
    scope_id: bytes
    key: bytes
    page: int
    offset: int


class Counters:
    """The connector's counters since they were last taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._d: dict[str, float] = {}

    def add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self._d[k] = self._d.get(k, 0) + v

    def take(self) -> dict[str, float]:
        with self._lock:
            d, self._d = self._d, {}
        return d


class Transfers:
    """One worker's paged KV tensors (one per layer, in layer order) and the
    kvsp clients that fill and drain them."""

    def __init__(
        self, client: Client, holder: str, g: Geometry, lease_ttl_ms: int, timeout_s: float, stats: Counters
    ) -> None:
        self.client, self.holder, self.geometry = client, holder, g
        self.lease_ttl_ms, self.timeout_s, self.stats = lease_ttl_ms, timeout_s, stats
        self.kv: list[torch.Tensor] = []
        self.layout = ""
        self.layer_ready: list[threading.Event] = []

    def attach(self, kv: list[torch.Tensor], page: int) -> None:
        """vLLM's tensors as they are, checked against the descriptor."""
        g = self.geometry
        if len(kv) != g.layers:
            raise ValueError(f"kvsp connector: vLLM registered {len(kv)} layers, the model has {g.layers}")
        layout = pages.detect_layout(kv[0], g.kv_heads, g.head_dim)
        for t in kv:
            if KV_DTYPES.get(str(t.dtype)) != g.elem:
                raise ValueError(f"kvsp connector: a KV tensor of {t.dtype}, the descriptor says {g.elem}")
            if pages.detect_layout(t, g.kv_heads, g.head_dim) != layout or t.shape != kv[0].shape:
                raise ValueError("kvsp connector: the layers' KV tensors differ in shape")
        if pages.page_tokens(kv[0]) != page:
            raise ValueError("kvsp connector: the KV tensors' page size is not vLLM's block size")
        self.kv, self.layout = kv, layout
        self.layer_ready = [threading.Event() for _ in kv]
        for e in self.layer_ready:
            e.set()

    def _leased(self, compat: CompatID, job: LoadJob) -> tuple[list[str], list[Any]]:
        """Lease the job's blocks at their holders (A-2): the holders keep
        them until the GETs are done; leases the holders grant."""
        by: dict[str, list[BlockKey]] = {}
        for b in job.blocks:
            by.setdefault(b.holder, []).append(BlockKey(b.key))
        leases: list[Any] = []
        for h, keys in by.items():
            try:
                leases.append((h, self.client.holder(h).lease(ScopeID(job.scope_id), compat, keys, self.lease_ttl_ms)))
            except Exception as e:  # the GET finds out whether the block is still there
                log.warning("kvsp connector: lease at %s: %s", h, e)
        return list(by), leases

    def _release(self, leases: Iterable[Any]) -> None:
        for h, lease in leases:
            try:
                self.client.holder(h).release_lease(lease.lease)
            except Exception as e:
                log.debug("kvsp connector: lease release at %s: %s", h, e)

    def load(self, compat: CompatID, job: LoadJob) -> set[int]:
        """Fetch a request's blocks in order, each verified layer by layer
        against its record's digests and scattered into its page as it
        arrives; from the first that fails, its page and every later one
        are returned as invalid (vLLM recomputes them)."""
        t0 = time.monotonic()
        g, bt = self.geometry, self.geometry.block_tokens
        _, leases = self._leased(compat, job)
        bad: set[int] = set()
        done = 0
        try:
            for i, b in enumerate(job.blocks):
                try:
                    ref = BlockRef(compat, ScopeID(job.scope_id), BlockKey(b.key))
                    with self.client.holder(b.holder).get_block(ref, g, layer_digests=b.layer_digests) as s:
                        got = [layer.index for layer in s if self._scatter(layer.index, b, layer.k, layer.v)]
                    if got != list(range(g.layers)):
                        raise ValueError(f"the holder sent layers {got[:1]}..{got[-1:]}, not all {g.layers}")
                    _sync(self.kv[0])
                except Exception as e:
                    log.warning("kvsp connector: block %d of %s: %s", i, job.req_id, e)
                    bad = {x.page for x in job.blocks[i:]}
                    log.warning("kvsp connector: pages %s of %s invalid", sorted(bad), job.req_id)
                    self.stats.add(load_failures=1, load_failed_tokens=(len(job.blocks) - i) * bt)
                    break
                done += 1
        finally:
            self._release(leases)
            self.stats.add(loaded_tokens=done * bt, load_seconds=time.monotonic() - t0)
        return bad

    def load_layerwise(self, compat: CompatID, jobs: list[LoadJob]) -> set[int]:
        """The step's blocks read at once, a connection each (STREAMS at a
        time), round-robin one layer from each: layer l is in every page
        before layer l+1 is read, so vLLM computes layer l while the rest
        arrive. A block that fails invalidates its page and its request's
        later ones; every layer is marked ready in the end, whatever
        happened, so the forward never waits forever."""
        t0 = time.monotonic()
        g, bt = self.geometry, self.geometry.block_tokens
        blocks = [(j, i, b) for j in jobs for i, b in enumerate(j.blocks)]
        leases = [lz for j in jobs for lz in self._leased(compat, j)[1]]
        bad: set[int] = set()
        failed: dict[str, int] = {}
        loaded = 0
        try:
            for at in range(0, len(blocks), STREAMS):
                group = blocks[at : at + STREAMS]
                streams: list[Any] = []
                for j, _i, b in group:
                    ref = BlockRef(compat, ScopeID(j.scope_id), BlockKey(b.key))
                    try:
                        s = self.client.holder(b.holder).get_block(ref, g, layer_digests=b.layer_digests)
                        streams.append((s, iter(s)))
                    except Exception as e:
                        log.warning("kvsp connector: a block of %s: %s", j.req_id, e)
                        streams.append(None)
                for layer in range(g.layers):
                    for (j, i, b), s in zip(group, streams, strict=True):
                        if s is None or i >= failed.get(j.req_id, len(j.blocks)):
                            failed[j.req_id] = min(failed.get(j.req_id, len(j.blocks)), i)
                            continue
                        try:
                            x = next(s[1])
                            if x.index != layer:
                                raise ValueError(f"the holder sent layer {x.index} where {layer} was due")
                            self._scatter(x.index, b, x.k, x.v)
                        except Exception as e:
                            log.warning("kvsp connector: block %d of %s: %s", i, j.req_id, e)
                            failed[j.req_id] = min(failed.get(j.req_id, len(j.blocks)), i)
                    if at + STREAMS >= len(blocks):
                        _sync(self.kv[layer])  # the copies done before the forward reads the layer
                        self.layer_ready[layer].set()
                for (j, i, _b), s in zip(group, streams, strict=True):
                    if s is None:
                        continue
                    if i < failed.get(j.req_id, len(j.blocks)):
                        try:
                            for _ in s[1]:  # the container's end: no trailing octets, its digest
                                pass
                        except Exception as e:
                            log.warning("kvsp connector: block %d of %s: %s", i, j.req_id, e)
                            failed[j.req_id] = i
                    s[0].close()
        except Exception as e:
            log.warning("kvsp connector: layer-wise load: %s", e)
            failed.update({j.req_id: 0 for j in jobs if j.req_id not in failed})
        finally:
            if self.kv:
                _sync(self.kv[0])
            for ev in self.layer_ready:
                ev.set()
            self._release(leases)
            for j in jobs:
                f = failed.get(j.req_id, len(j.blocks))
                bad |= {b.page for b in j.blocks[f:]}
                loaded += f
                if f < len(j.blocks):
                    self.stats.add(load_failures=1, load_failed_tokens=(len(j.blocks) - f) * bt)
            self.stats.add(loaded_tokens=loaded * bt, load_seconds=time.monotonic() - t0)
        return bad

    def _scatter(self, layer: int, b: LoadBlock, k: memoryview, v: memoryview) -> bool:
        g = self.geometry
        t = self.kv[layer]
        kt = pages.from_bytes(k, t.dtype, g.block_tokens, g.kv_heads, g.head_dim)
        vt = pages.from_bytes(v, t.dtype, g.block_tokens, g.kv_heads, g.head_dim)
        pages.scatter(t, self.layout, b.page, b.offset, kt.to(t.device), vt.to(t.device))
        return True

    def gather(self, layer: int, saves: list[SaveBlock]) -> tuple[torch.Tensor, torch.Tensor]:
        bt = self.geometry.block_tokens
        t = self.kv[layer]
        idx = torch.tensor([s.page for s in saves], device=t.device)
        sub = torch.tensor([s.offset // bt for s in saves], device=t.device)
        k, v = pages.gather(t, self.layout, idx, sub, bt)
        return k, v

    def put(self, compat: CompatID, saves: list[SaveBlock], staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        g = self.geometry
        h = self.client.holder(self.holder)
        for n, s in enumerate(saves):
            try:
                buf = io.BytesIO()
                w = Writer(buf, new_header(CODEC_RAW, 0, g.layers, g))
                for k, v in staged:
                    w.write_layer(pages.as_bytes(k[n]), pages.as_bytes(v[n]))
                d = w.close()
                if h.put_block(BlockRef(compat, ScopeID(s.scope_id), BlockKey(s.key)), buf.getbuffer(), d.container):
                    self.stats.add(saved_tokens=g.block_tokens)
                else:
                    self.stats.add(save_kept_tokens=g.block_tokens)
            except IncompatibleError as e:
                log.warning(
                    "kvsp connector: %s: the holder needs this model's descriptor in its descriptors "
                    "(python -m kvsp.vllm descriptor MODEL_DIR --block-tokens %d --dtype %s)",
                    e,
                    g.block_tokens,
                    g.elem,
                )
                self.stats.add(save_failures=1)
            except Exception as e:
                log.warning("kvsp connector: saving a block of %s: %s", s.req_id, e)
                self.stats.add(save_failures=1)


def _sync(t: torch.Tensor) -> None:
    """On a GPU, wait for this thread's copies into t: vLLM's forward runs
    on its own stream, which does not wait for ours."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
