"""The gateway's benchmarks, with OpenAI's SDK as the client, against
`kvsp serve --config examples/openai/kvsp.yaml` (SmolLM2 on two llama.cpp
instances), all ratios taken in the same run:

1. TTFT of a chat whose 2,048-token prefix (--prefix-tokens) is cached at the other
   instance's holder (answered at instance 1, which is then drained; asked
   again at instance 2, which loads it) against a prefix of the same length
   that nothing has seen (computed).
2. The gateway's own cost per request (tokenize, template, SSE) against a
   direct place and generate of the same tokens (kvsp's Python client),
   both with the prefix resident: the difference of the median TTFTs
   (the SDK's own time included), against the cached TTFT.
3. Output tokens per second through the gateway against direct generate
   calls of the same requests, 1 and 4 concurrent streams.

    .cache/venv/bin/python python/bench/gateway_bench.py --dir examples/openai [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import ssl
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import openai

from kvsp import ScopeKey, parse_descriptor
from kvsp.client import Client

MODEL = "smollm2-135m-instruct"
IDENTITY = "spiffe://kvsp.local/node/127.0.0.1"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="examples/openai", help="the configuration's directory (kvsp certs wrote it)")
    ap.add_argument("--roles", default="https://127.0.0.1:8446/")
    ap.add_argument("--gateway", default="https://127.0.0.1:8445/v1")
    ap.add_argument("--gguf", default=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--kvsp", default="bin/kvsp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="the tokens the cached and asked chats share")
    a = ap.parse_args()
    d = pathlib.Path(a.dir)
    ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
    sdk = openai.OpenAI(
        base_url=a.gateway,
        api_key=(d / "api-key.txt").read_text().strip(),
        http_client=openai.DefaultHttpx2Client(verify=ctx),
        max_retries=0,
        timeout=300,
    )
    node = Client(cert=str(d / "self.pem"), key=str(d / "self.key"), ca=str(d / "ca.pem"), server_identity=IDENTITY)
    ii1, ii2, pc = a.roles + "ii1/", a.roles + "ii2/", a.roles + "pc/"
    scope = ScopeKey.from_hex((d / "scope-a.key").read_text()).scope_id()
    compat = parse_descriptor((d / "descriptor.json").read_bytes()).compat_id()

    def tokens(msgs: list[dict[str, str]]) -> list[int]:
        out = subprocess.run(
            [a.kvsp, "model", "tokenize", a.gguf, "--chat"],
            input=json.dumps(msgs),
            capture_output=True,
            text=True,
            check=True,
        )
        return [int(t) for t in json.loads(out.stdout)]

    def only(inst: str) -> None:
        """Place on inst only: the other drains."""
        other = ii2 if inst == ii1 else ii1
        node.instance(inst).set_state("active")
        node.instance(other).set_state("draining")
        time.sleep(1.5)  # the next status records

    def ttft_sdk(msgs: Any, max_tokens: int = 4) -> float:
        t0 = time.perf_counter()
        stream = sdk.chat.completions.create(
            model=MODEL, messages=msgs, temperature=0, max_tokens=max_tokens, stream=True
        )
        first = None
        for chunk in stream:
            if first is None and any(ch.delta.content for ch in chunk.choices):
                first = time.perf_counter() - t0
        assert first is not None
        return first

    def ttft_direct(toks: list[int], max_tokens: int = 4) -> float:
        t0 = time.perf_counter()
        placed = node.controller(pc).place(scope, compat, toks, max_tokens)
        first = None
        for _ in node.instance(placed.instance).generate(placed, scope, compat, toks, max_tokens):
            if first is None:
                first = time.perf_counter() - t0
        assert first is not None
        return first

    nonce = os.urandom(4).hex()  # prefixes no earlier run cached

    def shared(p: str) -> int:
        """The tokens two chats with system prompt p share (the cached and
        the asked one's questions)."""
        x = tokens([{"role": "system", "content": p}, {"role": "user", "content": "Where are the maps?"}])
        y = tokens([{"role": "system", "content": p}, {"role": "user", "content": "Where is poetry?"}])
        return next(i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v)

    def prefix(k: int) -> str:
        """A system prompt whose chats share exactly --prefix-tokens tokens,
        its own for each k (and run): shelves, then filler words."""

        def text(shelves: int, filler: int) -> str:
            return (
                f"Library notice {nonce}-{k}. "
                + " ".join(f"Shelf {k}-{i} holds books on topic {i * 7919 % 1000}." for i in range(shelves))
                + " ok" * filler
            )

        lo, hi = 0, 4 * a.prefix_tokens // 16  # a shelf is about 16 tokens
        while lo < hi:  # the most shelves within the target
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if shared(text(mid, 0)) <= a.prefix_tokens else (lo, mid - 1)
        for filler in range(64):
            n = shared(text(lo, filler))
            if n == a.prefix_tokens:
                return text(lo, filler)
            if n > a.prefix_tokens:
                break
        raise SystemExit(f"no system prompt of exactly {a.prefix_tokens} shared tokens for {k}")

    res: dict[str, Any] = {"cached": [], "none": [], "gateway": [], "direct": []}
    try:
        for r in range(a.rounds):
            p = prefix(r)
            n = shared(p)
            only(ii1)
            ttft_sdk(
                [{"role": "system", "content": p}, {"role": "user", "content": "Where are the maps?"}]
            )  # ii1 computes and stores it
            only(ii2)
            res["cached"].append(
                ttft_sdk([{"role": "system", "content": p}, {"role": "user", "content": "Where is poetry?"}])
            )
            res["none"].append(
                ttft_sdk(
                    [{"role": "system", "content": prefix(1000 + r)}, {"role": "user", "content": "Where is poetry?"}]
                )
            )
            # The prefix is resident at ii2 now: the gateway against direct calls.
            # Each call asks a question no call asked before (of the same
            # length in tokens): both compute the same suffix after the
            # resident prefix.
            for j in range(3):
                g = [
                    {"role": "system", "content": p},
                    {"role": "user", "content": f"Where is shelf {100 + 10 * r + j}?"},
                ]
                dq = [
                    {"role": "system", "content": p},
                    {"role": "user", "content": f"Where is shelf {500 + 10 * r + j}?"},
                ]
                dt = tokens(dq)
                assert len(dt) == len(tokens(g))
                if j % 2:
                    res["direct"].append(ttft_direct(dt))
                    res["gateway"].append(ttft_sdk(g))
                else:
                    res["gateway"].append(ttft_sdk(g))
                    res["direct"].append(ttft_direct(dt))
            res.setdefault("prefix_tokens", []).append(n)
        # Output rate: long answers, 1 and 4 at once, at ii2.
        count: Any = [{"role": "user", "content": "Count from 1 to 500, separated by commas."}]
        toks = tokens(count)

        def rate_sdk() -> float:
            t0 = time.perf_counter()
            r = sdk.chat.completions.create(model=MODEL, messages=count, temperature=0, max_tokens=160)
            assert r.usage is not None
            return r.usage.completion_tokens / (time.perf_counter() - t0)

        def rate_direct() -> float:
            t0 = time.perf_counter()
            placed = node.controller(pc).place(scope, compat, toks, 160)
            n = sum(1 for _ in node.instance(placed.instance).generate(placed, scope, compat, toks, 160))
            return n / (time.perf_counter() - t0)

        rate_sdk(), rate_direct()  # the prompt's blocks cached for both paths alike
        for streams in (1, 4):
            for name, f in (
                ("gateway", rate_sdk),
                ("direct", rate_direct),
                ("gateway", rate_sdk),
                ("direct", rate_direct),
            ):
                rates: list[float] = []

                def run(f: Any = f, rates: list[float] = rates) -> None:
                    rates.append(f())

                ts = [threading.Thread(target=run) for _ in range(streams)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                res.setdefault(f"rate_{name}_{streams}", []).append(sum(rates))
    finally:
        node.instance(ii1).set_state("active")
        node.instance(ii2).set_state("active")
    med = {k: statistics.median(v) for k, v in res.items() if v}
    out = {
        "measured": time.strftime("%Y-%m-%d"),
        "prefix_tokens": res["prefix_tokens"],
        "ttft_cached_s": res["cached"],
        "ttft_none_s": res["none"],
        "ttft_speedup": med["none"] / med["cached"],
        "ttft_gateway_s": res["gateway"],
        "ttft_direct_s": res["direct"],
        "gateway_overhead_of_cached_ttft": (med["gateway"] - med["direct"]) / med["cached"],
        "tokens_per_s": {k: v for k, v in res.items() if k.startswith("rate_")},
        "rate_ratio_1": med["rate_gateway_1"] / med["rate_direct_1"],
        "rate_ratio_4": med["rate_gateway_4"] / med["rate_direct_4"],
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
