"""Tenancy through timing (make test-slow): a key of scope B sending scope
A's cached system prompt gets no hit in what it is told (cached_tokens 0)
nor in how long it waits. Ten paired samples on SmolLM2: B's time to the
first token on A's prompt is within the noise of B's on a fresh prompt of
the same words in another order (the same length), while A's own repeat is
at least 5x faster, so the probe would see a hit if there were one."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator

import openai
import pytest
from gateways import MODEL, Gateway, serving

pytestmark = pytest.mark.slow

SAMPLES = 10
WORDS = (  # noqa: SIM905 (a text is easier to read than a column)
    "river mountain window garden library engine harbor lantern meadow orchard pencil silver "
    "thunder valley whisper castle bridge candle desert forest island jacket kitchen ladder "
    "marble needle ocean pillow rabbit saddle tunnel violin wagon yellow anchor basket "
    "cotton dragon feather glacier hammer insect jungle kettle lemon mirror nickel oyster "
    "pepper quartz"
).split()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with serving(tmp_path_factory.mktemp("openai-tenancy")) as g:
        yield g


def ttft(c: openai.OpenAI, system: str) -> tuple[float, int, int]:
    """Seconds to the first streamed token of a one-token greedy answer,
    with the prompt's tokens and cached_tokens."""
    start = time.perf_counter()
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Say one word."}],
        temperature=0,
        max_tokens=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, prompt, cached = 0.0, 0, -1
    for chunk in stream:
        if not first and any(ch.delta.content for ch in chunk.choices):
            first = time.perf_counter() - start
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
    assert first > 0 and cached >= 0
    return first, prompt, cached


def test_another_scope_sees_no_hit_in_timing(gateway: Gateway) -> None:
    a, b = gateway.client(), gateway.client(gateway.keys["tenant-b"])
    rng = random.Random(49)
    on_a: list[float] = []
    fresh: list[float] = []
    repeat: list[float] = []
    for i in range(SAMPLES):
        words = [rng.choice(WORDS) for _ in range(280)]
        mine = " ".join(words)
        rng.shuffle(words)
        other = " ".join(words)
        _, n, cached = ttft(a, mine)  # A computes it: cached in scope A
        assert n >= 256 and cached == 0, (n, cached)
        # B's two requests in alternating order, so a drift in the machine
        # falls on both alike.
        order = [(mine, on_a), (other, fresh)]
        for prompt, into in order if i % 2 == 0 else reversed(order):
            t, m, cached = ttft(b, prompt)
            assert cached == 0 and abs(m - n) <= 8, (m, n, cached)
            into.append(t)
        t, _, cached = ttft(a, mine)
        assert cached >= (n // 16 - 1) * 16, (n, cached)
        repeat.append(t)
    diffs = [x - y for x, y in zip(on_a, fresh, strict=True)]
    q = statistics.quantiles(fresh, n=4)
    noise = max(q[2] - q[0], 0.15 * statistics.median(fresh))
    report = (
        f"TTFT medians over {SAMPLES} pairs: B on A's prompt {statistics.median(on_a):.3f} s, "
        f"B fresh {statistics.median(fresh):.3f} s (noise {noise:.3f} s), "
        f"median paired difference {statistics.median(diffs):+.3f} s; A's repeat {statistics.median(repeat):.3f} s"
    )
    print(report)
    assert abs(statistics.median(diffs)) <= noise, report
    assert statistics.median(fresh) >= 5 * statistics.median(repeat), report
