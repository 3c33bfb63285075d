"""Can vLLM run here? vLLM (CPU) on the tiny model, offline, greedy,
against transformers' greedy decoding of the same prompts in float32:
the token ids must be equal. Prints the versions, the times and the ids.

    .cache/vllm-venv/bin/python scripts/vllm/smoke.py MODEL_DIR
"""

from __future__ import annotations

import os
import sys
import time

PROMPTS = ["The Index Service answers a lookup", "A holder keeps KV blocks in tiers", "hello world"]


def main(model_dir: str) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.monotonic()
    import torch
    import vllm
    from transformers import AutoTokenizer, LlamaForCausalLM
    from vllm import LLM, SamplingParams

    print(f"vllm {vllm.__version__}, torch {torch.__version__}, imported in {time.monotonic() - t0:.1f} s")
    t1 = time.monotonic()
    llm = LLM(model=model_dir, dtype="float32", max_model_len=1024, enforce_eager=True, block_size=32)
    print(f"engine started in {time.monotonic() - t1:.1f} s")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bad = 0
    for p, o in zip(PROMPTS, outs, strict=True):
        ids = tok(p)["input_ids"]
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
        got = list(o.outputs[0].token_ids)
        print(f"{p!r}: vLLM {got}, transformers {want}")
        bad += got != want
    print("vLLM runs here: its greedy tokens equal transformers'" if not bad else f"{bad} prompts differ")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: smoke.py MODEL_DIR")
    sys.exit(main(sys.argv[1]))
