"""``python -m kvsp.vllm descriptor MODEL_DIR --block-tokens N [--dtype bf16] [--name S]``:
the Compatibility Descriptor the connector derives for a model directory,
in its canonical JSON (JCS) form, for the holders' ``descriptors`` lists."""

from __future__ import annotations

import argparse
import pathlib
import sys

from ..errors import KVSPError
from .model import describe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsp.vllm")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("descriptor", help="print a model directory's Compatibility Descriptor (JCS)")
    d.add_argument("model", type=pathlib.Path)
    d.add_argument("--block-tokens", type=int, required=True)
    d.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="the cache's element type")
    d.add_argument("--name", default=None, help="the model's name (default: the directory's)")
    a = p.parse_args(argv)
    try:
        desc = describe(a.model, block_tokens=a.block_tokens, kv_dtype=a.dtype, name=a.name)
    except KVSPError as e:
        print(f"kvsp.vllm: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(desc.jcs().decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
