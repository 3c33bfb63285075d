"""kvsp for vLLM: :class:`KVSPConnector`, a KV connector vLLM loads by name::

    --kv-transfer-config '{"kv_connector": "KVSPConnector", "kv_connector_module_path": "kvsp.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"config": "kvsp-vllm.json"}}'

Importing this package imports neither vLLM nor torch: the connector class
is imported when it is asked for (vLLM's factory does ``getattr``), and it
refuses a vLLM version it was not tested with (SUPPORTED_VLLM). The
configuration (:mod:`kvsp.vllm.config`) and the model's descriptor
(:mod:`kvsp.vllm.model`, ``python -m kvsp.vllm descriptor``) need neither.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVSPConnector"]


def __getattr__(name: str) -> Any:
    if name in ("KVSPConnector", "KVSPMetadata", "KVSPStats", "SUPPORTED_VLLM"):
        from . import _connector

        return getattr(_connector, name)
    raise AttributeError(f"module 'kvsp.vllm' has no attribute {name!r}")
