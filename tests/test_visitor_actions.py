"""Visitors' actions, in process, without a browser: the callbacks called as Gradio would call them
(``tests/support/playground.py``)."""

from __future__ import annotations

import time

from tests.support.playground import no_progress, playground, request


def test_settings_refused_past_the_bound_say_so_and_leave_the_visitor_where_they_were():
    """Found by the machine: past the operator's bound on visitors' own engines, Apply settings left the visitor on
    their engine but its status said "✅ You are on the “your own settings” engine" with the refused settings."""
    with playground(max_custom=1) as pg:
        model = pg.ctx.engines.default.model
        mine = {"model": model, "page_size": 4, "n_pages": 16, "max_batch_size": 2, "prefix_caching": True}
        pg.setup.apply_settings(mine | {"dtype": "float32"}, request("first"), no_progress)
        before = pg.ctx.visitors.peek("second").profile
        update = pg.setup.apply_settings(mine | {"n_pages": 24, "dtype": "float32"}, request("second"), no_progress)
        status = update[pg.ctx.ui.setup.engine.status]
        assert pg.ctx.visitors.peek("second").profile == before, "refused: the visitor stays"
        assert "You stay on" in status and "✅" not in status, status


def test_a_run_stopped_before_its_first_step_has_its_end_recorded():
    """Found by the machine: a request cancelled while it waited (never admitted, no page to give back) got the next
    step as its ``ended_step``, but the idle engine recorded no step: Stop's after_run waited ``END_WAIT_S`` for it in
    vain, the replay stayed open, and whatever step came next, another visitor's, joined the recording as its end."""
    with playground() as pg:
        session = "stops-at-once"
        backend = pg.ctx.engines.backend(pg.ctx.engines.default)
        assert backend is not None
        with backend._engine._lock:  # the engine cannot admit the request before it is cancelled
            stream = pg.runs.run(pg.fields(max_tokens=2, n_panels=1), request(session))
            next(stream)
            stream.close()  # Stop
        shown = pg.ctx.visitors.peek(session).shown
        assert shown is not None
        deadline = time.monotonic() + 10
        while backend.request_info(list(shown.request_ids))[0].status != "cancelled":  # at the engine's next loop
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pg.runs.after_run(request(session))
        [info] = backend.request_info(list(shown.request_ids))
        assert backend.stats().steps >= info.ended_step, "the step that records its end came"
        recording = pg.ctx.visitors.peek(session).recording
        assert recording is not None and recording.closed, "the run ended, and its end is recorded"
        assert recording.samples[-1].step == info.ended_step
