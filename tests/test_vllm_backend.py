"""The playground on a vLLM server (``VllmBackend``), end to end.

Three groups:

- recorded KV events through the backend's page bookkeeping (no server: a fake answers HTTP, the tracker is fed
  the payloads recorded from the real server, tests/data/vllm/README.md);
- faults: app.py attached to a fake vLLM server (tests/support/fake_vllm.py) that is killed mid-run and started
  again. A fake, because a real vLLM takes about a minute to start on 2 cores, twice per test;
- ``@pytest.mark.vllm``: app.py attached to a real vLLM server, driven by gradio_client. They need
  ``ASTRAI_VLLM_URL`` (``.ci/run`` starts the server in the background and sets it; by hand:
  ``python scripts/serve_vllm.py --wait`` then ``ASTRAI_VLLM_URL=http://127.0.0.1:8011
  ASTRAI_VLLM_KV_EVENTS=ipc:///tmp/astrai-vllm-kv.sock ASTRAI_VLLM_KV_REPLAY=ipc:///tmp/astrai-vllm-kv-replay.sock
  python -m pytest -m vllm``). Without it they are skipped, with that reason.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from astrai.observation import CacheCleared, PageStored
from astrai.playground.backends.vllm.encoding import END_SEQ, AllBlocksCleared, decode_batch, parse_frames
from astrai.playground.backends.vllm.metrics import parse_metrics
from tests.support import fake_vllm
from tests.support.fake_kv import StubSubscriber
from tests.support.needs import NO_CHROMIUM, NO_VLLM
from tests.support.waiting import wait_until
from tools import loadtest
from tools.loadtest import launch_app

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
DATA = ROOT / "tests" / "data" / "vllm"
VLLM_URL = os.environ.get("ASTRAI_VLLM_URL")
WAIT_FOR_SERVER_S = float(os.environ.get("ASTRAI_VLLM_WAIT_S", 420))  # .ci/run may still be installing/starting it


# --- recorded events through the backend (no server) ---------------------------------------------------------


@pytest.fixture
def fake_http():
    """The fake vLLM's HTTP side, in this process (for backends whose events a test feeds by hand)."""
    with fake_vllm.serve() as (url, _):
        yield url


def recorded_batches(name: str):
    for line in (DATA / f"{name}.jsonl").read_text().splitlines():
        parts = [base64.b64decode(p) for p in json.loads(line)["frames_b64"]]
        _, seq, payload = parse_frames(parts)
        if seq != END_SEQ:
            yield seq, decode_batch(payload)


