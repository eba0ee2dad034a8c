"""Compare routing: the panels' prompts as tenants, sent in waves through each router of a fleet, side by side.

Each tenant (panel) sends one request per wave, all tenants of a wave at once; the waves go through one router,
then the same waves through the next. Every pass runs in a prefix-cache namespace of its own (a fresh
``cache_salt``), so each starts cold and no pass is helped by another's blocks. What is compared is what the
servers reported: each request's prompt and cached tokens (its usage), the replica its KV events name, and the
TTFT this client measured.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import gradio as gr

from astrai.playground.backends.protocol import Backend, BackendError
from astrai.playground.callbacks.context import Context, Update, served_once_named, session_of
from astrai.playground.callbacks.run import Batch, RunCallbacks, parse_batch
from astrai.playground.scenarios import ROUTING_WAVES
from astrai.playground.state import ShownRun
from astrai.playground.ui.components import by_name
from astrai.playground.views import fleet
from astrai.sampling import SamplingParams

MAX_TOKENS = 16  # the comparison is about prefill: short answers keep a pass to seconds
# A wave's requests start this far apart, in tenant order, and overlap: sent all at once they reach the router in a
# random order, and round robin's tenant -> replica pattern (what the lesson shows) changed from pass to pass.
STAGGER_S = 0.05


class RoutingCallbacks:
    def __init__(self, ctx: Context, runs: RunCallbacks):
        self.ctx, self.ui, self.runs = ctx, ctx.ui, runs

    def compare_routing(
        self,
        values: dict[str, Any],
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - gradio injects it
    ) -> Update:
        """Both passes, then the chart; the panels show the last wave of the last pass, and their badges, token
        colouring and table describe those same requests (not the visitor's previous Run)."""
        batch, session = parse_batch(values), session_of(request)
        visitor = self.ctx.visitors.act(session)
        params = SamplingParams(max_tokens=min(batch.params.max_tokens, MAX_TOKENS), temperature=0.0)
        answers = [""] * len(batch.prompts)
        results: list[fleet.PolicyResult] = []
        last_wave: list[int] = []
        try:
            with self.ctx.engines.run_on(visitor.profile) as backend:
                if len(backend.routers) < 2:
                    raise gr.Error("Compare routing needs a fleet behind two routers (see README: a vLLM fleet).")
                for index, router in enumerate(backend.routers):
                    progress(index / len(backend.routers), desc=f"through the {router.policy} router")
                    result, last_wave = self._pass(backend, index, batch, params, session, answers)
                    results.append(result)
        except BackendError as exc:
            raise gr.Error(str(exc)) from None
        prompts = tuple(prompt + ROUTING_WAVES[-1] for prompt in batch.prompts)
        visitor.shown, visitor.recording = ShownRun(tuple(last_wave), prompts, visitor.profile), None
        cache, outputs = self.ui.cache, self.ui.panels.outputs
        update: Update = {cache.routing: fleet.routing_chart(results), cache.routing_note: fleet.routing_note(results)}
        update |= self.runs.details(visitor, session, final=True)
        return update | {box: answers[i] if i < len(answers) else "" for i, box in enumerate(outputs)}

    def _pass(
        self,
        backend: Backend,
        router: int,
        batch: Batch,
        params: SamplingParams,
        session: str,
        answers: list[str],
    ) -> tuple[fleet.PolicyResult, list[int]]:
        """One pass through ``router``: the result, and the request ids of its last wave (one per tenant)."""
        salt = f"routing/{session}/{uuid.uuid4().hex}"  # a namespace of its own: this pass starts cold
        ids: list[int] = []
        tenants: list[int] = []
        wave: list[int] = []
        for ending in ROUTING_WAVES:
            answers[:] = [""] * len(batch.prompts)  # the panels show the last wave's answers
            runs = []
            wave = []
            try:
                for tenant, prompt in enumerate(batch.prompts):  # one after another, overlapping: see STAGGER_S
                    text = backend.format_prompt(batch.prefix, prompt + ending)
                    run = backend.submit([text], params, salt, router=router)
                    self.ctx.visitors.register(run.request_ids, session)  # the privacy rule: the visitor's pages
                    runs.append(run)
                    ids += run.request_ids
                    wave += run.request_ids
                    tenants.append(tenant)
                    time.sleep(STAGGER_S)
                for tenant, run in enumerate(runs):
                    for _, delta in run:
                        answers[tenant] += delta
            finally:
                for run in runs:
                    run.close()
        served = served_once_named(backend, ids)
        infos = {info.id: info for info in backend.request_info(ids)}
        names = {rid: s.replica.split(" (")[0] for rid, s in served.items()}
        result = fleet.PolicyResult(
            policy=backend.routers[router].policy,
            infos=tuple(infos[r] for r in ids if r in infos),
            served=tuple(names.get(r) for r in ids if r in infos),
            tenants=tuple(t for r, t in zip(ids, tenants, strict=True) if r in infos),
        )
        return result, wave

    def wire(self) -> None:
        ui = self.ui
        inputs, fn = by_name(ui.run_fields(), self.compare_routing)
        outputs = [ui.cache.routing, ui.cache.routing_note, *ui.panels.outputs]
        outputs += [*ui.panels.badges, *ui.panels.highlights, ui.cache.table]
        ui.buttons.routing.click(
            fn,
            inputs,
            outputs,
            api_name="compare_routing",
            concurrency_limit=2,
            concurrency_id="routing",
            show_progress="minimal",
            show_progress_on=ui.panels.outputs[0],  # a component already showing progress: one more costs every
            # streamed message of every run (tests/test_app.py keeps them to four)
        )
