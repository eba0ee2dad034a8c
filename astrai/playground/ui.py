"""The Gradio Blocks: layout and wiring only (the callbacks are in ``callbacks.py``).

Laid out for a 1366×768 laptop screen: the panels on the left and the cache (page map, occupancy) on the right,
so a run and what it does to the cache are in view together, without scrolling. Below them: replay, the other
charts, the prefix tree, what caching saved, the coloured prompt tokens and the settings.
"""

from __future__ import annotations

import inspect
import json
import os

import gradio as gr

from astrai.playground import views
from astrai.playground.callbacks import MAX_NEW_TOKENS, MAX_PANELS, MAX_PROMPT_CHARS, Components, Playground
from astrai.playground.backends.local import (
    BATCH_SIZES,
    DTYPES,
    MODEL_CHOICES,
    PAGE_SIZES,
    POOL_PAGES,
    EngineSettings,
    LocalBackend,
)
from astrai.playground.scenarios import LESSON, SCENARIOS
from astrai.playground.service import PlaygroundService

DEFAULT_PANELS = 4
REFRESH_SECONDS = 1.0
# Events that show no progress also register none: Gradio's front end refreshes, at every status message of every
# event (each streamed text message among them), the loading status of every component any event has shown progress
# on, cloning its props. Left on all outputs, up to 56 components a message (tests/test_app.py keeps it at 3).
QUIET = {"show_progress": "hidden", "show_progress_on": []}
REPLAY_TICK_SECONDS = 0.2
RUN_CONCURRENCY = int(os.environ.get("ASTRAI_RUN_CONCURRENCY", 16))  # runs streaming at once (more wait in the queue)
QUEUE_SIZE = 64  # waiting events beyond this get an immediate "queue is full" answer
CAPTIONS = {
    "page_map": "Every page: your panel's colour when in use (x = shared), blue when cached (darker = more recently "
    "used), grey when free or another visitor's; red marks an eviction. Hover a page for its refs, owners, tokens "
    "and hits served.",
    "occupancy": "Pages in use by running requests, cached (kept after their requests ended, evictable), and free, "
    "after each engine step.",
    "lru": "Cached pages wait in the LRU; it shrinks when a hit takes a page back or an eviction reuses one.",
    "hit_rate": views.HIT_RATE_CAPTION,
    "tree": "Every cached page under the page its key chains from: prompts share a branch as long as they share "
    "full pages. Text is shown for your own pages only.",
}
INTRO = (
    "### AstrAI playground: watch a KV cache reuse work\n"
    "Prompts run as **one batch** through a paged KV cache with a **prefix cache**: full pages are keyed by a chained "
    "hash of their tokens, and a request that starts with the same tokens reuses them. One engine serves every "
    "visitor (their text stays hidden)."
)
# Outline the view a lesson step talks about (an inline style: no stylesheet to ship).
# The step number is read back from the note ("**Lesson 3/6: ...") because a gr.State never reaches the browser.
HIGHLIGHT_JS = (
    "(note) => { const ids = "
    + json.dumps([step.look_at for step in LESSON])
    + "; for (const id of ids) { const e = document.getElementById(id); if (e) e.style.outline = ''; }"
    " const m = /Lesson (\\d+)\\//.exec(note || ''); const e = m && document.getElementById(ids[m[1] - 1]);"
    " if (e) { e.style.outline = '3px solid #f59e0b'; e.scrollIntoView({block: 'nearest'}); } }"
)


