"""The playground end to end: app.py served on loopback, driven by gradio_client and by headless Chromium."""

from __future__ import annotations

import functools
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from astrai import InferenceEngine
from astrai.playground.backends.profiles import EMBEDDED_LABEL, EMBEDDED_MODEL
from tests.support.needs import NO_CHROMIUM
from tests.support.waiting import wait_until
from tools import loadtest
from tools.browser import CHROMIUM, open_playground, open_visitors, run_and_wait
from tools.idle_cost import visibility_js
from tools.loadtest import launch_app

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
PREFIX = "Once upon a time, in a small village by the sea, there lived a kind old fisherman named Tom. "
PANELS = ["One day, he found a", "One day, his cat", "One day, a big storm"]


@pytest.fixture(scope="module")
def server_url():
    ARTIFACTS.mkdir(exist_ok=True)
    with launch_app(log_path=ARTIFACTS / "app.log") as url:
        yield url


@pytest.fixture(scope="module")
def client(server_url):
    from gradio_client import Client

    return Client(server_url, verbose=False)


def run_args(panels: list[str], max_tokens: int) -> dict:
    return loadtest.run_args(panels, max_tokens, PREFIX)


def test_run_streams_every_panel_and_equals_the_engine(client):
    job = client.submit(**run_args(PANELS, 24), api_name="/run")
    updates = list(job)
    assert len(updates) > 2, "the run should stream several updates"
    final = updates[-1]
    assert len(final) == 6, "the stream carries the six text boxes only (each output costs every frame)"
    for earlier in updates:
        assert all(final[i].startswith(earlier[i]) for i in range(len(PANELS))), "streamed text only grows"
    with InferenceEngine.from_pretrained(EMBEDDED_MODEL, page_size=16, n_pages=256) as engine:
        expected = engine.generate([PREFIX + p for p in PANELS], max_tokens=24)
    assert list(final[: len(PANELS)]) == expected
    assert all(final[i] == "" for i in range(len(PANELS), 6))
    badges = client.predict(api_name="/after_run")[: len(PANELS)]  # the badges come after the text (as in a browser)
    cached = [int(re.search(r"\*\*(\d+)\*\* cached", b).group(1)) for b in badges]
    assert cached[0] == 0 and min(cached[1:]) > 0, badges  # panels after the first share the prefix pages


def test_only_five_components_ever_carry_a_loading_status(server_url):
    """Gradio's front end refreshes, at every status message of every event (each streamed message among them),
    the loading status of every component that any event has shown progress on, cloning its props: with the
    defaults (progress on all outputs) up to 56 components a message, and the streamed text lagged."""
    import urllib.request

    config = json.load(urllib.request.urlopen(server_url + "config", timeout=10))
    elem = {c["id"]: c["props"].get("elem_id") for c in config["components"]}
    targets = set()
    for dependency in config["dependencies"]:
        if dependency["targets"]:  # gr.api endpoints have no trigger on the page
            shown = dependency["show_progress_on"]
            targets |= set(dependency["outputs"] if shown is None else shown)
    assert {elem[t] for t in targets} == {"out_0", "scenario_note", "engine_status", "sizing_note", "ladder_note"}


def test_stop_cancels_and_releases_pages(client):
    """Stop cancels the requests still running and frees every page they held. Sampled at temperature 2 (seeded)
    so most continuations run to max_tokens: greedy ones end by EOS after 100-150 tokens, and on a loaded machine
    the cancel can land after that. A request that ended first is counted as finished, never as cancelled."""
    before = client.predict(api_name="/cache_stats")
    job = client.submit(**run_args(PANELS, 256) | {"temperature": 2.0, "seed": 0}, api_name="/run")

    def streaming() -> bool:
        outputs = job.outputs()
        return bool(outputs) and any(outputs[-1][: len(PANELS)])

    assert wait_until(streaming, timeout=30)
    assert client.predict(api_name="/cache_stats")["used_pages"] > 0
    job.cancel()

    def delta(stats: dict, key: str) -> int:
        return stats[key] - before[key]

    def settled() -> bool:
        stats = client.predict(api_name="/cache_stats")
        return stats["used_pages"] == 0 and delta(stats, "cancelled") + delta(stats, "finished") == len(PANELS)

    assert wait_until(settled, timeout=10, interval=0.2)
    assert delta(client.predict(api_name="/cache_stats"), "cancelled") >= 1, "Stop cancelled what was still running"


