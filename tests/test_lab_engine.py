"""The lab's default capacity is an engine's pool: requests run one at a time through ``InferenceEngine(n_pages=C)``
(the embedded model) and through the replay at capacity C get the same hit, request by request, under every online
policy, at pool sizes small enough to evict a request's own chain and to refuse a long prompt."""

from __future__ import annotations

import random

import pytest

from astrai import InferenceEngine
from astrai.checkpoints import load_checkpoint
from astrai.eviction import POLICIES
from astrai.lab.replay import Replay
from astrai.lab.trace import Trace, TraceRequest
from astrai.playground.backends.profiles import EMBEDDED_MODEL

PAGE = 4  # tokens a page, and a block
POOLS = (3, 5, 8)  # pages: 3 refuses prompts of 12 tokens or more


@pytest.fixture(scope="module")
def embedded():
    return load_checkpoint(EMBEDDED_MODEL)


def prompts(seed: int, count: int = 18) -> list[list[int]]:
    """Prompts that mostly continue a prefix of an earlier one (cut anywhere, even mid-page) with new tokens, some
    fresh, from 2 to about 40 tokens: chains that share, diverge and come back, and a few too long for a small pool."""
    rng = random.Random(seed)
    fresh = iter(range(300, 10_000))
    made: list[list[int]] = []
    for _ in range(count):
        head = rng.choice(made)[: rng.randrange(0, 28)] if made and rng.random() < 0.75 else []
        made.append(head + [next(fresh) for _ in range(rng.randrange(1 if head else 2, 14))])
    return made


def as_trace(prompts: list[list[int]]) -> Trace:
    """The prompts as a trace of ``PAGE``-token blocks: a full block's id names its whole prefix, a partial last
    block gets an id of its own."""
    ids: dict[tuple[int, ...], int] = {}
    requests = []
    for i, prompt in enumerate(prompts):
        full = [ids.setdefault(tuple(prompt[: (j + 1) * PAGE]), len(ids)) for j in range(len(prompt) // PAGE)]
        partial = [100_000 + i] if len(prompt) % PAGE else []
        requests.append(TraceRequest(i, len(prompt), 1, (*full, *partial)))
    return Trace(tuple(requests), PAGE)


def engine_hits(model, tokenizer, prompts: list[list[int]], pages: int, policy: str) -> list[int | None]:
    """Each prompt's cached tokens on a fresh engine with ``pages`` pages, one request at a time, one token each
    (so nothing generated is cached); None where the engine refuses the prompt."""
    hits: list[int | None] = []
    longest = max(len(p) for p in prompts)
    with InferenceEngine(
        model, tokenizer, page_size=PAGE, n_pages=pages, eviction=policy, compile=False, max_batched_tokens=longest
    ) as engine:
        for prompt in prompts:
            try:
                stream = engine.generate_ids([prompt], max_tokens=1, stream=True)
            except ValueError:  # "needs ... tokens of KV but the whole pool holds ..."
                hits.append(None)
                continue
            for _ in stream:
                pass
            (info,) = engine.request_info(stream.request_ids)
            hits.append(info.cached_tokens)
    return hits


def test_a_replay_at_capacity_c_serves_each_request_what_an_engine_with_c_pages_serves(embedded):
    model, tokenizer = embedded
    sequence = prompts(seed=1)
    replay = Replay(as_trace(sequence))
    evicted = False
    for pages in POOLS:
        for policy in POLICIES:
            served = engine_hits(model, tokenizer, sequence, pages, policy)
            refused = [i for i, hit in enumerate(served) if hit is None]
            assert list(replay.refused(pages)) == refused, (pages, policy)
            expected = [hit or 0 for hit in served]
            assert replay.request_hits(policy, pages) == expected, (pages, policy)
            result = replay.run(policy, pages)
            assert (result.hit_tokens, result.refused) == (sum(expected), len(refused))
            evicted |= result.evictions > 0 and pages > 3
    assert evicted, "the sequence must make the smaller pools evict"
    assert replay.refused(3), "the sequence must hold a prompt that a 3-page pool refuses"
