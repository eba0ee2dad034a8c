"""A small soak with injected faults, cancellations, evictions and preemptions (the full one: astrai.soak)."""

from astrai.soak import run_soak


def test_soak_with_faults_loses_nothing_and_leaks_nothing():
    report = run_soak(n_requests=240, clients=6, seed=7, fault_rate=0.03)
    assert report.ok, report
    assert report.faults_injected > 0 and report.outcomes["failed"] > 0
    assert report.outcomes["cancelled"] > 0 and report.outcomes["finished"] > 100
    assert report.evictions > 0 and report.preemptions > 0
    assert report.greedy_checked > 20
