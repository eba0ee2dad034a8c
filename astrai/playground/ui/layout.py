"""The page's layout: components only, no events (each callbacks module wires its own).

Laid out for a 1366×768 laptop screen: the panels on the left and the cache (page map, occupancy) on the right,
so a run and what it does to the cache are in view together, without scrolling. Below them: replay, the other
charts, the prefix tree, what caching saved, the coloured prompt tokens and the settings.

A fresh page opens on the lesson's first step, its prompts filled in: the first click on Run streams.
"""

from __future__ import annotations

import gradio as gr

from astrai.eviction import POLICIES
from astrai.playground.backends.profiles import BATCH_SIZES, DTYPES, PAGE_SIZES, POOL_PAGES, Profile
from astrai.playground.scenarios import NAMESPACES, SCENARIO_BY_NAME, Lesson
from astrai.playground.ui.components import (
    MAX_PANELS,
    CacheViews,
    Components,
    EngineForm,
    LadderViews,
    Panels,
    ReplayControls,
    RunButtons,
    RunForm,
    Setup,
    SizingViews,
)
from astrai.playground.views import ladder, sizing, text

EVICTION_NAMES = {
    "lru": "LRU: least recently used",
    "fifo": "FIFO: first cached, first out",
    "lfu": "LFU: fewest hits served",
    "arc": "ARC: recency and frequency, adaptive",
}
MAX_PROMPT_CHARS = 2000
MAX_NEW_TOKENS = 256
REFRESH_SECONDS = 1.0
REPLAY_TICK_SECONDS = 0.2
CAPTIONS = {
    "page_map": "Every page: your panel's colour when in use (x = shared), blue when cached (darker = more recently "
    "used), grey when free or another visitor's; red marks an eviction. Hover a page for its refs, owners, tokens "
    "and hits served.",
    "occupancy": "Pages in use by running requests, cached (kept after their requests ended, evictable), and free, "
    "after each engine step.",
    "lru": "Cached pages wait in the LRU; it shrinks when a hit takes a page back or an eviction reuses one.",
    "hit_rate": text.HIT_RATE_CAPTION,
    "tree": "Every cached page under the page its key chains from: prompts share a branch as long as they share "
    "full pages. Text is shown for your own pages only.",
    "routing": "Press **Compare routing** to send the tenants' waves through each router, each pass on a cold cache.",
    "sizing": "Each workload's requests replayed one at a time through this engine's own page pool, without a model, "
    "under each eviction policy and pool size (pages of one block each, as an engine's n_pages: pages in use "
    "count too): a hit is the longest cached run of leading blocks, the last prompt "
    "token is always computed. Belady's MIN evicts the block needed furthest in the future: no online policy can "
    "do better. *Your requests* replays the ones you ran here (at your engine's page size).",
}
INTRO = (
    "**AstrAI playground: watch a KV cache reuse work.** Prompts run as **one batch** through a paged KV cache; "
    "prompts that start alike reuse its pages."
)
# The lesson's bar stays at the top of the window, so a step's note and its buttons are in view beside whatever view
# the step scrolls to (``callbacks/setup.py``'s ``highlight_js`` scrolls it just below the bar). Gradio's container
# hides its overflow, which makes it the bar's scrolling box; "clip" clips the same without being one.
PAGE_CSS = """
.gradio-container { overflow: clip !important; }
#lesson_bar { position: sticky; top: 0; z-index: 1000; background: var(--body-background-fill);
  padding: 6px 0 2px; gap: 6px; border-bottom: 1px solid var(--border-color-primary); }
#lesson_bar #scenario_note p { margin: 0; }
#lesson_buttons button { white-space: nowrap; min-width: max-content; }
#cache_namespace label { padding: 2px 8px; }
#cache_namespace .wrap { gap: 4px; }
"""