def build_demo(service: PlaygroundService) -> gr.Blocks:
    app = Playground(service)
    backend = service.backend
    local = isinstance(backend, LocalBackend)
    settings = backend.settings if isinstance(backend, LocalBackend) else EngineSettings()
    with gr.Blocks(title="AstrAI playground: see the KV cache", analytics_enabled=False) as demo:
        gr.Markdown(INTRO)
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=640):
                with gr.Row():
                    scenario = gr.Dropdown(
                        [s.name for s in SCENARIOS],
                        value=None,
                        label="Scenario",
                        elem_id="scenario",
                        scale=2,
                        min_width=160,
                    )
                    n_panels = gr.Slider(
                        1, MAX_PANELS, value=DEFAULT_PANELS, step=1, label="Panels", elem_id="n_panels", scale=1
                    )
                    with gr.Column(scale=1, min_width=120):
                        lesson_prev = gr.Button("◀ Lesson", size="sm", elem_id="lesson_prev")
                        lesson_next = gr.Button("Lesson ▶", size="sm", elem_id="lesson_next")
                with gr.Row():
                    run_btn = gr.Button("Run", variant="primary", elem_id="run_btn", min_width=80)
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop_btn", min_width=80)
                    follow_btn = gr.Button("Follow-up turn", elem_id="follow_btn", min_width=120)
                    compare_btn = gr.Button("Compare with caching off", elem_id="compare_btn", min_width=180)
                    clear_btn = gr.Button("Clear cache", elem_id="clear_btn", min_width=100)
                scenario_note = gr.Markdown(
                    "Pick a scenario or a lesson step to fill the panels, or write your own prompts.",
                    elem_id="scenario_note",
                )
                shared_prefix = gr.Textbox(
                    label="Shared prefix (a system prompt before every panel's prompt)",
                    lines=1,
                    max_lines=3,
                    max_length=MAX_PROMPT_CHARS,
                    elem_id="prefix",
                )
                columns, prompts, outputs, badges = [], [], [], []
                with gr.Row(equal_height=False):
                    for i in range(MAX_PANELS):
                        with gr.Column(visible=i < DEFAULT_PANELS, min_width=150) as column:
                            prompts.append(
                                gr.Textbox(
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
                                    lines=4,
                                    max_lines=4,
                                    interactive=False,
                                    autoscroll=True,
                                    elem_id=f"out_{i}",
                                )
                            )
                            badges.append(gr.Markdown("", elem_id=f"badge_{i}"))
                        columns.append(column)
            with gr.Column(scale=2, min_width=420):
                page_map = gr.Plot(elem_id="page_map", show_label=False)
                occupancy = gr.Plot(elem_id="plot_0", show_label=False)
                stats = gr.Markdown(elem_id="stats")
        with gr.Row(equal_height=False):
            replay_step = gr.Slider(
                0, 1, value=0, step=1, label="Replay: step of your last run", elem_id="replay_step", scale=4
            )
            step_back = gr.Button("◀ step", size="sm", elem_id="replay_back", scale=0, min_width=70)
            play_1x = gr.Button("▶ 1×", size="sm", elem_id="replay_play", scale=0, min_width=60)
            play_slow = gr.Button("▶ ¼×", size="sm", elem_id="replay_slow", scale=0, min_width=60)
            pause_btn = gr.Button("❚❚", size="sm", elem_id="replay_pause", scale=0, min_width=50)
            step_fwd = gr.Button("step ▶", size="sm", elem_id="replay_fwd", scale=0, min_width=70)
            live_btn = gr.Button("Live", size="sm", elem_id="replay_live", scale=0, min_width=60)
        replay_note = gr.Markdown("", elem_id="replay_note")
        with gr.Row(equal_height=False):
            with gr.Column():
                lru = gr.Plot(elem_id="plot_1", show_label=False)
                gr.Markdown(f"<small>{CAPTIONS['lru']}</small>")
            with gr.Column():
                hit_rate = gr.Plot(elem_id="plot_2", show_label=False)
                gr.Markdown(f"<small>{CAPTIONS['hit_rate']}</small>")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                prefix_tree = gr.Plot(elem_id="prefix_tree", show_label=False)
                gr.Markdown(f"<small>{CAPTIONS['tree']}</small>")
            with gr.Column(scale=2):
                savings = gr.Plot(elem_id="savings", show_label=False)
                savings_note = gr.Markdown(elem_id="savings_note")
        gr.Markdown(f"<small>{CAPTIONS['page_map']} {CAPTIONS['occupancy']}</small>")
        with gr.Accordion("Prompt tokens: cached or computed", open=False, elem_id="tokens_accordion"):
            highlights = []
            with gr.Row(equal_height=False):
                for i in range(MAX_PANELS):
                    highlights.append(
                        gr.HighlightedText(
                            label=f"Panel {i + 1} prompt tokens",
                            color_map={"cached": "#22c55e", "computed": "#f97316"},
                            show_legend=True,
                            elem_id=f"tokens_{i}",
                            combine_adjacent=False,
                            min_width=150,
                        )
                    )
        with gr.Accordion("Sampling and options", open=False), gr.Row():
            max_tokens = gr.Slider(1, MAX_NEW_TOKENS, value=64, step=1, label="Max tokens", elem_id="max_tokens")
            temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)")
            top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="Top-p")
            top_k = gr.Slider(0, 200, value=0, step=1, label="Top-k (0 = off)")
            seed = gr.Number(0, precision=0, label="Seed", minimum=0)
            isolate = gr.Checkbox(False, label="Isolate my cache (salt the hash with my session)", elem_id="isolate")
            live = gr.Checkbox(True, label="Live charts (refresh every second)", elem_id="live_charts")
        table = gr.DataFrame(headers=views.TABLE_COLUMNS, label="Your requests", interactive=False, elem_id="requests")
        with gr.Accordion(
            "Engine settings (shared by every visitor; applying rebuilds the engine)", open=False, visible=local
        ):
            with gr.Row():
                # hidden for vLLM, whose model is the server's: its label is not one of the choices
                model = gr.Dropdown(list(MODEL_CHOICES), value=backend.label if local else None, label="Model")
                page_size = gr.Dropdown(list(PAGE_SIZES), value=settings.page_size, label="Page size (tokens)")
                n_pages = gr.Slider(*POOL_PAGES, value=settings.n_pages, step=8, label="Pool size (pages)")
                max_batch = gr.Slider(*BATCH_SIZES, value=settings.max_batch_size, step=1, label="Max batch")
                prefix_caching = gr.Checkbox(settings.prefix_caching, label="Prefix caching")
                dtype = gr.Radio(list(DTYPES), value=settings.dtype, label="dtype")
            apply_btn = gr.Button("Apply settings / load model", elem_id="apply_btn")
            engine_status = gr.Markdown(elem_id="engine_status")
        view_state = gr.State({})
        lesson_state = gr.State(-1)
        replay_timer = gr.Timer(REPLAY_TICK_SECONDS, active=False)
        ui = app.ui = Components(
            scenario=scenario,
            scenario_note=scenario_note,
            shared_prefix=shared_prefix,
            n_panels=n_panels,
            prompts=prompts,
            outputs=outputs,
            badges=badges,
            highlights=highlights,
            table=table,
            max_tokens=max_tokens,
            page_map=page_map,
            plots=[occupancy, lru, hit_rate],
            prefix_tree=prefix_tree,
            stats=stats,
            view_state=view_state,
            replay_step=replay_step,
            replay_note=replay_note,
            replay_timer=replay_timer,
            savings=savings,
            savings_note=savings_note,
            lesson_state=lesson_state,
            settings=dict(
                page_size=page_size,
                n_pages=n_pages,
                max_batch_size=max_batch,
                prefix_caching=prefix_caching,
                dtype=dtype,
            ),
            engine_status=engine_status,
        )
        _wire(app, ui, demo, columns, locals())
    demo.queue(max_size=int(os.environ.get("ASTRAI_QUEUE_SIZE", QUEUE_SIZE)), default_concurrency_limit=2)
    return demo


