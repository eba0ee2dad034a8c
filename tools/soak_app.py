"""Soak of the playground app, the explainer on: ``python -m tools.soak_app [--visitors 300 --runs 5000]``.

Issue 42 says: "A soak of the app with the explainer on proves it: 300 visitors and 5,000 runs, mixed over the
lesson's steps. Memory is flat after warm-up, and no "unknown" appears on a prompt the engine has never seen." This
tool is that soak. Where ``tools.soak`` drives one engine from inside the process, this drives the whole app from
outside, through the endpoints a browser calls, so whatever the app keeps per visitor, per run and per engine (its
visitors' state, recordings, own pools, the explainer's key histories) is what it measures.

It starts app.py on loopback as ``tools.loadtest`` does (or takes ``--url``), then sends ``--visitors`` visitors, at
most ``--concurrent`` connected at once: each is a gradio_client session of its own (``tools.loadtest.Student``)
that arrives, walks lesson steps picked at random (evenly) until it has made its share of the ``--runs`` runs, and
leaves (its session closed); the next one takes its place. At each step it does what ``tools.loadtest --lockstep``'s
students do: the step's scenario through ``/load_scenario`` (as Lesson ▶), then the step's presses
(``astrai.playground.promises.presses``: Run, Run twice, Run + Follow-up turn + Run, or Compare), each streamed to
its end and followed by ``/after_run``. A run is one press of Run or Compare. Visitors are many and short-lived on
purpose: the app's memory must not grow with the sessions it has seen, only with those it serves.

At a share of the step visits (``--fresh-share``, half by default) the step's prompts are replaced by prompts no
engine has seen: as many panels as the step has, each as many random words (``tools.soak.WORDS``) as the step's
prefix and prompt hold, after an id that starts the prompt (a nonce of this soak, the visit, the panel: 13
characters, each one token at most), so the first page of every such prompt is new and nothing after it can be
cached either. The first press of such a visit is a **never-seen run** (a second press repeats or extends prompts
the engine has just seen). After every run the visitor reads its request table as the page shows it
(``tools.loadtest.read_panels``) and counts the prompt tokens under "unknown": on never-seen runs the target is 0
(the explainer knows every page the engine has made since it started, so a page that was never made is "new",
however long the app has run); on all runs the count is reported too. A panel whose causes do not add up to its
prompt tokens was not explained at all, which would make "no unknown" vacuous: those are counted as well.

The app's ``VmRSS`` is sampled every ``--sample-every`` runs (a twentieth of them by default). Memory is flat after
warm-up when it stops growing once the first ``WARM_UP`` of the runs are done: the report gives the growth from the
first sample at or past that point to the last one, in MiB and %, with the lowest and highest sample in between (no
threshold is set here: the issue asks for the figure). Also: runs per second, TTFT p50 / p95 (panel 1's first text,
as it streamed), errors with their messages (the commonest ``KEEP_MESSAGES``), and figures per lesson step. The run
is OK (exit 0) when no run failed, every visitor connected, every panel read was explained and no never-seen run had
an unknown token. ``--json PATH`` writes the report. All traffic is loopback (or ``--url``); every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import ssl
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from astrai.explain import Cause
from astrai.playground import promises
from astrai.playground.promises import Panel
from astrai.playground.scenarios import LESSON, SCENARIO_BY_NAME
from tools.loadtest import (
    APP,
    Student,
    StudentStep,
    badge_trouble,
    cpu_description,
    follow_up_prompts,
    parse_steps,
    pct,
    process_memory_kb,
    read_panels,
    scenario_args,
    start_app,
)
from tools.soak import WORDS

WARM_UP = 0.2  # the share of the runs after which memory must be flat
KEEP_MESSAGES = 10  # error messages and unknown-token examples kept in the report
MAX_TOKENS = 16  # each run's cap (the steps' own are 4 to 160): 5,000 runs in hours, not a day, on 2 cores


def unknown_tokens(panels: tuple[Panel, ...]) -> int:
    """The prompt tokens of a run's panels whose cause, in the request table, is "unknown"."""
    return sum(panel.causes.get(Cause.UNKNOWN, 0) for panel in panels)


