"""The Gradio Blocks: prompt panels that stream side by side, and live charts of the shared engine's cache."""

from __future__ import annotations

import os
import time
from typing import Any

import gradio as gr
import pandas as pd

from astrai import EngineClosedError, InferenceEngine, RequestFailedError
from astrai.playground import charts
from astrai.playground.scenarios import FOLLOW_UP, SCENARIO_BY_NAME, SCENARIOS
from astrai.playground.service import MODEL_CHOICES, EngineService, EngineSettings

MAX_PANELS = 6
DEFAULT_PANELS = 4
MAX_PROMPT_CHARS = 2000
MAX_NEW_TOKENS = 256
THROTTLE_SECONDS = 0.04  # one UI update per 40 ms at most: gradio sends every yield
REFRESH_SECONDS = 1.0
MAX_HIGHLIGHT_TOKENS = 300
QUEUE_SIZE = 64  # waiting events beyond this get an immediate "queue is full" answer
TABLE_COLUMNS = [
    "panel",
    "prompt",
    "status",
    "prompt tokens",
    "cached tokens",
    "generated",
    "TTFT s",
    "tok/s",
    "preemptions",
]
CAPTIONS = [
    "Pages in use by running requests, cached (kept after their requests ended, evictable), and free.",
    "Cached pages wait in the LRU; it shrinks when a hit takes a page back or an eviction reuses one.",
    "Share of prompt tokens served from cache: since start, and over the last 32 requests.",
    "Every page: coloured by your panel when in use (x = shared), blue when cached (darker = more recently "
    "used), grey when free or another visitor's; red flashes mark evictions.",
]
INTRO = """# AstrAI playground: watch a KV cache reuse work
Several prompts run as **one batch** through a paged KV cache with a persistent **prefix cache**. Full pages are
keyed by a chained hash of their tokens; a later request that starts with the same tokens reuses them instead of
recomputing. Pick a scenario, press **Run**, and watch the badges, the coloured prompt tokens and the charts.
The engine is shared by every visitor, so you may hit pages someone else computed (their text stays hidden)."""


def format_prompt(engine: InferenceEngine, prefix: str, prompt: str) -> str:
    """Instruct models get their chat template (the shared prefix as the system turn); base models plain text."""
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": prefix}] if prefix.strip() else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prefix + prompt


def badge(info: dict[str, Any] | None) -> str:
    if info is None:
        return ""
    parts = [f"**{info['prompt_tokens']}** prompt tokens"]
    cached = info["cached_tokens"]
    if cached is not None:
        parts.append(f"**{cached}** cached ({100 * cached / info['prompt_tokens']:.0f}%)")
    if info["ttft"] is not None:
        parts.append(f"TTFT {info['ttft']:.2f} s")
    if info["tokens_per_s"]:
        parts.append(f"{info['tokens_per_s']:.1f} tok/s")
    if info["preemptions"]:
        parts.append(f"preempted ×{info['preemptions']}")
    return " · ".join(parts)


def token_highlights(engine: InferenceEngine, info: dict[str, Any]) -> list[tuple[str, str]]:
    """The prompt's tokens, labelled cached or computed, for gr.HighlightedText."""
    ids = info["prompt_ids"][:MAX_HIGHLIGHT_TOKENS]
    cached = info["cached_tokens"] or 0
    special = set(engine.tokenizer.all_special_ids)
    pieces = []
    for i, token in enumerate(ids):
        text = "⟨s⟩" if token in special else engine.tokenizer.decode([token])
        pieces.append((text, "cached" if i < cached else "computed"))
    return pieces


def request_table(infos: list[dict[str, Any] | None], prompts: list[str]) -> pd.DataFrame:
    rows = [
        [
            i + 1,
            prompts[i][:40],
            info["status"],
            info["prompt_tokens"],
            info["cached_tokens"],
            info["generated_tokens"],
            round(info["ttft"], 3) if info["ttft"] is not None else None,
            round(info["tokens_per_s"], 1) if info["tokens_per_s"] else None,
            info["preemptions"],
        ]
        for i, info in enumerate(infos)
        if info is not None
    ]
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def stats_line(service: EngineService, stats: dict[str, Any]) -> str:
    return (
        f"**{stats['used_pages']}** in use · **{stats['cached_pages']}** cached · **{stats['free_pages']}** free "
        f"of {stats['n_pages']} pages × {stats['page_size']} tokens · hit rate {stats['hit_rate']:.0%} "
        f"(recent {stats['recent_hit_rate']:.0%}) · {stats['evictions']} evictions · {stats['preemptions']} "
        f"preemptions · prefix caching {'on' if stats['prefix_caching'] else 'off'} · model: {service.model_label}"
    )


