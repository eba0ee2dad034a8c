"""The Gradio Blocks: prompt panels that stream side by side, and live charts of the shared cache.

Every callback returns a dict keyed by component (Gradio's dict-return form): what a callback leaves out stays as
it is on the page. Callbacks read the cache only through the backend protocol and format it with ``views``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import gradio as gr

from astrai.observation import PageEvicted
from astrai.playground import charts, views
from astrai.playground.backend import BackendError
from astrai.playground.local_backend import (
    BATCH_SIZES,
    DTYPES,
    MODEL_CHOICES,
    PAGE_SIZES,
    POOL_PAGES,
    EngineSettings,
    LocalBackend,
)
from astrai.playground.scenarios import FOLLOW_UP, SCENARIO_BY_NAME, SCENARIOS
from astrai.playground.service import PlaygroundService
from astrai.sampling import SamplingParams

MAX_PANELS = 6
DEFAULT_PANELS = 4
MAX_PROMPT_CHARS = 2000
MAX_NEW_TOKENS = 256
THROTTLE_SECONDS = 0.04  # one UI update per 40 ms at most: gradio sends every yield
REFRESH_SECONDS = 1.0
QUEUE_SIZE = 64  # waiting events beyond this get an immediate "queue is full" answer
CAPTIONS = [
    "Pages in use by running requests, cached (kept after their requests ended, evictable), and free, after each "
    "engine step.",
    "Cached pages wait in the LRU; it shrinks when a hit takes a page back or an eviction reuses one.",
    views.HIT_RATE_CAPTION,
    "Every page: coloured by your panel when in use (x = shared), blue when cached (darker = more recently "
    "used), grey when free or another visitor's; red flashes mark evictions.",
]
INTRO = """# AstrAI playground: watch a KV cache reuse work
Several prompts run as **one batch** through a paged KV cache with a persistent **prefix cache**. Full pages are
keyed by a chained hash of their tokens; a later request that starts with the same tokens reuses them instead of
recomputing. Pick a scenario, press **Run**, and watch the badges, the coloured prompt tokens and the charts.
The engine is shared by every visitor, so you may hit pages someone else computed (their text stays hidden)."""


@dataclass
class Components:
    """The components callbacks write to, by role."""

    scenario_note: Any
    shared_prefix: Any
    n_panels: Any
    prompts: list
    outputs: list
    badges: list
    highlights: list
    table: Any
    max_tokens: Any
    plots: list
    stats: Any
    view_state: Any
    settings: dict[str, Any]  # EngineSettings field -> its component
    engine_status: Any


def session_of(request: gr.Request) -> str:
    return request.session_hash or "anonymous"


class Playground:
    """Callbacks bound to one shared service; Gradio gives each the caller's session through gr.Request."""

    def __init__(self, service: PlaygroundService):
        self.service = service
        self.backend = service.backend
        self.ui: Components  # set by build_demo once the components exist

    # ----- run / stop ------------------------------------------------------------------------------------
    def run(
        self,
        n_panels,
        shared_prefix,
        prompt_1,
        prompt_2,
        prompt_3,
        prompt_4,
        prompt_5,
        prompt_6,
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        isolate_cache,
        request: gr.Request,
    ):
        panels = [prompt_1, prompt_2, prompt_3, prompt_4, prompt_5, prompt_6]
        session = session_of(request)
        try:  # anything a client can send: NaN, None, strings where numbers belong
            n = int(n_panels)
            if not 1 <= n <= MAX_PANELS:
                raise ValueError(f"Use between 1 and {MAX_PANELS} panels.")
            prefix = shared_prefix or ""
            prompts = [p or "" for p in panels[:n]]
            for i, prompt in enumerate(prompts):
                if not (prefix + prompt).strip():
                    raise ValueError(f"Panel {i + 1} has an empty prompt.")
                if len(prefix) + len(prompt) > 2 * MAX_PROMPT_CHARS:
                    raise ValueError(f"Panel {i + 1}: prompt too long (max {2 * MAX_PROMPT_CHARS} characters).")
            if not 1 <= int(max_tokens) <= MAX_NEW_TOKENS:
                raise ValueError(f"Max tokens must be between 1 and {MAX_NEW_TOKENS}.")
            params = SamplingParams(
                max_tokens=int(max_tokens),
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                seed=None if seed is None else int(seed),
            )
            run = self.backend.submit(
                [self.backend.format_prompt(prefix, p) for p in prompts], params, session if isolate_cache else None
            )
        except (ValueError, TypeError, OverflowError, BackendError) as exc:
            raise gr.Error(str(exc)) from None
        self.service.register(run.request_ids, session)
        answers = [""] * n
        coloured: set[int] = set()  # panels whose token colouring was sent (once: it never changes)
        decode, special = self.backend.decode, self.backend.special_ids()
        ui = self.ui

        def frame(first: bool = False) -> dict:
            by_id = {info.id: info for info in self.backend.request_info(run.request_ids)}
            infos = [by_id.get(rid) for rid in run.request_ids]
            update: dict = {ui.table: views.request_rows(infos, prompts)}
            for i in range(MAX_PANELS):
                info = infos[i] if i < n else None
                update[ui.outputs[i]] = answers[i] if i < n else ""
                update[ui.badges[i]] = views.badge(info)
                if info is not None and info.cached_tokens is not None and i not in coloured:
                    coloured.add(i)
                    update[ui.highlights[i]] = views.token_highlights(info, decode, special)
                elif first:
                    update[ui.highlights[i]] = None  # clear the last run's colouring
            return update

        try:
            yield frame(first=True)
            last = time.monotonic()
            for index, delta in run:
                answers[index] += delta
                if time.monotonic() - last >= THROTTLE_SECONDS:
                    last = time.monotonic()
                    yield frame()
            yield frame()
        except BackendError as exc:
            gr.Warning(str(exc))
            yield frame()
        finally:
            run.close()  # Stop, a closed tab or an error: release the pages now

    # ----- the live charts --------------------------------------------------------------------------------
    def refresh(self, view_state: dict | None, request: gr.Request) -> dict:
        backend, ui = self.backend, self.ui
        state = view_state or {}
        generation = backend.generation
        fresh = state.get("generation") != generation
        events = backend.events(after=0 if fresh else state.get("seq", 0))
        evicted = set() if fresh else {e.page for e in events if isinstance(e, PageEvicted)}
        seq = events[-1].seq if events else (0 if fresh else state.get("seq", 0))
        stats = backend.stats()
        quiet = not fresh and not events and stats.steps == state.get("steps")
        new_state = {"generation": generation, "seq": seq, "steps": stats.steps, "settled": quiet}
        if quiet and state.get("settled"):  # nothing moved since the last drawing: spare the browser a redraw
            return {ui.view_state: new_state}
        series = views.series(backend.history(0), stats, time.time())
        records = backend.snapshot().pages
        requests = {r for record in records for r in (*record.requests, record.stored_by) if r is not None}
        pages = views.page_views(
            records, self.service.owners(sorted(requests)), session_of(request), evicted, backend.decode
        )
        return {
            ui.plots[0]: charts.occupancy_chart(series),
            ui.plots[1]: charts.lru_chart(series),
            ui.plots[2]: charts.hit_rate_chart(series),
            ui.plots[3]: charts.page_map(pages, lambda panel: f"panel {panel + 1}"),
            ui.stats: views.stats_line(stats, backend.label),
            ui.view_state: new_state,
        }

    # ----- buttons ----------------------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        """The shared cache's counters, for API clients (load tests, dashboards)."""
        return dataclasses.asdict(self.backend.stats())

    def clear_cache(self) -> None:
        freed = self.backend.clear()
        gr.Info(f"Prefix cache cleared: {freed} cached pages are free again.")

    def follow_up(self, n_panels, *texts) -> dict:
        prompts, outputs = texts[:MAX_PANELS], texts[MAX_PANELS:]
        return {
            self.ui.prompts[i]: p + o + FOLLOW_UP
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
            if i < int(n_panels) and o
        }

    def apply_settings(self, model_label, page_size, n_pages, max_batch, prefix_caching, dtype, progress=gr.Progress()):  # noqa: B008 - gradio injects progress through the default
        try:
            settings = EngineSettings(
                page_size=int(page_size),
                n_pages=int(n_pages),
                max_batch_size=int(max_batch),
                prefix_caching=bool(prefix_caching),
                dtype=str(dtype),
            )
        except (ValueError, TypeError) as exc:
            raise gr.Error(str(exc)) from None
        return {self.ui.engine_status: self._rebuild(str(model_label), settings, progress)}

    def _rebuild(self, label: str, settings: EngineSettings, progress: gr.Progress) -> str:
        backend = self.backend
        if not isinstance(backend, LocalBackend):
            return "This backend's settings belong to its server; the playground cannot change them."
        progress(0.1, desc=f"Loading {label} and building the engine…")
        started = time.monotonic()
        try:
            backend.rebuild(label, settings)
        except Exception as exc:  # offline, unsupported, out of memory: keep serving the current engine
            gr.Warning(f"Could not switch: {exc}")
            return f"❌ Could not load **{label}** with these settings: `{exc}`. Still serving **{backend.label}**."
        progress(1.0)
        return f"✅ **{label}** ready in {time.monotonic() - started:.1f} s ({settings})."

    def load_scenario(self, name, progress=gr.Progress()) -> dict:  # noqa: B008
        scenario = SCENARIO_BY_NAME.get(name)
        if scenario is None:
            return {}
        ui = self.ui
        update: dict = {
            ui.scenario_note: f"**{scenario.name}:** {scenario.explanation}",
            ui.shared_prefix: scenario.prefix,
            ui.n_panels: len(scenario.prompts),
            ui.max_tokens: scenario.max_tokens,
        }
        prompts = scenario.prompts + [""] * (MAX_PANELS - len(scenario.prompts))
        update.update({box: text for box, text in zip(ui.prompts, prompts, strict=True)})
        update.update({box: "" for box in ui.outputs})
        wanted = scenario.settings
        if isinstance(self.backend, LocalBackend) and wanted != self.backend.settings:
            update[ui.engine_status] = self._rebuild(self.backend.label, wanted, progress)
        if isinstance(self.backend, LocalBackend):
            current = self.backend.settings
            update.update({box: getattr(current, field) for field, box in ui.settings.items()})
        return update