def unexplained(panels: tuple[Panel, ...]) -> int:
    """The panels whose table row does not account for every prompt token by cause (no explanation was given)."""
    return sum(sum(panel.causes.values()) != panel.prompt_tokens for panel in panels)


def fresh_prompts(nonce: int, visit: int, shape: list[str], rng: random.Random) -> list[str]:
    """Prompts no engine has seen, one per text of ``shape`` and as many words long: each starts with an id of its own
    (``nonce``: this soak's, so another soak on the same app makes others; ``visit``; the panel), at most one token a
    character, so that the prompt's first page, and with it each page's chained key, was never made before."""
    return [
        f"{nonce:06x}{visit:06d}{panel} " + " ".join(rng.choices(WORDS, k=len(text.split())))
        for panel, text in enumerate(shape)
    ]


@dataclass
class StepFigures:
    """One lesson step over the soak."""

    visits: int = 0
    runs: int = 0
    never_seen_runs: int = 0
    errors: int = 0
    unknown_tokens: int = 0
    unknown_never_seen: int = 0


@dataclass
class AppSoakReport:
    visitors: int
    planned_runs: int
    config: str = ""
    cpu: str = field(default_factory=cpu_description)
    sessions: set[str] = field(default_factory=set)  # distinct gradio sessions that arrived
    runs: int = 0  # presses of Run or Compare, failed ones too
    never_seen_runs: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    arrivals_on_shared_pool: int = 0  # a step's own pool refused (its reserve taken): the app's warning
    panels: int = 0  # panels whose request table row was read
    never_seen_panels: int = 0
    unexplained_panels: int = 0
    unknown_tokens: int = 0  # on every run
    unknown_never_seen: int = 0  # on never-seen runs: the target is 0
    unknown_examples: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    seconds: float = 0.0
    memory_kb: list[tuple[int, int]] = field(default_factory=list)  # (runs done, VmRSS); []: not known (--url)
    peak_kb: int | None = None  # VmHWM at the end
    steps: dict[int, StepFigures] = field(default_factory=dict)  # 1-based step -> its figures

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and len(self.sessions) == self.visitors
            and self.unexplained_panels == 0
            and self.unknown_never_seen == 0
        )

    def warm_up(self) -> dict | None:
        """Memory after warm-up: from the first sample at or past ``WARM_UP`` of the runs to the last (None: fewer
        than two such samples)."""
        after = [kb for runs, kb in self.memory_kb if runs >= WARM_UP * self.planned_runs]
        if len(after) < 2:
            return None
        first, last = after[0], after[-1]
        return dict(
            from_runs=next(runs for runs, _ in self.memory_kb if runs >= WARM_UP * self.planned_runs),
            from_mib=round(first / 1024, 1),
            to_mib=round(last / 1024, 1),
            growth_mib=round((last - first) / 1024, 1),
            growth_pct=round(100 * (last - first) / first, 1),
            min_mib=round(min(after) / 1024, 1),
            max_mib=round(max(after) / 1024, 1),
        )

    def as_json(self) -> dict:
        return dict(
            ok=self.ok,
            cpu=self.cpu,
            config=self.config,
            visitors=len(self.sessions),
            runs=self.runs,
            never_seen_runs=self.never_seen_runs,
            seconds=round(self.seconds, 1),
            runs_per_s=round(self.runs / self.seconds, 2) if self.seconds else None,
            ttft_p50=pct(self.ttft, 50, "inclusive"),
            ttft_p95=pct(self.ttft, 95, "inclusive"),
            errors=self.errors.total(),
            error_messages=dict(self.errors.most_common(KEEP_MESSAGES)),
            arrivals_on_shared_pool=self.arrivals_on_shared_pool,
            panels=self.panels,
            never_seen_panels=self.never_seen_panels,
            unexplained_panels=self.unexplained_panels,
            unknown_tokens=self.unknown_tokens,
            unknown_never_seen=self.unknown_never_seen,
            unknown_examples=self.unknown_examples,
            memory_mib=[[runs, round(kb / 1024, 1)] for runs, kb in self.memory_kb],
            peak_mib=None if self.peak_kb is None else round(self.peak_kb / 1024, 1),
            after_warm_up=self.warm_up(),
            steps={step: vars(figures) for step, figures in sorted(self.steps.items())},
        )

    def lines(self) -> list[str]:
        f = self.as_json()
        ttft = " / ".join("n/a" if f[k] is None else f"{f[k]:.2f}" for k in ("ttft_p50", "ttft_p95"))
        out = [
            f"cpu: {self.cpu}",
            f"soak: {self.config}",
            f"visitors: {f['visitors']} of {self.visitors}; runs: {self.runs} ({self.never_seen_runs} never-seen) in "
            f"{f['seconds']} s, {f['runs_per_s']} runs/s; TTFT p50 / p95 {ttft} s",
            f"errors: {f['errors']}" + "".join(f"\n  ×{n}: {m}" for m, n in f["error_messages"].items()),
            f"unknown tokens on never-seen prompts: {self.unknown_never_seen} (target 0, {self.never_seen_panels} "
            f"panels); on all prompts: {self.unknown_tokens} ({self.panels} panels); panels not explained: "
            f"{self.unexplained_panels}",
            *(f"  {example}" for example in self.unknown_examples),
            f"arrivals put on a step's shared pool (own pools' reserve taken): {self.arrivals_on_shared_pool}",
        ]
        out.append(f"{'step':<48} {'visits':>6} {'runs':>5} {'never-seen':>10} {'errors':>6} {'unknown (n-s)':>13}")
        for step, s in sorted(self.steps.items()):
            title = f"{step}. {LESSON[step - 1].title}"[:48]
            unknown = f"{s.unknown_tokens} ({s.unknown_never_seen})"
            out.append(f"{title:<48} {s.visits:>6} {s.runs:>5} {s.never_seen_runs:>10} {s.errors:>6} {unknown:>13}")
        warm = f["after_warm_up"]
        if not self.memory_kb:
            out.append("app memory: not known (the app was not started by this tool)")
        else:
            series = ", ".join(f"{runs}: {kb / 1024:.0f}" for runs, kb in self.memory_kb)
            out.append(f"app VmRSS (MiB) by runs done: {series}; peak (VmHWM) {f['peak_mib']} MiB")
        if self.memory_kb and warm is None:
            out.append("after warm-up: fewer than two samples (lower --sample-every)")
        elif warm is not None:
            out.append(
                f"after warm-up (from {warm['from_runs']} runs): {warm['from_mib']} -> {warm['to_mib']} MiB, "
                f"{warm['growth_mib']:+} MiB ({warm['growth_pct']:+}%); min {warm['min_mib']}, max {warm['max_mib']}"
            )
        return [*out, "OK" if self.ok else "FAILED"]


