"""Visitors' actions, in process, without a browser: the callbacks called as Gradio would call them
(``tests/support/playground.py``)."""

from __future__ import annotations

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
