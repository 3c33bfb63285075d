"""Verified block GETs by the Python client against a running holder:
HTTP/1.1, each layer checked against the record's layer digest and the
container against Repr-Digest, as `kvsp bench --transports http1` does
with the Go client; --streams N runs N threads, each on its own
connection (the client's pool), as Go's N streams. Prints GB/s and this
process's CPU-seconds per GB (the holder's CPU is its own process's).

    python bench/get_bench.py --dir DIR --seconds 3 [--streams 8]   # DIR: a kvsp certs directory, kvsp serve running
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import sys
import threading
import time

import kvsp
from kvsp.client import BlockRef, Client


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="the directory kvsp certs wrote (kvsp.yaml, descriptor.json, keys)")
    ap.add_argument("--base", default="https://127.0.0.1:28443/")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--identity", default="spiffe://kvsp.local/node/127.0.0.1")
    ap.add_argument("--streams", type=int, default=1, help="concurrent GETs: threads, a connection each")
    a = ap.parse_args()
    d = pathlib.Path(a.dir)
    desc = kvsp.parse_descriptor((d / "descriptor.json").read_bytes())
    g = kvsp.Geometry.of(desc)
    key = kvsp.ScopeKey.from_hex((d / "scope-a.key").read_text())
    ref = BlockRef(
        desc.compat_id(),
        key.scope_id(),
        kvsp.block_keys(key, desc.compat_id(), desc.block_tokens, list(range(desc.block_tokens)))[0],
    )
    n = g.raw_section_len()
    layers = [(bytes([i % 251]) * n, bytes([(i * 7) % 253]) * n) for i in range(desc.layers)]
    out = io.BytesIO()
    w = kvsp.Writer(out, kvsp.new_header(kvsp.CODEC_RAW, 0, desc.layers, g))
    for k, v in layers:
        w.write_layer(k, v)
    digests = w.close()
    producer = Client(
        cert=str(d / "self.pem"), key=str(d / "self.key"), ca=str(d / "ca.pem"), server_identity=a.identity
    )
    producer.holder(a.base + "h1/").put_block(ref, out.getvalue(), digests.container)
    tool = Client(
        cert=str(d / "client.pem"), key=str(d / "client.key"), ca=str(d / "ca.pem"), server_identity=a.identity
    )
    h = tool.holder(a.base + "h1/")
    counts = [[0, 0] for _ in range(a.streams)]  # octets, GETs per stream
    start = threading.Barrier(a.streams + 1)

    def stream(i: int) -> None:
        start.wait()
        while time.perf_counter() - t0 < a.seconds:
            with h.get_block(ref, g, layer_digests=digests.layers) as s:
                for layer in s:
                    counts[i][0] += len(layer.k) + len(layer.v)
            counts[i][1] += 1

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(a.streams)]
    for t in threads:
        t.start()
    t0, c0 = time.perf_counter(), time.process_time()
    start.wait()
    for t in threads:
        t.join()
    octets, gets = sum(c[0] for c in counts), sum(c[1] for c in counts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    r = {
        "block_octets": len(out.getvalue()),
        "streams": a.streams,
        "gets": gets,
        "octets": octets,
        "seconds": wall,
        "gb_per_s": octets / wall / 1e9,
        "cpu_seconds_per_gb": cpu / (octets / 1e9),
        "python": sys.version.split()[0],
    }
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
