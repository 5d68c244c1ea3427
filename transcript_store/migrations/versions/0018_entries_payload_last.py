"""SQLite: the entries' payload becomes their last column.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07

SQLite stores a row's columns one after the other, and a payload larger than what fits in a page goes
on in a chain of overflow pages. A column stored after it is reached only by walking that chain, page by
page: ``size_bytes``, ``idempotency_key``, ``turn_id`` and ``created_us`` came after ``payload``, so every
statement that reads sizes without payloads (a delta page's byte bound, a closed range's size check, an
export's page plan, the session sizes ``sessions list`` shows) read each large message whole from disk
to find its size (12 rows of 300 KB: 4.3 ms against 0.02 ms for their seqs). The table is rebuilt with
the payload last: same rows, same rowids, same indexes (recreated from their stored definitions), same
keys. SQLite copies the table in the upgrade's one transaction, through the WAL and then into the file: it
needs about twice the table's size in free disk space (three times with ``secure_delete``, which writes every
freed page of the old copy to the WAL as zeros), and time in proportion to it.

PostgreSQL is left as it is: there a payload over ~2 KB is stored out of line (TOAST), and the other
columns are read without it, whatever their order.

Downgrade: the table rebuilt in the old order.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

ID = sa.String(255)
OLD = "ts_entries_old"


def _column(name: str) -> sa.Column[object]:
    types: dict[str, tuple[object, bool]] = {
        "scope": (ID, False),
        "session_id": (ID, False),
        "seq": (sa.Integer, False),
        "entry_id": (ID, False),
        "parent_id": (ID, True),
        "depth": (sa.Integer, False),
        "position": (sa.Integer, True),
        "generation": (sa.Integer, False),
        "kind": (sa.String(16), False),
        "role": (sa.String(16), True),
        "payload": (sa.Text, False),
        "size_bytes": (sa.Integer, False),
        "idempotency_key": (ID, True),
        "turn_id": (ID, True),
        "created_us": (sa.BigInteger, False),
    }
    kind, nullable = types[name]
    return sa.Column(name, kind, nullable=nullable)  # type: ignore[arg-type]


#: the columns as 0001 made them, and as this revision orders them (every fixed-width or short one first)
BEFORE = [
    "scope", "session_id", "seq", "entry_id", "parent_id", "depth", "position", "generation", "kind", "role",
    "payload", "size_bytes", "idempotency_key", "turn_id", "created_us",
]
AFTER = [name for name in BEFORE if name != "payload"] + ["payload"]


def _rebuild(order: list[str]) -> None:
    """Copy ts_entries into a table of the same name with its columns in ``order`` (SQLite only)."""
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return
    # The indexes as stored (unique and partial ones included), then the triggers on the table (none of
    # the store's; an operator's own go with the old table): made again after the copy, under their names,
    # which SQLite keeps database-wide (so only once the old table and its indexes are gone), the triggers
    # last so that the copy fires none.
    rebuilt = [
        str(sql) for (sql,) in bind.execute(sa.text(
            "SELECT sql FROM sqlite_master WHERE type IN ('index', 'trigger') AND tbl_name = 'ts_entries'"
            " AND sql IS NOT NULL ORDER BY type = 'trigger', name"
        ))
    ]
    # The rename in SQLite's legacy mode: since 3.26 it also rewrites every view and trigger body naming
    # the table to name the old copy, which is dropped below, so an operator's view of the entries
    # failed ("no such table: main.ts_entries_old"), and with it every later ALTER TABLE of the file.
    # In legacy mode they keep naming ts_entries, which the copy is. (No foreign key names ts_entries.)
    legacy = bind.exec_driver_sql("PRAGMA legacy_alter_table").scalar()
    bind.exec_driver_sql("PRAGMA legacy_alter_table = ON")
    try:
        op.rename_table("ts_entries", OLD)
    finally:
        bind.exec_driver_sql(f"PRAGMA legacy_alter_table = {'ON' if legacy else 'OFF'}")
    op.create_table(
        "ts_entries",
        *[_column(name) for name in order],
        sa.PrimaryKeyConstraint("scope", "session_id", "seq", name="ts_entries_pk"),
        sa.ForeignKeyConstraint(
            ["scope", "session_id"],
            ["ts_sessions.scope", "ts_sessions.session_id"],
            ondelete="CASCADE",
            name="ts_entries_session_fk",
        ),
    )
    names = ", ".join(order)
    # rowid too: the store looks rows up by it within a statement only, but a copy keeps what it can.
    op.execute(f"INSERT INTO ts_entries (rowid, {names}) SELECT rowid, {names} FROM {OLD} ORDER BY rowid")
    op.drop_table(OLD)
    for sql in rebuilt:
        op.execute(sql)


def upgrade() -> None:
    _rebuild(AFTER)


def downgrade() -> None:
    _rebuild(BEFORE)
