"""examples/vllm's deployment (an IS and a holder, two scopes, the engines'
identity from ``kvsp certs --engine vllm``) on free ports, for the
connector's tests and its benchmark: any descriptor, failpoints armed
from the start."""

from __future__ import annotations

import json
import pathlib
import time
from dataclasses import dataclass

from serving import ROOT, SERVER_ID, Proc, certs, free_ports

import kvsp
from kvsp.client import Client


@dataclass
class Deployment:
    dir: pathlib.Path
    base: str
    proc: Proc
    desc: kvsp.Descriptor
    config: pathlib.Path  # the connector's (kvsp-vllm.json)

    @property
    def index(self) -> str:
        return self.base + "is/"

    @property
    def holder(self) -> str:
        return self.base + "h1/"

    def client(self, who: str = "vllm") -> Client:
        d = self.dir
        return Client(
            cert=str(d / f"{who}.pem"), key=str(d / f"{who}.key"), ca=str(d / "ca.pem"), server_identity=SERVER_ID
        )

    def scope(self, name: str = "a") -> kvsp.ScopeKey:
        return kvsp.ScopeKey.from_hex((self.dir / f"scope-{name}.key").read_text())

    def published(self, keys: list[kvsp.BlockKey], scope: str = "a", timeout: float = 30) -> kvsp.LookupResponse:
        """The IS's answer once every key is there (holders publish after the PUT)."""
        c, s = self.client(), self.scope(scope)
        end = time.monotonic() + timeout
        while True:
            r = c.index(self.index).lookup(s.scope_id(), self.desc.compat_id(), keys)
            if r.matched == len(keys):
                return r
            if time.monotonic() > end:
                raise AssertionError(f"{len(keys) - r.matched} of {len(keys)} blocks never reached the IS")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.stop()


def start(d: pathlib.Path, desc: kvsp.Descriptor, failpoints: str = "") -> Deployment:
    port, metrics = free_ports(2)
    conf = (ROOT / "examples" / "vllm" / "kvsp.yaml").read_text()
    (d / "kvsp.yaml").write_text(conf.replace("8447", str(port)).replace("9093", str(metrics)))
    (d / "descriptor.json").write_bytes(desc.jcs())
    certs(d / "kvsp.yaml", "--engine", "vllm")
    cc = json.loads((ROOT / "examples" / "vllm" / "kvsp-vllm.json").read_text().replace("8447", str(port)))
    (d / "kvsp-vllm.json").write_text(json.dumps(cc))
    proc = Proc(d / "kvsp.yaml", port, {"KVSP_FAILPOINTS": failpoints} if failpoints else {}).start()
    return Deployment(d, f"https://127.0.0.1:{port}/", proc, desc, d / "kvsp-vllm.json")


def synthetic(layers: int, kv_heads: int, head_dim: int, block_tokens: int, kv_dtype: str) -> kvsp.Descriptor:
    """A descriptor of a model nobody runs: the geometry is what matters."""
    d = kvsp.Descriptor(
        model=f"synthetic-{layers}x{kv_heads}x{head_dim}",
        model_digest="sha-256:" + "11" * 32,
        tokenizer_digest="sha-256:" + "22" * 32,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        positional="rope",
        block_tokens=block_tokens,
        layout="kvsp-layout-1",
    )
    d.validate()
    return d