def test_bad_input_gets_a_clear_message(client):
    from gradio_client.exceptions import AppError

    args = run_args(["", "x"], 8) | {"shared_prefix": ""}
    with pytest.raises(AppError, match="Panel 1 has an empty prompt"):
        client.predict(**args, api_name="/run")
    assert client.predict(api_name="/cache_stats")["used_pages"] == 0


@pytest.fixture
def page(server_url) -> Iterator:
    if not shutil.which(CHROMIUM):
        pytest.skip(NO_CHROMIUM)
    with open_playground(server_url) as pg:
        yield pg


@pytest.mark.browser
def test_browser_shared_prefix_scenario(page):
    page.locator("#scenario input").click()
    page.get_by_role("option", name="Shared system prompt").click()
    page.wait_for_function("document.querySelector('#prompt_3 textarea').value.length > 0", timeout=30000)
    page.click("#run_btn")
    page.wait_for_function(
        "[0,1,2,3].every(i => document.querySelector(`#out_${i} textarea`).value.length > 10)", timeout=60000
    )
    page.wait_for_selector("#plot_0 .js-plotly-plot", timeout=30000)
    page.wait_for_selector("#page_map .js-plotly-plot .heatmaplayer", state="attached", timeout=30000)
    page.wait_for_function("/[1-9]\\d* cached/.test(document.querySelector('#badge_1').innerText)", timeout=30000)
    badge = page.locator("#badge_1").inner_text()
    assert int(re.search(r"(\d+) cached", badge).group(1)) > 0
    page.locator("#tokens_accordion").get_by_text("Prompt tokens").click()
    # the accordion renders its contents when it opens: the box may not exist yet at the first poll
    page.wait_for_function("document.querySelector('#tokens_1')?.innerText.includes('cached')", timeout=10000)
    page.click("#stop_btn")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)


@pytest.mark.browser
def test_browser_a_run_clears_the_last_runs_badges_then_fills_in_its_own(page):
    """The stream carries the text alone: a click clears the badges, and ``after_run`` fills them in."""
    page.locator("#n_panels input[type=number]").fill("1")
    page.locator("#n_panels input[type=number]").press("Enter")
    page.wait_for_selector("#prompt_1", state="hidden", timeout=10000)
    page.locator("#prompt_0 textarea").fill("and then " * 15)  # greedy, this runs to 256 tokens
    page.get_by_text("Sampling").first.click()
    page.locator("#max_tokens input[type=number]").fill("256")
    page.locator("#max_tokens input[type=number]").press("Enter")
    ttft = "/TTFT/.test(document.querySelector('#badge_0').innerText)"
    run_and_wait(page, 1)  # ended: a click while it streams would start no run (Gradio's trigger_mode "once")
    page.wait_for_function(ttft, timeout=60000)
    page.click("#run_btn")
    page.wait_for_function(f"!{ttft}", timeout=10000)  # not the last run's figures while this one streams
    page.wait_for_function(ttft, timeout=60000)
    assert page.locator("#out_0 textarea").input_value(), "the text streamed"


HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script><b>bold</b> Once upon a time'


@pytest.mark.browser
def test_browser_shows_html_in_prompts_as_text_and_caps_length(page):
    page.locator("#n_panels input[type=number]").fill("2")
    page.locator("#n_panels input[type=number]").press("Enter")
    page.wait_for_selector("#prompt_2", state="hidden", timeout=10000)
    page.locator("#prompt_0 textarea").fill(HOSTILE)
    page.locator("#prompt_1 textarea").fill("x" * 5000)
    assert len(page.locator("#prompt_1 textarea").input_value()) <= 2000  # the box caps oversized text
    page.click("#run_btn")  # 2,000 x's are still 2,001 tokens: too long for the model, said in a toast
    page.get_by_text("over max_seq_len").first.wait_for(timeout=30000)
    page.locator("#prompt_1 textarea").fill("The dog ran")
    page.click("#run_btn")
    page.wait_for_function("document.querySelector('#out_0 textarea').value.length > 5", timeout=60000)
    page.wait_for_function("document.querySelector('#requests').innerText.includes('<img')", timeout=30000)
    page.locator("#tokens_accordion").get_by_text("Prompt tokens").click()
    page.wait_for_function("document.querySelector('#prefix_tree').innerText.includes('<img')", timeout=30000)
    page.wait_for_timeout(1500)  # give any injected handler a chance to run
    assert page.evaluate("window.__pwned") is None
    for view in ("#requests", "#tokens_0", "#prefix_tree", "#page_map"):
        assert page.locator(f"{view} img").count() == 0, view
    assert "<script>" in page.locator("#tokens_0").inner_text().replace(" ", "").replace("\n", "")