class _Soak:
    """The visitors' shared bookkeeping: the report, the run count, and the memory samples it triggers."""

    def __init__(
        self,
        url: str,
        report: AppSoakReport,
        steps: list[int],
        fresh_share: float,
        max_tokens: int,
        seed: int,
        app_pid: int | None,
        sample_every: int,
        job_timeout: float,
        call_timeout: float,
        progress: Callable[[str], None] | None,
    ):
        self.url, self.report, self.steps, self.fresh_share = url, report, steps, fresh_share
        self.max_tokens, self.seed, self.app_pid, self.sample_every = max_tokens, seed, app_pid, sample_every
        self.job_timeout, self.call_timeout, self.progress = job_timeout, call_timeout, progress
        self.nonce = random.SystemRandom().getrandbits(24)  # never seeded: a rerun on the same app must not repeat
        self.tls = ssl.create_default_context()  # one for every request (see tools.loadtest.run_load)
        self.lock = threading.Lock()
        self.visits = 0

    def visitor(self, index: int, runs: int) -> None:
        """One visitor: arrives, makes ``runs`` runs over random steps, leaves."""
        rng = random.Random(f"{self.seed}/{index}")
        try:
            student = Student(index, self.url, self.tls, self.call_timeout, self.job_timeout)
        except Exception as exc:  # no session: its runs count as failed
            for _ in range(runs):
                self.counted(None, False, f"connecting: {str(exc) or repr(exc)}")
            return
        with self.lock:
            self.report.sessions.add(student.client.session_hash)
        record = StudentStep(index)
        try:
            while runs > 0:
                runs -= self.walk(student, rng.choice(self.steps), rng.random() < self.fresh_share, runs, rng, record)
        finally:
            student.leave()
            with self.lock:
                self.report.ttft += [t for t in record.ttft if t is not None]

    def walk(
        self, student: Student, index: int, fresh: bool, budget: int, rng: random.Random, record: StudentStep
    ) -> int:
        """Lesson step ``index`` as the visitor does it, its presses cut at ``budget`` runs; returns the runs made."""
        step = LESSON[index]
        scenario = SCENARIO_BY_NAME[step.scenario]
        with self.lock:
            self.visits += 1
            visit = self.visits
            self.report.steps.setdefault(index + 1, StepFigures()).visits += 1
        prefix, prompts = scenario.prefix, list(scenario.prompts)
        if fresh:
            prefix, prompts = "", fresh_prompts(self.nonce, visit, [prefix + p for p in prompts], rng)
        try:
            status, _ = student.arrive(scenario.name)
        except Exception as exc:  # the visitor could not start the step: its first press counts as failed
            self.counted(index, fresh, f"arriving: {str(exc) or repr(exc)}")
            return 1
        if "⚠️" in status:
            with self.lock:
                self.report.arrivals_on_shared_pool += 1
        made, outputs = 0, ()
        for button in promises.presses(step):
            if made == budget:
                break
            if button == "replay_mine":  # the lab's replay of the visitor's requests: no run, nothing to soak
                continue
            if button == "follow_up":  # the button's work is the page's own: no call
                turns = follow_up_prompts(prefix, prompts, outputs[: len(prompts)])
                if turns is None:
                    self.counted(index, False, "follow-up turn: a panel had no answer, or the turn is too long")
                    return made + 1
                prompts = turns
                continue
            made += 1
            never_seen = fresh and made == 1
            try:
                result, after = student.press(
                    button, scenario_args(scenario, prompts, self.max_tokens, prefix), len(prompts), record
                )
                trouble = badge_trouble(list(after), len(prompts))
                if trouble is not None:
                    raise RuntimeError(f"ended early: {trouble}")
                panels = read_panels(after, len(prompts))
            except Exception as exc:
                self.counted(index, never_seen, f"{button}: {str(exc) or repr(exc)}")
                return made
            outputs = result.outputs
            self.counted(index, never_seen, None, panels, [str(b) for b in after[: len(prompts)]])
        return made

    def counted(
        self,
        index: int | None,
        never_seen: bool,
        error: str | None,
        panels: tuple[Panel, ...] = (),
        badges: list[str] | None = None,
    ) -> None:
        """One run made (or failed: ``error``) at step ``index`` (None: no step reached); every ``sample_every``
        runs, the app's memory."""
        report, unknown = self.report, unknown_tokens(panels)
        with self.lock:
            report.runs += 1
            report.never_seen_runs += never_seen
            figures = report.steps.setdefault(index + 1, StepFigures()) if index is not None else StepFigures()
            figures.runs += 1
            figures.never_seen_runs += never_seen
            if error is not None:
                report.errors[error[:240]] += 1
                figures.errors += 1
            report.panels += len(panels)
            report.never_seen_panels += len(panels) if never_seen else 0
            report.unexplained_panels += unexplained(panels)
            report.unknown_tokens += unknown
            figures.unknown_tokens += unknown
            if never_seen:
                report.unknown_never_seen += unknown
                figures.unknown_never_seen += unknown
            if unknown and len(report.unknown_examples) < KEEP_MESSAGES:
                shown = [
                    f"panel {i + 1}: {b[:160]}"
                    for i, (p, b) in enumerate(zip(panels, badges or [], strict=False))
                    if p.causes.get(Cause.UNKNOWN)
                ]
                kind = "never-seen" if never_seen else "seen"
                report.unknown_examples.append(f"run {report.runs}, step {index + 1} ({kind}): {'; '.join(shown)}")
            if report.runs % self.sample_every and report.runs != report.planned_runs:
                return
            if self.app_pid is not None:
                report.memory_kb.append((report.runs, process_memory_kb(self.app_pid).get("VmRSS", 0)))
            line = dict(
                runs=report.runs,
                errors=report.errors.total(),
                unknown=report.unknown_tokens,
                unknown_never_seen=report.unknown_never_seen,
                visitors=len(report.sessions),
            )
            if report.memory_kb:
                line["vmrss_mib"] = round(report.memory_kb[-1][1] / 1024)
        if self.progress is not None:
            self.progress(json.dumps(line))


