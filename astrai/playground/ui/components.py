"""The playground's components, by role and by name: callbacks read and write them through these fields (and
return dicts keyed by them), never by position in a list."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import gradio as gr

MAX_PANELS = 6


@dataclass(frozen=True)
class Panels:
    """One column per panel (``MAX_PANELS`` of them; the first ``n_panels`` are shown)."""

    columns: tuple[gr.Column, ...]
    prompts: tuple[gr.Textbox, ...]
    outputs: tuple[gr.Textbox, ...]
    badges: tuple[gr.Markdown, ...]
    highlights: tuple[gr.HTML, ...]  # each prompt's tokens coloured by why they were cached or computed


@dataclass(frozen=True)
class RunForm:
    """What a run is made of: the panels' prompts come from ``Panels.prompts``."""

    n_panels: gr.Slider
    shared_prefix: gr.Textbox
    max_tokens: gr.Slider
    temperature: gr.Slider
    top_p: gr.Slider
    top_k: gr.Slider
    seed: gr.Number
    cache_namespace: gr.Radio  # which cached pages a run may hit: scenarios.NAMESPACES


@dataclass(frozen=True)
class RunButtons:
    run: gr.Button
    stop: gr.Button
    follow_up: gr.Button
    compare: gr.Button
    clear: gr.Button
    routing: gr.Button  # Compare routing: shown only for a fleet behind two routers


@dataclass(frozen=True)
class CacheViews:
    """What the live view (and replay) draws."""

    page_map: gr.Plot
    occupancy: gr.Plot
    lru: gr.Plot
    hit_rate: gr.Plot
    prefix_tree: gr.Plot
    stats: gr.Markdown
    table: gr.DataFrame
    savings: gr.Plot
    savings_note: gr.Markdown
    routing: gr.Plot  # the routing comparison (a fleet behind two routers)
    routing_note: gr.Markdown
    live_charts: gr.Checkbox
    cursor: gr.State  # the live view's ``LiveCursor``
    timer: gr.Timer


@dataclass(frozen=True)
class ReplayControls:
    step: gr.Slider
    note: gr.Markdown
    back: gr.Button
    forward: gr.Button
    play_1x: gr.Button
    play_slow: gr.Button
    pause: gr.Button
    live: gr.Button
    timer: gr.Timer


@dataclass(frozen=True)
class SizingViews:
    """The cache-sizing lab: a workload, a capacity, and what each eviction policy serves there."""

    trace: gr.Radio
    capacity: gr.Radio  # the workload's replayed capacities, log-spaced, written with separators
    replay_mine: gr.Button
    chart: gr.Plot
    table: gr.DataFrame
    note: gr.Markdown


@dataclass(frozen=True)
class LadderViews:
    """Why is my hit rate low?: a source, a policy (for the traces), the ladder's chart, caption and exports."""

    source: gr.Radio  # views.ladder.SOURCES
    policy: gr.Dropdown  # the traces' replay policy; the visitor's sources take their engine's own
    compute: gr.Button
    chart: gr.Plot
    note: gr.Markdown
    downloads: dict[str, gr.DownloadButton]  # "html", "json", "csv" -> its button


@dataclass(frozen=True)
class EngineForm:
    """The Engine settings panel: a visitor's own profile."""

    model: gr.Dropdown
    page_size: gr.Dropdown
    n_pages: gr.Slider
    max_batch_size: gr.Slider
    prefix_caching: gr.Checkbox
    dtype: gr.Radio
    eviction: gr.Dropdown
    apply: gr.Button
    status: gr.Markdown
    shared_pools: gr.Checkbox  # the lesson's small pools: one shared with everyone instead of the visitor's own


@dataclass(frozen=True)
class Setup:
    scenario: gr.Dropdown
    note: gr.Markdown
    lesson_prev: gr.Button
    lesson_next: gr.Button
    restart: gr.Button  # Restart lesson: shown at the lesson's end
    lesson_end: (
        gr.Markdown
    )  # the lesson's end: the visitor's runs counted by cause, and the reasons a token is computed
    lesson_step: gr.State  # the page shown, 0 .. ``Lesson.length`` - 1 (the steps, then the end; it opens on the first)
    engine: EngineForm


