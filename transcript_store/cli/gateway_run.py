"""``gateway``: the multi-worker gateway run with injected faults."""

from __future__ import annotations

import logging

import click

from ..db import mask_url, sqlite_file
from ..errors import InvalidInput, SchemaNotCurrent
from ..gateway import DEFAULT_SEED, GATEWAY_SCOPE, MAX_RUN_TURNS, MAX_SESSIONS, MAX_TURNS, MAX_WORKERS
from .conversation import chosen_model, model_options
from .group import cli
from .hosting import _optional_store, refuse_bad_legacy_config, warn_unusable_engines
from .options import EXIT_USAGE, CommandError, Integer, common_options, state
from .output import console, emit_json
from .stores import _no_store_advice, _no_store_file, _refuse_non_sqlite_file, make_url_or_usage


@cli.command()
@click.option("--workers", type=Integer(1, MAX_WORKERS), default=4, show_default=True,
              help="Worker processes.")
@click.option("--sessions", "session_count", type=Integer(1, MAX_SESSIONS), default=6, show_default=True,
              help="Conversations.")
@click.option("--turns", type=Integer(1, MAX_TURNS), default=5, show_default=True,
              help=f"Turns per conversation (at most {MAX_RUN_TURNS} turns in all).")
@model_options
@click.option("--faults/--no-faults", default=True, show_default=True, help="Inject crashes, timeouts and rewrites.")
@click.option("--seed", type=Integer(), metavar="INTEGER",
              help=f"Seed of the workload and the faults [default: {DEFAULT_SEED}].")
@common_options(GATEWAY_SCOPE)
def gateway(workers: int, session_count: int, turns: int, engine: str | None, model_url: str | None,
            model_name: str | None, api_key: str | None, faults: bool, seed: int | None) -> None:
    """Run the main job: a multi-worker gateway with injected faults, ending with an exactly-once report."""
    from ..gateway import GatewayOptions, run_gateway, sigterm_ends_the_run

    st = state()
    config = st.store_config()
    make_url_or_usage(config.url)
    _refuse_non_sqlite_file(config.url)
    path = sqlite_file(config.url)
    why = _no_store_file(path) if path is not None and config.auto_upgrade is False else None
    if why is not None:  # (as open_store: nothing migrates on open, so nothing is created either)
        raise SchemaNotCurrent(f"no store at {mask_url(config.url)} ({why}): {_no_store_advice(why)}")
    settings = st.settings(engine)  # a bad settings file is a usage error here, not in the workers
    chosen_model(model_url, model_name, api_key)  # so is a bad model URL
    options = GatewayOptions(
        db_url=config.url, workers=workers, sessions=session_count, turns=turns, engine=engine,
        model_url=model_url, model=model_name, api_key=api_key, faults=faults, config_path=st.config,
        progress=not st.json,
    )
    try:
        options.check()
    except InvalidInput as e:  # sessions x turns past the bound of a run: a usage error
        raise CommandError(str(e), EXIT_USAGE) from None
    # A bad [engine.config.legacy] stops every worker's host as it is built: refused before a worker starts,
    # but after the usage errors above: checked first, it turned counts past a run's bound from 2 into 1.
    refuse_bad_legacy_config(settings)
    if seed is not None:
        options.seed = seed
    if st.scope_given:
        options.scope = st.scope_name
    # An engine that cannot load (a mistyped config value) is said once, before the workers run its turns on
    # legacy; it may need the store to load (none yet: checked without one, as engines list does).
    store, _why = _optional_store()
    try:
        # each worker quarantines such an engine as it first meets it: its record would say it again, once a
        # worker (respawns included), as an ERROR line
        options.reported_unusable = tuple(warn_unusable_engines(settings, store))
    finally:
        if store is not None:
            store.close()
    # The faults are on purpose and the report counts them: their records would drown the progress bar.
    # Set here, never by run_gateway (a library call leaves its caller's logging alone), and given back
    # after the run: the command may run inside another program's process (click's runner, a test).
    lib_log = logging.getLogger("transcript_store")
    level = lib_log.level
    lib_log.setLevel(logging.ERROR)
    try:
        # A SIGTERM or a SIGHUP (the terminal closed): the interrupted run's cleanup (the workers stopped, the
        # display closed, the store closed), then the signal's own end. SIGHUP ended the run where it stood.
        with sigterm_ends_the_run():
            report = run_gateway(options, console())
    finally:
        lib_log.setLevel(level)
    if st.json:
        emit_json(report.to_dict())
    else:
        report.render(console())
    if not report.ok:
        raise CommandError(f"the gateway run failed its checks: {'; '.join(report.problems)}")
