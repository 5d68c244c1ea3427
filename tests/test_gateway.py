"""The main job: a shortened gateway run with faults on both backends; its exactly-once check must hold."""

from __future__ import annotations

from rich.console import Console

from transcript_store.gateway import GatewayOptions, run_gateway


def test_gateway_run_with_faults_is_exactly_once(store_url: str) -> None:
    options = GatewayOptions(
        db_url=store_url,
        engine="lossless",  # as `make run`: a degraded turn falls back from lossless to legacy
        workers=3,
        sessions=4,
        turns=4,
        seed=11,
        progress=False,
        kill_rate=0.3,
        timeout_rate=0.2,
        rewrite_rate=0.2,
    )
    report = run_gateway(options, Console(quiet=True))
    assert report.ok, report.problems
    assert report.planned_turns == 16
    assert report.admitted == 16 and report.accepted == 16
    assert report.committed + report.blocked == 16
    assert report.kills > 0 and report.provider_timeouts > 0 and report.rewrites > 0
    assert report.retried_dispatches >= report.kills
    # Every rewrite forced a turn-local degradation that the report explains.
    assert sum(report.degraded.values()) >= 1
    assert report.engine == "lossless"
