"""The Compatibility Descriptor of a model vLLM loads from a directory in
Hugging Face's layout (R-CMP-1..17): model_digest over its weight files
(A-31, as Go's ``kvsp.ModelDigest``), tokenizer_digest over
``tokenizer.json``, the KV geometry and RoPE parameters from
``config.json``, the element type vLLM's cache holds. What the registry
cannot express (a sliding window, latent attention, several KV groups, a
non-integral RoPE theta) is refused here, by name, before vLLM serves.

``python -m kvsp.vllm descriptor MODEL_DIR --block-tokens N --dtype bf16``
prints it for the holders' ``descriptors`` lists."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from ..descriptor import LAYOUT_RAW, MAX_SCALING_NAME_LEN, Descriptor, Positional
from ..errors import invalid

WEIGHT_FILE_EXTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# torch's names of the cache's element types, and the registry's.
KV_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
_BUF = 1 << 20


def files_digest(root: pathlib.Path, names: list[str]) -> str:
    """SHA-256 over the named files concatenated in ascending bytewise order
    of their slash-separated names, streamed (Go's ``kvsp.FilesDigest``)."""
    h = hashlib.sha256()
    for name in sorted(names, key=lambda n: n.encode("utf-8", "surrogateescape")):
        with open(root / name, "rb") as f:
            while b := f.read(_BUF):
                h.update(b)
    return "sha-256:" + h.hexdigest()


def weight_files(root: pathlib.Path) -> list[str]:
    """Every regular file (or link to one) holding tensor data (A-31), by
    its relative name with ``/`` separators."""
    out = []
    for dirpath, _dirs, files in os.walk(root, followlinks=False):
        for f in files:
            p = pathlib.Path(dirpath) / f
            if f.endswith(WEIGHT_FILE_EXTS) and p.is_file():
                out.append(p.relative_to(root).as_posix())
    if not out:
        raise invalid(f"model: no weight files ({', '.join(WEIGHT_FILE_EXTS)}) in {root}")
    return out


def tokenizer_file(root: pathlib.Path) -> pathlib.Path:
    for name in TOKENIZER_FILES:
        if (root / name).is_file():
            return root / name
    raise invalid(f"model: no tokenizer definition ({', '.join(TOKENIZER_FILES)}) in {root}")


def _int(conf: Mapping[str, Any], key: str) -> int:
    v = conf.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise invalid(f"model: config.json: {key}: a positive integer is required")
    return v


def positional(conf: Mapping[str, Any]) -> str:
    """``rope;theta=N[,scaling=NAME]`` from config.json's rope_parameters
    (transformers 5) or rope_theta and rope_scaling (earlier)."""
    params = conf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        raise invalid("model: config.json: rope_parameters per layer type are not in the registry")
    if not isinstance(params, dict):
        params = dict(conf.get("rope_scaling") or {})
        if "rope_theta" in conf:
            params["rope_theta"] = conf["rope_theta"]
    theta = params.get("rope_theta", 10000.0)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0 or theta != int(theta):
        raise invalid(f"model: config.json: rope_theta {theta!r}: the registry takes a positive integer")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if not isinstance(kind, str):
        raise invalid("model: config.json: rope_type: a name")
    scaling = "" if kind == "default" else kind.lower()
    if len(scaling) > MAX_SCALING_NAME_LEN:
        raise invalid(f"model: config.json: rope_type {kind!r}: longer than the registry's names")
    return str(Positional("rope", int(theta), scaling))


def geometry(conf: Mapping[str, Any]) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder whose every layer keeps
    full-attention KV; the kinds kvsp's layout cannot carry are refused."""
    if conf.get("sliding_window") not in (None, 0) and conf.get("use_sliding_window", True):
        raise invalid("model: sliding-window attention: its KV is not the prefix's; not in the registry")
    types = conf.get("layer_types")
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        raise invalid("model: layer types other than full attention (hybrid or sliding): not supported")
    if conf.get("kv_lora_rank"):
        raise invalid("model: latent attention (MLA): its cache is not K and V per head; not supported")
    layers = _int(conf, "num_hidden_layers")
    heads = _int(conf, "num_attention_heads")
    kv_heads = conf.get("num_key_value_heads") or heads
    head_dim = conf.get("head_dim") or _int(conf, "hidden_size") // heads
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int) or kv_heads <= 0 or head_dim <= 0:
        raise invalid("model: config.json: num_key_value_heads and head_dim: positive integers")
    return layers, kv_heads, head_dim


def read_config(root: pathlib.Path) -> dict[str, Any]:
    try:
        conf = json.loads((root / "config.json").read_bytes())
    except OSError as e:
        raise invalid(f"model: config.json: {e.strerror} in {root}") from None
    except ValueError:
        raise invalid(f"model: config.json in {root}: not JSON") from None
    if not isinstance(conf, dict):
        raise invalid("model: config.json: an object")
    text = conf.get("text_config")
    return text if isinstance(text, dict) else conf


def describe(root: pathlib.Path, *, block_tokens: int, kv_dtype: str, name: str | None = None) -> Descriptor:
    """The descriptor of the model in directory root, as vLLM caches its KV
    in kv_dtype (a registry name: bf16, fp16, fp32) at block_tokens."""
    if not root.is_dir():
        raise invalid(f"model: {root}: a local directory is required (the digests are over its files)")
    conf = read_config(root)
    layers, kv_heads, head_dim = geometry(conf)
    d = Descriptor(
        model=name or root.resolve().name,
        model_digest=files_digest(root, weight_files(root)),
        tokenizer_digest=files_digest(tokenizer_file(root).parent, [tokenizer_file(root).name]),
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        positional=positional(conf),
        block_tokens=block_tokens,
        layout=LAYOUT_RAW,
    )
    d.validate()
    return d