def test_too_many_panels_is_refused(client):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="maximum value 6|between 1 and 6 panels"):
        client.predict(**run_args(PANELS, 8) | {"n_panels": 50}, api_name="/run")


def test_another_session_never_sees_my_text_and_isolation_works(server_url):
    from gradio_client import Client

    alice, bob = Client(server_url, verbose=False), Client(server_url, verbose=False)
    secret = "Zanzibar the purple elephant sang a long song about the moon and the stars to her friend"
    alice.predict(**run_args([secret], 8) | {"shared_prefix": ""}, api_name="/run")
    assert "Zanzibar" in json.dumps(alice.predict(api_name="/refresh")), "control: Alice sees her own pages"
    assert "Zanzibar" not in json.dumps(bob.predict(api_name="/refresh"))

    def bob_cached(isolate: bool) -> int:
        args = run_args([secret], 4) | {"shared_prefix": "", "cache_namespace": "mine" if isolate else "shared"}
        bob.predict(**args, api_name="/run")
        badge = bob.predict(api_name="/after_run")[0]
        return int(re.search(r"\*\*(\d+)\*\* cached", badge).group(1))

    assert bob_cached(isolate=True) == 0  # his salted namespace cannot see Alice's pages
    assert bob_cached(isolate=False) > 0  # the shared namespace hits them (without showing her text)


def test_the_privacy_rule_holds_on_a_scenarios_engine_too(server_url):
    """Visitors on the small-pool engine share it, and its page map still hides the other one's text."""
    from gradio_client import Client

    alice, bob = Client(server_url, verbose=False), Client(server_url, verbose=False)
    for visitor in (alice, bob):
        visitor.predict("Eviction pressure (small pool)", api_name="/load_scenario")
    secret = "Zebedee the orange giraffe counted twenty clouds over the quiet town"
    alice.predict(**run_args([secret], 4) | {"shared_prefix": ""}, api_name="/run")
    assert alice.predict(api_name="/cache_stats")["n_pages"] == 40, "control: Alice ran on the small pool"
    assert "Zebedee" in json.dumps(alice.predict(api_name="/refresh")), "control: Alice sees her own pages"
    seen_by_bob = json.dumps(bob.predict(api_name="/refresh"))
    assert "40 pages" in seen_by_bob and "Zebedee" not in seen_by_bob


def test_no_api_call_changes_what_the_default_profile_serves(server_url):
    """Every endpoint that picks settings, a scenario or a model acts on the caller's own profile: a visitor who
    never touched them still gets the default engine (it was rebuilt for everybody before profiles)."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    mallory, alice = Client(server_url, verbose=False), Client(server_url, verbose=False)
    default = {k: alice.predict(api_name="/cache_stats")[k] for k in ("n_pages", "page_size", "prefix_caching")}
    assert default == {"n_pages": 2048, "page_size": 16, "prefix_caching": True}
    with pytest.raises(AppError, match="not in the list of choices|not offered"):  # hub models are off by default
        mallory.predict("Qwen3-0.6B (hub)", 16, 256, 8, True, "float32", api_name="/apply_settings")
    outputs = mallory.predict(EMBEDDED_LABEL, 8, 64, 2, False, "float32", api_name="/apply_settings")
    status = next(o for o in outputs if isinstance(o, str) and "engine" in o)
    assert "your own settings" in status and "64 pages × 8 tokens" in status
    mallory.predict("Eviction pressure (small pool)", api_name="/load_scenario")
    assert mallory.predict(api_name="/cache_stats")["n_pages"] == 40, "control: the caller did move"
    for name in ("/clear_cache", "/after_run"):
        mallory.predict(api_name=name)
    after = {k: alice.predict(api_name="/cache_stats")[k] for k in default}
    assert after == default
    outputs = alice.predict(**run_args(PANELS[:1], 4), api_name="/run")
    assert outputs[0], "the default engine still answers"


def states_in(figure_json: str) -> dict[int, str]:
    """page -> state, read from a page map's hover texts ("<b>page 3</b>: in use ...")."""
    heatmap = json.loads(figure_json["plot"] if isinstance(figure_json, dict) else figure_json)["data"][0]
    found = {}
    for row in heatmap["text"]:
        for cell in row:
            match = re.match(r"<b>page (\d+)</b>: (just evicted|in use|cached|free)", cell or "")
            if match:
                found[int(match.group(1))] = match.group(2).replace(" ", "_")
    return found


