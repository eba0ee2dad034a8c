"""What the causes of a shown run cost each live tick: ``python -m benchmarks.explain_tick [--rounds 3]
[--history 150] [--ticks 50]``.

The playground's default engine (its settings, the embedded model) first serves ``--history`` earlier runs of six
panels, other visitors' runs, so the key history holds thousands of keys and some evicted; then one run of six
panels, the one shown. What a tick of the live view adds for it (``callbacks/run.py``'s details): the causes of its
six requests (``Backend.explain``) and each panel's coloured tokens (``views.causes.token_html``). A round times
``--ticks`` ticks and keeps its median; the figure is min / median / max over rounds (issue 36's bound: 5 ms).
"""

from __future__ import annotations

import argparse
import statistics
import time

from astrai.engine import InferenceEngine
from astrai.playground.backends.local import LocalBackend
from astrai.playground.backends.profiles import DEFAULT_PROFILE, EMBEDDED_MODEL
from astrai.playground.scenarios import SCENARIOS
from astrai.playground.views import causes, text
from astrai.sampling import SamplingParams
from benchmarks.host_cpu import cpu_name

PANELS = 6
MAX_TOKENS = 48


def panel_prompts(backend: LocalBackend, run: int) -> list[str]:
    """Six prompts of the lesson's scenarios, after their own prefixes; ``run`` varies their tails, so each run
    stores pages of its own beside the shared prefixes."""
    pairs = [(s.prefix, p) for s in SCENARIOS for p in s.prompts]
    chosen = [pairs[(run * PANELS + i) % len(pairs)] for i in range(PANELS)]
    return [backend.format_prompt(prefix, f"{prompt} ({run})") for prefix, prompt in chosen]


def served(backend: LocalBackend, run: int) -> list[int]:
    handle = backend.submit(panel_prompts(backend, run), SamplingParams(max_tokens=MAX_TOKENS), salt=None)
    for _ in handle:
        pass
    return list(handle.request_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--history", type=int, default=150, help="earlier six-panel runs before the one shown")
    parser.add_argument("--ticks", type=int, default=50, help="ticks timed per round")
    args = parser.parse_args()
    settings = DEFAULT_PROFILE.settings
    engine = InferenceEngine.from_pretrained(
        EMBEDDED_MODEL,
        page_size=settings.page_size,
        n_pages=settings.n_pages,
        max_batch_size=settings.max_batch_size,
        dtype=settings.dtype,
    )
    backend = LocalBackend(engine, "default")
    try:
        for run in range(args.history):
            served(backend, run)
        ids = served(backend, args.history)
        own = set(ids)
        whose = causes.Whose({rid: i for i, rid in enumerate(ids)}, own)
        shown_as = text.readable(backend.decode, backend.special_ids())

        def tick() -> list[str]:
            infos = {info.id: info for info in backend.request_info(ids)}
            return [
                causes.token_html(why, infos[why.request].prompt_ids, shown_as, whose, text.MAX_HIGHLIGHT_TOKENS)
                for why in backend.explain(ids, own.__contains__)
            ]

        assert len(tick()) == PANELS, "every panel of the shown run is explained"
        medians = []
        for _ in range(args.rounds):
            seconds = []
            for _ in range(args.ticks):
                started = time.perf_counter()
                tick()
                seconds.append(time.perf_counter() - started)
            medians.append(statistics.median(seconds) * 1000)
        stats = backend.stats()
        print(f"cpu: {cpu_name()}")
        print(
            f"engine: {settings.n_pages} pages x {settings.page_size} tokens; {args.history} earlier runs of {PANELS} "
            f"panels x {MAX_TOKENS} tokens; {stats.evictions} evictions, {stats.cached_pages} cached pages"
        )
        print(
            f"a tick's causes for {PANELS} panels (explain + token_html), median of {args.ticks} per round, "
            f"min / median / max over {args.rounds} rounds: {min(medians):.2f} / {statistics.median(medians):.2f} / "
            f"{max(medians):.2f} ms"
        )
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
