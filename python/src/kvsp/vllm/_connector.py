"""KVSPConnector: vLLM's KV connector (``KVConnectorBase_V1``) over kvsp.

The scheduler side (vLLM's engine-core process) turns a request's tokens
into Block Keys under the scope its cache salt maps to (:mod:`kvsp.salts`),
looks them up at the Index Service off the scheduler loop, and tells the
worker which kvsp blocks go into which of vLLM's pages (loads) and which
pages hold blocks to store (saves). The worker side (each worker process)
leases and GETs blocks verified by their layer digests and scatters them
into vLLM's per-layer tensors, and gathers computed blocks out of them into
KVB1 containers that it PUTs to the holder. Scope keys never leave the
scheduler process; the worker sees scope IDs and Block Keys.
"""

from __future__ import annotations

import logging
import pathlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.outputs import KVConnectorOutput

from .. import Chain, CompatID, Geometry, ScopeID
from ..client import Client
from ..ids import BlockKey
from ..scope import ScopeKey
from .config import ConnectorConfig, load_config, load_mode
from .model import KV_DTYPES, describe, geometry, read_config
from .transfer import Counters, LoadBlock, LoadJob, SaveBlock, Transfers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

SUPPORTED_VLLM = ("0.32.0",)
log = logging.getLogger("kvsp.vllm")


def check_vllm_version(version: str) -> None:
    """The connector API is experimental in vLLM and changes between
    releases: a version it was not tested with is refused, by name."""
    if version.split("+")[0] not in SUPPORTED_VLLM:
        raise RuntimeError(f"kvsp.vllm.KVSPConnector supports vLLM {', '.join(SUPPORTED_VLLM)}; this is vLLM {version}")


check_vllm_version(vllm.__version__)


@dataclass
class KVSPMetadata(KVConnectorMetadata):  # type: ignore[misc]
    compat: bytes
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveBlock] = field(default_factory=list)


STAT_KEYS = (
    "lookups",
    "lookup_failures",
    "loaded_tokens",
    "load_failed_tokens",
    "load_failures",
    "load_seconds",
    "saved_tokens",
    "save_kept_tokens",
    "save_failures",
)


@dataclass
class KVSPStats(KVConnectorStats):  # type: ignore[misc]
    """Counters since the last report: lookups and their failures (scheduler),
    tokens loaded, tokens of blocks that failed to load (reported to vLLM for
    recomputation), failed loads, seconds spent loading, tokens stored, tokens
    whose blocks the holder already had (412: it keeps the first copy), saves
    that failed (worker)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVSPStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data.get(k, 0) for k in STAT_KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVSPPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The counters of :class:`KVSPStats` as Prometheus counters
    ``vllm:kvsp_<name>`` (exposed as ``vllm:kvsp_<name>_total``), per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._by: dict[tuple[int, str], Any] = {}
        for k in STAT_KEYS:
            c = self._counter_cls(
                name=f"vllm:kvsp_{k}", documentation=f"kvsp connector: {k.replace('_', ' ')}", labelnames=labelnames
            )
            for idx, values in per_engine_labelvalues.items():
                self._by[(idx, k)] = c.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            m = self._by.get((engine_idx, k))
            if m is not None and v:
                m.inc(v)


@dataclass
class _Req:
    """The scheduler's state of one request."""

    request: Request
    scope: ScopeKey | None
    chain: Chain | None = None
    keys: list[BlockKey] = field(default_factory=list)
    lookup: Future[tuple[int, list[Any]]] | None = None
    hit: int = 0  # kvsp blocks found from the first
    replicas: list[Any] = field(default_factory=list)
    local: int = 0  # tokens vLLM holds itself (block-aligned)
    saved: int = 0  # blocks stored, loaded or saved: the next to save
    allocated: bool = False
    loading: dict[int, int] = field(default_factory=dict)  # page -> the block loaded into it


class KVSPConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector over kvsp. Loaded by vLLM as
    ``--kv-transfer-config '{"kv_connector": "KVSPConnector",
    "kv_connector_module_path": "kvsp.vllm", "kv_role": "kv_both",
    "kv_connector_extra_config": {"config": "kvsp-vllm.json"}}'``
    (:mod:`kvsp.vllm.config`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        # Scope keys are read where Block Keys are made, the scheduler; the
        # workers see scope IDs and keys only.
        self.cfg: ConnectorConfig = load_config(extra, scopes=role == KVConnectorRole.SCHEDULER)
        self.page = int(vllm_config.cache_config.block_size)
        bt = self.cfg.block_tokens
        if self.page % bt:
            raise ValueError(
                f"kvsp connector: kvsp's block_tokens {bt} must equal vLLM's block size {self.page} or divide it"
            )
        tp = vllm_config.parallel_config.tensor_parallel_size
        pp = vllm_config.parallel_config.pipeline_parallel_size
        if tp != 1 or pp != 1:
            raise ValueError(
                f"kvsp connector: tensor parallel size {tp}, pipeline {pp}: a kvsp block holds every head of every "
                "layer, and each worker holds a share; only 1 and 1 are supported"
            )
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("kvsp connector: the model has several KV cache groups (hybrid attention): not supported")
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kvsp connector: kv_load_failure_policy is %r: a block that fails its digest fails its request;"
                ' "recompute" has vLLM compute it instead',
                self._kv_transfer_config.kv_load_failure_policy,
            )
        mc = vllm_config.model_config
        self.model_dir = pathlib.Path(mc.model)
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype != "auto":
            raise ValueError(f"kvsp connector: cache dtype {cache_dtype}: only the model's dtype (auto) is supported")
        self.kv_dtype = KV_DTYPES.get(str(mc.dtype))
        if self.kv_dtype is None:
            raise ValueError(f"kvsp connector: the model's dtype {mc.dtype}: not in the registry")
        layers, heads, head_dim = geometry(read_config(self.model_dir))
        self.geometry = Geometry(layers, bt, heads, head_dim, self.kv_dtype)
        self.client = Client(
            cert=self.cfg.cert,
            key=self.cfg.key,
            ca=self.cfg.ca,
            server_identity=self.cfg.server_identity,
            timeout=self.cfg.timeout_s,
        )
        self.pool = ThreadPoolExecutor(self.cfg.threads, thread_name_prefix="kvsp")
        # Loads on their own threads: a backlog of PUTs never delays the
        # blocks a forward waits for.
        self.load_pool = ThreadPoolExecutor(self.cfg.threads, thread_name_prefix="kvsp-load")
        self.stats = Counters()
        self.puts: set[Future[None]] = set()
        self.lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            desc = describe(self.model_dir, block_tokens=bt, kv_dtype=self.kv_dtype, name=self.cfg.model)
            self.compat: CompatID = desc.compat_id()
            self.reqs: dict[str, _Req] = {}
            self.loads: list[LoadJob] = []
            log.info(
                "kvsp connector: %s, compat_id %s, block_tokens %d, %r", desc.model, self.compat, bt, self.cfg.scopes
            )
        else:
            self.xfer = Transfers(
                self.client, self.cfg.holder, self.geometry, self.cfg.lease_ttl_ms, self.cfg.timeout_s, self.stats
            )
            self.layer_of: dict[str, int] = {}
            self.jobs: dict[str, tuple[Future[set[int]], set[int]]] = {}  # a load and its pages
            self.sync: list[tuple[Future[set[int]], set[int]]] = []
            self.invalid: set[int] = set()
            self.timed_out = False
            self.sync_reqs: dict[str, set[int]] = {}  # this step's layer-wise loads: request -> pages
            self.staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---------------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        bt = self.cfg.block_tokens
        st = self.reqs.get(request.request_id)
        if st is not None and request.num_computed_tokens == 0:
            # Asked afresh (a preempted request resumed, or a load that
            # failed from its first block): whatever was allocated is gone.
            st.allocated, st.loading = False, {}
        if st is None:
            scope = self.cfg.scopes.scope_for(request.cache_salt)
            if request.lora_request is not None or request.mm_features or request.prompt_embeds is not None:
                # Block Keys cover token ids only: an adapter, images or
                # embeddings behind the same ids would make other KV.
                scope = None
            st = _Req(request, scope)
            self.reqs[request.request_id] = st
            if st.scope is not None:
                st.chain = Chain(st.scope, self.compat, bt)
                tokens = request.all_token_ids
                n = (len(tokens) - 1) // bt  # vLLM computes at least the last token
                st.keys = st.chain.extend(tokens[: n * bt])
                if n:
                    st.lookup = self.pool.submit(self._lookup, st.scope.scope_id(), list(st.keys))
        if st.lookup is not None:
            if not st.lookup.done():
                return None, False  # asked again next step: the scheduler loop never waits on the IS
            try:
                st.hit, st.replicas = st.lookup.result()
                st.hit = min(st.hit, len(st.replicas), len(st.keys))
            except Exception as e:  # the IS unreachable or refusing: compute, as without a cache
                log.warning("kvsp connector: lookup failed: %s", e)
                self.stats.add(lookup_failures=1)
                st.hit, st.replicas = 0, []
            st.lookup = None
        st.local = num_computed_tokens
        ext = st.hit * bt - num_computed_tokens
        if ext <= 0:
            return 0, False
        return ext, self.cfg.load == "async"

    def _lookup(self, scope: ScopeID, keys: list[BlockKey]) -> tuple[int, list[Any]]:
        self.stats.add(lookups=1)
        r = self.client.index(self.cfg.index).lookup(scope, self.compat, keys)
        return r.matched, [reps[0] for reps in r.replicas]

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None or st.scope is None or st.allocated:
            return
        st.allocated = True
        bt = self.cfg.block_tokens
        first, end = st.local // bt, (st.local + num_external_tokens) // bt
        st.saved = end
        if num_external_tokens <= 0:
            return
        ids = blocks.get_block_ids()[0]
        job = LoadJob(request.request_id, bytes(st.scope.scope_id()), [], self.cfg.load == "layerwise")
        for j in range(first, end):
            tok, rec = j * bt, st.replicas[j]
            page = ids[tok // self.page]
            job.blocks.append(LoadBlock(bytes(st.keys[j]), page, tok % self.page, rec.holder, rec.layer_digests))
            st.loading.setdefault(page, j)
        self.loads.append(job)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A load that failed lowers its request's hit to the first block
        that failed: if vLLM asks again (a request whose load failed from
        its first block starts over), that block is not promised twice."""
        bad = connector_output.invalid_block_ids or set()
        for st in self.reqs.values():
            if st.loading and bad:
                failed = [j for page, j in st.loading.items() if page in bad]
                if failed:
                    st.hit = min(st.hit, min(failed))
            if st.loading and st.request.request_id in (connector_output.finished_recving or ()):
                st.loading = {}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVSPMetadata(bytes(self.compat), self.loads)
        self.loads = []
        bt = self.cfg.block_tokens
        for rid in scheduler_output.preempted_req_ids or ():
            st = self.reqs.get(rid)
            if st is not None:  # its pages are gone: when it runs again it is looked up and loaded afresh
                st.allocated, st.loading = False, {}
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = self.reqs.get(rid)
            if st is None or st.scope is None or st.chain is None:
                continue
            r = st.request
            tokens = r.all_token_ids
            c = r.num_computed_tokens  # this step computes tokens [c, c+n)
            st.saved = min(st.saved, c // bt)  # blocks recomputed after a failed load are stored again
            full = min(c + n, len(tokens)) // bt
            if full <= st.saved:
                continue
            if full > len(st.keys):
                st.keys += st.chain.extend(tokens[st.chain.blocks * bt + len(st.chain.pending()) : full * bt])
            ids = self._kv_cache_manager.get_block_ids(rid)[0]
            sid = bytes(st.scope.scope_id())
            for j in range(st.saved, full):
                tok = j * bt
                meta.saves.append(SaveBlock(rid, sid, bytes(st.keys[j]), ids[tok // self.page], tok % self.page))
            st.saved = full
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # The worker copied each computed block out of vLLM's pages in the
        # step that computed it: nothing is left to hold the pages for.
        # A request finished while its load is in flight keeps its pages
        # by vLLM's own rule until the worker reports the load done.
        st = self.reqs.pop(request.request_id, None)
        if st is not None and st.lookup is not None:
            st.lookup.cancel()
        return False, None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        d = self.stats.take()
        return KVSPStats(data=d) if any(d.values()) else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads wait in every attention layer
        (wait_for_layer_load), which a captured CUDA graph would skip."""
        return load_mode(extra_config) == "layerwise"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVSPStats(data=dict(data)) if data is not None else KVSPStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVSPPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        by = sorted((extract_layer_index(name), name, t) for name, t in kv_caches.items())
        if [i for i, _, _ in by] != list(range(self.geometry.layers)):
            raise ValueError(
                f"kvsp connector: vLLM registered layers {[i for i, _, _ in by]}, the model has {self.geometry.layers}"
            )
        self.xfer.attach([t for _, _, t in by], self.page)
        self.layer_of = {name: i for i, name, _ in by}

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSPMetadata)
        sync = [j for j in meta.loads if j.layerwise]
        if sync:
            for e in self.xfer.layer_ready:
                e.clear()
            pages = {b.page for j in sync for b in j.blocks}
            self.sync_reqs = {j.req_id: {b.page for b in j.blocks} for j in sync}
            self.sync.append((self.load_pool.submit(self.xfer.load_layerwise, CompatID(meta.compat), sync), pages))
        for job in meta.loads:
            if not job.layerwise:
                f = self.load_pool.submit(self.xfer.load, CompatID(meta.compat), job)
                self.jobs[job.req_id] = (f, {b.page for b in job.blocks})

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self.layer_of.get(layer_name)
        if i is not None and not self.xfer.layer_ready[i].wait(self.cfg.timeout_s * 4):
            # The forward goes on, over pages that may not hold the blocks:
            # all of this step's loaded pages are reported invalid, so vLLM
            # discards what it computes from them and computes them again.
            log.warning("kvsp connector: layer %d did not arrive in time", i)
            self.timed_out = True

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Copy this step's completed blocks of one layer out of vLLM's
        pages as soon as the layer is computed."""
        meta = self._get_connector_metadata()
        i = self.layer_of.get(layer_name)
        if not isinstance(meta, KVSPMetadata) or not meta.saves or i is None or i in self.staged:
            return
        self.staged[i] = self.xfer.gather(i, meta.saves)

    def wait_for_save(self) -> None:
        """The step's computed blocks: every layer copied out (those
        save_kv_layer did not), then built into containers and PUT in the
        background; the pages are free to reuse when this returns."""
        meta = self._connector_metadata
        if not isinstance(meta, KVSPMetadata) or not meta.saves:
            self.staged.clear()
            return
        staged = [self.staged.get(i) or self.xfer.gather(i, meta.saves) for i in range(len(self.xfer.kv))]
        self.staged.clear()
        saves = meta.saves
        if self.sync:
            # What this step computed after a layer-wise load depends on
            # the loaded prefix: if that load failed, it is not stored (the
            # holder keeps a block's first copy).
            bad: set[int] = set()
            for lf, pages in self.sync:
                bad |= pages if self.timed_out else _outcome(lf, pages)
            failed = {rid for rid, pages in self.sync_reqs.items() if pages & bad}
            keep = [n for n, sv in enumerate(saves) if sv.req_id not in failed]
            if len(keep) < len(saves):
                idx = torch.tensor(keep, dtype=torch.long)
                staged = [(k[idx], v[idx]) for k, v in staged]
                saves = [saves[n] for n in keep]
            if not saves:
                return
        f = self.pool.submit(self.xfer.put, CompatID(meta.compat), saves, staged)
        with self.lock:
            self.puts.add(f)
        f.add_done_callback(self._put_done)

    def _put_done(self, f: Future[None]) -> None:
        with self.lock:
            self.puts.discard(f)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Loads done (their requests' ids, so vLLM schedules them or frees
        their pages), their failed pages kept for
        get_block_ids_with_load_errors, which vLLM calls next in the same
        step; the step's layer-wise loads, which its last layer waited for.
        A load that raised has every page of it failed: reported, never
        left waiting. Saves hold no page, so none is reported as sending."""
        done = {rid for rid, (f, _) in self.jobs.items() if f.done()}
        for rid in done:
            self.invalid |= _outcome(*self.jobs.pop(rid))
        for f, pages in self.sync:
            self.invalid |= pages if self.timed_out else _outcome(f, pages)
        self.sync.clear()
        self.timed_out = False
        return None, done or None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Nothing outlives the step here: a step's saves are copied out of
        the pages before it ends, and loads go only into the pages of
        requests waiting for them, which vLLM does not preempt. (The
        scheduler side forgets a preempted request's allocation, so that it
        is looked up and loaded afresh.)"""

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self.invalid = self.invalid, set()
        return bad

    def wait_saves(self, timeout: float | None = None) -> None:
        """Block until the PUTs started so far are done (tests, shutdown)."""
        with self.lock:
            fs = list(self.puts)
        for f in fs:
            f.result(timeout)

    def shutdown(self) -> None:
        self.wait_saves(self.cfg.timeout_s * 4)
        self.pool.shutdown(wait=True)
        self.load_pool.shutdown(wait=True)
        self.client.close()


def _outcome(f: Future[set[int]], pages: set[int]) -> set[int]:
    """The pages a finished load failed; all of them if it raised."""
    try:
        return f.result()
    except Exception as e:
        log.warning("kvsp connector: a load failed: %s", e)
        return set(pages)