def _wire(app: Playground, ui: Components, demo: gr.Blocks, columns: list, c: dict) -> None:
    """Events. ``c`` holds the components that only their own events use (buttons, sampling inputs)."""
    gr.api(app.cache_stats, api_name="cache_stats", concurrency_limit=8)
    gr.api(app.page_map_at, api_name="page_map_at", concurrency_limit=8)
    ui.n_panels.change(
        lambda k: {column: gr.Column(visible=i < int(k)) for i, column in enumerate(columns)},
        ui.n_panels,
        columns,
        queue=False,
        api_visibility="private",
        **QUIET,
    )
    run_inputs = [
        ui.n_panels,
        ui.shared_prefix,
        *ui.prompts,
        ui.max_tokens,
        c["temperature"],
        c["top_p"],
        c["top_k"],
        c["seed"],
        c["isolate"],
    ]
    run_outputs = ui.outputs  # the text alone: see Playground._stream
    details_outputs = [*ui.badges, *ui.highlights, ui.table]
    after_outputs = [*details_outputs, ui.replay_step, ui.replay_note, ui.savings, ui.savings_note]

    # A click first clears the last run's badges, token colouring and table (they would describe it while the new
    # run streams); the run then streams its text alone and ``after_run`` fills them in (see Playground._stream).
    started = {
        button: button.click(app.no_details, None, details_outputs, queue=False, api_visibility="private", **QUIET)
        for button in (c["run_btn"], c["compare_btn"])
    }
    run_event = started[c["run_btn"]].then(
        app.run,
        run_inputs,
        run_outputs,
        api_name="run",
        concurrency_limit=RUN_CONCURRENCY,
        concurrency_id="run",
        show_progress="minimal",
        show_progress_on=ui.outputs[0],  # a queued run says so once, not in every panel (each tracker costs frames)
    )
    compare_event = started[c["compare_btn"]].then(
        app.compare,
        run_inputs,
        run_outputs,
        api_name="compare",
        concurrency_limit=RUN_CONCURRENCY,
        concurrency_id="run",
        show_progress="minimal",
        show_progress_on=ui.outputs[0],
    )
    # API clients call /after_run themselves once /run returns (the browser chains it): see tests/test_app.py
    run_event.then(app.after_run, None, after_outputs, api_name="after_run", **QUIET)
    compare_event.then(app.after_run, None, after_outputs, api_visibility="private", **QUIET)
    c["stop_btn"].click(fn=None, cancels=[run_event, compare_event], api_name="stop").then(
        app.after_run, None, after_outputs, api_visibility="private", **QUIET
    )
    c["clear_btn"].click(app.clear_cache, api_name="clear_cache", concurrency_limit=4)
    c["follow_btn"].click(
        app.follow_up, [ui.n_panels, *ui.prompts, *ui.outputs], ui.prompts, api_visibility="private", **QUIET
    )
    c["apply_btn"].click(
        app.apply_settings,
        [c["model"], c["page_size"], c["n_pages"], c["max_batch"], c["prefix_caching"], c["dtype"]],
        [ui.engine_status],
        api_name="apply_settings",
        concurrency_limit=1,
        concurrency_id="rebuild",
    )
    scenario_outputs = [ui.scenario_note, ui.shared_prefix, ui.n_panels, *ui.prompts, *ui.outputs, ui.max_tokens]
    scenario_outputs += [*ui.settings.values(), ui.engine_status]
    ui.scenario.input(
        app.load_scenario,
        ui.scenario,
        scenario_outputs,
        api_name="load_scenario",
        concurrency_limit=1,
        concurrency_id="rebuild",
        show_progress_on=ui.scenario_note,
    )
    for button, delta in ((c["lesson_prev"], -1), (c["lesson_next"], 1)):
        button.click(
            _bind(app.lesson, delta=delta),
            ui.lesson_state,
            [ui.lesson_state, ui.scenario, *scenario_outputs],
            api_visibility="private",
            concurrency_limit=1,
            concurrency_id="rebuild",
            show_progress_on=ui.scenario_note,
        ).then(fn=None, inputs=ui.scenario_note, js=HIGHLIGHT_JS)

    live_outputs = [ui.page_map, *ui.plots, ui.prefix_tree, ui.stats, ui.view_state]
    replay_outputs = [ui.replay_step, ui.replay_note, ui.page_map, *ui.plots, ui.prefix_tree, *ui.outputs]
    replay_outputs += [ui.replay_timer]
    timer = gr.Timer(REFRESH_SECONDS)
    c["live"].change(
        lambda on: gr.Timer(active=bool(on)), c["live"], timer, queue=False, api_visibility="private", **QUIET
    )
    timer.tick(
        app.refresh,
        ui.view_state,
        live_outputs,
        api_visibility="undocumented",
        concurrency_limit=8,
        **QUIET,
    )
    demo.load(app.refresh, ui.view_state, live_outputs, api_visibility="private", **QUIET)
    ui.replay_step.input(
        app.show_step,
        ui.replay_step,
        replay_outputs,
        api_name="show_step",
        **QUIET,
        trigger_mode="always_last",
    )
    for button, delta in ((c["step_back"], -1), (c["step_fwd"], 1)):
        button.click(
            _bind(app.step_by, delta=delta),
            ui.replay_step,
            replay_outputs,
            api_visibility="private",
            **QUIET,
        )
    for button, speed in ((c["play_1x"], "1x"), (c["play_slow"], "quarter")):
        button.click(_bind(app.play, speed=speed), ui.replay_step, [ui.replay_timer], api_visibility="private", **QUIET)
    c["pause_btn"].click(app.pause, None, [ui.replay_timer], api_visibility="private", **QUIET)
    ui.replay_timer.tick(app.tick, None, replay_outputs, api_visibility="private", concurrency_limit=8, **QUIET)
    back_to_live = [ui.replay_timer, ui.replay_step, ui.view_state]
    c["live_btn"].click(app.live, None, back_to_live, api_visibility="private", **QUIET)


def _bind(method, **fixed):
    """``method`` with some keyword arguments fixed, keeping the rest of its signature for Gradio to read (it
    injects ``gr.Request`` and ``gr.Progress`` by their annotations and defaults)."""
    signature = inspect.signature(method)
    kept = [p for name, p in signature.parameters.items() if name not in fixed]

    names = [p.name for p in kept]

    def bound(*args, **kwargs):  # gradio passes the injected Request/Progress positionally: name every argument
        return method(**dict(zip(names, args, strict=False)), **kwargs, **fixed)

    bound.__signature__ = signature.replace(parameters=kept)
    bound.__annotations__ = {k: v for k, v in method.__annotations__.items() if k not in fixed}
    return bound
