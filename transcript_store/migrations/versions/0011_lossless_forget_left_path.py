"""The lossless engine forgets what a reset of an earlier release kept: what left the active path.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02

Before commit 0bafff9 a reset (a branch, a rewrite) emptied the session's context list and imported
the visible transcript again, and kept every message and summary row: the originals of a rewritten
(redacted) message, abandoned branches and the summaries made from them stayed where lcm_grep,
lcm_describe and lcm_expand find them. A reset now forgets them (``engines/lossless/reset.py``), but
a session reset under an earlier release is past that reset: nothing forgets its rows until its next
branch or rewrite, maybe never. This revision deletes what that reset forgets: every summary neither
in the context nor under a summary that is, and every message that the context does not cover (raw
or through a kept summary) and that is no longer on the active path. A store written by this release
has neither (``audit`` reports the first); the context items, the view and the transcript stay as
they are. The messages also go that a reset the recall tools applied left out of the context, before
such a reset gave them back at once, when the path moved away from them before the next import.

One statement per table over the engine's tables, in the upgrade's transaction; SQLite's search rows
go with their rows through the 0004 triggers, PostgreSQL's search column is part of the row.
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

#: the summaries of every session reachable from its context items (a cycle ends: UNION, not UNION ALL)
_REACHED = (
    "WITH RECURSIVE reached(scope, session_id, seq) AS ("
    " SELECT scope, session_id, summary_seq FROM ts_lcm_context_items WHERE summary_seq IS NOT NULL"
    " UNION SELECT c.scope, c.session_id, c.child_seq FROM ts_lcm_summary_children c JOIN reached r"
    " ON c.scope = r.scope AND c.session_id = r.session_id AND c.parent_seq = r.seq) "
)


def _unreached(table: str, column: str) -> str:
    return (
        f"NOT EXISTS (SELECT 1 FROM reached r WHERE r.scope = {table}.scope"
        f" AND r.session_id = {table}.session_id AND r.seq = {table}.{column})"
    )


#: a message none of the context covers (run once the unreached summaries and their sources are gone)
_UNCOVERED = (
    "NOT EXISTS (SELECT 1 FROM ts_lcm_context_items i WHERE i.scope = m.scope AND i.session_id = m.session_id"
    " AND i.message_ordinal = m.ordinal)"
    " AND NOT EXISTS (SELECT 1 FROM ts_lcm_summary_sources s WHERE s.scope = m.scope AND s.session_id = m.session_id"
    " AND s.message_ordinal = m.ordinal)"
)
#: ... whose entry is not on the active path (kept: a reset the recall tools applied gives the messages
#: of a dropped leaf back to the next import, which finds their rows)
_OFF_PATH = (
    "NOT EXISTS (SELECT 1 FROM ts_entries e JOIN ts_active_path p ON p.scope = e.scope"
    " AND p.session_id = e.session_id AND p.depth = e.depth AND p.seq = e.seq"
    " WHERE e.scope = m.scope AND e.session_id = m.session_id AND e.entry_id = m.entry_id)"
)


def upgrade() -> None:
    # Edges first: the children of a summary the context does not reach are not reached either.
    for table, column in (
        ("ts_lcm_summary_children", "parent_seq"),
        ("ts_lcm_summary_sources", "summary_seq"),
        ("ts_lcm_summaries", "summary_seq"),
    ):
        op.execute(f"{_REACHED}DELETE FROM {table} WHERE {_unreached(table, column)}")
    op.execute(f"DELETE FROM ts_lcm_messages AS m WHERE {_UNCOVERED} AND {_OFF_PATH}")


def downgrade() -> None:
    # Nothing to give back: the rows were what a reset of this release forgets.
    pass