def run_app_soak(
    url: str,
    visitors: int = 300,
    runs: int = 5000,
    concurrent: int = 30,
    steps: list[int] | None = None,
    fresh_share: float = 0.5,
    max_tokens: int = MAX_TOKENS,
    seed: int = 0,
    app_pid: int | None = None,
    sample_every: int | None = None,
    job_timeout: float = 300.0,
    call_timeout: float = 120.0,
    progress: Callable[[str], None] | None = None,
) -> AppSoakReport:
    """``visitors`` visitors, at most ``concurrent`` at once, make ``runs`` runs in all (shared evenly) over the
    lesson's ``steps`` (0-based; all by default): see the module's docstring. ``app_pid``: the server process, for its
    memory; ``sample_every``: runs between two samples of it (a twentieth of ``runs`` by default); ``progress``: told
    the figures so far at each sample."""
    if not 1 <= visitors <= runs:
        raise ValueError(f"every visitor makes a run at least: visitors must be 1 to runs ({runs}), not {visitors}")
    steps = list(range(len(LESSON))) if steps is None else steps
    sample_every = sample_every or max(runs // 20, 1)
    report = AppSoakReport(visitors, runs)
    report.config = (
        f"{visitors} visitors, {concurrent} at once, {runs} runs over steps {', '.join(str(i + 1) for i in steps)}, "
        f"{fresh_share:.0%} of step visits on never-seen prompts, max tokens {max_tokens}, memory every "
        f"{sample_every} runs, seed {seed}"
    )
    soak = _Soak(
        url, report, steps, fresh_share, max_tokens, seed, app_pid, sample_every, job_timeout, call_timeout, progress
    )
    if app_pid is not None:
        report.memory_kb.append((0, process_memory_kb(app_pid).get("VmRSS", 0)))
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(concurrent, visitors)) as pool:  # a visitor that leaves frees a place
        shares = [runs // visitors + (i < runs % visitors) for i in range(visitors)]
        list(pool.map(soak.visitor, range(visitors), shares))
    report.seconds = time.monotonic() - started
    if app_pid is not None:
        report.peak_kb = process_memory_kb(app_pid).get("VmHWM")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running playground; by default app.py is started on loopback")
    parser.add_argument("--visitors", type=int, default=300, help="distinct sessions in all")
    parser.add_argument("--runs", type=int, default=5000, help="presses of Run or Compare in all")
    parser.add_argument("--concurrent", type=int, default=30, help="visitors connected at once")
    parser.add_argument("--steps", default="all", help="the lesson steps to mix: 'all', or numbers such as 1,3,8")
    parser.add_argument("--fresh-share", type=float, default=0.5, help="step visits on never-seen prompts")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="a cap on every step's max tokens")
    parser.add_argument("--sample-every", type=int, default=None, help="runs between memory samples (runs / 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job-timeout", type=float, default=300.0, help="a run still streaming after this fails")
    parser.add_argument("--json", type=Path, help="also write the report here, as JSON")
    parser.add_argument("--app", type=Path, default=APP, help="the app.py to start (another checkout's, say)")
    parser.add_argument("--app-log", type=Path, help="where the started app's output goes (default: nowhere)")
    args = parser.parse_args()
    if not 1 <= args.visitors <= args.runs or args.concurrent < 1 or args.max_tokens < 1:
        parser.error("--visitors takes 1 to --runs, and --concurrent and --max-tokens 1 or more")
    if not 0 <= args.fresh_share <= 1:
        parser.error("--fresh-share takes a share from 0 to 1")
    try:
        steps = parse_steps(args.steps)
    except ValueError as exc:
        parser.error(str(exc))
    with contextlib.ExitStack() as stack:
        launched = None if args.url else stack.enter_context(start_app(log_path=args.app_log, app=args.app))
        report = run_app_soak(
            args.url or launched.url,
            args.visitors,
            args.runs,
            args.concurrent,
            steps,
            args.fresh_share,
            args.max_tokens,
            args.seed,
            None if launched is None else launched.pid,
            args.sample_every,
            args.job_timeout,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    for line in report.lines():
        print(line)
    if args.json:
        args.json.write_text(json.dumps(report.as_json(), indent=1, ensure_ascii=False))
    raise SystemExit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