class Playground:
    """Callbacks bound to one shared service; Gradio gives each the caller's session through gr.Request."""

    def __init__(self, service: EngineService):
        self.service = service

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
        engine = self.service.current()
        session = request.session_hash or "anonymous"
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
            stream = engine.generate(
                [format_prompt(engine, prefix, p) for p in prompts],
                max_tokens=int(max_tokens),
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                seed=None if seed is None else int(seed),
                stream=True,
                cache_salt=session if isolate_cache else None,
            )
        except (ValueError, TypeError, OverflowError, EngineClosedError) as exc:
            raise gr.Error(str(exc)) from None
        self.service.register(stream.request_ids, session)
        answers = [""] * n
        coloured: set[int] = set()  # panels whose token colouring was sent (once: it never changes)
        first = True

        def frame() -> list[Any]:
            nonlocal first
            by_id = {info["id"]: info for info in engine.request_info(stream.request_ids)}
            infos = [by_id.get(rid) for rid in stream.request_ids]
            highlights: list[Any] = []
            for i in range(MAX_PANELS):
                info = infos[i] if i < n else None
                if info is not None and info["cached_tokens"] is not None and i not in coloured:
                    coloured.add(i)
                    highlights.append(token_highlights(engine, info))
                else:
                    highlights.append(None if first else gr.skip())  # the first frame clears the last run's
            first = False
            outs = [answers[i] if i < n else "" for i in range(MAX_PANELS)]
            badges = [badge(infos[i]) if i < n else "" for i in range(MAX_PANELS)]
            return [*outs, *badges, *highlights, request_table(infos, prompts)]

        try:
            yield frame()
            last = time.monotonic()
            for index, delta in stream:
                answers[index] += delta
                if time.monotonic() - last >= THROTTLE_SECONDS:
                    last = time.monotonic()
                    yield frame()
            yield frame()
        except EngineClosedError:
            gr.Warning("The engine was rebuilt or stopped, so this run ended early.")
            yield frame()
        except RequestFailedError as exc:
            raise gr.Error(str(exc)) from None
        finally:
            stream.close()  # Stop, a closed tab or an error: release the pages now

    # ----- the live charts --------------------------------------------------------------------------------
    def refresh(self, view_state: dict | None, request: gr.Request):
        engine = self.service.current()
        session = request.session_hash or "anonymous"
        state = view_state or {}
        fresh = state.get("engine") != id(engine)
        events = engine.events(after=0 if fresh else state.get("seq", 0))
        evicted = set() if fresh else {e["page"] for e in events if e["kind"] == "page_evicted"}
        seq = events[-1]["seq"] if events else (0 if fresh else state.get("seq", 0))
        stats = engine.cache_stats()
        quiet = not fresh and not events and stats["steps"] == state.get("steps")
        if quiet and state.get("settled"):  # nothing moved since the last drawing: spare the browser a redraw
            return (*[gr.skip()] * 5, state)
        history, now = list(self.service.history), time.time()
        views = [self._page_view(engine, record, session, evicted) for record in engine.cache_snapshot()]
        return (
            charts.occupancy_chart(history, now),
            charts.lru_chart(history, now),
            charts.hit_rate_chart(history, now),
            charts.page_map(views, lambda panel: f"panel {panel + 1}"),
            stats_line(self.service, stats),
            {"engine": id(engine), "seq": seq, "steps": stats["steps"], "settled": quiet},
        )

    def _page_view(self, engine: InferenceEngine, record: dict, session: str, evicted: set[int]) -> charts.PageView:
        owners = [self.service.owner(rid) for rid in record["requests"]]
        mine = [o.panel for o in owners if o is not None and o.session == session]
        visible = bool(mine) or (record["state"] == "cached" and self.service.origin(record["page"]) == session)
        return charts.PageView(
            page=record["page"],
            state=record["state"],
            ref_count=record["ref_count"],
            lru_rank=record["lru_rank"],
            chain_pos=record["chain_pos"],
            panels=mine,
            other_users=len(owners) - len(mine),
            text=engine.tokenizer.decode(record["tokens"]) if visible and record["tokens"] else None,
            just_evicted=record["page"] in evicted,
        )

    # ----- buttons ----------------------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        """The shared engine's counters, for API clients (load tests, dashboards)."""
        return self.service.current().cache_stats()

    def clear_cache(self) -> None:
        freed = self.service.current().clear()
        gr.Info(f"Prefix cache cleared: {freed} cached pages are free again.")

    @staticmethod
    def follow_up(n_panels, *texts):
        prompts, outputs = texts[:MAX_PANELS], texts[MAX_PANELS:]
        return [
            (p + o + FOLLOW_UP) if i < int(n_panels) and o else gr.skip()
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
        ]

    def apply_settings(self, model_label, page_size, n_pages, max_batch, prefix_caching, dtype, progress=gr.Progress()):  # noqa: B008 - gradio injects progress through the default
        settings = EngineSettings(
            page_size=int(page_size),
            n_pages=int(n_pages),
            max_batch_size=int(max_batch),
            prefix_caching=bool(prefix_caching),
            dtype=str(dtype),
        )
        progress(0.1, desc=f"Loading {model_label} and building the engine…")
        started = time.monotonic()
        try:
            self.service.rebuild(model_label, settings)
        except Exception as exc:  # offline, unsupported, out of memory: keep serving the current engine
            gr.Warning(f"Could not switch: {exc}")
            return (
                f"❌ Could not load **{model_label}** with these settings: `{exc}`. "
                f"Still serving **{self.service.model_label}**."
            )
        progress(1.0)
        return f"✅ **{model_label}** ready in {time.monotonic() - started:.1f} s ({settings})."

    def load_scenario(self, name, progress=gr.Progress()):  # noqa: B008
        scenario = SCENARIO_BY_NAME.get(name)
        if scenario is None:
            return [gr.skip()] * (9 + 2 * MAX_PANELS)
        status = gr.skip()
        s = scenario.settings
        if s != self.service.settings:
            status = self.apply_settings(
                self.service.model_label,
                s.page_size,
                s.n_pages,
                s.max_batch_size,
                s.prefix_caching,
                s.dtype,
                progress=progress,
            )
        prompts = scenario.prompts + [""] * (MAX_PANELS - len(scenario.prompts))
        return [
            f"**{scenario.name}:** {scenario.explanation}",
            scenario.prefix,
            len(scenario.prompts),
            *prompts,
            *([""] * MAX_PANELS),
            scenario.max_tokens,
            s.page_size,
            s.n_pages,
            s.max_batch_size,
            s.prefix_caching,
            status,
        ]