def test_replay_shows_the_recorded_pool_at_each_step(server_url):
    from gradio_client import Client

    client = Client(server_url, verbose=False)
    final = client.predict(**run_args(PANELS, 20), api_name="/run")
    client.predict(api_name="/after_run")  # the browser chains it after a run: the slider now spans the run
    recorded = [client.predict(k, api_name="/page_map_at") for k in (0, 1, 5)]
    assert recorded[0] and recorded[1] != recorded[0], "the first step of the run changed the pool"
    for k, pool in zip((0, 1, 5), recorded, strict=True):
        outputs = client.predict(k, api_name="/show_step")
        shown = states_in(outputs[2])
        expected = {p["page"]: p["state"] for p in pool}
        assert shown == {page: expected[page] for page in shown}, k
        texts = list(outputs[7 : 7 + len(PANELS)])
        assert all(final[i].startswith(texts[i]) for i in range(len(PANELS))), "each panel's text up to that step"
        assert (k == 0) == (texts == [""] * len(PANELS))


@pytest.fixture
def laptop(server_url):
    if not shutil.which(CHROMIUM):
        pytest.skip(NO_CHROMIUM)
    with open_playground(server_url, viewport=(1366, 768)) as pg:
        yield pg


def figure(page, elem_id: str) -> dict:
    return page.evaluate(
        f"(() => {{ const p = document.querySelector('#{elem_id} .js-plotly-plot');"
        " return p && {data: p.data, title: p.layout.title.text}; })()"
    )


def in_view(page, selector: str) -> bool:
    box = page.locator(selector).bounding_box()
    return box is not None and box["y"] >= 0 and box["y"] + box["height"] <= 768 and box["x"] + box["width"] <= 1366


