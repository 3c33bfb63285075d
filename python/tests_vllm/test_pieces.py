"""The connector's pieces in-process, with vLLM's own classes: its factory
loads the class from kv_connector_module_path; a vLLM version, a block
size, a parallelism or a cache type it cannot serve is refused at start by
name; the page gather and scatter hold kvsp-layout-1 against both of
vLLM's layouts."""

from __future__ import annotations

import hashlib
import json
import pathlib
import time
from typing import Any

import deployment
import pytest
import torch
from serving import ROOT
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.engine.arg_utils import EngineArgs

import kvsp.vllm
from kvsp.vllm import _connector, pages

MODEL = ROOT / "bin" / "vllm-tiny"


def _kv(conf: pathlib.Path) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KVSPConnector",
        kv_connector_module_path="kvsp.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"config": str(conf)},
    )


def _conf(tmp: pathlib.Path, **over: Any) -> pathlib.Path:
    c = {
        "index": "https://127.0.0.1:1/is/",
        "holder": "https://127.0.0.1:1/h1/",
        "tls": {"cert": "c.pem", "key": "c.key", "ca": "ca.pem"},
        "block_tokens": 16,
    } | over
    p = tmp / "kvsp-vllm.json"
    p.write_text(json.dumps(c))
    return p


def test_factory_loads_the_connector(tmp_path: pathlib.Path) -> None:
    cls = KVConnectorFactory.get_connector_class(_kv(_conf(tmp_path)))
    assert cls is kvsp.vllm.KVSPConnector
    assert issubclass(cls, KVConnectorBase_V1)
    assert _connector.SUPPORTED_VLLM == ("0.32.0",)


def test_other_vllm_versions_refused() -> None:
    _connector.check_vllm_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0; this is vLLM 0\.33\.0"):
        _connector.check_vllm_version("0.33.0")


def _config(tmp: pathlib.Path, block: int = 32, dtype: str = "float32", **over: Any) -> Any:
    args = EngineArgs(
        model=str(MODEL),
        dtype=dtype,
        block_size=block,
        max_model_len=512,
        enforce_eager=True,
        kv_transfer_config=_kv(_conf(tmp, **over)),
    )
    return args.create_engine_config()


def test_refused_at_start(tmp_path: pathlib.Path) -> None:
    vc = _config(tmp_path, block_tokens=24)
    with pytest.raises(ValueError, match="block_tokens 24 must equal vLLM's block size 32 or divide it"):
        kvsp.vllm.KVSPConnector(vc, KVConnectorRole.SCHEDULER, None)
    vc = _config(tmp_path, block_tokens=16)
    vc.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="tensor parallel size 2"):
        kvsp.vllm.KVSPConnector(vc, KVConnectorRole.WORKER, None)
    vc = _config(tmp_path, block_tokens=16)
    vc.cache_config.cache_dtype = "fp8"
    with pytest.raises(ValueError, match="cache dtype fp8"):
        kvsp.vllm.KVSPConnector(vc, KVConnectorRole.WORKER, None)
    with pytest.raises(kvsp.InvalidError, match="unknown member 'blocktokens'"):
        kvsp.vllm.KVSPConnector(_config(tmp_path, blocktokens=16), KVConnectorRole.WORKER, None)