def build_layout(default: Profile, model_choices: list[str], chooses_pools: bool, lesson: Lesson) -> Components:
    """Every component, inside the caller's ``gr.Blocks``. ``lesson``: the scenarios and steps this deployment
    offers (a fleet behind two routers adds routing, and its button and chart)."""
    first = SCENARIO_BY_NAME[lesson.steps[0].scenario]
    routing = any(s.look_at == "routing" for s in lesson.steps)
    routing_button = gr.Button("Compare routing", variant="primary", elem_id="route_btn", render=False)
    gr.Markdown(INTRO)
    with gr.Column(elem_id="lesson_bar"):  # pinned to the top of the window (PAGE_CSS): the step's note, its buttons
        with gr.Row(equal_height=True, elem_id="lesson_buttons"):
            lesson_prev = gr.Button("◀ Lesson", elem_id="lesson_prev", size="md", scale=0, interactive=False)
            lesson_next = gr.Button("Lesson ▶", elem_id="lesson_next", size="md", scale=0)
            buttons = RunButtons(
                run=gr.Button("Run", variant="primary", elem_id="run_btn", size="md", scale=1),
                stop=gr.Button("Stop", variant="stop", elem_id="stop_btn", size="md", scale=0),
                follow_up=gr.Button("Follow-up turn", elem_id="follow_btn", size="md", scale=0),
                compare=gr.Button("Compare with caching off", elem_id="compare_btn", size="md", scale=0),
                clear=gr.Button("Clear cache", elem_id="clear_btn", size="md", scale=0),
                routing=routing_button,
            )
            restart = gr.Button("Restart lesson", elem_id="lesson_restart", size="md", scale=0, visible=False)
        note = gr.Markdown(lesson.note(0), elem_id="scenario_note")
    lesson_end = gr.Markdown(elem_id=lesson.end.look_at, visible=False)  # the lesson's end: the visitor's runs
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=640):
            with gr.Row(equal_height=False):
                with gr.Column(scale=3):
                    scenario = gr.Dropdown(
                        [s.name for s in lesson.scenarios], value=first.name, label="Scenario", elem_id="scenario"
                    )
                    shared_prefix = gr.Textbox(
                        first.prefix,
                        label="Shared prefix (a system prompt before every panel's prompt)",
                        lines=1,
                        max_lines=2,
                        max_length=MAX_PROMPT_CHARS,
                        elem_id="prefix",
                    )
                with gr.Column(scale=2):
                    namespace = gr.Radio(
                        [(words, name) for name, words in NAMESPACES.items()],
                        value=first.namespace,
                        label="Cached pages a run may hit",
                        elem_id="cache_namespace",
                    )
                    n_panels = gr.Slider(
                        1, MAX_PANELS, value=len(first.prompts), step=1, label="Panels", elem_id="n_panels"
                    )
            panels = _panels(first.prompts)
        with gr.Column(scale=2, min_width=420):
            page_map = gr.Plot(elem_id="page_map", show_label=False)
            occupancy = gr.Plot(elem_id="plot_0", show_label=False)
            stats = gr.Markdown(elem_id="stats")
    replay = _replay_controls()
    highlights = _highlights(len(first.prompts))  # the run's prompt tokens, near its panels
    with gr.Row(equal_height=False):
        with gr.Column():
            lru = gr.Plot(elem_id="plot_1", show_label=False)
            gr.Markdown(f"<small>{CAPTIONS['lru']}</small>")
        with gr.Column():
            hit_rate = gr.Plot(elem_id="plot_2", show_label=False)
            gr.Markdown(f"<small>{CAPTIONS['hit_rate']}</small>")
    ladder_views = _ladder()  # beside the hit rate: why it is not higher
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            prefix_tree = gr.Plot(elem_id="prefix_tree", show_label=False)
            gr.Markdown(f"<small>{CAPTIONS['tree']}</small>")
        with gr.Column(scale=2):
            savings = gr.Plot(elem_id="savings", show_label=False)
            savings_note = gr.Markdown(elem_id="savings_note")
    with gr.Row(equal_height=False, visible=routing, elem_id="routing"):
        with gr.Column(scale=3):
            routing_plot = gr.Plot(elem_id="routing_chart", show_label=False)
        with gr.Column(scale=2):
            routing_button.render()  # beside the chart it fills (the lesson step scrolls here)
            routing_note = gr.Markdown(CAPTIONS["routing"], elem_id="routing_note")
    gr.Markdown(f"<small>{CAPTIONS['page_map']} {CAPTIONS['occupancy']}</small>")
    sizing_views = _sizing()
    with gr.Accordion("Sampling and options", open=False), gr.Row():
        max_tokens = gr.Slider(
            1, MAX_NEW_TOKENS, value=first.max_tokens, step=1, label="Max tokens", elem_id="max_tokens"
        )
        temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)")
        top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="Top-p")
        top_k = gr.Slider(0, 200, value=0, step=1, label="Top-k (0 = off)")
        seed = gr.Number(0, precision=0, label="Seed", minimum=0)
        live_charts = gr.Checkbox(True, label="Live charts (refresh every second)", elem_id="live_charts")
    table = gr.DataFrame(headers=text.TABLE_COLUMNS, label="Your requests", interactive=False, elem_id="requests")
    engine = _engine_form(default, model_choices, chooses_pools)
    return Components(
        panels=Panels(panels.columns, panels.prompts, panels.outputs, panels.badges, highlights),
        form=RunForm(n_panels, shared_prefix, max_tokens, temperature, top_p, top_k, seed, namespace),
        buttons=buttons,
        cache=CacheViews(
            page_map=page_map,
            occupancy=occupancy,
            lru=lru,
            hit_rate=hit_rate,
            prefix_tree=prefix_tree,
            stats=stats,
            table=table,
            savings=savings,
            savings_note=savings_note,
            routing=routing_plot,
            routing_note=routing_note,
            live_charts=live_charts,
            cursor=gr.State(None),
            timer=gr.Timer(REFRESH_SECONDS),
        ),
        replay=replay,
        setup=Setup(scenario, note, lesson_prev, lesson_next, restart, lesson_end, gr.State(0), engine),
        sizing=sizing_views,
        ladder=ladder_views,
    )