@pytest.mark.browser
def test_browser_laptop_screen_shows_panels_and_cache_together_then_replay_tree_and_savings(laptop):
    page = laptop
    pick = page.locator("#scenario input")
    pick.click()
    page.get_by_role("option", name="Shared system prompt").click()
    page.wait_for_function("document.querySelector('#prompt_3 textarea').value.length > 0", timeout=30000)
    page.click("#clear_btn")
    page.click("#run_btn")
    page.wait_for_function(
        "[0,1,2,3].every(i => document.querySelector(`#out_${i} textarea`).value.length > 10)", timeout=60000
    )
    page.wait_for_selector("#page_map .js-plotly-plot", timeout=10000)
    for view in ("#run_btn", "#out_0", "#out_3", "#page_map .js-plotly-plot", "#plot_0 .js-plotly-plot"):
        # polled: CI once read a box in view and, a moment later, one that was not, while the charts redrew
        in_view_now = functools.partial(in_view, page, view)
        assert wait_until(in_view_now, timeout=5, interval=0.1), (
            f"{view} is not on the 1366x768 screen without scrolling: {page.locator(view).bounding_box()}"
        )
    page.wait_for_function(
        "(document.querySelector('#requests').innerText.match(/finished/g) || []).length >= 4", timeout=60000
    )
    # issue 43: the cause chips above each prompt's tokens were clipped in half under the box's label
    page.locator("#tokens_accordion").get_by_text("Prompt tokens").click()
    page.wait_for_selector("#tokens_0 .causes span", timeout=10000)
    label = page.locator("#tokens_0 [data-testid=block-label]").bounding_box()
    chip = page.locator("#tokens_0 .causes span").first.bounding_box()
    assert label is not None and chip is not None and chip["y"] >= label["y"] + label["height"] - 1, (label, chip)
    # the tree of this run: a node per page of it (a small tree is not collapsed) and one for all others, counting as
    # many cached pages as the stats line once the cache settles (the tree is redrawn in turns with the other
    # charts, so the two may differ for a second or two; one drawn before the run has no "your last run's")
    page.wait_for_function(
        """(() => {
          const p = document.querySelector('#prefix_tree .js-plotly-plot');
          const tree = p && /Prefix tree: (\\d+) pages [(]0 in use.*your last run's/.exec(p.layout.title.text);
          const stats = /(\\d+)\\** cached/.exec(document.querySelector('#stats').innerText);
          return tree && stats && +tree[1] > 0 && tree[1] === stats[1];
        })()""",
        timeout=30000,
    )
    tree = figure(page, "prefix_tree")
    focused = re.search(r"(\d+) of them your last run's, (\d+) gathered as others", tree["title"])
    assert focused, tree["title"]
    mine, others = int(focused.group(1)), int(focused.group(2))
    assert mine > 0 and len(tree["data"][0]["ids"]) - 1 == mine + (others > 0)  # minus the root; others in one node
    # replay: step back from the end, and the page map and texts go back with it
    final = page.locator("#out_0 textarea").input_value()
    page.click("#replay_back")
    page.wait_for_function("document.querySelector('#replay_note').innerText.includes('Replay')", timeout=10000)
    for _ in range(5):
        page.click("#replay_back")
    page.wait_for_timeout(1500)
    title = figure(page, "page_map")["title"]
    assert "after step" in title
    earlier = page.locator("#out_0 textarea").input_value()
    assert final.startswith(earlier) and len(earlier) < len(final)
    # what caching saved: both bars, fewer prefill tokens with caching on
    page.click("#compare_btn")
    page.wait_for_function(
        "(() => { const p = document.querySelector('#savings .js-plotly-plot');"
        " return p && p.data.filter(t => t.name === 'caching off').length === 1; })()",
        timeout=60000,
    )
    bars = {t["name"]: t["y"][0] for t in figure(page, "savings")["data"]}  # one chart: prefill tokens computed
    assert bars["caching on"] < bars["caching off"], bars
    assert "prefill tokens were computed" in page.locator("#savings_note").inner_text()


@pytest.mark.browser
def test_browser_lesson_steps_load_their_scenario_and_point_at_a_view(laptop):
    from astrai.playground.scenarios import SCENARIO_BY_NAME, Lesson

    page, lesson = laptop, Lesson.for_deployment(routers=0)
    for number, step in enumerate(lesson.steps, start=1):
        if number > 1:  # the page opens on the first step
            page.click("#lesson_next")
        page.wait_for_function(
            f"document.querySelector('#scenario_note').innerText.includes('Lesson {number}/{lesson.length}')",
            timeout=60000,
        )
        first_prompt = SCENARIO_BY_NAME[step.scenario].prompts[0]
        page.wait_for_function(
            f"document.querySelector('#prompt_0 textarea').value === {json.dumps(first_prompt)}", timeout=30000
        )
        # the view may be absent for a moment while the step's updates re-render it: wait for it, outlined
        page.wait_for_function(f"document.getElementById('{step.look_at}')?.style.outline.includes('solid')")


@pytest.mark.browser
def test_browser_a_fresh_pages_first_run_streams(page):
    """The page opens on the lesson's first step, its prompts filled in: the first click on Run streams (it said
    "Panel 1 has an empty prompt" when the page opened empty)."""
    assert "Lesson 1/" in page.locator("#scenario_note").inner_text()
    page.click("#run_btn")
    page.wait_for_function(
        "[0,1,2,3].every(i => document.querySelector(`#out_${i} textarea`).value.length > 10)", timeout=60000
    )
    page.wait_for_function("/TTFT/.test(document.querySelector('#badge_0').innerText)", timeout=30000)