def build_demo(service: EngineService) -> gr.Blocks:
    app = Playground(service)
    settings = service.settings
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
        table = gr.DataFrame(headers=TABLE_COLUMNS, label="Your requests", interactive=False, elem_id="requests")
        with gr.Accordion("Engine settings (shared by every visitor; applying rebuilds the engine)", open=False):
            with gr.Row():
                model = gr.Dropdown(list(MODEL_CHOICES), value=service.model_label, label="Model")
                page_size = gr.Dropdown([4, 8, 16, 32, 64], value=settings.page_size, label="Page size (tokens)")
                n_pages = gr.Slider(8, 1024, value=settings.n_pages, step=8, label="Pool size (pages)")
                max_batch = gr.Slider(1, 16, value=settings.max_batch_size, step=1, label="Max batch")
                prefix_caching = gr.Checkbox(settings.prefix_caching, label="Prefix caching")
                dtype = gr.Radio(["float32", "bfloat16"], value=settings.dtype, label="dtype")
            apply_btn = gr.Button("Apply settings / load model", elem_id="apply_btn")
            engine_status = gr.Markdown(elem_id="engine_status")
        view_state = gr.State({})
        gr.api(app.cache_stats, api_name="cache_stats", concurrency_limit=8)

        n_panels.change(
            lambda k: [gr.Column(visible=i < int(k)) for i in range(MAX_PANELS)],
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
        settings_inputs = [model, page_size, n_pages, max_batch, prefix_caching, dtype]
        apply_btn.click(
            app.apply_settings,
            settings_inputs,
            engine_status,
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
                page_size,
                n_pages,
                max_batch,
                prefix_caching,
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
