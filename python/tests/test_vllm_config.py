"""The vLLM connector's configuration and model descriptor, which need
neither vLLM nor torch: every member checked and an unknown one refused
by name; model_digest over the weight files as A-31 says (the same bytes
as Go's kvsp.ModelDigest: sorted names, contents concatenated); the RoPE
parameters and geometry of config.json; what the registry cannot carry,
refused."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest

import kvsp
from kvsp.vllm.config import load_config, parse_config
from kvsp.vllm.model import describe, positional

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCOPE = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"


def _conf(**over: Any) -> dict[str, Any]:
    return {
        "index": "https://kvsp.example:8443/is/",
        "holder": "https://KVSP.example:8443/h1/",
        "tls": {"cert": "c.pem", "key": "c.key", "ca": "ca.pem"},
        "block_tokens": 16,
    } | over


def test_config(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a.key").write_text(SCOPE)
    c = parse_config(
        _conf(scopes={"salts": [{"salt_sha256": hashlib.sha256(b"s3cret").hexdigest(), "scope_key_file": "a.key"}]}),
        tmp_path,
    )
    assert c.index == "https://kvsp.example:8443/is/" and c.holder == "https://kvsp.example:8443/h1/"
    assert c.cert == str(tmp_path / "c.pem") and c.block_tokens == 16 and c.load == "async"
    assert c.scopes.scope_for("s3cret") == kvsp.ScopeKey.from_hex(SCOPE)
    assert c.scopes.scope_for("s3cret ") is None and c.scopes.scope_for(None) is None  # default: no sharing
    f = tmp_path / "sub" / "kvsp-vllm.json"
    f.parent.mkdir()
    f.write_text(json.dumps(_conf()))
    assert load_config({"config": str(f)}).ca == str(f.parent / "ca.pem")  # relative to the file


@pytest.mark.parametrize(
    ("over", "want"),
    [
        ({"blocktokens": 16}, "unknown member 'blocktokens'"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"block_tokens": True}, "block_tokens"),
        ({"index": "http://kvsp.example/is/"}, "index: .*https"),
        ({"holder": "https://kvsp.example/h1"}, "holder: .*end in"),
        ({"tls": {"cert": "c.pem", "key": "c.key"}}, "tls"),
        ({"load": "sync"}, "load"),
        ({"lease_ttl_ms": 10}, "lease_ttl_ms"),
        ({"scopes": {"salt": []}}, "unknown member 'salt'"),
    ],
)
def test_config_refused(tmp_path: pathlib.Path, over: dict[str, Any], want: str) -> None:
    with pytest.raises(kvsp.InvalidError, match=want):
        parse_config(_conf(**over), tmp_path)
    with pytest.raises(kvsp.InvalidError, match="not beside it"):
        load_config({"config": "x.json", "block_tokens": 16})


def _model(d: pathlib.Path, **conf: Any) -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    c = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256} | conf
    (d / "config.json").write_text(json.dumps(c))
    (d / "tokenizer.json").write_bytes(b'{"tok": 1}')
    (d / "model-00002-of-00002.safetensors").write_bytes(b"second")
    (d / "model-00001-of-00002.safetensors").write_bytes(b"first")
    (d / "model.safetensors.index.json").write_text("{}")  # an index: not a weight file
    return d


def test_descriptor(tmp_path: pathlib.Path) -> None:
    m = _model(tmp_path / "tiny", rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    d = describe(m, block_tokens=32, kv_dtype="fp32")
    assert d.model == "tiny"
    assert d.model_digest == "sha-256:" + hashlib.sha256(b"first" + b"second").hexdigest()
    assert d.tokenizer_digest == "sha-256:" + hashlib.sha256(b'{"tok": 1}').hexdigest()
    assert (d.layers, d.kv_heads, d.head_dim, d.kv_dtype, d.block_tokens) == (4, 2, 64, "fp32", 32)
    assert d.positional == "rope;theta=10000" and d.layout == "kvsp-layout-1"
    out = subprocess.run(
        [sys.executable, "-m", "kvsp.vllm", "descriptor", str(m), "--block-tokens", "32", "--dtype", "fp32"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out.encode() == d.jcs() + b"\n"


def test_positional_forms() -> None:
    assert positional({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == (
        "rope;theta=500000,scaling=llama3"
    )
    assert positional({"rope_parameters": {"rope_theta": 1000000, "rope_type": "yarn"}}) == (
        "rope;theta=1000000,scaling=yarn"
    )
    with pytest.raises(kvsp.InvalidError, match="positive integer"):
        positional({"rope_theta": 10000.5})


@pytest.mark.parametrize(
    ("conf", "want"),
    [
        ({"sliding_window": 4096}, "sliding-window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer types"),
        ({"kv_lora_rank": 512}, "latent attention"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ],
)
def test_descriptor_refused(tmp_path: pathlib.Path, conf: dict[str, Any], want: str) -> None:
    with pytest.raises(kvsp.InvalidError, match=want):
        describe(_model(tmp_path / "m", **conf), block_tokens=16, kv_dtype="bf16")


def test_import_needs_no_vllm() -> None:
    """kvsp.vllm imports neither vLLM nor torch until the connector class is asked for."""
    code = (
        "import sys, kvsp.vllm, kvsp.vllm.config, kvsp.vllm.model; print('vllm' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["False", "False"]


def test_digests_are_gos(tmp_path: pathlib.Path) -> None:
    """model_digest and tokenizer_digest as Go's kvsp digest computes them
    (A-31: nested weight files, a link to one followed, indexes and
    configuration left out, names ordered by bytes, not by locale)."""
    from serving import binary

    m = _model(tmp_path / "m")
    (m / "sub").mkdir()
    (m / "sub" / "B.bin").write_bytes(b"upper")
    (m / "a.bin").write_bytes(b"lower")
    (m / "model-10.safetensors").write_bytes(b"ten")
    (tmp_path / "elsewhere.pt").write_bytes(b"linked")
    (m / "linked.pt").symlink_to(tmp_path / "elsewhere.pt")
    d = describe(m, block_tokens=16, kv_dtype="bf16")

    def go(*args: str) -> str:
        out = subprocess.run([str(binary()), "digest", *args], check=True, capture_output=True, text=True)
        return out.stdout.strip()

    assert d.model_digest == go("model", str(m))
    assert d.tokenizer_digest == go("file", str(m / "tokenizer.json"))