def stats_text(page) -> str:
    return page.locator("#stats").inner_text()


@pytest.mark.browser
def test_browser_two_visitors_one_scenario_each_neither_disturbs_the_other(server_url):
    """A streams up to 256 tokens a panel on the shared-system-prompt engine; as soon as A's text shows, B picks the
    eviction scenario and runs it twice: A's run ends with every panel finished on an unchanged pool, and B's runs
    really used the small pool. (On the code before engines by profile, B's pick rebuilt the one engine: A's run was
    cut short and A's pool shrank to 40 pages.)"""
    if not shutil.which(CHROMIUM):
        pytest.skip(NO_CHROMIUM)
    with open_visitors(server_url, 2, viewport=(1366, 768)) as (a, b):
        a.get_by_text("Sampling").first.click()
        a.locator("#max_tokens input[type=number]").fill("256")
        a.locator("#max_tokens input[type=number]").press("Enter")
        a.wait_for_function("/2048 pages × 16 tokens/.test(document.querySelector('#stats').innerText)", timeout=30000)
        a.click("#run_btn")
        a.wait_for_function("document.querySelector('#out_0 textarea').value.length > 10", timeout=60000)
        b.locator("#scenario input").click()
        b.get_by_role("option", name="Eviction pressure (small pool)").click()
        b.wait_for_function("/40 pages × 16 tokens/.test(document.querySelector('#stats').innerText)", timeout=60000)
        for _ in range(2):  # the second run finds the LRU full of the first one's pages
            run_and_wait(b, 6, timeout_ms=120000)
        b.wait_for_function("/[1-9]\\d* evictions/.test(document.querySelector('#stats').innerText)", timeout=30000)
        assert "small pool" in stats_text(b)
        a.wait_for_function(
            "(document.querySelector('#requests').innerText.match(/finished/g) || []).length >= 4", timeout=180000
        )
        table = a.locator("#requests").inner_text()
        assert "cancelled" not in table and "failed" not in table, table
        assert "2048 pages × 16 tokens, batch 128" in stats_text(a), "A's engine is the one A started on"
        assert re.search(r"\b0 evictions", stats_text(a)), stats_text(a)
        assert all(a.locator(f"#out_{i} textarea").input_value() for i in range(4))


@pytest.mark.browser
def test_browser_a_hidden_tab_sends_no_ticks_and_starts_again_when_shown(page, client):
    """A tab the browser hides sends no tick (Gradio 6.31's Timer ticks only while ``document.visibilityState`` is
    "visible": the live view relies on it, ``callbacks/live.py``): while another visitor's run changes the page's
    engine, which wakes a waiting tick, a hidden tab asks for nothing more; shown again, it ticks within seconds."""
    page.wait_for_function("document.querySelector('#stats').innerText.length > 0", timeout=30000)
    page.wait_for_timeout(3000)  # the first drawing done, the next tick settled
    page.evaluate(visibility_js(hidden=True))
    page.wait_for_timeout(1000)  # the timer is off once the page has the visibility click's answer
    ticks: list[str] = []
    page.on("request", lambda r: ticks.append(r.url) if re.search("queue/join|run/predict", r.url) else None)
    client.predict(**run_args(PANELS, 16), api_name="/run")  # on the default engine, the page's
    page.wait_for_timeout(4000)  # (the page hears its requests only inside a Playwright call)
    assert ticks == [], f"a hidden tab sent {len(ticks)} ticks"
    page.evaluate(visibility_js(hidden=False))
    page.wait_for_timeout(3000)
    assert ticks, "shown again, the tab ticks again"


def test_the_app_starts_where_localhost_answers_slowly(monkeypatch):
    """Gradio's check that localhost answers (one HEAD, a 3 s timeout) ended the app when the page's first render
    took longer, on 2 busy cores: the app launches without it, with the options app.py passes."""
    import gradio as gr
    from gradio import networking

    from astrai.playground.ui.app import launch_options

    monkeypatch.setattr(networking, "url_ok", lambda url: False)  # as a HEAD that timed out answers
    with gr.Blocks() as demo:
        gr.Markdown("up")
    try:
        demo.launch(**launch_options(), prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
        assert demo.local_url
    finally:
        demo.close()
