"""The main job: a shortened gateway run with faults on both backends; its exactly-once check must hold."""

from __future__ import annotations

from pathlib import Path

import pytest
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


LOUD_ENGINE = """
import warnings

from engines.legacy import LegacyEngine


class Loud(LegacyEngine):
    info = LegacyEngine.info.model_copy(update={"id": "loud", "name": "loud"})

    def assemble(self, **kw):
        print("printed \\x1b]0;owned\\x07 \\ud800 end")
        warnings.warn("warned \\x1b[2J here")
        return super().assemble(**kw)


def create_engine(ctx):
    return Loud(ctx)
"""


def test_an_engines_own_output_in_a_worker_is_shown_not_obeyed(
    store_url: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # An engine quoting stored text in print() or warnings.warn() must not move the operator's terminal
    # (a window title, a cleared screen), and a lone surrogate must not fail its turn.
    folder = tmp_path / "plugins" / "loud"
    folder.mkdir(parents=True)
    (folder / "plugin.yaml").write_text("name: loud\nversion: 1.0\nentry: create_engine\n")
    (folder / "__init__.py").write_text(LOUD_ENGINE)
    config = tmp_path / "transcript-store.toml"
    config.write_text('[engine]\nplugin_dirs = ["plugins"]\n')
    options = GatewayOptions(
        db_url=store_url, engine="loud", workers=1, sessions=1, turns=2, faults=False, progress=False,
        config_path=str(config),
    )
    report = run_gateway(options, Console(quiet=True))
    assert report.ok, report.problems
    assert report.committed == 2 and not report.degraded
    out, err = capfd.readouterr()
    assert "printed \\x1b]0;owned\\x07 \\ud800 end" in out
    assert "warned \\x1b[2J here" in err
    assert "\x1b" not in out + err