def test_recorded_events_become_pages_events_and_owners(fake_http):
    from astrai.playground.backends.vllm.backend import VllmBackend
    from astrai.playground.backends.vllm.run import _Request

    stub = StubSubscriber()
    backend = VllmBackend(fake_http, subscriber=stub, sample_every_s=3600)  # the test ticks by hand
    try:
        prompts = json.loads((DATA / "prompts.json").read_text())
        text = prompts["shared_prefix"] + prompts["suffixes"][0]
        ids = tuple(backend._tokenizer(text)["input_ids"])
        backend._requests[4242] = _Request(4242, "x", time.monotonic(), prompt_ids=ids, status="finished")
        batches = list(recorded_batches("kv_events_run"))
        clears = [i for i, (_, b) in enumerate(batches) if any(isinstance(e, AllBlocksCleared) for e in b.events)]
        cleared_at = clears[0]
        for seq, batch in batches[:cleared_at]:
            stub.tracker.apply(seq, batch)
        backend._tick()
        blocks = stub.tracker.snapshot().blocks
        pages = [p for p in backend.snapshot().pages if p.state != "free"]
        assert len(pages) == len(blocks) > 0
        assert len({p.page for p in pages}) == len(pages), "one slot per block"
        assert all(p.ref_count is None and p.lru_rank is None and p.hits is None for p in pages), "never invented"
        stored = [e for e in backend.events(0) if isinstance(e, PageStored)]
        assert len(stored) == len(blocks)
        firsts = [p for p in pages if p.parent_key is None]
        assert firsts and all(p.chain_pos == 0 for p in firsts)
        by_key = {p.key: p for p in pages}
        for p in pages:
            if p.parent_key in by_key:
                assert p.chain_pos == by_key[p.parent_key].chain_pos + 1
        # the blocks of the request's prompt (3 full blocks of the shared prefix) are attributed to it
        owned = sorted(p.chain_pos for p in pages if p.stored_by == 4242)
        assert owned[:3] == [0, 1, 2], owned
        assert all(p.state == "cached" for p in pages), "a finished request holds nothing"
        # the same request running: its blocks are in use by it
        backend._requests[4242].status = "running"
        backend._tick()
        in_use = [p for p in backend.snapshot().pages if p.state == "in_use"]
        assert {p.chain_pos for p in in_use} >= {0, 1, 2} and all(p.requests == (4242,) for p in in_use)
        # a reset on the server: the cache is cleared, slots start over
        last_seq = backend.events(0)[-1].seq
        for seq, batch in batches[cleared_at:]:
            stub.tracker.apply(seq, batch)
        backend._tick()
        after = backend.events(last_seq)
        assert any(isinstance(e, CacheCleared) for e in after)
        assert [e.seq for e in backend.events(0)] == sorted({e.seq for e in backend.events(0)}), "monotonic seq"
        live = [p for p in backend.snapshot().pages if p.state != "free"]
        assert len(live) == len(stub.tracker.snapshot().blocks)
        stats = backend.stats()
        assert stats.cached_pages is not None and stats.readmitted_hit_tokens is None
        assert backend.history(0), "samples were recorded"
    finally:
        backend.shutdown()


def test_views_and_charts_say_n_a_for_what_vllm_does_not_report(fake_http):
    from astrai.playground.backends.vllm.backend import VllmBackend
    from astrai.playground.views import charts, replay, tree
    from astrai.playground.views import pages as page_rules
    from astrai.playground.views import series as chart_series
    from astrai.playground.views import text as views

    stub = StubSubscriber()
    with_events = VllmBackend(fake_http, subscriber=stub, sample_every_s=3600)
    without = VllmBackend(fake_http, sample_every_s=3600)
    try:
        for seq, batch in list(recorded_batches("kv_events_run"))[:6]:
            stub.tracker.apply(seq, batch)
        with_events._tick()
        line = views.stats_line(without.stats(), without.derived)
        assert "n/a (vLLM does not report it) cached" in line and "vLLM at " + fake_http in without.label
        line = views.stats_line(with_events.stats(), with_events.derived)
        assert "cached (derived)" in line and "free (derived)" in line
        for backend in (with_events, without):
            stats, history, snapshot = backend.stats(), backend.history(0), backend.snapshot()
            series = chart_series.series(history, stats, time.time())
            for chart in (charts.occupancy_chart, charts.lru_chart, charts.hit_rate_chart):
                chart(series)
            pages = page_rules.page_views(snapshot.pages, {}, "me", set(), backend.decode)
            figure = charts.page_map(pages, str)
            hover = json.dumps(figure.to_plotly_json()["data"][0]["text"])
            if backend is with_events:
                assert "ref count n/a" in hover and "order n/a: the backend does not report it (vLLM: its LRU" in hover
            charts.prefix_tree(tree.prefix_tree(snapshot.pages, [], {}, "me", backend.decode), str)
            recording = replay.Recording(snapshot, tuple(history), (), closed=True, eviction=stats.eviction)
            frames = len(recording.frames)
            replay.replay_series(recording, frames)
            replayed = replay.pages_at(recording, len(history))
            assert all(p.lru_rank is None for p in replayed), "vLLM publishes no LRU order: replay must not invent one"
            assert any(p.state == "cached" for p in replayed) or backend is without
            assert "n/a" in replay.narrate(recording, frames) or not history
    finally:
        with_events.shutdown()
        without.shutdown()


