"""Load test of the playground: ``python -m tools.loadtest --clients 16 --rounds 3 [--spread]``.

Starts app.py on loopback (or uses ``--url``), then runs concurrent gradio_client users (one ``Client``, one
session each), each sending batches for several rounds and cancelling some mid-stream (``--cancel-rate``). It
reports completed / errors / cancelled counts, p50/p95 time to first token and total time, how a full queue
answers, and the engines' used pages afterwards; the CPU; and, for an app it started, the app process's memory.

Two ways to fill the panels:

- without ``--spread`` (the figures in docs/benchmarks.md): every user sends 4 of ``PROMPTS`` after ``PREFIX``,
  on the default engine;
- ``--spread [weighted|round-robin]``: a classroom working through the lesson. Each user is given a scenario
  (weighted, the default of the flag: half of them on "Shared system prompt", the rest evenly over "Eviction
  pressure (small pool)", "Distinct prompts (no hits)", "Same page, different prefix" and "Follow-up turn", each
  scenario at least once when there are enough users; or round-robin over the same five). Every round starts, as
  the lesson's steps do, with ``/load_scenario`` of that scenario in the user's own session (which puts the session
  on the scenario's engine); then the user runs the scenario's prompts after its prefix, in the scenario's cache
  namespace (shared, the user's own, or fresh for each run: ``Scenario.namespace``), with max tokens
  ``min(scenario's, --max-tokens)``, and calls ``/after_run`` as the browser does. A "Follow-up turn" user sends
  each panel's prompt + answer + " Then" from its second round on. ``--custom N`` (1 by default with ``--spread``)
  users of the shared-system-prompt scenario first apply their own Engine settings (``/apply_settings``,
  ``CUSTOM_SETTINGS``: an engine of their own). Figures are given per scenario (and engine), and overall.

A run is **ended by another visitor** when its own client did not cancel it and /run returned without an error,
and yet (a) the run's stream carried a warning (``gr.Warning``: the app's "The engine stopped, so
this run ended early", or a failed request), or (b) with ``--spread``, the ``/after_run`` badge of one of its panels
says "cancelled" or "failed" (the request's status), or is empty (the engine no longer knows the request: it was
retired or replaced). Nothing the client does can cause either, so every such run was cut short by something
outside it: another visitor's action, or the app. It is not counted as completed.

The tool's own engines: before the load, one stats session per engine the load uses (the default, the small pool,
the custom one) moves there and reads ``/cache_stats``; after it, each is read again for the tokens generated,
used pages and failed requests. The app's memory is ``VmRSS`` (and its peak, ``VmHWM``) of the server process,
read before the load (every engine the load uses is built by then) and after it; with ``--url`` it is not known.
With several rounds, TTFT and total time are also given per round (a round is every user's n-th run; users are
not synchronised), as min / median / max over the rounds. Every loop is bounded in count and time; all traffic is
loopback (or ``--url``).

``--lockstep --clients 30 --steps all`` (or ``--steps 1,3,8``): a class working through the lesson together, as a
teacher leads it. Each student is one gradio_client session, kept over every step (a browser tab). At each step,
every student loads it as Lesson ▶ does (``/load_scenario`` of the step's scenario: the lesson's buttons are not in the
API, and their callback is that one's function) and reads ``/cache_stats``; once all have answered (the barrier), all
press the step's button within ``PRESS_SPREAD_S`` (one press per student, spread uniformly, shuffled), each streaming
its run to the end and then calling ``/after_run`` as the browser chains it. A step that says "Run twice", "then
Follow-up turn, then Run again" or "Press Compare" gets those presses, each one in lockstep again, and one that says
"then Replay my requests" has every student call ``/replay_my_requests`` after its run (``astrai.playground.promises
.presses``). Per step: TTFT p50 / p95 / max (the first text of panel 1 as the student saw
it stream, every press), each run's time to its end, the class's time from the first press to the last run's end, the
errors with their messages, and per student whether what it was shown (badges, the request table's cause counts, the
savings note, the evictions its stats line counted during the step, Replay my requests' table) keeps the step's promise
(``astrai.playground.promises``); then the app's VmRSS after all steps. ``--rounds N`` walks the lesson N times and
gives each step's TTFT p95 as min / median / max over the rounds; ``--json PATH`` writes the report. The tool reads only
what a visitor reads, so it holds however the app makes a step's pool.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astrai.playground.scenarios import Scenario

APP = Path(__file__).resolve().parents[1] / "app.py"
PROMPTS = [
    "One day, he found a",
    "One day, his cat",
    "One day, a big storm",
    "One day, a little girl named Lily",
    "The dog ran to",
    "Mia wanted a",
    "The sun was",
    "Ben and Sam",
]
PREFIX = "Once upon a time, in a small village by the sea, there lived a kind old fisherman named Tom. "
# --spread weighted: users per scenario in these proportions (16 users: 8 / 2 / 2 / 2 / 2, one of the 8 on its own
# settings by default)
SPREAD_WEIGHTS = {
    "Shared system prompt": 8,
    "Eviction pressure (small pool)": 2,
    "Distinct prompts (no hits)": 2,
    "Same page, different prefix": 2,
    "Follow-up turn": 2,
}
SPREADS = ("weighted", "round-robin")
# --custom: the Engine settings those users apply (an engine none of the scenarios names)
CUSTOM_SETTINGS = dict(page_size=8, n_pages=512, max_batch_size=16, prefix_caching=True, dtype="float32")
CUSTOM_GROUP = " (own settings)"
MAX_PROMPT_CHARS = 4000  # the app refuses prefix + prompt beyond 2 x ui.layout.MAX_PROMPT_CHARS
ENDED_WORDS = ("cancelled", "failed")


# ----- the app -------------------------------------------------------------------------------------------------
START_TIMEOUT_S = 300


@dataclass(frozen=True)
class LaunchedApp:
    url: str
    pid: int


@contextlib.contextmanager
def start_app(
    extra_env: dict[str, str] | None = None,
    log_path: Path | None = None,
    app: Path = APP,
    args: list[str] | None = None,
) -> Iterator[LaunchedApp]:
    """Serve ``app`` (this checkout's app.py by default) on a free loopback port for the duration of the block;
    yields its URL and the server's process id."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        # the app's backend comes from ``args`` only: a test run's ASTRAI_VLLM_* (set by .ci/run for the vllm tests)
        # must not turn the embedded-engine apps into vLLM ones
        **{name: value for name, value in os.environ.items() if not name.startswith("ASTRAI_VLLM_")},
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_OFFLINE": "1",
        **(extra_env or {}),
    }
    log = open(log_path or os.devnull, "w")  # noqa: SIM115 - closed below, after the server
    command = [sys.executable, str(app), *(args or [])]
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=app.parent)
    # a first start on this machine compiles the model (about a minute on 2 cores; astrai/compiled_forward.py)
    url, deadline = f"http://127.0.0.1:{port}/", time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            try:
                urllib.request.urlopen(url + "config", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"app.py exited with {proc.returncode}; see {log_path}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"app.py did not start within {START_TIMEOUT_S} s") from None
                time.sleep(0.3)
        yield LaunchedApp(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextlib.contextmanager
def launch_app(
    extra_env: dict[str, str] | None = None,
    log_path: Path | None = None,
    app: Path = APP,
    args: list[str] | None = None,
) -> Iterator[str]:
    """``start_app``, yielding the URL alone."""
    with start_app(extra_env, log_path, app, args) as launched:
        yield launched.url


def process_memory_kb(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak) of a process, in kB; empty when it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in lines if line.startswith(("VmRSS:", "VmHWM:")))
    return {name: int(value.split()[0]) for name, value in fields}


def cpu_description() -> str:
    """The CPU's model name and whether it has AVX-512 (``avx512f``) and AMX (``amx_tile``)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    has = {flag: "yes" if flag in flags else "no" for flag in ("avx512f", "amx_tile")}
    return f"{name} ({os.cpu_count()} CPUs); avx512f: {has['avx512f']}; amx_tile: {has['amx_tile']}"


# ----- what the users send -------------------------------------------------------------------------------------
def run_args(panels: list[str], max_tokens: int, prefix: str = PREFIX) -> dict:
    """Keyword arguments of the /run endpoint for these panel prompts, greedy."""
    prompts = panels + [""] * (6 - len(panels))
    return dict(
        n_panels=len(panels),
        shared_prefix=prefix,
        **{f"prompt_{i + 1}": p for i, p in enumerate(prompts)},
        max_tokens=max_tokens,
        temperature=0,
        top_p=1,
        top_k=0,
        seed=0,
        cache_namespace="shared",
    )


def scenario_args(scenario: Scenario, panels: list[str], max_tokens: int | None, prefix: str | None = None) -> dict:
    """``run_args`` as the page sets them on ``scenario``: its prefix (or ``prefix``), its cache namespace, and its max
    tokens, capped at ``max_tokens`` (None: its own)."""
    args = run_args(panels, min(scenario.max_tokens, max_tokens or scenario.max_tokens), scenario.prefix)
    if prefix is not None:
        args["shared_prefix"] = prefix
    args["cache_namespace"] = scenario.namespace  # as the scenario sets it in the page
    return args


@dataclass(frozen=True)
class Visit:
    """What one user does: the scenario it loads, and whether it applies ``CUSTOM_SETTINGS`` after it."""

    scenario: str | None  # None: the plain mode (4 of PROMPTS on the default engine)
    custom: bool = False

    @property
    def group(self) -> str:
        if self.scenario is None:
            return "4 of PROMPTS"
        return self.scenario + (CUSTOM_GROUP if self.custom else "")

    @property
    def engine(self) -> str:
        """The name of the profile it runs on."""
        if self.custom:
            return "your own settings"
        if self.scenario is None:
            return "default"
        from astrai.playground.scenarios import SCENARIO_BY_NAME

        return SCENARIO_BY_NAME[self.scenario].profile.name


def apportion(n: int, weights: dict[str, int]) -> dict[str, int]:
    """``n`` split in proportion to ``weights`` (largest remainders, ties in order), each name at least once when
    ``n`` allows."""
    total = sum(weights.values())
    quotas = {name: n * w / total for name, w in weights.items()}
    counts = {name: int(q) for name, q in quotas.items()}
    by_remainder = sorted(weights, key=lambda name: quotas[name] - counts[name], reverse=True)
    for name in by_remainder[: n - sum(counts.values())]:
        counts[name] += 1
    if n >= len(weights):
        for name in weights:
            if counts[name] == 0:
                counts[max(counts, key=counts.get)] -= 1
                counts[name] = 1
    return counts


def spread_plan(clients: int, spread: str | None, custom: int = 0) -> list[Visit]:
    """Each user's visit. ``weighted``: ``apportion`` over ``SPREAD_WEIGHTS``, interleaved (smooth weighted
    round-robin) so the scenarios start mixed; ``round-robin``: the scenarios in turn. Then up to ``custom`` users
    of the first scenario (from the last, one always left plain) apply their own settings."""
    if spread is None:
        return [Visit(None)] * clients
    names = list(SPREAD_WEIGHTS)
    if spread == "round-robin":
        order = [names[i % len(names)] for i in range(clients)]
    elif spread == "weighted":
        counts = apportion(clients, SPREAD_WEIGHTS)
        credit = dict.fromkeys(names, 0)
        order = []
        for _ in range(clients):
            for name in names:
                credit[name] += counts[name]
            best = max(names, key=lambda name: credit[name])
            credit[best] -= clients
            order.append(best)
    else:
        raise ValueError(f"spread must be one of {SPREADS}, got {spread!r}")
    visits = [Visit(name) for name in order]
    firsts = [i for i, visit in enumerate(visits) if visit.scenario == names[0]]
    for i in firsts[1:][::-1][:custom]:
        visits[i] = Visit(names[0], custom=True)
    return visits


# ----- the report ----------------------------------------------------------------------------------------------
@dataclass
class RunRecord:
    group: str
    engine: str
    round: int  # 0-based
    outcome: str  # completed / cancelled / ended_by_other / busy / error
    ttft: float | None
    total: float


def pct(values: list[float], q: int, method: str = "exclusive") -> float | None:
    """The ``q``-th percentile (``statistics.quantiles``' method: "inclusive" keeps it within the values seen)."""
    return round(statistics.quantiles(values, n=100, method=method)[q - 1], 3) if len(values) >= 2 else None


def spread_of(values: list[float | None]) -> str:
    """min / median / max of the values that are known."""
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    return " / ".join(f"{v:.3f}" for v in (min(known), statistics.median(known), max(known)))


@dataclass
class LoadReport:
    outcomes: Counter = field(default_factory=Counter)  # completed / cancelled / ended_by_other / busy / error / hung
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    busy_answer_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ended_by_other: list[str] = field(default_factory=list)  # why, one line per such run
    runs: list[RunRecord] = field(default_factory=list)
    clients: dict[str, int] = field(default_factory=dict)  # group -> users
    used_pages_after: int = -1  # the most any engine the load used still holds (0: none leaked)
    engines: dict[str, dict] = field(default_factory=dict)  # engine -> generated tokens, used pages after, failed
    seconds: float = 0.0
    tokens_per_s: float | None = None  # tokens the engines generated during the load, over its wall time
    memory_kb: dict[str, int] = field(default_factory=dict)  # VmRSS before/after the load, VmHWM after; {}: unknown
    cpu: str = field(default_factory=cpu_description)
    config: str = ""

    def summary(self) -> dict:
        return dict(
            outcomes=dict(self.outcomes),
            ttft_p50=pct(self.ttft, 50),
            ttft_p95=pct(self.ttft, 95),
            total_p50=pct(self.total, 50),
            total_p95=pct(self.total, 95),
            ended_by_other=len(self.ended_by_other),
            ended_by_other_why=self.ended_by_other[:5],
            busy_answers=len(self.busy_answer_s),
            busy_answer_max_s=max(self.busy_answer_s, default=None),
            errors=self.errors[:5],
            used_pages_after=self.used_pages_after,
            seconds=round(self.seconds, 1),
            tokens_per_s=None if self.tokens_per_s is None else round(self.tokens_per_s, 1),
        )

    def lines(self) -> list[str]:
        """The report as text: CPU, per group and overall, per round, engines, memory."""
        out = [f"cpu: {self.cpu}", f"load: {self.config}"]
        header = f"{'scenario':<46} {'engine':<18} {'users':>5} {'runs':>4} {'done':>4} {'canc':>4} {'err':>4}"
        out.append(header + f" {'other':>5}  {'TTFT p50 / p95 s':<17} {'total p50 / p95 s':<17}")
        groups = [*self.clients, "overall"]
        for group in groups:
            runs = self.runs if group == "overall" else [r for r in self.runs if r.group == group]
            if not runs:
                continue
            count = Counter(r.outcome for r in runs)
            ttft = [r.ttft for r in runs if r.ttft is not None]
            total = [r.total for r in runs if r.outcome == "completed"]
            engine = "" if group == "overall" else runs[0].engine
            users = sum(self.clients.values()) if group == "overall" else self.clients[group]
            out.append(
                f"{group:<46} {engine:<18} {users:>5} {len(runs):>4} {count['completed']:>4} {count['cancelled']:>4}"
                f" {count['error'] + count['busy']:>4} {count['ended_by_other']:>5}  {_pair(ttft):<17} {_pair(total)}"
            )
        rounds = sorted({r.round for r in self.runs})
        if len(rounds) > 1:
            out.append(f"per round, min / median / max over {len(rounds)} rounds (s):")
            out += self._per_round(self.runs, rounds, "  ")
            engines = sorted({r.engine for r in self.runs})
            if len(engines) > 1:  # each engine apart: the lesson's small pool is slow by design (evictions, waits)
                for engine in engines:
                    out.append(f"  on the {engine} engine:")
                    out += self._per_round([r for r in self.runs if r.engine == engine], rounds, "    ")
        for engine, figures in self.engines.items():
            out.append(f"engine {engine}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
        if self.memory_kb:
            mib = {k: f"{v / 1024:.0f} MiB" for k, v in self.memory_kb.items()}
            out.append(
                f"app memory ({len(self.engines)} engines in use by the load, built before it): VmRSS before the "
                f"load {mib.get('before', '?')}, after {mib.get('after', '?')}; peak (VmHWM) {mib.get('peak', '?')}"
            )
        else:
            out.append("app memory: not known (the app was not started by this tool)")
        return out

    @staticmethod
    def _per_round(runs: list[RunRecord], rounds: list[int], indent: str) -> list[str]:
        ttft = [[r.ttft for r in runs if r.round == i and r.ttft is not None] for i in rounds]
        total = [[r.total for r in runs if r.round == i and r.outcome == "completed"] for i in rounds]
        per_round = {
            "TTFT p50": [pct(values, 50) for values in ttft],
            "TTFT p95": [pct(values, 95) for values in ttft],
            "total p50": [pct(values, 50) for values in total],
            "total p95": [pct(values, 95) for values in total],
        }
        return [f"{indent}{name}: {spread_of(values)}" for name, values in per_round.items()]


def _pair(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f} (one run)" if values else "n/a"
    return f"{pct(values, 50):.2f} / {pct(values, 95):.2f}"


# ----- the load ------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    outcome: str  # completed / cancelled / busy / error (ended_by_other is decided by the caller)
    ttft: float | None
    total: float
    error: str | None = None
    warnings: list[str] = field(default_factory=list)  # gr.Warning / gr.Error messages the stream carried
    outputs: tuple = ()  # the panels' final text (a completed run)


def _call(client, timeout: float, *args, api_name: str, **kwargs):
    """A non-streaming endpoint, bounded in time."""
    job = client.submit(*args, api_name=api_name, **kwargs)
    try:
        return job.result(timeout=timeout)
    except TimeoutError:
        job.cancel()
        raise TimeoutError(f"{api_name} did not answer within {timeout:.0f} s") from None


def _move(client, visit: Visit, timeout: float) -> None:
    """Put the client's session on the visit's engine, as the page does: the scenario, then the settings."""
    status = _call(client, timeout, visit.scenario, api_name="/load_scenario")[-1]
    if visit.custom:
        from astrai.playground.backends.profiles import EMBEDDED_LABEL

        status = _call(client, timeout, model=EMBEDDED_LABEL, **CUSTOM_SETTINGS, api_name="/apply_settings")[-1]
    if not str(status).startswith("✅"):
        raise RuntimeError(f"the move to {visit.group!r} was refused: {status}")


def _drain_warnings(job) -> list[str]:
    """The warning and error messages (``gr.Warning``, ``gr.Error``) a job's stream carried since the last call.
    gradio_client keeps every status update of a job in ``communicator.updates`` (an unbounded queue it fills and
    nothing else drains for a sync caller); a ``log`` update is a toast."""
    updates = getattr(getattr(job, "communicator", None), "updates", None)
    messages: list[str] = []
    for _ in range(100_000 if updates is not None else 0):
        try:
            update = updates.get_nowait()
        except Exception:  # asyncio.QueueEmpty
            break
        log = getattr(update, "log", None)
        if log and log[1] in ("warning", "error"):
            messages.append(str(log[0]))
    return messages


def one_run(
    client, args: dict, cancel: bool, timeout: float, panels: int = 4, api_name: str = "/run", first_panel: bool = False
) -> RunResult:
    """One /run (or ``api_name``: /compare streams the same way): streamed until done, or cancelled at its first text
    when ``cancel``. Its TTFT is the first text of any panel, or with ``first_panel``, of panel 1."""
    started = time.monotonic()
    ttft = None
    warnings: list[str] = []
    watched = 1 if first_panel else panels
    try:
        job = client.submit(**args, api_name=api_name)
        deadline = started + timeout
        while not job.done() and time.monotonic() < deadline:
            warnings += _drain_warnings(job)
            outputs = job.outputs()
            if ttft is None and outputs and any(outputs[-1][:watched]):
                ttft = time.monotonic() - started
                if cancel:
                    job.cancel()
                    return RunResult("cancelled", ttft, time.monotonic() - started, warnings=warnings)
            time.sleep(0.02)
        if not job.done():
            job.cancel()
            return RunResult("error", ttft, time.monotonic() - started, "timed out", warnings)
        final = job.result()
        warnings += _drain_warnings(job)
        if ttft is None and any(job.outputs()[-1][:watched]):
            ttft = time.monotonic() - started
        return RunResult("completed", ttft, time.monotonic() - started, None, warnings, tuple(final or ()))
    except Exception as exc:
        message = str(exc)
        outcome = "busy" if "queue" in message.lower() and "full" in message.lower() else "error"
        return RunResult(outcome, ttft, time.monotonic() - started, message[:200], warnings)


def follow_up_prompts(prefix: str, prompts: list[str], answers: tuple | list) -> list[str] | None:
    """The next turn's prompts, as Follow-up turn makes them (each prompt + its answer + ``FOLLOW_UP``); None when a
    panel has no answer or a turn would pass the app's length limit."""
    from astrai.playground.scenarios import FOLLOW_UP

    turns = [p + str(a) + FOLLOW_UP for p, a in zip(prompts, answers, strict=False) if a]
    fits = len(turns) == len(prompts) and all(len(prefix + t) <= MAX_PROMPT_CHARS for t in turns)
    return turns if fits else None


def badge_trouble(badges: list, panels: int) -> str | None:
    """Why /after_run's badges say a run's request did not end on its own (see the module's docstring), or None."""
    for i, badge in enumerate(badges[:panels]):
        text = str(badge or "")
        if not text:
            return f"panel {i + 1} has no badge (its engine no longer knows the request)"
        words = [word for word in ENDED_WORDS if word in text]
        if words:
            return f"panel {i + 1}: {text[:160]}"
    return None


class _Stats:
    """A session of the tool's own on one engine: reads /cache_stats there."""

    def __init__(self, client, visit: Visit, timeout: float):
        self.client, self.visit, self.timeout = client, visit, timeout
        if visit.scenario is not None:
            _move(client, visit, timeout)
        self.before = self.read()

    def read(self) -> dict:
        return _call(self.client, self.timeout, api_name="/cache_stats")


def run_load(
    url: str,
    clients: int = 16,
    rounds: int = 3,
    max_tokens: int = 48,
    cancel_rate: float = 0.25,
    seed: int = 0,
    job_timeout: float = 180.0,
    spread: str | None = None,
    custom: int | None = None,
    app_pid: int | None = None,
    call_timeout: float = 60.0,
) -> LoadReport:
    """``clients`` users, ``rounds`` runs each (see the module's docstring); ``app_pid``: the server process, for its
    memory. ``custom`` defaults to 1 with a spread, 0 without."""
    from gradio_client import Client

    report = LoadReport()
    lock = threading.Lock()
    # gradio_client opens an httpx client per request, and httpx builds a fresh TLS context (loading certifi's CA
    # bundle) for each one unless it is given one: py-spy put 61% of this generator's CPU there, and the generator
    # shares the server's two cores. One context, verification unchanged, for every request (``ssl_verify`` goes
    # to httpx's ``verify`` as it is, and httpx takes a context there).
    tls = ssl.create_default_context()
    visits = spread_plan(clients, spread, (1 if spread else 0) if custom is None else custom)
    report.clients = dict(Counter(visit.group for visit in visits))
    report.config = (
        f"{clients} users ({'spread ' + spread if spread else 'no spread'}, {sum(v.custom for v in visits)} on own "
        f"settings), {rounds} rounds, max tokens {max_tokens}, cancel rate {cancel_rate}"
    )
    if spread is not None:
        from astrai.playground.scenarios import SCENARIO_BY_NAME

    def record(visit: Visit, round_: int, result: RunResult, ended: str | None = None) -> None:
        outcome = "ended_by_other" if ended else result.outcome
        with lock:
            report.runs.append(RunRecord(visit.group, visit.engine, round_, outcome, result.ttft, result.total))
            report.outcomes[outcome] += 1
            if result.ttft is not None:
                report.ttft.append(result.ttft)
            if outcome == "completed":
                report.total.append(result.total)
            if outcome == "busy":
                report.busy_answer_s.append(result.total)
            if result.error and outcome == "error":
                report.errors.append(f"{visit.group}: {result.error}")
            if ended:
                report.ended_by_other.append(f"{visit.group}, round {round_ + 1}: {ended}")

    def user(index: int, visit: Visit) -> None:
        rng = random.Random(seed * 1000 + index)
        round_ = 0
        try:
            client = Client(url, verbose=False, ssl_verify=tls)
            scenario = SCENARIO_BY_NAME[visit.scenario] if visit.scenario is not None else None
            prompts = list(scenario.prompts) if scenario is not None else []
            for round_ in range(rounds):
                if scenario is None:
                    args = run_args(rng.sample(PROMPTS, 4), max_tokens)
                else:
                    started = time.monotonic()
                    try:
                        _move(client, visit, call_timeout)
                    except Exception as exc:  # refused, or no answer: this round's run is not sent
                        record(visit, round_, RunResult("error", None, time.monotonic() - started, str(exc)[:200]))
                        continue
                    args = scenario_args(scenario, prompts, max_tokens)
                cancel = rng.random() < cancel_rate
                result = one_run(client, args, cancel, job_timeout, args["n_panels"])
                ended = None
                if result.outcome == "completed" and result.warnings:
                    ended = f"the stream warned: {result.warnings[0][:160]}"
                if scenario is not None and result.outcome in ("completed", "cancelled"):
                    try:  # the browser chains it after every run, stopped or not
                        badges = _call(client, call_timeout, api_name="/after_run")[:6]
                    except Exception as exc:
                        record(visit, round_, RunResult("error", result.ttft, result.total, f"/after_run: {exc}"))
                        continue
                    if result.outcome == "completed" and ended is None:
                        ended = badge_trouble(list(badges), args["n_panels"])
                record(visit, round_, result, ended)
                if scenario is not None and scenario.name == "Follow-up turn":  # the next turn, as the button does
                    answers = result.outputs[: len(prompts)] if result.outcome == "completed" and not ended else ()
                    prompts = follow_up_prompts(scenario.prefix, prompts, answers) or list(scenario.prompts)
        except Exception as exc:  # the client itself failed: the rounds it did not finish count as errors
            for missed in range(round_, rounds):
                record(visit, missed, RunResult("error", None, 0.0, f"client failed: {exc}"[:200]))

    engine_visits: dict[str, Visit] = {}
    for visit in visits:  # one stats session per engine, on a visit that leads there
        engine_visits.setdefault(visit.engine, Visit(visit.scenario, visit.custom))
    stats_clients = {}
    for engine, visit in engine_visits.items():
        try:
            stats_clients[engine] = _Stats(Client(url, verbose=False, ssl_verify=tls), visit, call_timeout)
        except Exception as exc:
            report.errors.append(f"stats session on {engine}: {exc}"[:200])
    if app_pid is not None:
        report.memory_kb["before"] = process_memory_kb(app_pid).get("VmRSS", 0)
    started = time.monotonic()
    threads = [threading.Thread(target=user, args=(i, v), daemon=True) for i, v in enumerate(visits)]
    for t in threads:
        t.start()
    deadline = started + (job_timeout + 3 * call_timeout) * rounds + 60
    for t in threads:
        t.join(timeout=max(deadline - time.monotonic(), 0.1))
    report.outcomes["hung"] += sum(t.is_alive() for t in threads)
    report.seconds = time.monotonic() - started
    generated = 0
    for engine, stats in stats_clients.items():
        try:
            after = stats.read()
        except Exception as exc:
            report.errors.append(f"stats of {engine}: {exc}"[:200])
            continue
        tokens = None
        if stats.before.get("generated_tokens") is not None:  # None: older apps
            tokens = after["generated_tokens"] - stats.before["generated_tokens"]
            generated += tokens
        failed = after.get("failed", 0) - stats.before.get("failed", 0)
        report.engines[engine] = {"generated tokens": tokens, "failed requests": failed}
    if any(figures["generated tokens"] is not None for figures in report.engines.values()):
        report.tokens_per_s = generated / report.seconds
    deadline = time.monotonic() + 10
    pending = dict(stats_clients)
    while pending and time.monotonic() < deadline:  # cancelled runs release their pages at the engine's next step
        for engine, stats in list(pending.items()):
            with contextlib.suppress(Exception):
                used = stats.read()["used_pages"]
                report.engines[engine]["used pages after"] = used
                if used == 0:
                    del pending[engine]
        if pending:
            time.sleep(0.2)
    read = [figures.get("used pages after") for figures in report.engines.values()]
    # -1: not read; a vLLM server whose /metrics lacks the pool usage reports None, which is not a count
    report.used_pages_after = max((used for used in read if used is not None), default=-1)
    if app_pid is not None:
        memory = process_memory_kb(app_pid)
        report.memory_kb |= {"after": memory.get("VmRSS", 0), "peak": memory.get("VmHWM", 0)}
    return report


# ----- lockstep: a class on each lesson step ---------------------------------------------------------------------
PRESS_SPREAD_S = 1.0  # a class's presses of one button, spread uniformly over this
API_OF = {"run": "/run", "compare": "/compare"}
BADGE_FIGURE = r"\*\*(\d+)\*\* {}"  # a badge's bold figure before these words ("**48** cached")


@dataclass
class StudentStep:
    """One student at one lesson step of one round: each press's TTFT (the first text of panel 1, as it streamed)
    and whole run, what went wrong, and the step's promise as the student's badges, table and stats line read."""

    student: int
    ttft: list[float | None] = field(default_factory=list)
    run_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    promise: str = "not read"  # kept / broken / nothing promised / not read (an error came first)
    broken: list[str] = field(default_factory=list)
    cached: list[list[int | None]] = field(default_factory=list)  # each Run's panels' cached tokens, as badged


@dataclass
class StepRound:
    """A lesson step as the class went through it in one round."""

    step: int  # 1-based, as the lesson numbers it
    title: str
    round: int  # 0-based
    presses: tuple[str, ...]
    engine: str  # the engine the app said the first student is on
    seconds: float  # from the first press to the end of the last run
    students: list[StudentStep]

    @property
    def ttfts(self) -> list[float]:
        return [t for s in self.students for t in s.ttft if t is not None]

    def summary(self) -> dict:
        ttft, runs = self.ttfts, [r for s in self.students for r in s.run_s]
        errors = Counter(e for s in self.students for e in s.errors)
        return dict(
            step=self.step,
            title=self.title,
            round=self.round + 1,
            presses=list(self.presses),
            engine=self.engine,
            ttft_n=len(ttft),  # presses whose panel 1 showed text (a run timed out before it has none)
            presses_n=sum(len(s.run_s) for s in self.students),
            ttft_p50=pct(ttft, 50, "inclusive"),
            ttft_p95=pct(ttft, 95, "inclusive"),
            ttft_max=round(max(ttft), 3) if ttft else None,
            run_p50=pct(runs, 50, "inclusive"),
            run_max=round(max(runs), 3) if runs else None,
            class_s=round(self.seconds, 2),
            errors=sum(errors.values()),
            error_messages=dict(errors.most_common(5)),
            promise=dict(Counter(s.promise for s in self.students)),
            broken={f"student {s.student + 1}": s.broken for s in self.students if s.broken},
        )


@dataclass
class LockstepReport:
    clients: int
    rounds: int
    steps: list[StepRound] = field(default_factory=list)
    memory_kb: dict[str, int] = field(default_factory=dict)  # VmRSS at start and after all steps, VmHWM; {}: unknown
    cpu: str = field(default_factory=cpu_description)
    config: str = ""

    def as_json(self) -> dict:
        return dict(
            cpu=self.cpu,
            config=self.config,
            clients=self.clients,
            rounds=self.rounds,
            steps=[s.summary() for s in self.steps],
            students=[
                {"step": s.step, "round": s.round + 1, "students": [vars(x) for x in s.students]} for s in self.steps
            ],
            memory_kb=self.memory_kb,
        )

    def lines(self) -> list[str]:
        """A table of the steps (each round), the p95 over rounds, what went wrong, and the app's memory."""
        out = [f"cpu: {self.cpu}", f"lockstep: {self.config}"]
        out.append(
            f"{'step':<40} {'rnd':>3} {'presses':<19} {'TTFT p50 / p95 / max s':<23} {'run p50 / max s':<16}"
            f" {'class s':>7} {'err':>4} {'TTFTs':>9}  promise kept"
        )
        for s in self.steps:
            f = s.summary()
            ttft = " / ".join("n/a" if f[k] is None else f"{f[k]:.2f}" for k in ("ttft_p50", "ttft_p95", "ttft_max"))
            runs = " / ".join("n/a" if f[k] is None else f"{f[k]:.2f}" for k in ("run_p50", "run_max"))
            promise = f"{f['promise'].get('kept', 0)}/{len(s.students)}"
            shown = f"{f['ttft_n']}/{f['presses_n']}"
            if "nothing promised" in f["promise"]:
                promise = "n/a (the text promises nothing of the run)"
            out.append(
                f"{f'{s.step}. {s.title}'[:40]:<40} {s.round + 1:>3} {'+'.join(s.presses):<19} {ttft:<23} {runs:<16}"
                f" {s.seconds:>7.1f} {f['errors']:>4} {shown:>9}  {promise}"
            )
        if self.rounds > 1:
            out.append(f"TTFT p95 over {self.rounds} rounds, min / median / max (s):")
            for step in dict.fromkeys(s.step for s in self.steps):
                rounds = [s for s in self.steps if s.step == step]
                p95s = [pct(s.ttfts, 95, "inclusive") for s in rounds]
                out.append(f"  {f'{step}. {rounds[0].title}':<44} {spread_of(p95s)}")
        for s in self.steps:
            out.append(f"step {s.step}, round {s.round + 1}: on {s.engine}")
            f = s.summary()
            out += [f"  error ×{n}: {message}" for message, n in f["error_messages"].items()]
            out += [f"  {who}: {'; '.join(why)[:300]}" for who, why in list(f["broken"].items())[:5]]
        if self.memory_kb:
            mib = {k: f"{v / 1024:.0f} MiB" for k, v in self.memory_kb.items()}
            out.append(
                f"app memory: VmRSS at start {mib.get('start', '?')}, after all steps {mib.get('after', '?')}; "
                f"peak (VmHWM) {mib.get('peak', '?')}"
            )
        else:
            out.append("app memory: not known (the app was not started by this tool)")
        return out


def parse_steps(text: str) -> list[int]:
    """``all`` or comma-separated lesson step numbers ("1,3,8"), as 0-based indices in the order given."""
    from astrai.playground.scenarios import LESSON

    if text.strip() == "all":
        return list(range(len(LESSON)))
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--steps takes 'all' or step numbers like 1,3,8, not {text!r}") from None
    wrong = [n for n in numbers if not 1 <= n <= len(LESSON)]
    if wrong or not numbers:
        raise ValueError(f"the lesson has steps 1 to {len(LESSON)}; --steps {text!r} names {wrong or 'none'}")
    return [n - 1 for n in numbers]


def read_panels(after: tuple | list, n: int):
    """The panels of a run as /after_run shows them: each badge's prompt and cached tokens, and its row of the
    request table by cause (``astrai.playground.promises.Panel``)."""
    import re

    from astrai.playground.promises import Panel
    from astrai.playground.views.causes import CAUSES

    badges = [str(b or "") for b in after[:n]]
    table = next((x for x in after if isinstance(x, dict) and "headers" in x), None)
    if table is None:
        raise ValueError("/after_run sent no request table")
    headers, rows = table["headers"], table["data"]
    if len(rows) < n:
        raise ValueError(f"the request table has {len(rows)} rows for {n} panels")
    words = {word: cause for cause, (word, _) in CAUSES.items()}
    panels = []
    for badge, row in zip(badges, rows, strict=False):
        prompt = re.search(BADGE_FIGURE.format("prompt tokens"), badge)
        cached = re.search(BADGE_FIGURE.format("cached"), badge)
        if prompt is None:
            raise ValueError(f"a badge without its prompt tokens: {badge!r}")
        cells = dict(zip(headers, row, strict=True))
        by_cause = {words[h]: v for h, v in cells.items() if h in words and isinstance(v, int)}
        panels.append(Panel(int(prompt.group(1)), int(cached.group(1)) if cached else None, by_cause))
    return tuple(panels)


def read_replayed(outputs: tuple | list):
    """Replay my requests as /replay_my_requests shows it: the capacity its control ends on (the last output), and
    each policy's prompt tokens served there, from its table (``astrai.playground.promises.Replayed``)."""
    from astrai.playground.promises import Replayed
    from astrai.playground.views.sizing import POLICY_NAMES

    table = next((x for x in outputs if isinstance(x, dict) and "headers" in x), None)
    if table is None or not table["data"]:
        raise ValueError(f"Replay my requests showed no table: {str(outputs)[:160]!r}")
    served = table["headers"].index("prompt tokens served")
    policies = {name: policy for policy, name in POLICY_NAMES.items()}
    capacity = outputs[-1]  # the control's new choices come as an update: {"value": ..., "choices": ...}
    capacity = capacity.get("value") if isinstance(capacity, dict) else capacity
    return Replayed(int(capacity), {policies[row[0]]: int(str(row[served]).replace(",", "")) for row in table["data"]})


def read_computed(note: str) -> tuple[int, int]:
    """Compare's prefill tokens computed with caching on and off, as the savings note says them."""
    import re

    found = re.search(r"With caching, \*\*(\d+)\*\* prefill tokens.*Without it, \*\*(\d+)\*\* were computed", note)
    if found is None:
        raise ValueError(f"the savings note gives no comparison: {note[:160]!r}")
    return int(found.group(1)), int(found.group(2))


class Student:
    """One student: a session of its own (a browser tab), kept over every step and round."""

    def __init__(self, index: int, url: str, tls: ssl.SSLContext, call_timeout: float, job_timeout: float):
        from gradio_client import Client

        self.index, self.call_timeout, self.job_timeout = index, call_timeout, job_timeout
        self.client = Client(url, verbose=False, ssl_verify=tls)

    def arrive(self, scenario: str) -> tuple[str, dict]:
        """Go to the step as Lesson ▶ does (the step's scenario in this session: the lesson's buttons are not in the
        API, and they call /load_scenario's function); returns where the app says it is, and the stats line's
        figures there (its engine's, or pool's: whatever the session is shown)."""
        status = str(_call(self.client, self.call_timeout, scenario, api_name="/load_scenario")[-1])
        if not status.startswith("✅"):
            raise RuntimeError(f"the move to {scenario!r} was refused: {status}")
        return status, self.stats()

    def stats(self) -> dict:
        return _call(self.client, self.call_timeout, api_name="/cache_stats")

    def replay_mine(self) -> tuple:
        """Replay my requests, as the button does."""
        return tuple(_call(self.client, self.call_timeout, api_name="/replay_my_requests"))

    def leave(self) -> None:
        """Close the tab: the session's heartbeat stops, as a browser's does (tools/soak_app.py's visitors leave)."""
        self.client.close()

    def press(self, button: str, args: dict, n: int, record: StudentStep) -> tuple[RunResult, tuple]:
        """One press of Run or Compare, streamed to its end, then /after_run as the browser chains it."""
        result = one_run(self.client, args, False, self.job_timeout, n, API_OF[button], first_panel=True)
        record.ttft.append(result.ttft)
        record.run_s.append(round(result.total, 3))
        if result.outcome != "completed":
            timed_out = result.error == "timed out"
            raise RuntimeError(
                f"timed out after {self.job_timeout:.0f} s" if timed_out else result.error or result.outcome
            )
        if result.warnings:
            raise RuntimeError(f"the stream warned: {result.warnings[0][:160]}")
        return result, tuple(_call(self.client, self.call_timeout, api_name="/after_run"))


def _walk_step(
    students: list[Student], index: int, round_: int, pool, rng: random.Random, max_tokens: int | None
) -> StepRound:
    """Every student through lesson step ``index``: all arrive (the barrier: every arrival has answered), then for
    each button the step says to press, all press it within ``PRESS_SPREAD_S`` (uniformly spread, in a shuffled
    order), each streaming its run to the end; then each reads the step's promise off what it was shown."""
    from astrai.playground import promises
    from astrai.playground.scenarios import LESSON, SCENARIO_BY_NAME

    step = LESSON[index]
    scenario = SCENARIO_BY_NAME[step.scenario]
    presses = promises.presses(step)
    records = [StudentStep(s.index) for s in students]
    prompts = [list(scenario.prompts) for _ in students]
    before: list[dict] = [{} for _ in students]
    runs: list[list] = [[] for _ in students]
    computed: list[tuple[int, int] | None] = [None] * len(students)
    replayed: list = [None] * len(students)  # what Replay my requests showed each (promises.Replayed)
    outputs: list[tuple] = [() for _ in students]

    def failed(i: int, where: str, exc: Exception) -> None:
        records[i].errors.append(f"{where}: {exc}"[:240])

    def arrive(i: int) -> str:
        try:
            status, before[i] = students[i].arrive(scenario.name)
            return status
        except Exception as exc:
            failed(i, "arriving", exc)
            return ""

    statuses = list(pool.map(arrive, range(len(students))))
    engine = next((s for s in statuses if s), "?").removeprefix("✅ You are on ").replace("**", "")
    first_press, last_end = None, time.monotonic()
    for button in presses:
        if button == "follow_up":  # the button's work is the page's own: no call
            for i in range(len(students)):
                if not records[i].errors:
                    turns = follow_up_prompts(scenario.prefix, prompts[i], outputs[i][: len(prompts[i])])
                    if turns is None:
                        failed(i, "follow-up turn", ValueError("a panel had no answer, or the turn is too long"))
                    prompts[i] = turns or prompts[i]
            continue
        if button == "replay_mine":  # the lab's replay, in the request's thread: no engine step, no spread

            def replay(i: int) -> None:
                if not records[i].errors:
                    try:
                        replayed[i] = read_replayed(students[i].replay_mine())
                    except Exception as exc:
                        failed(i, "replay my requests", exc)

            list(pool.map(replay, range(len(students))))
            continue
        offsets = [PRESS_SPREAD_S * k / len(students) for k in range(len(students))]
        rng.shuffle(offsets)
        start = time.monotonic() + 0.05  # every student is at the barrier: the presses begin now
        first_press = first_press or start

        def press(i: int, at: float, button: str = button) -> None:
            if records[i].errors:  # it could not arrive, or its last press failed: it sits this one out
                return
            args = scenario_args(scenario, prompts[i], max_tokens)
            time.sleep(max(at - time.monotonic(), 0.0))
            try:
                result, after = students[i].press(button, args, len(prompts[i]), records[i])
                outputs[i] = result.outputs
                if button == "run":
                    runs[i].append(read_panels(after, len(prompts[i])))
                    records[i].cached.append([p.cached_tokens for p in runs[i][-1]])
                else:
                    computed[i] = read_computed(str(after[-1]))
            except Exception as exc:
                failed(i, button, exc)

        list(pool.map(press, range(len(students)), [start + o for o in offsets]))
        last_end = time.monotonic()
    for i, record in enumerate(records):
        if record.errors:
            continue
        if promises.promise(step) is None:
            record.promise = "nothing promised"
            continue
        try:
            evicted = students[i].stats()["evictions"] - before[i]["evictions"]
            seen = promises.Seen(before[i]["page_size"], tuple(runs[i]), evicted, computed[i], replayed[i])
            record.broken = promises.check(step, seen)
            record.promise = "broken" if record.broken else "kept"
        except Exception as exc:
            failed(i, "reading the promise", exc)
    seconds = last_end - first_press if first_press else 0.0
    return StepRound(index + 1, step.title, round_, presses, engine, seconds, records)


def run_lockstep(
    url: str,
    clients: int = 30,
    steps: list[int] | None = None,
    rounds: int = 1,
    max_tokens: int | None = None,
    seed: int = 0,
    app_pid: int | None = None,
    job_timeout: float = 300.0,
    call_timeout: float = 120.0,
    progress: Callable[[str], None] | None = None,
) -> LockstepReport:
    """A class of ``clients`` students in lockstep through the lesson's ``steps`` (0-based; all by default),
    ``rounds`` times over: see ``_walk_step``. ``max_tokens``: a cap on each step's own (None: the step's);
    ``progress``: told each step's summary as it ends."""
    from concurrent.futures import ThreadPoolExecutor

    from astrai.playground.scenarios import LESSON

    steps = list(range(len(LESSON))) if steps is None else steps
    report = LockstepReport(clients, rounds)
    report.config = (
        f"{clients} students, steps {', '.join(str(i + 1) for i in steps)}, {rounds} round(s), presses spread over "
        f"{PRESS_SPREAD_S:.0f} s, max tokens {'each step' + chr(39) + 's own' if max_tokens is None else max_tokens}"
    )
    if app_pid is not None:
        report.memory_kb["start"] = process_memory_kb(app_pid).get("VmRSS", 0)
    tls = ssl.create_default_context()  # one TLS context for every request (see run_load)
    rng = random.Random(seed)
    with ThreadPoolExecutor(max_workers=clients) as pool:
        students = list(pool.map(lambda i: Student(i, url, tls, call_timeout, job_timeout), range(clients)))
        for round_ in range(rounds):
            for index in steps:
                report.steps.append(_walk_step(students, index, round_, pool, rng, max_tokens))
                if progress is not None:
                    progress(json.dumps(report.steps[-1].summary(), ensure_ascii=False))
    if app_pid is not None:
        memory = process_memory_kb(app_pid)
        report.memory_kb |= {"after": memory.get("VmRSS", 0), "peak": memory.get("VmHWM", 0)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running playground; by default app.py is started on loopback")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=None, help="3 by default; with --lockstep, 1")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="a cap on every scenario's max tokens (48; --lockstep: none)"
    )
    parser.add_argument("--cancel-rate", type=float, default=0.25, help="the share of runs cancelled mid-stream")
    parser.add_argument(
        "--spread",
        nargs="?",
        const="weighted",
        choices=SPREADS,
        help="spread the users over the scenarios (weighted when given alone; see above)",
    )
    parser.add_argument("--custom", type=int, default=None, help="users on their own Engine settings (--spread: 1)")
    parser.add_argument(
        "--lockstep", action="store_true", help="a class in lockstep through the lesson's steps (see above)"
    )
    parser.add_argument("--steps", default="all", help="with --lockstep: 'all', or step numbers such as 1,3,8")
    parser.add_argument("--json", type=Path, help="with --lockstep: also write the report here, as JSON")
    parser.add_argument(
        "--job-timeout", type=float, default=300.0, help="with --lockstep: a run still streaming after this is an error"
    )
    parser.add_argument("--queue-size", type=int, default=None, help="ASTRAI_QUEUE_SIZE for the started app")
    parser.add_argument("--max-batch", type=int, default=None, help="ASTRAI_MAX_BATCH_SIZE for the started app")
    parser.add_argument("--concurrency", type=int, default=None, help="ASTRAI_RUN_CONCURRENCY for the started app")
    parser.add_argument("--app", type=Path, default=APP, help="the app.py to start (another checkout's, say)")
    args = parser.parse_args()
    if args.custom and not args.spread:
        parser.error("--custom needs --spread")
    if args.lockstep and (args.spread or args.custom):
        parser.error("--lockstep walks the lesson's steps: it takes neither --spread nor --custom")
    if args.json and not args.lockstep:
        parser.error("--json needs --lockstep")
    if args.clients < 1 or (args.rounds is not None and args.rounds < 1):
        parser.error("--clients and --rounds take a count of 1 or more")
    steps: list[int] = []
    if args.lockstep:
        try:
            steps = parse_steps(args.steps)
        except ValueError as exc:
            parser.error(str(exc))
    knobs = {
        "ASTRAI_QUEUE_SIZE": args.queue_size,
        "ASTRAI_MAX_BATCH_SIZE": args.max_batch,
        "ASTRAI_RUN_CONCURRENCY": args.concurrency,
    }
    env = {name: str(value) for name, value in knobs.items() if value is not None}
    with contextlib.ExitStack() as stack:
        launched = None if args.url else stack.enter_context(start_app(env, app=args.app))
        url, pid = args.url or launched.url, None if launched is None else launched.pid
        if args.lockstep:
            lockstep = run_lockstep(
                url,
                args.clients,
                steps,
                args.rounds or 1,
                args.max_tokens,
                app_pid=pid,
                job_timeout=args.job_timeout,
                progress=lambda line: print(line, file=sys.stderr, flush=True),
            )
            for line in lockstep.lines():
                print(line)
            if args.json:
                args.json.write_text(json.dumps(lockstep.as_json(), indent=1, ensure_ascii=False))
            return
        report = run_load(
            url,
            args.clients,
            args.rounds or 3,
            args.max_tokens or 48,
            args.cancel_rate,
            spread=args.spread,
            custom=args.custom,
            app_pid=pid,
        )
    for key, value in report.summary().items():
        print(f"{key}: {value}")
    for line in report.lines():
        print(line)


if __name__ == "__main__":
    main()