def _sizing() -> SizingViews:
    """The cache-sizing lab: how much each eviction policy serves at each pool size, on real traffic or yours."""
    curves = sizing.load()
    first = curves[0]
    # a Column carries the view's id: Gradio writes a Group's elem_id on two nested elements
    with gr.Column(elem_id="sizing"), gr.Group():
        gr.Markdown(f"**How big should the cache be?** {CAPTIONS['sizing']}")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                chart = gr.Plot(elem_id="sizing_chart", show_label=False)
            with gr.Column(scale=2):
                trace = gr.Radio(
                    [c.name for c in curves] + [sizing.MINE], value=first.name, label="Workload", elem_id="sizing_trace"
                )
                capacity = gr.Radio(
                    sizing.capacity_choices(first),
                    value=first.nearest(5859),
                    label="Pool size in pages (blocks), on a log scale: pick one, and read what each policy serves",
                    elem_id="sizing_capacity",
                )
                waiting = f"{sizing.REPLAY_MINE} ({sizing.not_yet(0)})"  # a new page's session has run nothing
                replay_mine = gr.Button(waiting, size="sm", interactive=False, elem_id="sizing_mine")
                note = gr.Markdown(elem_id="sizing_note")
    # below the view the lesson points at (``sizing``), so that view fits a laptop's window under the lesson's bar
    table = gr.DataFrame(
        headers=sizing.TABLE_COLUMNS, label="At that capacity", interactive=False, elem_id="sizing_table"
    )
    return SizingViews(trace, capacity, replay_mine, chart, table, note)


def _ladder() -> LadderViews:
    """Why is my hit rate low?: the hit-rate ladder of the visitor's runs, their engine, or a shipped trace."""
    with gr.Row(equal_height=False, elem_id="ladder"):
        with gr.Column(scale=3):
            chart = gr.Plot(elem_id="ladder_chart", show_label=False)
        with gr.Column(scale=2):
            source = gr.Radio(list(ladder.SOURCES), value=ladder.LAST_RUN, label="Count", elem_id="ladder_source")
            policy = gr.Dropdown(
                [(EVICTION_NAMES[name], name) for name in POLICIES],
                value="lru",
                label="Policy for the traces (your runs and engine: your engine's own)",
                elem_id="ladder_policy",
            )
            compute = gr.Button("Why is my hit rate low?", size="sm", variant="primary", elem_id="ladder_btn")
            note = gr.Markdown(ladder.WAITING, elem_id="ladder_note")
            with gr.Row():
                downloads = {
                    kind: gr.DownloadButton(
                        f"{label} ↓", size="sm", interactive=False, elem_id=f"ladder_{kind}", min_width=60
                    )
                    for kind, label in (("html", "HTML report"), ("json", "JSON"), ("csv", "CSV"))
                }
    return LadderViews(source, policy, compute, chart, note, downloads)


