"""The vLLM connector's load path against the Python client's verified GET
of the same blocks into a discarded buffer, same transport (HTTP/1.1 over
TLS, one connection), same run, alternating rounds:

- client: ``Holder.get_block`` of each block, every layer checked against
  the record's digest and the container against Repr-Digest, the layers
  dropped;
- connector: what the connector does for a request whose prefix is cached
  (kvsp.vllm.transfer): the lookup at the IS, a lease, the same verified
  GETs, each layer scattered into vLLM's CPU page layout (HND, bf16);
- layer-wise: the same through ``load_layerwise`` (a connection per block,
  a layer from each in turn).

Blocks of 2 MiB (16 layers x 8 KV heads x 128 x 32 tokens, bf16) on a
``kvsp serve`` started here (examples/vllm). Prints GB/s, the ratio to the
client's and this process's CPU-seconds per GB. Runs in .cache/vllm-venv
(torch):

    PYTHONPATH=python/src KVSP_BIN=bin/kvsp .cache/vllm-venv/bin/python \
        python/bench/vllm_load_bench.py --blocks 48 --rounds 3
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests_vllm"), str(HERE.parent / "tests")]

import deployment  # noqa: E402
import torch  # noqa: E402

import kvsp  # noqa: E402
from kvsp.client import BlockRef  # noqa: E402
from kvsp.vllm.transfer import Counters, LoadBlock, LoadJob, SaveBlock, Transfers  # noqa: E402

LAYERS, HEADS, HD, BT = 16, 8, 128, 32


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    desc = deployment.synthetic(LAYERS, HEADS, HD, BT, "bf16")
    g = kvsp.Geometry.of(desc)
    size = 2 * LAYERS * g.raw_section_len()
    n = a.blocks
    with tempfile.TemporaryDirectory() as tmp:
        dep = deployment.start(pathlib.Path(tmp), desc)
        try:
            src = [torch.randn(n, HEADS, BT, 2 * HD).to(torch.bfloat16) for _ in range(LAYERS)]
            scope = dep.scope()
            keys = kvsp.block_keys(scope, desc.compat_id(), BT, list(range(n * BT)))
            sid = bytes(scope.scope_id())
            saves = [SaveBlock("r", sid, bytes(k), j, 0) for j, k in enumerate(keys)]
            x = Transfers(dep.client(), dep.holder, g, 60_000, 30.0, Counters())
            x.attach(src, BT)
            x.put(desc.compat_id(), saves, [x.gather(layer, saves) for layer in range(LAYERS)])
            dep.published(keys)
            client = dep.client()
            dst = [torch.zeros(n, HEADS, BT, 2 * HD, dtype=torch.bfloat16) for _ in range(LAYERS)]
            y = Transfers(client, dep.holder, g, 60_000, 30.0, Counters())
            y.attach(dst, BT)

            def lookup() -> LoadJob:
                r = client.index(dep.index).lookup(scope.scope_id(), desc.compat_id(), keys)
                assert r.matched == n
                blocks = [
                    LoadBlock(bytes(k), j, 0, reps[0].holder, reps[0].layer_digests)
                    for j, (k, reps) in enumerate(zip(keys, r.replicas, strict=True))
                ]
                return LoadJob("r", sid, blocks, False)

            records = lookup().blocks

            def plain() -> None:
                h = client.holder(dep.holder)
                for b in records:
                    ref = BlockRef(desc.compat_id(), kvsp.ScopeID(sid), kvsp.BlockKey(b.key))
                    with h.get_block(ref, g, layer_digests=b.layer_digests) as s:
                        for _ in s:
                            pass

            def connector() -> None:
                assert y.load(desc.compat_id(), lookup()) == set()

            def layerwise() -> None:
                assert y.load_layerwise(desc.compat_id(), [lookup()]) == set()

            runs: dict[str, list[tuple[float, float]]] = {"client": [], "connector": [], "layer-wise": []}
            for r in range(a.rounds):
                for name, f in (("client", plain), ("connector", connector), ("layer-wise", layerwise)):
                    for t in dst:
                        t.zero_()
                    t0, c0 = time.perf_counter(), time.process_time()
                    f()
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    runs[name].append((wall, cpu))
                    gb = n * size / 1e9
                    print(f"round {r + 1} {name:10s} {gb / wall:.3f} GB/s  {cpu / gb:.2f} CPU-s/GB", flush=True)
                assert all(torch.equal(s, d) for s, d in zip(src, dst, strict=True))
            gb = n * size / 1e9
            base = [gb / w for w, _ in runs["client"]]
            print(f"{n} blocks of {size / 2**20:.1f} MiB, {a.rounds} rounds (medians):")
            for name, rs in runs.items():
                rates = [gb / w for w, _ in rs]
                ratios = [r / b for r, b in zip(rates, base, strict=True)]
                print(
                    f"  {name:10s} {statistics.median(rates):.3f} GB/s, {statistics.median(ratios):.2f} of the client's"
                    f" (per round {', '.join(f'{x:.2f}' for x in ratios)}),"
                    f" {statistics.median(c for _, c in rs) / gb:.2f} CPU-s/GB"
                )
        finally:
            dep.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
