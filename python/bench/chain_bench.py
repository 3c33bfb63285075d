"""Block Key chain throughput (tokens/s), bulk (block_keys) and token by
token (Chain.push), at B = 16 and 256 over 131,072 tokens, as Go's
BenchmarkBlockKeys measures it:

    python bench/chain_bench.py
"""

from __future__ import annotations

import json
import time

import kvsp


def main() -> None:
    key = kvsp.ScopeKey(bytes(range(32)))
    compat = kvsp.CompatID(bytes(32))
    toks = [(7 * i + 3) % 128256 for i in range(131072)]
    out = {}
    for b in (16, 256):
        for name, run in (
            ("bulk", lambda b=b: kvsp.block_keys(key, compat, b, toks)),
            ("push", lambda b=b: [c.push(t) for c in [kvsp.Chain(key, compat, b)] for t in toks]),
        ):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 1.0:
                run()
                n += 1
            out[f"{name}/B={b}"] = round(n * len(toks) / (time.perf_counter() - t0))
    print(json.dumps({"tokens_per_s": out}))


if __name__ == "__main__":
    main()
