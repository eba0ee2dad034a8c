#!/usr/bin/env python3
"""Record real payloads from a local vLLM server into tests/data/vllm/ (see the README there).

Runs in the app's environment (httpx, openai, pyzmq); it starts and stops the servers itself through
scripts/serve_vllm.py, which keeps vLLM in its own venv:

    python scripts/record_vllm_payloads.py            # all phases, about 5 minutes on 2 cores
    python scripts/record_vllm_payloads.py --phase run

Phase "run" (server on port 8011, vLLM's own pool, dev routes on):
  /metrics before any request; three rounds of the same 4 streaming completions sent concurrently, sharing a
  >= 96-token prefix (round 1 cold, round 2 with `vllm_xargs.kv_cache_report_mode = "full"`, round 3 default
  "incremental" mode); /metrics after; POST /reset_prefix_cache and one short request (AllBlocksCleared is
  published with the next scheduler step); a replay request from seq 0; then 8 long generations while /metrics
  is scraped (a busy moment).
Phase "evict" (server on port 8012, same KV-events endpoint, `--num-gpu-blocks-override 20`):
  6 distinct prompts at once (more than the pool holds: requests wait and are preempted, /metrics is scraped
  meanwhile), then 4 of them again with "full" reports; blocks are evicted (BlockRemoved).

Phase "dp" (server on port 8013, `--data-parallel-size 2`, KV events on tcp://*:5590 and :5591): two rounds of
  the shared-prefix prompts; per-rank /metrics and events.

One SUB socket stays connected to the KV-events endpoint for the whole recording, across the server restart.
The library's KvEventSubscriber runs beside it (joining late, then across the restart) and must end with the same
blocks as the recorded frames replayed offline.
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from astrai.playground.backends.vllm.metrics import parse_metrics  # noqa: E402
from astrai.playground.backends.vllm.subscriber import KvEventSubscriber, replay_frames  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "vllm"
SERVE = REPO / "scripts" / "serve_vllm.py"
MODEL = "tinystories-llama"
KV_ENDPOINT = "ipc:///tmp/astrai-vllm-kv-record.sock"
KV_REPLAY = "ipc:///tmp/astrai-vllm-kv-record-replay.sock"
TOPIC = "kv-events"
DP_EVENTS_PORT = 5590  # rank r publishes on 5590 + r
DP_REPLAY_PORT = 5600

SHARED_PREFIX = (
    "Once upon a time, there was a little girl named Lily. She lived in a small house with her mom, her dad and "
    "her big brown dog, Max. Every morning Lily and Max went to the park to play. They liked to run on the green "
    "grass, look at the birds and jump in the puddles when it rained. One day, Lily found a shiny red ball under "
    "a big tree. She wanted to share it with her friends, so she ran to the swings where Tom and Sue were playing."
)
SUFFIXES = (
    " Tom said,",
    " Sue looked at the ball and",
    " Max barked because",
    " Then the sun went down and",
)
# Two "visitors", two panels each: vLLM puts a request's session_id into the events it causes.
SESSIONS: list[str | None] = ["visitor-a", "visitor-a", "visitor-b", "visitor-b"]
DISTINCT = (
    "A little bird lived in a tall tree near a river. Every day the bird sang a happy song for the fish, the "
    "frogs and the old turtle who slept on a warm rock. One morning the bird saw a boat on the water.",
    "Ben had a red truck that he loved very much. He took it to school, to the shop and to his grandma's house. "
    "One day the wheel of the truck fell off and Ben was very sad. His dad said they could fix it together.",
    "The cat and the mouse were not friends. The cat always chased the mouse around the kitchen, and the mouse "
    "always ran into its little hole. But one cold night the mouse found the cat shivering outside the door.",
    "Anna wanted to bake a cake for her mom's birthday. She got flour, eggs, milk and sugar from the kitchen. "
    "She mixed everything in a big bowl, but then she saw that she had forgotten something very important.",
    "There was a big green frog who could not jump. All the other frogs laughed at him when he tried. So the "
    "frog went to the wise old owl in the forest and asked her how he could learn to jump like his friends.",
    "Sam and his sister Mia built a fort out of blankets and chairs in the living room. They brought books, "
    "toys and snacks inside. When it got dark, they turned on a small lamp and told each other scary stories.",
)


class FrameRecorder(threading.Thread):
    """SUB socket on the KV-events endpoint; keeps every multipart message with its arrival time."""

    def __init__(self, endpoint: str, t0: float) -> None:
        super().__init__(daemon=True, name="kv-frame-recorder")
        self.endpoint = endpoint
        self.t0 = t0
        self.frames: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        self.ready.set()
        try:
            while not self.stopping.is_set():
                if not sub.poll(200):
                    continue
                parts = sub.recv_multipart()
                with self.lock:
                    self.frames.append(frame_record(parts, "pub", time.monotonic() - self.t0))
        finally:
            sub.close()

    def take(self) -> list[dict[str, Any]]:
        with self.lock:
            frames, self.frames = self.frames, []
        return frames


def frame_record(parts: list[bytes], source: str, t: float) -> dict[str, Any]:
    record: dict[str, Any] = {"source": source, "t": round(t, 4), "n_frames": len(parts)}
    record["frames_b64"] = [base64.b64encode(p).decode("ascii") for p in parts]
    if len(parts) >= 2 and len(parts[-2]) == 8:
        record["seq"] = int.from_bytes(parts[-2], "big", signed=True)
    return record


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    print(f"  wrote {path.relative_to(REPO)} ({len(rows)} lines)")


def serve(port: int, *extra: str) -> float:
    cmd = [sys.executable, str(SERVE), "--wait", "--dev-mode", "--port", str(port)]
    cmd += ["--kv-events", KV_ENDPOINT, "--kv-replay", KV_REPLAY, *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"server on port {port} did not start:\n{result.stderr}")
    seconds = float(result.stdout.strip().splitlines()[-1])
    print(f"  server on port {port} ready in {seconds:.1f} s")
    return seconds


def stop(port: int) -> None:
    subprocess.run([sys.executable, str(SERVE), "--stop", "--port", str(port)], check=False)


def get_metrics(base: str) -> str:
    response = httpx.get(f"{base}/metrics", timeout=10)
    response.raise_for_status()
    return response.text


def count_tokens(base: str, text: str) -> int:
    response = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": text}, timeout=10)
    response.raise_for_status()
    return int(response.json()["count"])


def stream_one(
    client: openai.OpenAI,
    prompt: str,
    max_tokens: int,
    xargs: dict[str, Any] | None,
    label: dict[str, Any],
    session_id: str | None = None,
    body: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One streaming completion; returns each chunk as the server sent it (openai parses the SSE)."""
    extra_body: dict[str, Any] = dict(body or {})
    if xargs:
        extra_body["vllm_xargs"] = xargs
    if session_id:
        extra_body["session_id"] = session_id  # vLLM copies it into the request's KV events
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra_body or None,
    )
    rows = []
    t0 = time.monotonic()
    for chunk in stream:
        # to_dict() keeps only the fields the server sent (exclude_unset), i.e. the SSE event's JSON
        rows.append({**label, "t": round(time.monotonic() - t0, 4), "chunk": chunk.to_dict()})
    return rows


