"""The pace of a run's text messages (the browser shows at most one update per message)."""

from __future__ import annotations

from astrai.playground.callbacks.pacing import Pacer


def messages(arrivals: list[float], interval: float) -> list[float]:
    pacer = Pacer(lambda: interval)
    return [t for t in arrivals if pacer.ready(t)]


def test_deltas_every_engine_step_keep_the_cadence_of_the_interval():
    arrivals = [i * 0.012 for i in range(167)]  # a delta every 12 ms for 2 s
    sent = messages(arrivals, 0.04)
    assert sent[0] == 0.0, "the first delta goes at once"
    assert len(sent) >= 48, f"{len(sent)} messages in 2 s at one per 40 ms (timing from each message gives 42)"


def test_a_stalled_run_does_not_burst_to_catch_up():
    arrivals = [0.0, 0.01, 1.0, 1.001, 1.002, 1.01, 1.019, 1.05]  # a second with no delta, then a flurry
    sent = messages(arrivals, 0.04)
    assert sent == [0.0, 1.0, 1.05]