@dataclass(frozen=True)
class Components:
    panels: Panels
    form: RunForm
    buttons: RunButtons
    cache: CacheViews
    replay: ReplayControls
    setup: Setup
    sizing: SizingViews
    ladder: LadderViews

    def run_fields(self) -> dict[str, gr.Component]:
        """The run's inputs by API parameter name (``/run`` and ``/compare`` take them by these names)."""
        form = self.form
        return {
            "n_panels": form.n_panels,
            "shared_prefix": form.shared_prefix,
            **{f"prompt_{i + 1}": box for i, box in enumerate(self.panels.prompts)},
            "max_tokens": form.max_tokens,
            "temperature": form.temperature,
            "top_p": form.top_p,
            "top_k": form.top_k,
            "seed": form.seed,
            "cache_namespace": form.cache_namespace,
        }

    def engine_fields(self) -> dict[str, gr.Component]:
        """The Engine settings panel's inputs by API parameter name (``/apply_settings``)."""
        engine = self.setup.engine
        return {
            "model": engine.model,
            "page_size": engine.page_size,
            "n_pages": engine.n_pages,
            "max_batch_size": engine.max_batch_size,
            "prefix_caching": engine.prefix_caching,
            "dtype": engine.dtype,
            "eviction": engine.eviction,
        }


def by_name(fields: Mapping[str, gr.Component], handler: Callable[..., Any]) -> tuple[list[gr.Component], Callable]:
    """The inputs of an event whose handler takes its values as one dict by name: ``handler(values, *rest)``.

    Gradio passes input values by position; this wrapper turns them back into names, and gives the endpoint a
    signature with those names (what API clients see), followed by the handler's own injected parameters
    (``gr.Request``, ``gr.Progress``), which Gradio finds by annotation and default.
    """
    names = list(fields)
    injected = list(inspect.signature(handler).parameters.values())[1:]

    def values(args: tuple[Any, ...]) -> tuple[dict[str, Any], tuple[Any, ...]]:
        return dict(zip(names, args[: len(names)], strict=True)), args[len(names) :]

    wrapper: Callable[..., Any]
    if inspect.isgeneratorfunction(handler):

        def streaming(*args: Any) -> Iterator[Any]:
            named, rest = values(args)
            yield from handler(named, *rest)

        wrapper = streaming
    else:

        def wrapper(*args: Any) -> Any:
            named, rest = values(args)
            return handler(named, *rest)

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    _describe(wrapper, handler, [*params, *injected])
    return list(fields.values()), wrapper


def fixed(method: Callable, **kwargs: Any) -> Callable:
    """``method`` with some keyword arguments fixed, keeping the rest of its signature for Gradio to read (it
    injects ``gr.Request`` and ``gr.Progress`` by their annotations and defaults, positionally)."""
    signature = inspect.signature(method)
    kept = [p for name, p in signature.parameters.items() if name not in kwargs]
    names = [p.name for p in kept]

    def bound(*args: Any) -> Any:
        return method(**dict(zip(names, args, strict=False)), **kwargs)

    _describe(bound, method, kept)
    return bound


def _describe(wrapper: Callable, handler: Callable, params: list[inspect.Parameter]) -> None:
    """Give ``wrapper`` the signature Gradio reads. Only a ``gr.Request`` annotation is kept, as the class itself:
    Gradio resolves annotations in the wrapper's module, and one name it cannot resolve there makes it drop them
    all (and then it injects no request)."""
    requests = {p.name for p in params if p.annotation in (gr.Request, "gr.Request")}
    params = [p.replace(annotation=gr.Request if p.name in requests else inspect.Parameter.empty) for p in params]
    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # what inspect reads
    wrapper.__annotations__ = dict.fromkeys(requests, gr.Request)
    wrapper.__name__ = handler.__name__
    wrapper.__doc__ = handler.__doc__