def run_round(
    client: openai.OpenAI,
    prompts: list[str],
    max_tokens: int,
    xargs: dict[str, Any] | None,
    label: dict[str, Any],
    sessions: list[str | None] | None = None,
    body: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    sessions = sessions or [None] * len(prompts)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(stream_one, client, p, max_tokens, xargs, {**label, "panel": i, "session_id": sid}, sid, body)
            for i, (p, sid) in enumerate(zip(prompts, sessions, strict=True))
        ]
        rows = [row for f in futures for row in f.result()]
    for i in range(len(prompts)):
        usage = [r["chunk"]["usage"] for r in rows if r["panel"] == i and r["chunk"].get("usage")]
        details = (usage[-1].get("prompt_tokens_details") or {}) if usage else {}
        prompt_tokens = usage[-1]["prompt_tokens"] if usage else "?"
        print(f"    {label} panel {i}: prompt {prompt_tokens}, cached {details.get('cached_tokens')}")
    return rows


def settle(seconds: float = 1.5) -> None:
    """Events are published from a queue after each scheduler step: give the last ones time to arrive."""
    time.sleep(seconds)


class MetricsPoller(threading.Thread):
    """Scrapes /metrics while requests run and keeps the scrape with the most requests running + waiting."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True, name="metrics-poller")
        self.base = base
        self.best: tuple[float, str] | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.02):
            try:
                text = get_metrics(self.base)
            except httpx.HTTPError:
                continue
            metrics = parse_metrics(text)
            busy = (metrics.running or 0) + (metrics.waiting or 0) + (metrics.kv_cache_usage or 0)
            if self.best is None or busy > self.best[0]:
                self.best = (busy, text)


def check_subscriber(name: str, subscriber: KvEventSubscriber, frames: list[dict[str, Any]]) -> None:
    """The live subscriber's view must equal the recorded frames replayed offline."""
    offline = replay_frames([base64.b64decode(x) for x in r["frames_b64"]] for r in frames).snapshot()
    live = subscriber.snapshot()
    same = dict(live.blocks) == dict(offline.blocks) and live.last_seq == offline.last_seq
    print(
        f"  subscriber check ({name}): live {len(live.blocks)} blocks, seq {live.last_seq}, complete {live.complete},"
        f" restarts {live.restarts}, replays {subscriber.status()['replays']}; offline {len(offline.blocks)} blocks,"
        f" seq {offline.last_seq}: {'SAME' if same else 'DIFFERENT'}"
    )
    if not same:
        raise SystemExit(f"live subscriber and recorded frames disagree ({name})")


