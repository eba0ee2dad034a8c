"""The explainer over a vLLM server's recorded KV events, through the playground's own tracker and pages.

A server publishes no request events and no salts: its explanations are judged as of a moment the caller gives
(``looked_up_after``: here, the events of the first round), and "another namespace" cannot be told
(``namespaces_known`` False). tests/data/vllm/README.md says how the events were recorded (phase evict: a pool of
20 blocks of 32 tokens; round 1 the six distinct stories, round 2 stories 2-5 again).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

from astrai.explain import Cause, KeyHistory, explain
from astrai.observation import RequestInfo
from astrai.playground.backends.vllm.encoding import END_SEQ, KVEventBatch, decode_batch, parse_frames
from astrai.playground.backends.vllm.pages import BlockPages
from astrai.playground.backends.vllm.tracker import BlockTracker

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "vllm"
BLOCK = 32


def recorded_batches(name: str) -> Iterator[tuple[int, KVEventBatch]]:
    """The recorded event batches as the subscriber decodes them: (seq, batch)."""
    for line in (DATA / f"{name}.jsonl").read_text().splitlines():
        _, seq, payload = parse_frames([base64.b64decode(part) for part in json.loads(line)["frames_b64"]])
        if seq != END_SEQ:
            yield seq, decode_batch(payload)


def test_recorded_vllm_evictions_explain_every_prompt_token_once():
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets" / "models" / "tinystories-llama")
    stories = [
        tuple(tokenizer(text)["input_ids"]) for text in json.loads((DATA / "prompts.json").read_text())["distinct"]
    ]
    usage = [
        row["chunk"]["usage"]
        for row in map(json.loads, (DATA / "completion_streams_evict.jsonl").read_text().splitlines())
        if row["round"] == 2 and row["chunk"].get("usage")
    ]
    first = [
        SimpleNamespace(id=1 + i, status="finished", prompt_ids=ids, output_ids=[]) for i, ids in enumerate(stories)
    ]
    second = [
        SimpleNamespace(id=7 + i, status="finished", prompt_ids=ids, output_ids=[]) for i, ids in enumerate(stories[2:])
    ]
    assert [len(r.prompt_ids) for r in second] == [u["prompt_tokens"] for u in usage], "the server's tokens"

    tracker, pages, history = BlockTracker(), BlockPages(), KeyHistory()
    clock = {"seq": 0, "step": 0}

    def tick() -> None:  # as the backend's sampler does: diff the tracker's blocks, stamp the events
        clock["step"] += 1
        _, factories = pages.update(tracker.snapshot(), [*first, *second], float(clock["step"]))
        events = []
        for factory in factories:
            clock["seq"] += 1
            events.append(factory(clock["seq"], clock["step"]))
        history.feed(events)

    batches = list(recorded_batches("kv_events_evict"))
    round_two = next(i for i in range(1, len(batches)) if batches[i][1].ts - batches[i - 1][1].ts > 1.0)
    looked_up_after: dict[int, int] = {}
    for i, (seq, batch) in enumerate(batches):
        if i == round_two:
            looked_up_after = {r.id: history.last_seq for r in second}
        tracker.apply(seq, batch)
        tick()
    infos = [
        RequestInfo(
            r.id,
            "finished",
            len(r.prompt_ids),
            u["prompt_tokens_details"]["cached_tokens"],
            0,
            0,
            r.prompt_ids,
            (),
            None,
            None,
            None,
        )
        for r, u in zip(second, usage, strict=True)
    ]
    explanations = explain(history, infos, page_size=BLOCK, looked_up_after=looked_up_after)
    for x, info in zip(explanations, infos, strict=True):
        assert sum(x.counts.values()) == x.prompt_tokens == info.prompt_tokens
        assert x.counts[Cause.CACHED] == info.cached_tokens
        assert not x.namespaces_known, "a server's events carry no salt"
    # story 2's only block went in round 1, to make room (vLLM does not say for whom); the others were served by
    # the blocks their own round-1 requests stored
    evicted = explanations[0].segments[0]
    assert (evicted.start, evicted.end, evicted.cause) == (0, BLOCK, Cause.EVICTED)
    assert evicted.page.request == 3 and evicted.page.ended_step is not None and evicted.page.evicted_for is None
    for x in explanations[1:]:
        cached = x.segments[0]
        assert (cached.start, cached.end, cached.cause) == (0, BLOCK, Cause.CACHED)
        assert cached.page.request == x.request - len(second)
    for x in explanations:
        assert [s.cause for s in x.segments[1:]] == [Cause.PARTIAL_PAGE, Cause.LAST_TOKEN]


def test_a_request_is_judged_by_the_blocks_the_subscriber_holds_when_it_is_sent():
    """Defect (the fleet's "another replica" check on a real fleet): a request sent right after a run ended was
    judged as of the last sample, taken before that run's blocks reached the events (they are in the subscriber at
    once, in a sample only at the next tick), so the pages it could have hit read as new. Sending records them."""
    from astrai.playground.backends.vllm.backend import VllmBackend
    from tests.support import fake_vllm
    from tests.support.fake_kv import StubSubscriber

    with fake_vllm.serve() as (url, _):
        stub = StubSubscriber()
        backend = VllmBackend(url, subscriber=stub, sample_every_s=3600)  # no tick but the first, at the start
        try:
            assert backend.events(0) == []
            for seq, batch in list(recorded_batches("kv_events_evict"))[:2]:  # a run's blocks reach the subscriber
                stub.tracker.apply(seq, batch)
            backend._keys.sent([1])  # the moment submit() stamps
            stored = backend.events(0)
            assert stored, "the blocks held when it was sent are recorded then"
            assert backend._keys._sent_after[1] == stored[-1].seq, "and it is judged after them"
        finally:
            backend.shutdown()