def build_demo(service: PlaygroundService) -> gr.Blocks:
    app = Playground(service)
    backend = service.backend
    local = isinstance(backend, LocalBackend)
    settings = backend.settings if isinstance(backend, LocalBackend) else EngineSettings()
    with gr.Blocks(title="AstrAI playground: see the KV cache", analytics_enabled=False) as demo:
        gr.Markdown(INTRO)
        with gr.Row():
            scenario = gr.Dropdown(
                [s.name for s in SCENARIOS], value=None, label="Scenario", elem_id="scenario", scale=1
            )
            scenario_note = gr.Markdown(
                "Pick a scenario to fill the panels, or write your own prompts.", elem_id="scenario_note"
            )
        shared_prefix = gr.Textbox(
            label="Shared prefix (a system prompt prepended to every panel)",
            lines=2,
            max_length=MAX_PROMPT_CHARS,
            elem_id="prefix",
        )
        with gr.Row():
            n_panels = gr.Slider(1, MAX_PANELS, value=DEFAULT_PANELS, step=1, label="Panels", elem_id="n_panels")
            isolate = gr.Checkbox(False, label="Isolate my cache (salt the hash with my session)", elem_id="isolate")
        columns, prompts, outputs, badges, highlights = [], [], [], [], []
        with gr.Row(equal_height=False):
            for i in range(MAX_PANELS):
                with gr.Column(visible=i < DEFAULT_PANELS, min_width=200) as column:
                    prompts.append(
                        gr.Textbox(
                            label=f"Panel {i + 1} prompt", lines=2, max_length=MAX_PROMPT_CHARS, elem_id=f"prompt_{i}"
                        )
                    )
                    outputs.append(
                        gr.Textbox(
                            label=f"Panel {i + 1} output",
                            lines=6,
                            max_lines=12,
                            interactive=False,
                            autoscroll=True,
                            elem_id=f"out_{i}",
                        )
                    )
                    badges.append(gr.Markdown("", elem_id=f"badge_{i}"))
                    highlights.append(
                        gr.HighlightedText(
                            label="prompt tokens",
                            color_map={"cached": "#22c55e", "computed": "#f97316"},
                            show_legend=True,
                            elem_id=f"tokens_{i}",
                            combine_adjacent=False,
                        )
                    )
                columns.append(column)
        with gr.Row():
            run_btn = gr.Button("Run", variant="primary", elem_id="run_btn")
            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop_btn")
            follow_btn = gr.Button("Follow-up turn", elem_id="follow_btn")
            clear_btn = gr.Button("Clear cache", elem_id="clear_btn")
        with gr.Accordion("Sampling", open=False), gr.Row():
            max_tokens = gr.Slider(1, MAX_NEW_TOKENS, value=64, step=1, label="Max tokens", elem_id="max_tokens")
            temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)")
            top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="Top-p")
            top_k = gr.Slider(0, 200, value=0, step=1, label="Top-k (0 = off)")
            seed = gr.Number(0, precision=0, label="Seed", minimum=0)
        with gr.Row():
            stats = gr.Markdown(elem_id="stats")
            live = gr.Checkbox(
                True, label="Live charts (refresh every second)", elem_id="live_charts", scale=0, min_width=260
            )
        plots = []
        for row in range(2):
            with gr.Row():
                for col in range(2):
                    with gr.Column():
                        plots.append(gr.Plot(elem_id=f"plot_{2 * row + col}", show_label=False))
                        gr.Markdown(f"<small>{CAPTIONS[2 * row + col]}</small>")
        table = gr.DataFrame(headers=views.TABLE_COLUMNS, label="Your requests", interactive=False, elem_id="requests")
        with gr.Accordion(
            "Engine settings (shared by every visitor; applying rebuilds the engine)", open=False, visible=local
        ):
            with gr.Row():
                model = gr.Dropdown(list(MODEL_CHOICES), value=backend.label, label="Model")
                page_size = gr.Dropdown(list(PAGE_SIZES), value=settings.page_size, label="Page size (tokens)")
                n_pages = gr.Slider(*POOL_PAGES, value=settings.n_pages, step=8, label="Pool size (pages)")
                max_batch = gr.Slider(*BATCH_SIZES, value=settings.max_batch_size, step=1, label="Max batch")
                prefix_caching = gr.Checkbox(settings.prefix_caching, label="Prefix caching")
                dtype = gr.Radio(list(DTYPES), value=settings.dtype, label="dtype")
            apply_btn = gr.Button("Apply settings / load model", elem_id="apply_btn")
            engine_status = gr.Markdown(elem_id="engine_status")
        view_state = gr.State({})
        app.ui = Components(
            scenario_note=scenario_note,
            shared_prefix=shared_prefix,
            n_panels=n_panels,
            prompts=prompts,
            outputs=outputs,
            badges=badges,
            highlights=highlights,
            table=table,
            max_tokens=max_tokens,
            plots=plots,
            stats=stats,
            view_state=view_state,
            settings=dict(
                page_size=page_size,
                n_pages=n_pages,
                max_batch_size=max_batch,
                prefix_caching=prefix_caching,
                dtype=dtype,
            ),
            engine_status=engine_status,
        )
        gr.api(app.cache_stats, api_name="cache_stats", concurrency_limit=8)

        n_panels.change(
            lambda k: {column: gr.Column(visible=i < int(k)) for i, column in enumerate(columns)},
            n_panels,
            columns,
            queue=False,
            api_visibility="private",
        )
        run_event = run_btn.click(
            app.run,
            [n_panels, shared_prefix, *prompts, max_tokens, temperature, top_p, top_k, seed, isolate],
            [*outputs, *badges, *highlights, table],
            api_name="run",
            concurrency_limit=4,
            concurrency_id="run",
            show_progress="minimal",
        )
        stop_btn.click(fn=None, cancels=[run_event], api_name="stop")
        clear_btn.click(app.clear_cache, api_name="clear_cache", concurrency_limit=4)
        follow_btn.click(app.follow_up, [n_panels, *prompts, *outputs], prompts, api_visibility="private")
        apply_btn.click(
            app.apply_settings,
            [model, page_size, n_pages, max_batch, prefix_caching, dtype],
            [engine_status],
            api_name="apply_settings",
            concurrency_limit=1,
            concurrency_id="rebuild",
        )
        scenario.change(
            app.load_scenario,
            scenario,
            [
                scenario_note,
                shared_prefix,
                n_panels,
                *prompts,
                *outputs,
                max_tokens,
                *app.ui.settings.values(),
                engine_status,
            ],
            api_name="load_scenario",
            concurrency_limit=1,
            concurrency_id="rebuild",
        )
        timer = gr.Timer(REFRESH_SECONDS)
        live.change(lambda on: gr.Timer(active=bool(on)), live, timer, queue=False, api_visibility="private")
        refresh_outputs = [*plots, stats, view_state]
        timer.tick(
            app.refresh,
            view_state,
            refresh_outputs,
            api_visibility="undocumented",
            concurrency_limit=8,
            show_progress="hidden",
        )
        demo.load(app.refresh, view_state, refresh_outputs, api_visibility="private")
    demo.queue(max_size=int(os.environ.get("ASTRAI_QUEUE_SIZE", QUEUE_SIZE)), default_concurrency_limit=2)
    return demo