def _panels(prompts: list[str]) -> Panels:
    columns, boxes, outputs, badges = [], [], [], []
    with gr.Row(equal_height=False):
        for i in range(MAX_PANELS):
            with gr.Column(visible=i < len(prompts), min_width=150) as column:
                boxes.append(
                    gr.Textbox(
                        prompts[i] if i < len(prompts) else "",
                        label=f"Panel {i + 1} prompt",
                        lines=2,
                        max_lines=2,
                        max_length=MAX_PROMPT_CHARS,
                        elem_id=f"prompt_{i}",
                    )
                )
                outputs.append(
                    gr.Textbox(
                        label=f"Panel {i + 1} output",
                        lines=3,
                        max_lines=3,
                        interactive=False,
                        autoscroll=True,
                        elem_id=f"out_{i}",
                    )
                )
                badges.append(gr.Markdown("", elem_id=f"badge_{i}"))
            columns.append(column)
    return Panels(tuple(columns), tuple(boxes), tuple(outputs), tuple(badges), ())


def _highlights(shown: int) -> tuple[gr.HTML, ...]:
    """Each panel's prompt tokens coloured by cause (``views/causes.py``); hover a run of tokens for why."""
    accordion = gr.Accordion(
        "Prompt tokens: why each was cached or computed (hover a run of tokens)", open=False, elem_id="tokens_accordion"
    )
    with accordion, gr.Row(equal_height=False):
        return tuple(
            gr.HTML(
                label=f"Panel {i + 1} prompt tokens",
                show_label=True,
                container=True,
                elem_id=f"tokens_{i}",
                min_height=0,
                visible=i < shown,
                padding=True,  # the legend's chips start below the label, not under it (they were clipped in half)
            )
            for i in range(MAX_PANELS)
        )


def _replay_controls() -> ReplayControls:
    with gr.Row(equal_height=False):
        step = gr.Slider(0, 1, value=0, step=1, label="Replay: step of your last run", elem_id="replay_step", scale=4)
        back = gr.Button("◀ step", elem_id="replay_back", min_width=70, size="sm", scale=0)
        play_1x = gr.Button("▶ 1×", elem_id="replay_play", min_width=60, size="sm", scale=0)
        play_slow = gr.Button("▶ slow", elem_id="replay_slow", min_width=70, size="sm", scale=0)
        pause = gr.Button("❚❚", elem_id="replay_pause", min_width=50, size="sm", scale=0)
        forward = gr.Button("step ▶", elem_id="replay_fwd", min_width=70, size="sm", scale=0)
        live = gr.Button("Live", elem_id="replay_live", min_width=60, size="sm", scale=0)
    note = gr.Markdown("", elem_id="replay_note")
    timer = gr.Timer(REPLAY_TICK_SECONDS, active=False)
    return ReplayControls(step, note, back, forward, play_1x, play_slow, pause, live, timer)


def _engine_form(default: Profile, model_choices: list[str], chooses_pools: bool) -> EngineForm:
    title = "Engine settings (your own engine: applying gives you an engine with these settings)"
    settings = default.settings
    with gr.Accordion(title, open=False, visible=chooses_pools, elem_id="engine_settings"):
        with gr.Row():
            shown = default.model if default.model in model_choices else model_choices[0]  # a server: its model
            model = gr.Dropdown(model_choices, value=shown, label="Model", elem_id="engine_model")
            page_size = gr.Dropdown(list(PAGE_SIZES), value=settings.page_size, label="Page size (tokens)")
            n_pages = gr.Slider(*POOL_PAGES, value=settings.n_pages, step=8, label="Pool size (pages)")
            max_batch = gr.Slider(*BATCH_SIZES, value=settings.max_batch_size, step=1, label="Max batch")
            prefix_caching = gr.Checkbox(settings.prefix_caching, label="Prefix caching")
            dtype = gr.Radio(list(DTYPES), value=settings.dtype, label="dtype")
            eviction = gr.Dropdown(
                [(EVICTION_NAMES[name], name) for name in POLICIES],
                value=settings.eviction,
                label="Eviction (which cached page goes first)",
                elem_id="engine_eviction",
            )
        apply = gr.Button("Apply settings / load model", elem_id="apply_btn")
        shared_pools = gr.Checkbox(
            False,
            label="Small-pool lesson steps: one pool shared with everyone (to show a class one pool), not your own",
            elem_id="shared_pools",
        )
        status = gr.Markdown(elem_id="engine_status")
    return EngineForm(
        model, page_size, n_pages, max_batch, prefix_caching, dtype, eviction, apply, status, shared_pools
    )
