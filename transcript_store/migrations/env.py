"""Alembic environment: runs on a connection handed over by transcript_store.migrate, or on a URL."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

config = context.config


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=None,
        # Each migration and its version row commit together, one migration at a time.
        transaction_per_migration=True,
        render_as_batch=connection.dialect.name == "sqlite",  # type: ignore[attr-defined]
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("set sqlalchemy.url or use `transcript-store upgrade --db URL`")
    engine = create_engine(url)
    with engine.connect() as conn:
        _run(conn)
        conn.commit()