@pytest.mark.parametrize("layout", ["hnd", "nhd"])
@pytest.mark.parametrize("bt", [32, 16, 8])
def test_gather_scatter_kvsp_layout(layout: str, bt: int) -> None:
    """A block scattered from kvsp-layout-1 octets into a page reads back
    the same octets, and lands where each token, head and dimension
    belongs: K[t, h, :] of the block is token off+t of head h in the page."""
    g = torch.Generator().manual_seed(bt)
    n_pages, heads, page, d = 7, 2, 32, 64
    shape = [n_pages, heads, page, 2 * d] if layout == "hnd" else [2, n_pages, page, heads, d]
    t = torch.randn(shape, generator=g, dtype=torch.float32)
    assert pages.detect_layout(t, heads, d) == layout
    k = torch.randn(bt, heads, d, generator=g)
    v = torch.randn(bt, heads, d, generator=g)
    off = page - bt  # the page's last block
    pages.scatter(t, layout, 5, off, k, v)
    for tok in (0, bt - 1):
        for h in range(heads):
            if layout == "hnd":
                assert torch.equal(t[5, h, off + tok, :d], k[tok, h]) and torch.equal(t[5, h, off + tok, d:], v[tok, h])
            else:
                assert torch.equal(t[0, 5, off + tok, h], k[tok, h]) and torch.equal(t[1, 5, off + tok, h], v[tok, h])
    before = t.clone()
    gk, gv = pages.gather(t, layout, torch.tensor([5, 2]), torch.tensor([off // bt, 0]), bt)
    assert gk.shape == (2, bt, heads, d) and gk.is_contiguous()
    assert bytes(pages.as_bytes(gk[0])) == bytes(pages.as_bytes(k.contiguous()))
    assert bytes(pages.as_bytes(gv[0])) == bytes(pages.as_bytes(v.contiguous()))
    back = pages.from_bytes(pages.as_bytes(gk[1]), torch.float32, bt, heads, d)
    ref = before[2, :, :bt, :d].permute(1, 0, 2) if layout == "hnd" else before[0, 2, :bt]
    assert torch.equal(back, ref)
    assert torch.equal(t, before)  # gathering copies, never writes


def test_shapes_refused() -> None:
    with pytest.raises(ValueError, match="neither"):
        pages.detect_layout(torch.zeros(3, 4, 32, 64), 2, 64)


def test_scheduler_side_with_vllm_requests(tmp_path: pathlib.Path) -> None:
    """vLLM's own Request objects through the scheduler side, against an IS
    that does not answer (a port nothing listens on): a secret salt's
    request is "not yet known" (None) while its lookup is in flight, never
    blocking, then 0 once the lookup failed; an unknown salt, no salt, or a
    LoRA adapter (Block Keys cover token ids only) is 0 at once, looked up
    nowhere."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    (tmp_path / "kvsp").mkdir()
    dep = deployment.start(tmp_path / "kvsp", deployment.synthetic(4, 2, 64, 16, "fp32"))
    dep.stop()  # its certificates, and an IS that no longer answers
    (tmp_path / "a.key").write_text("00" * 32)
    salt = "s3cret"
    scopes = {"salts": [{"salt_sha256": hashlib.sha256(salt.encode()).hexdigest(), "scope_key_file": "a.key"}]}
    tls = {"cert": "kvsp/vllm.pem", "key": "kvsp/vllm.key", "ca": "kvsp/ca.pem"}
    vc = _config(tmp_path, block_tokens=16, scopes=scopes, tls=tls, index=dep.index, timeout_s=2)
    c = kvsp.vllm.KVSPConnector(vc, KVConnectorRole.SCHEDULER, None)
    sp = SamplingParams(max_tokens=4)
    tokens = list(range(100, 200))

    def req(rid: str, **kw: Any) -> Request:
        return Request(rid, tokens, sp, None, **kw)

    hit = req("a", cache_salt=salt)
    t0 = time.monotonic()
    assert c.get_num_new_matched_tokens(hit, 0) == (None, False)
    assert time.monotonic() - t0 < 0.5  # the lookup runs off the scheduler loop
    end = time.monotonic() + 30
    while (got := c.get_num_new_matched_tokens(hit, 0)) == (None, False):
        assert time.monotonic() < end
        time.sleep(0.05)
    assert got == (0, False)
    lora = LoRARequest("adapter", 1, str(tmp_path))
    for r in (req("b", cache_salt="guess"), req("c"), req("d", cache_salt=salt, lora_request=lora)):
        assert c.get_num_new_matched_tokens(r, 0) == (0, False)
        assert c.reqs[r.request_id].lookup is None and c.reqs[r.request_id].scope is None
    assert c.reqs["a"].scope is not None and len(c.reqs["a"].keys) == (len(tokens) - 1) // 16
    c.shutdown()