def replay(endpoint: str, start_seq: int, t0: float) -> list[dict[str, Any]]:
    """vLLM's replay protocol: a DEALER sends (b"", start_seq as 8 bytes big-endian); the ROUTER answers
    (b"", topic, seq, payload) per buffered batch, then (b"", b"", -1 as 8 bytes, b"")."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
    rows = []
    try:
        while dealer.poll(5000):
            parts = dealer.recv_multipart()
            rows.append(frame_record(parts, "replay", time.monotonic() - t0))
            if rows[-1].get("seq") == -1:
                break
    finally:
        dealer.close()
    return rows


def phase_run(recorder: FrameRecorder, late: KvEventSubscriber, t0: float) -> None:
    port = 8011
    base = f"http://127.0.0.1:{port}"
    serve(port)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        settle()
        (OUT / "metrics_before.txt").write_text(get_metrics(base))
        print(f"  shared prefix: {count_tokens(base, SHARED_PREFIX)} tokens")
        prompts = [SHARED_PREFIX + s for s in SUFFIXES]
        streams: list[dict[str, Any]] = []
        streams += run_round(client, prompts, 24, None, {"round": 1, "mode": "incremental"}, SESSIONS)
        settle()
        late.start()  # a subscriber that joins late: it must catch up through the replay endpoint
        full = {"kv_cache_report_mode": "full"}
        streams += run_round(client, prompts, 24, full, {"round": 2, "mode": "full"}, SESSIONS)
        settle()
        streams += run_round(client, prompts, 24, None, {"round": 3, "mode": "incremental"}, SESSIONS)
        settle()
        (OUT / "metrics_after_hits.txt").write_text(get_metrics(base))
        reset = httpx.post(f"{base}/reset_prefix_cache", timeout=10)
        print(f"  POST /reset_prefix_cache -> {reset.status_code} {reset.text}")
        # AllBlocksCleared waits in the scheduler's event queue until the next step: one request publishes it.
        streams += run_round(client, prompts[:1], 8, None, {"round": 4, "mode": "after-reset"})
        settle()
        (OUT / "metrics_after_reset.txt").write_text(get_metrics(base))
        write_jsonl(OUT / "completion_streams.jsonl", streams)
        frames = recorder.take()
        write_jsonl(OUT / "kv_events_run.jsonl", frames)
        check_subscriber("run, joined after round 1", late, frames)
        write_jsonl(OUT / "kv_replay_from_0.jsonl", replay(KV_REPLAY, 0, t0))
        (OUT / "kv_event_sources.json").write_text(httpx.get(f"{base}/kv_event_sources").text + "\n")
        # A busy moment for /metrics (running > 0, pool usage > 0): 8 long generations, scraped meanwhile. Its
        # events are not kept (the late subscriber sees them; phase evict's restart resets it).
        poller = MetricsPoller(base)
        poller.start()
        busy = [*DISTINCT, *prompts[:2]]
        run_round(client, busy, 880, None, {"round": 5, "mode": "busy"}, body={"ignore_eos": True})
        poller.stopping.set()
        poller.join(5)
        if poller.best is not None:
            (OUT / "metrics_during_busy.txt").write_text(poller.best[1])
        settle()
        recorder.take()
    finally:
        stop(port)


def phase_evict(recorder: FrameRecorder, late: KvEventSubscriber, t0: float) -> None:
    port = 8012
    base = f"http://127.0.0.1:{port}"
    serve(port, "--num-gpu-blocks-override", "20", "--max-model-len", "512")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="EMPTY", max_retries=0, timeout=300)
        settle()
        rows = run_round(client, list(DISTINCT), 128, None, {"round": 1, "mode": "incremental"})
        settle()
        full = {"kv_cache_report_mode": "full"}
        rows += run_round(client, list(DISTINCT[2:]), 128, full, {"round": 2, "mode": "full"})
        settle()
        (OUT / "metrics_after_evictions.txt").write_text(get_metrics(base))
        write_jsonl(OUT / "completion_streams_evict.jsonl", rows)
        frames = recorder.take()
        write_jsonl(OUT / "kv_events_evict.jsonl", frames)
        check_subscriber("evict, across the server restart", late, frames)
    finally:
        stop(port)


def phase_dp(t0: float) -> None:
    """Two data-parallel ranks (two engine cores) on CPU: per-rank /metrics (label engine) and per-rank events.

    With data parallelism vLLM offsets each rank's endpoint port by the rank, which works for tcp:// only (an
    ipc:// endpoint raises for rank 1), so this phase uses tcp://*:PORT (bound on all interfaces).
    """
    port = 8013
    base = f"http://127.0.0.1:{port}"
    recorders = [FrameRecorder(f"tcp://127.0.0.1:{DP_EVENTS_PORT + rank}", t0) for rank in range(2)]
    for r in recorders:
        r.start()
        r.ready.wait(5)
    extra = ["--kv-events", f"tcp://*:{DP_EVENTS_PORT}", "--kv-replay", f"tcp://*:{DP_REPLAY_PORT}"]
    serve(port, *extra, "--timeout", "400", "--", "--data-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        settle()
        prompts = [SHARED_PREFIX + s for s in SUFFIXES]
        for round_ in (1, 2):
            run_round(client, prompts, 24, None, {"round": round_, "mode": "incremental"}, SESSIONS)
            settle()
        (OUT / "metrics_dp2.txt").write_text(get_metrics(base))
        (OUT / "kv_event_sources_dp2.json").write_text(httpx.get(f"{base}/kv_event_sources").text + "\n")
        for rank, r in enumerate(recorders):
            write_jsonl(OUT / f"kv_events_dp2_rank{rank}.jsonl", r.take())
    finally:
        stop(port)
        for r in recorders:
            r.stopping.set()
            r.join(2)


def write_prompts() -> None:
    """The texts sent, so tests can match event token ids against the tokenizer."""
    prompts = {
        "shared_prefix": SHARED_PREFIX,
        "suffixes": list(SUFFIXES),
        "sessions": SESSIONS,
        "distinct": list(DISTINCT),
    }
    (OUT / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("all", "run", "evict", "dp"), default="all")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    write_prompts()
    t0 = time.monotonic()
    recorder = FrameRecorder(KV_ENDPOINT, t0)
    recorder.start()
    recorder.ready.wait(5)
    # The library's subscriber, checked against the raw frames: in phase run it joins after round 1 (so it must
    # replay), and it stays connected across the restart into phase evict (seq goes back to 0).
    late = KvEventSubscriber(KV_ENDPOINT, replay_endpoint=KV_REPLAY)
    try:
        if args.phase in ("all", "run"):
            print("phase run")
            phase_run(recorder, late, t0)
        if args.phase in ("all", "evict"):
            print("phase evict")
            recorder.take()  # frames between the phases (none expected) are not part of either file
            if not late.is_alive():
                late.start()
            phase_evict(recorder, late, t0)
    finally:
        late.stop()
        recorder.stopping.set()
        recorder.join(2)
    if args.phase in ("all", "dp"):
        print("phase dp")
        phase_dp(t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
