"""Tombstones of deleted sessions: a retry after a lost COMMIT does not make a deleted session again.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06

``ts_deleted_sessions`` keeps (scope, session id, incarnation) of every session ``delete_session``
deleted, written in the delete's transaction, and pruned by every delete once older than
``core.TOMBSTONE_SECONDS``. A create whose COMMIT was uncertain finds its own incarnation there on its
retry: the create landed and the session was deleted since, so the retry answers it as created instead
of making it again. A new empty table and its age index: no row changes.

On PostgreSQL the table is granted what ``ts_sessions`` is: workers running as a role that may only read
and write rows (not own tables) delete sessions, and a delete writes a tombstone; without the grant every
``delete_session`` would be refused after the upgrade ("permission denied for table").
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


#: (grantee, privilege, grantable) of a table's explicit grants, its owner's own left out (as in 0006)
_GRANTS = sa.text(
    "SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee,"
    " a.privilege_type, a.is_grantable"
    " FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee"
    " WHERE c.oid = CAST(:t AS regclass) AND a.grantee <> c.relowner"
)


def upgrade() -> None:
    """Create the tombstone table, keyed by the session as every per-session table is, granted as
    ``ts_sessions`` is (PostgreSQL)."""
    op.create_table(
        "ts_deleted_sessions",
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("session_id", sa.String(255), nullable=False),
        sa.Column("incarnation", sa.BigInteger, nullable=False),
        sa.Column("deleted_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("scope", "session_id", "incarnation", name="ts_deleted_sessions_pk"),
    )
    op.create_index("ts_deleted_sessions_age", "ts_deleted_sessions", ["deleted_us"], unique=False)
    if op.get_bind().dialect.name == "postgresql":
        for grantee, privilege, grantable in op.get_bind().execute(_GRANTS, {"t": "ts_sessions"}).all():
            grant = f"GRANT {privilege} ON ts_deleted_sessions TO {grantee}"
            op.execute(grant + (" WITH GRANT OPTION" if grantable else ""))


def downgrade() -> None:
    """Drop the tombstones (a retry then tells a deleted session from one never made no more)."""
    op.drop_index("ts_deleted_sessions_age", table_name="ts_deleted_sessions")
    op.drop_table("ts_deleted_sessions")
