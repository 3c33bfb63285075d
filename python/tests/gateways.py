"""The OpenAI-compatible gateway for the tests: examples/openai/kvsp.yaml
(the gateway, the IS, the PC, two holders, two llama.cpp instances running
SmolLM2-135M-Instruct) in one `kvsp serve` on free ports, with the
certificates and the API key `kvsp certs` writes, and more principals'
keys minted as an operator would."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from serving import ROOT, Proc, binary, certs, free_ports

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"


@dataclass
class Gateway:
    dir: pathlib.Path
    url: str
    metrics: str
    key: str
    keys: dict[str, str]  # more principals' keys: tenant-b (scope B), limited, revocable
    proc: Proc

    def client(self, key: str | None = None) -> openai.OpenAI:
        ctx = ssl.create_default_context(cafile=str(self.dir / "ca.pem"))
        return openai.OpenAI(
            base_url=self.url,
            api_key=key or self.key,
            http_client=openai.DefaultHttpx2Client(verify=ctx),
            max_retries=0,
            timeout=120,
        )

    def metric(self, name: str, labels: str = "") -> float:
        text = urllib.request.urlopen(self.metrics, timeout=10).read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_gateway(d: pathlib.Path, prefix_cache: bool = True) -> Gateway:
    """examples/openai/kvsp.yaml on free ports in d, with more keys; with
    prefix_cache false the engines reuse no block (every prompt token is
    computed: the answer with no cache)."""
    conf = (ROOT / "examples" / "openai" / "kvsp.yaml").read_text()
    api, roles, metrics = free_ports(3)
    model = os.environ.get("KVSP_SMOLLM2", str(ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not pathlib.Path(model).exists():
        pytest.fail(f"{model} is missing: make deps installs SmolLM2")
    lib = os.environ.get("KVSP_LLAMACPP_LIB", str(ROOT / ".cache" / "llama.cpp"))
    conf = conf.replace("127.0.0.1:8446", f"127.0.0.1:{roles}").replace("127.0.0.1:8445", f"127.0.0.1:{api}")
    conf = conf.replace("127.0.0.1:9092", f"127.0.0.1:{metrics}")
    conf = conf.replace("../../.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", model).replace(
        "../../.cache/llama.cpp", lib
    )
    conf = conf.replace(
        "scopes: [{key_file: scope-a.key}]", "scopes: [{key_file: scope-a.key}, {key_file: scope-b.key}]"
    )
    if not prefix_cache:
        assert conf.count("flash_attention: false}") == 2
        conf = conf.replace("flash_attention: false}", "flash_attention: false, prefix_cache: false}")
    (d / "kvsp.yaml").write_text(conf)
    shutil.copy(ROOT / "examples" / "openai" / "descriptor.json", d / "descriptor.json")
    certs(d / "kvsp.yaml")
    # More keys, minted as an operator would (kvsp keys api), their entries
    # added to the policy.
    kvsp_bin = str(binary())
    scope = {
        n: subprocess.run(
            [kvsp_bin, "keys", "scope", str(d / f"scope-{n}.key")], capture_output=True, text=True, check=True
        ).stdout.strip()
        for n in ("a", "b")
    }
    keys: dict[str, str] = {}
    entries = ""
    for name, sc, extra in (("tenant-b", "b", ""), ("limited", "a", ", max_concurrent: 1"), ("revocable", "a", "")):
        args = [kvsp_bin, "keys", "api", "--principal", name, "--scope", scope[sc], "--out", str(d / f"{name}.key.txt")]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        entries += out.splitlines()[1].rstrip().rstrip("}") + extra + "}\n"
        keys[name] = (d / f"{name}.key.txt").read_text().strip()
    (d / "policy.yaml").write_text((d / "policy.yaml").read_text() + entries)
    proc = Proc(d / "kvsp.yaml", roles).start()
    try:
        key = (d / "api-key.txt").read_text().strip()
        g = Gateway(d, f"https://127.0.0.1:{api}/v1", f"http://127.0.0.1:{metrics}/metrics", key, keys, proc)
        deadline = time.monotonic() + 60
        while True:  # the instances report to the PC
            try:
                g.client().chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
                )
                return g
            except openai.APIStatusError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    except BaseException:
        proc.stop()
        raise


@contextlib.contextmanager
def serving(d: pathlib.Path, prefix_cache: bool = True) -> Iterator[Gateway]:
    """start_gateway in d, stopped when the block ends (a module fixture's body)."""
    g = start_gateway(d, prefix_cache)
    try:
        yield g
    finally:
        g.proc.stop()