def test_bad_input_is_refused_before_anything_is_sent(fake_http):
    from astrai.playground.backends.vllm.backend import VllmBackend
    from astrai.sampling import SamplingParams

    backend = VllmBackend(fake_http, sample_every_s=3600)
    try:
        with pytest.raises(ValueError, match="empty prompt"):
            backend.submit(["ok", ""], SamplingParams(max_tokens=4), None)
        with pytest.raises(ValueError, match="max_model_len"):
            backend.submit(["word " * 1100], SamplingParams(max_tokens=4), None)
        with pytest.raises(ValueError, match="does not serve"):
            VllmBackend(fake_http, model_name="another-model")
        assert backend.request_info([1, 2, 3]) == []
    finally:
        backend.shutdown()


# --- faults: a fake server killed mid-run and started again ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fake(port: int, delay: float = 0.05) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.fake_vllm", "--port", str(port), "--delay", str(delay)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert wait_until(lambda: _health(f"http://127.0.0.1:{port}"), timeout=20, interval=0.1), "fake did not start"
    return proc


def _health(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def badges_of(client, n: int) -> list[str]:
    """The badges of the client's last run: /after_run (which a browser chains after /run) carries them."""
    return list(client.predict(api_name="/after_run")[:n])


def stats_line(client) -> str:
    outputs = client.predict(api_name="/refresh")
    return next(o for o in outputs if isinstance(o, str) and ("pages ×" in o or "unreachable" in o))


def test_a_server_killed_mid_run_fails_each_panel_clearly_and_the_app_recovers():
    from gradio_client import Client

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fake = start_fake(port)
    try:
        ARTIFACTS.mkdir(exist_ok=True)
        with launch_app(log_path=ARTIFACTS / "app-fake-vllm.log", args=["--vllm-url", url]) as app_url:
            client = Client(app_url, verbose=False)
            assert "vLLM at " + url in stats_line(client), "the stats line names the backend"
            panels = ["One day, he found a", "One day, his cat", "One day, a big storm", "The dog ran to"]
            job = client.submit(**loadtest.run_args(panels, 200), api_name="/run")
            assert wait_until(lambda: bool(job.outputs()) and all(job.outputs()[-1][:4]), timeout=30)
            fake.send_signal(signal.SIGKILL)
            fake.wait(timeout=10)
            started = time.monotonic()
            final = job.result(timeout=30)
            assert time.monotonic() - started < 20, "a dead server must not hang the run"
            for badge in badges_of(client, 4):
                assert "failed:" in badge and url in badge and "broke mid-stream" in badge, badge
            assert all(final[i] for i in range(4)), "what streamed before the kill stays"
            assert wait_until(lambda: "backend unreachable" in stats_line(client), timeout=10, interval=0.3)
            # still serving: a run while the server is down ends at once, each panel saying why
            started = time.monotonic()
            client.predict(**loadtest.run_args(panels[:2], 8), api_name="/run")
            assert time.monotonic() - started < 15
            badges = badges_of(client, 2)
            assert all("failed:" in b and "cannot reach" in b for b in badges), badges
            # the server comes back: no app restart needed
            fake = start_fake(port)
            assert wait_until(lambda: "backend unreachable" not in stats_line(client), timeout=15, interval=0.3)
            back = client.predict(**loadtest.run_args(panels[:2], 8), api_name="/run")
            assert all(back[:2]) and not any("failed" in b for b in badges_of(client, 2)), back
    finally:
        if fake.poll() is None:
            fake.kill()
            fake.wait(timeout=10)


def test_stop_closes_every_stream_so_the_server_aborts_them():
    """Stop, against a server slow enough to still be streaming (the real one finishes 256 tokens of the embedded
    model faster than a click arrives): every stream is closed at once, so the server aborts each request."""
    from gradio_client import Client

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fake = start_fake(port, delay=0.05)  # 200 tokens: 10 s per stream
    try:
        with launch_app(log_path=ARTIFACTS / "app-fake-vllm-stop.log", args=["--vllm-url", url]) as app_url:
            client = Client(app_url, verbose=False)
            panels = ["One day, he found a", "One day, his cat", "One day, a big storm", "The dog ran to"]
            job = client.submit(**loadtest.run_args(panels, 200), api_name="/run")
            assert wait_until(lambda: bool(job.outputs()) and all(job.outputs()[-1][:4]), timeout=30)
            job.cancel()

            def counts() -> dict:
                return httpx.get(url + "/fake/stats", timeout=2).json()

            assert wait_until(lambda: counts()["aborted"] == 4 and counts()["active"] == 0, timeout=5), counts()
            assert counts()["finished"] == 0
            stats = client.predict(api_name="/cache_stats")
            assert stats["cancelled"] == 4 and stats["finished"] == 0, stats
            # a scenario that would need a pool of its own says the server's is used (and nothing is built)
            outputs = client.predict("Eviction pressure (small pool)", api_name="/load_scenario")
            assert any(isinstance(o, str) and "uses the server's pool as it is" in o for o in outputs), outputs
            assert client.predict(api_name="/cache_stats")["n_pages"] == stats["n_pages"]
    finally:
        fake.kill()
        fake.wait(timeout=10)


def test_app_refuses_a_server_it_cannot_reach_with_a_clear_message():
    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, str(ROOT / "app.py"), "--vllm-url", url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode != 0
    assert "cannot attach to vLLM" in result.stderr and url in result.stderr, result.stderr[-2000:]
    # one line, no traceback and no noise from half-built clients at exit
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_the_openai_client_takes_the_stream_timeout():
    """The locked openai is built on httpx2, which refuses httpx's Timeout: a fresh install crashed at start, for any
    --vllm-url, while CI's older httpx2 let it through."""
    from astrai.playground.backends.vllm.backend import VllmBackend

    client = VllmBackend._openai("http://127.0.0.1:1")
    try:
        assert (client.timeout.connect, client.timeout.read) == (3.0, 60.0)
    finally:
        client.close()


# --- a real vLLM server --------------------------------------------------------------------------------------

# Long enough that each prompt fills at least two 32-token blocks: only full blocks are cached and hit.
PREFIX = (
    "Once upon a time, in a small village by the sea, there lived a kind old fisherman named Tom. Every morning "
    "he took his little boat out on the blue water, and every evening he came home with a basket of fish for "
    "his friends. The children of the village loved Tom, because he told them long stories about the big whales, "
    "the singing birds and the funny crabs that lived near the rocks. "
)  # 93-95 tokens with each panel's prompt: two full blocks of the prefix, shared by every panel
PANELS = ["One day, he found a", "One day, his cat", "One day, a big storm", "The dog ran to"]


@pytest.fixture(scope="module")
def vllm_url():
    if not VLLM_URL:
        pytest.skip(NO_VLLM)
    url = VLLM_URL.rstrip("/")
    launch_log = os.environ.get("ASTRAI_VLLM_LAUNCH_LOG")  # .ci/run: the background launcher's log

    def ready() -> bool:
        if launch_log and Path(launch_log + ".failed").exists():
            tail = Path(launch_log).read_text(errors="replace")[-3000:]
            pytest.fail(f"scripts/serve_vllm.py failed to start the server; {launch_log} ends with:\n{tail}")
        return _health(url)

    started = time.monotonic()
    assert wait_until(ready, timeout=WAIT_FOR_SERVER_S, interval=1.0), (
        f"the vLLM server at {url} did not answer /health within {WAIT_FOR_SERVER_S:.0f} s"
    )
    print(f"vLLM /health answered after waiting {time.monotonic() - started:.1f} s")
    return url


@pytest.fixture(scope="module")
def vllm_app(vllm_url):
    ARTIFACTS.mkdir(exist_ok=True)
    args = ["--vllm-url", vllm_url]
    for flag, name in (("--kv-events", "ASTRAI_VLLM_KV_EVENTS"), ("--kv-replay", "ASTRAI_VLLM_KV_REPLAY")):
        if os.environ.get(name):
            args += [flag, os.environ[name]]
    with launch_app(log_path=ARTIFACTS / "app-vllm.log", args=args) as url:
        yield url


@pytest.fixture(scope="module")
def vclient(vllm_app):
    from gradio_client import Client

    return Client(vllm_app, verbose=False)


def server_metrics(url: str):
    return parse_metrics(httpx.get(url + "/metrics", timeout=5).text)


def aborted(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort"
    )


def cached_in(badge: str) -> int:
    match = re.search(r"\*\*(\d+)\*\* cached", badge)
    assert match, badge
    return int(match.group(1))


def run_args(panels: list[str], max_tokens: int) -> dict:
    # isolate: this client's own prefix-cache namespace (cache_salt), so earlier runs on the server do not count
    return loadtest.run_args(panels, max_tokens, PREFIX) | {"cache_namespace": "mine"}


@pytest.mark.vllm
def test_vllm_four_panels_stream_and_equal_the_local_engine(vclient):
    from astrai import InferenceEngine
    from astrai.playground.backends.profiles import EMBEDDED_MODEL

    job = vclient.submit(**run_args(PANELS, 24), api_name="/run")
    updates = list(job)
    assert len(updates) > 2, "the run should stream several updates"
    final = updates[-1]
    for earlier in updates:
        assert all(final[i].startswith(earlier[i]) for i in range(4)), "streamed text only grows"
    assert all(final[i] for i in range(4)), "every panel streamed"
    with InferenceEngine.from_pretrained(EMBEDDED_MODEL, page_size=16, n_pages=256, compile=False) as engine:
        expected = engine.generate([PREFIX + p for p in PANELS], max_tokens=24)
    assert list(final[:4]) == expected, "greedy text equals the local engine's"


def settled_stats(client, quiet_s: float = 1.0, timeout_s: float = 20.0) -> dict:
    """The app's cache stats once the prefix-cache counters have stopped moving for ``quiet_s``.

    The vLLM backend samples ``/metrics`` every 0.25 s, and the server counts a request's prefix-cache query a
    moment after its stream ends, so stats read right after a run can predate it (a CI run read the same counters
    before and after a run, and divided by zero)."""
    latest = client.predict(api_name="/cache_stats")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = client.predict(api_name="/cache_stats")
        if (again["query_tokens"], again["hit_tokens"]) == (latest["query_tokens"], latest["hit_tokens"]):
            return again
        latest = again
    raise AssertionError(f"the prefix-cache counters were still moving after {timeout_s:.0f} s: {latest}")


@pytest.mark.vllm
def test_vllm_second_run_hits_the_cache_on_every_panel_and_the_hit_rate_rises(vclient):
    vclient.predict(**run_args(PANELS, 8), api_name="/run")  # (again) the first run in this namespace
    before = settled_stats(vclient)
    vclient.predict(**run_args(PANELS, 8), api_name="/run")
    after = settled_stats(vclient)
    cached = [cached_in(b) for b in badges_of(vclient, 4)]
    assert min(cached) >= 64, cached  # at least the two full blocks of the shared prefix
    window = (after["hit_tokens"] - before["hit_tokens"]) / (after["query_tokens"] - before["query_tokens"])
    assert window > 0.5 and after["hit_rate"] > before["hit_rate"], (before, after)


@pytest.mark.vllm
def test_vllm_page_map_holds_the_stored_blocks(vclient, vllm_url):
    if not os.environ.get("ASTRAI_VLLM_KV_EVENTS"):
        pytest.skip("ASTRAI_VLLM_KV_EVENTS is not set: no KV events, no page map")
    vclient.predict(**run_args(PANELS, 8), api_name="/run")

    latest: dict = {}

    def hovers() -> list[str]:
        figure = vclient.predict(api_name="/refresh")[0]  # the page map, unless nothing moved since the last call
        if isinstance(figure, dict) and figure.get("plot"):
            latest["figure"] = json.loads(figure["plot"])
        elif isinstance(figure, str) and figure:
            latest["figure"] = json.loads(figure)
        if "figure" not in latest:
            return []
        return [cell for row in latest["figure"]["data"][0]["text"] for cell in row if cell]

    from transformers import AutoTokenizer

    from astrai.playground.backends.profiles import EMBEDDED_MODEL
    from astrai.playground.views.text import readable

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    prompts = [tokenizer(PREFIX + p)["input_ids"] for p in PANELS]
    # the full blocks of the prompts, as chains (the same salt: the prefix's blocks are shared by all panels)
    chains = {tuple(ids[: 32 * (k + 1)]) for ids in prompts for k in range(len(ids) // 32)}
    shown_as = readable(tokenizer.decode, set(tokenizer.all_special_ids))  # as every view writes tokens
    texts = {shown_as(ids[32 * k : 32 * (k + 1)]) for ids in prompts for k in range(len(ids) // 32)}

    def mine() -> list[str]:  # pages whose text this session may see: the blocks its requests hold
        return [h for h in hovers() if "tokens: " in h and "hidden" not in h]

    assert wait_until(lambda: len(mine()) >= len(chains), timeout=10, interval=0.5), (len(mine()), len(chains))
    shown = " ".join(mine())
    for text in texts:
        assert html.escape(text.replace("\n", "⏎")[:40], quote=False) in shown, text[:40]
    held = [h for h in hovers() if re.match(r"<b>page \d+</b>: (cached|in use)", h)]
    assert all("ref count n/a" in h for h in held), "ref counts are not invented"
    stats = vclient.predict(api_name="/cache_stats")
    assert stats["cached_pages"] is not None and stats["stored_pages"] >= len(chains)


@pytest.mark.vllm
def test_vllm_stop_leaves_no_running_request(vclient, vllm_url):
    aborted_before = aborted(vllm_url)
    # greedy, these run to 256 tokens without an end of story (checked on the embedded engine)
    loops = ["and then " * 15, "and then " * 18] * 2
    job = vclient.submit(**run_args(loops, 256) | {"shared_prefix": ""}, api_name="/run")
    assert wait_until(lambda: bool(job.outputs()) and all(job.outputs()[-1][:4]), timeout=60, interval=0.05)
    job.cancel()
    # vLLM generates these 256 tokens faster than a Stop arrives, so an abort (vllm:request_success_total with
    # finished_reason="abort") is seen only sometimes; that the streams are closed at once is checked against a
    # slower fake server in test_stop_closes_every_stream_so_the_server_aborts_them.
    assert wait_until(lambda: server_metrics(vllm_url).running == 0, timeout=5, interval=0.1)
    assert server_metrics(vllm_url).waiting == 0
    print(f"aborted by this Stop: {aborted(vllm_url) - aborted_before:.0f} of 4")


def test_metrics_say_whether_prefix_caching_is_on():
    text = (DATA / "metrics_before.txt").read_text()
    assert parse_metrics(text).prefix_caching is True
    off = text.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    assert parse_metrics(off).prefix_caching is False
    assert parse_metrics("").prefix_caching is None


@pytest.mark.vllm
@pytest.mark.browser
def test_vllm_browser_shared_prefix_scenario_twice(vllm_app):
    """The local backend's browser check, on vLLM: each run of the scenario computes the shared page once and hits
    it three times, and every prompt token's cause is known (a block of the last run, under another salt, is not a
    conflict)."""
    import shutil

    from tools.browser import CHROMIUM, open_playground, run_and_wait

    if not shutil.which(CHROMIUM):
        pytest.skip(NO_CHROMIUM)
    with open_playground(vllm_app, viewport=(1366, 768)) as page:
        page.locator("#scenario input").click()
        page.get_by_role("option", name="Shared system prompt").click()
        page.wait_for_function("document.querySelector('#prompt_3 textarea').value.length > 0", timeout=30000)
        for _ in range(2):  # each run in a namespace of its own: the second one's pages are computed again
            run_and_wait(page, 4)
            badges = "[0,1,2,3].map(i => document.querySelector(`#badge_${i}`).innerText)"
            page.wait_for_function(f"{badges}.every(b => / cached/.test(b))", timeout=30000)
            shown = page.evaluate(badges)
            # whichever request the server schedules first computes the shared full page; the others hit it
            assert sum(bool(re.search(r"\b(3[2-9]|[4-9]\d|\d{3,}) cached", b)) for b in shown) == 3, shown
            assert not any("unknown" in b for b in shown), shown
        page.wait_for_selector("#page_map .js-plotly-plot .heatmaplayer", state="attached", timeout=30000)
        page.wait_for_function("document.querySelector('#stats').innerText.includes('vLLM at')", timeout=10000)
        if os.environ.get("ASTRAI_VLLM_KV_EVENTS"):
            assert "cached (derived)" in page.locator("#stats").inner_text()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "playground-vllm.png"), full_page=True)


@pytest.mark.vllm
@pytest.mark.timeout(1200)  # two server starts, a minute or more each on 2 busy cores
def test_vllm_real_server_killed_mid_run_then_restarted(vllm_url, tmp_path):
    """The fault test on a real server of its own (the shared one stays up for the other tests): SIGKILL to its
    whole process group with the run's requests in flight, then the same launcher starts it again on the same port
    and endpoints.

    The real server streams 256 tokens of the embedded model in about a second, faster than a client sees the text
    and can react, so the test freezes it (SIGSTOP) before the run and kills it while the requests wait on it. The
    fake-server test above covers a death in the middle of streamed text."""
    from gradio_client import Client

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    events, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/kv-replay.sock"
    pid_file = tmp_path / "vllm.pid"
    serve = [
        sys.executable,
        str(ROOT / "scripts" / "serve_vllm.py"),
        "--port",
        str(port),
        "--pid-file",
        str(pid_file),
        "--log",
        str(ARTIFACTS / "vllm-killed.log"),
        "--kv-events",
        events,
        "--kv-replay",
        replay,
    ]
    ARTIFACTS.mkdir(exist_ok=True)
    subprocess.run([*serve, "--wait", "--timeout", "600"], check=True, cwd=ROOT)
    try:
        app_args = ["--vllm-url", url, "--kv-events", events, "--kv-replay", replay]
        with launch_app(log_path=ARTIFACTS / "app-vllm-killed.log", args=app_args) as app_url:
            client = Client(app_url, verbose=False)
            server = int(pid_file.read_text())
            os.killpg(server, signal.SIGSTOP)  # frozen: the run's four requests reach it and wait for an answer
            job = client.submit(**loadtest.run_args(PANELS, 256, PREFIX), api_name="/run")
            time.sleep(3)
            assert not job.done(), "the run must still be waiting on the server when it dies"
            os.killpg(server, signal.SIGKILL)
            started = time.monotonic()
            job.result(timeout=60)
            assert time.monotonic() - started < 30, "a dead server must not hang the run"
            for badge in badges_of(client, 4):
                assert "failed:" in badge and url in badge, badge
            assert wait_until(lambda: "backend unreachable" in stats_line(client), timeout=15, interval=0.3)
            subprocess.run([*serve, "--wait", "--timeout", "600"], check=True, cwd=ROOT)
            assert wait_until(lambda: "backend unreachable" not in stats_line(client), timeout=30, interval=0.5)
            back = client.predict(**loadtest.run_args(PANELS[:2], 8, PREFIX), api_name="/run")
            assert all(back[:2]) and not any("failed" in b for b in badges_of(client, 2)), back
    finally:
        subprocess.run([*serve, "--stop"], check=False, cwd=ROOT)
