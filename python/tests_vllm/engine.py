"""One vLLM engine (vLLM on CPU, offline, greedy) in its own process, with
kvsp's connector when a connector configuration is given, serving requests
one after the other; after each, vLLM's own counters (its Prometheus
metrics: external prefix-cache hits) and the connector's.
Writes the results as JSON.

    python engine.py JOB.json OUT.json

JOB: {"model": DIR, "config": CONNECTOR.json or null, "dtype": "float32" (default) or "bfloat16",
      "requests": [{"tokens": [...], "salt": str or null, "max_tokens": N}]}
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

COUNTERS = (
    "vllm:external_prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
)


def _metrics(llm: Any) -> dict[str, float]:
    """vLLM's counters, and the connector's (vllm:kvsp_*)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        name = m.name
        if name in COUNTERS or name.startswith("vllm:kvsp_"):
            out[name] = out.get(name, 0.0) + float(getattr(m, "value", 0.0))
    return out


def main(job_path: str, out_path: str) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with open(job_path) as f:
        job = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if job.get("config"):
        kv = KVTransferConfig(
            kv_connector="KVSPConnector",
            kv_connector_module_path="kvsp.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"config": job["config"]},
        )
    t0 = time.monotonic()
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        block_size=32,
        max_model_len=1024,
        enforce_eager=True,
        kv_transfer_config=kv,
        disable_log_stats=False,
        seed=0,
    )
    started = time.monotonic() - t0
    results = []
    before = _metrics(llm)
    for r in job["requests"]:
        p = TokensPrompt(prompt_token_ids=r["tokens"])
        if r.get("salt") is not None:
            p["cache_salt"] = r["salt"]
        t1 = time.monotonic()
        (o,) = llm.generate([p], SamplingParams(max_tokens=r["max_tokens"], temperature=0, logprobs=0), use_tqdm=False)
        took = time.monotonic() - t1
        out = o.outputs[0]
        after = _metrics(llm)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        before = after
        results.append(
            {
                "tokens": list(out.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(out.logprobs or [], out.token_ids, strict=True)],
                "num_cached_tokens": o.num_cached_tokens,
                "metrics": delta,
                "seconds": took,
            }
        )
    with open(out_path, "w") as f:
        json.dump({"started_s": started, "results": results}, f)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
