"""A small soak with injected faults, cancellations, evictions and preemptions (the full one: tools.soak)."""

from tools.soak import run_soak


def test_soak_with_faults_loses_nothing_and_leaks_nothing():
    report = run_soak(n_requests=240, clients=6, seed=7, fault_rate=0.03)
    assert report.ok, report
    assert report.faults_injected > 0 and report.outcomes["failed"] > 0
    assert report.outcomes["cancelled"] > 0 and report.outcomes["finished"] > 100
    assert report.evictions > 0 and report.preemptions > 0
    assert report.greedy_checked > 20


def test_a_hung_forward_is_reported_within_seconds():
    report = run_soak(n_requests=200, clients=4, seed=3, fault_rate=0.0, hang_on_call=40, stall_s=2.0)
    assert report.hung > 0 and not report.ok, report
    assert report.seconds < 15, report  # from the first request to the report: the stall limit is 2 s
