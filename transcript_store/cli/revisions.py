"""``init``, ``upgrade`` and ``current``: the store's schema revision."""

from __future__ import annotations

import click

from .. import migrate
from ..errors import SchemaNotCurrent
from .group import cli
from .options import EXIT_SCHEMA, CommandError, common, state
from .output import emit_json
from .stores import run_advice, schema_advice, schema_state, store_session


def _migrate(*, create: bool) -> None:
    st = state()
    with store_session(create=create, check_schema=False) as store:
        if not create and store.current_revision() is None:
            # upgrade migrates a store; a database without one (an empty PostgreSQL database, another
            # program's SQLite file in WAL mode) is left as it is: creating one is init's to do.
            raise SchemaNotCurrent(
                f"no store at {store.url} (the database holds no transcript-store schema): {run_advice('init')}"
            )
        before, after = migrate.upgrade_from(store.db)  # "before" as read under the migration's lock
        head = migrate.head_revision()
        report = {"url": store.url, "backend": store.backend, "before": before, "revision": after, "head": head}
    if st.json:
        emit_json(report)
    elif before == after:
        click.echo(f"{report['url']}: already at revision {after} (head)")
    elif before is None:
        click.echo(f"{report['url']}: created the schema at revision {after}")
    else:
        click.echo(f"{report['url']}: migrated {before} -> {after}")


@cli.command()
@common
def init() -> None:
    """Create a store (or migrate an existing one to the newest schema)."""
    _migrate(create=True)


@cli.command()
@common
def upgrade() -> None:
    """Migrate an existing store to the newest schema revision."""
    _migrate(create=False)


@cli.command()
@common
def current() -> None:
    """Show the store's schema revision and this library's head; exit 4 when they differ."""
    st = state()
    with store_session(check_schema=False) as store:
        revision = store.current_revision()
        report = {"url": store.url, "backend": store.backend, "revision": revision}
    head = migrate.head_revision()
    report.update(head=head, state=schema_state(revision, head))
    if st.json:
        emit_json(report)
    else:
        for key in ("url", "revision", "head", "state"):
            click.echo(f"{key + ':':9} {report.get(key) or '(none)'}")
    if revision != head:
        raise CommandError(
            f"the schema is {report['state']} (revision {revision or 'none'}, head {head}): "
            f"{schema_advice(schema_state(revision, head))}",
            EXIT_SCHEMA,
        )
