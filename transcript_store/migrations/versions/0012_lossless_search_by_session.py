"""The lossless engine's SQLite search index keeps each session's rows in a rowid range of their own.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02

Revision 0004 gave every search row the next id of one map table for the whole store, so a session's
rows lay scattered among every other session's. A search drove the FTS5 query over the whole index
(``MATCH``) and only then kept its session's rows: a search in a session of 50 messages read,
joined and threw away every matching row of every other session and scope, and bm25 (the score)
counted each phrase's rows over the whole table too. Its time grew with the store, not the session
(a common term, 50,000 matching rows elsewhere: about 27 ms for the 50-message session's 50 hits; 1 ms
now, as in an empty store).

Now a search row's id says where it belongs: ``slot * 2**32 + ref`` for a message (``ref`` its
ordinal), ``slot * 2**32 + 2**31 + ref`` for a summary (its seq), where ``slot`` numbers the
(scope, session) in ``ts_lcm_search_slots``. FTS5 takes a ``rowid BETWEEN`` bound into its doclist
iteration (it seeks each term's doclist to the bound), so a search reads its session's rows of one
kind and no other; the map table goes (the id is the map). A slot is made by the first row of its
session and goes with its last, so the table holds one row per session with engine rows. A new slot
is one past the largest; past 2**31 - 1 (31 bits: the largest rowid is 2**63 - 1), the first free
one, so 2**31 - 1 sessions can hold engine rows at once (a CHECK refuses more). An ordinal or seq
(INTEGER, so below 2**31) outside its half of the range is refused by the trigger (the engine never
writes one).

SQLite only, in the upgrade's transaction: the index is built again from the engine's tables, which
hold what it indexed (the text is never updated; a row with no source row was never found), in time
and WAL space proportional to the engine's text (as the first import of it took). On
PostgreSQL, whose search structures are indexes on the engine's tables (0004, 0008) queried with the
session in the WHERE clause, nothing changes. The downgrade builds 0004's layout again from the same
tables.
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

#: the search rowids of one slot (one scope + session): its messages, then its summaries
SLOT = 2**32
#: where a slot's summaries start
SUMMARIES = 2**31
#: the largest slot: slot * SLOT + SLOT - 1 is the largest signed 64-bit rowid
MAX_SLOT = 2**31 - 1
#: table -> (kind, its ref column, the ref's offset in the slot)
_SOURCES = {"ts_lcm_messages": ("message", "ordinal", 0), "ts_lcm_summaries": ("summary", "summary_seq", SUMMARIES)}
_KEY = "scope = {row}.scope AND session_id = {row}.session_id"


# A new slot: one past the largest (the largest is found through the primary key); past MAX_SLOT, the
# first free one (a scan of the slots, once some 2**31 sessions have been made while a later one lived).
# CASE evaluates the branch it takes only. Every slot taken: MAX_SLOT + 1, which the CHECK refuses.
_NEXT_SLOT = (
    f"CASE WHEN top < {MAX_SLOT} THEN top + 1"
    " WHEN NOT EXISTS (SELECT 1 FROM ts_lcm_search_slots WHERE slot = 1) THEN 1"
    " ELSE (SELECT min(a.slot) + 1 FROM ts_lcm_search_slots AS a"
    " WHERE NOT EXISTS (SELECT 1 FROM ts_lcm_search_slots AS b WHERE b.slot = a.slot + 1)) END"
)


def _slot(row: str) -> str:
    """The slot of ``row``'s session (``new`` or ``old``), as a scalar subquery."""
    return f"(SELECT slot FROM ts_lcm_search_slots WHERE {_KEY.format(row=row)})"


def _scoped_triggers() -> None:
    for table, (_kind, ref, offset) in _SOURCES.items():
        op.execute(
            f"CREATE TRIGGER {table}_search_ai AFTER INSERT ON {table} BEGIN"
            f" SELECT RAISE(ABORT, '{table}.{ref} outside the search index range')"
            f" WHERE new.{ref} NOT BETWEEN 0 AND {SUMMARIES - 1};"
            # NOT EXISTS, not OR IGNORE: a trigger's conflict clause gives way to the outer statement's
            # (an INSERT OR REPLACE would replace the slot, and orphan the session's rows).
            f" INSERT INTO ts_lcm_search_slots (slot, scope, session_id) SELECT {_NEXT_SLOT}, new.scope,"
            f" new.session_id FROM (SELECT coalesce(max(slot), 0) AS top FROM ts_lcm_search_slots)"
            f" WHERE NOT EXISTS (SELECT 1 FROM ts_lcm_search_slots WHERE {_KEY.format(row='new')});"
            f" INSERT INTO ts_lcm_search (rowid, content)"
            f" VALUES ({_slot('new')} * {SLOT} + {offset} + new.{ref}, new.content);"
            f" END"
        )
        # The slot goes with the session's last engine row (a deleted session's rows cascade here).
        others = " AND ".join(
            f"NOT EXISTS (SELECT 1 FROM {source} WHERE {_KEY.format(row='old')})" for source in _SOURCES
        )
        op.execute(
            f"CREATE TRIGGER {table}_search_ad AFTER DELETE ON {table} BEGIN"
            f" DELETE FROM ts_lcm_search WHERE rowid = {_slot('old')} * {SLOT} + {offset} + old.{ref};"
            f" DELETE FROM ts_lcm_search_slots WHERE {_KEY.format(row='old')} AND {others};"
            f" END"
        )


def _drop_triggers() -> None:
    for table in _SOURCES:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_search_ai")
        op.execute(f"DROP TRIGGER IF EXISTS {table}_search_ad")


def _refuse_out_of_range() -> None:
    """Stop the upgrade (and roll it back) if a row's ref cannot take its place in its slot."""
    for table, (_kind, ref, _offset) in _SOURCES.items():
        bad = op.get_bind().exec_driver_sql(
            f"SELECT scope, session_id, {ref} FROM {table} WHERE {ref} NOT BETWEEN 0 AND {SUMMARIES - 1} LIMIT 1"
        ).first()
        if bad is not None:
            raise RuntimeError(f"{table}.{ref} = {bad[2]} of session {bad[1]!r} (scope {bad[0]!r}) is outside the"
                               f" search index range 0..{SUMMARIES - 1}: not migrated")


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    _refuse_out_of_range()
    _drop_triggers()
    op.execute("DROP TABLE ts_lcm_search")  # an FTS5 table: its shadow tables go with it
    op.execute("DROP TABLE ts_lcm_search_map")
    op.execute(
        f"CREATE TABLE ts_lcm_search_slots ("
        f" slot INTEGER PRIMARY KEY CONSTRAINT ts_lcm_search_slots_range CHECK (slot BETWEEN 1 AND {MAX_SLOT}),"
        f" scope VARCHAR(255) NOT NULL, session_id VARCHAR(255) NOT NULL,"
        f" CONSTRAINT ts_lcm_search_slots_session UNIQUE (scope, session_id))"
    )
    op.execute("CREATE VIRTUAL TABLE ts_lcm_search USING fts5(content, tokenize = 'trigram')")
    op.execute(
        "INSERT INTO ts_lcm_search_slots (scope, session_id)"
        f" SELECT scope, session_id FROM {' UNION SELECT scope, session_id FROM '.join(_SOURCES)} ORDER BY 1, 2"
    )
    for table, (_kind, ref, offset) in _SOURCES.items():
        # In key order, which is rowid order (slots were numbered in key order): FTS5 writes its pending
        # rows out at every rowid lower than the last, one small segment each.
        op.execute(
            f"INSERT INTO ts_lcm_search (rowid, content)"
            f" SELECT s.slot * {SLOT} + {offset} + t.{ref}, t.content FROM {table} AS t"
            f" JOIN ts_lcm_search_slots AS s ON s.scope = t.scope AND s.session_id = t.session_id"
            f" ORDER BY t.scope, t.session_id, t.{ref}"
        )
    _scoped_triggers()


# 0004's layout, as 0004 made it: one map id per search row, the next one of the whole store.
def _map_triggers() -> None:
    for table, (kind, ref, _offset) in _SOURCES.items():
        match = f"scope = old.scope AND session_id = old.session_id AND kind = '{kind}' AND ref = old.{ref}"
        op.execute(
            f"CREATE TRIGGER {table}_search_ai AFTER INSERT ON {table} BEGIN"
            f" INSERT INTO ts_lcm_search_map (scope, session_id, kind, ref)"
            f" VALUES (new.scope, new.session_id, '{kind}', new.{ref});"
            f" INSERT INTO ts_lcm_search (rowid, content) VALUES (last_insert_rowid(), new.content);"
            f" END"
        )
        op.execute(
            f"CREATE TRIGGER {table}_search_ad AFTER DELETE ON {table} BEGIN"
            f" DELETE FROM ts_lcm_search WHERE rowid = (SELECT id FROM ts_lcm_search_map WHERE {match});"
            f" DELETE FROM ts_lcm_search_map WHERE {match};"
            f" END"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    _drop_triggers()
    op.execute("DROP TABLE ts_lcm_search")
    op.execute("DROP TABLE ts_lcm_search_slots")
    op.execute(
        "CREATE TABLE ts_lcm_search_map ("
        " id INTEGER PRIMARY KEY, scope VARCHAR(255) NOT NULL, session_id VARCHAR(255) NOT NULL,"
        " kind VARCHAR(16) NOT NULL, ref INTEGER NOT NULL,"
        " CONSTRAINT ts_lcm_search_map_ref UNIQUE (scope, session_id, kind, ref))"
    )
    op.execute("CREATE VIRTUAL TABLE ts_lcm_search USING fts5(content, tokenize = 'trigram')")
    for table, (kind, ref, _offset) in _SOURCES.items():
        op.execute(
            f"INSERT INTO ts_lcm_search_map (scope, session_id, kind, ref)"
            f" SELECT scope, session_id, '{kind}', {ref} FROM {table} ORDER BY scope, session_id, {ref}"
        )
        op.execute(
            f"INSERT INTO ts_lcm_search (rowid, content) SELECT m.id, t.content FROM ts_lcm_search_map AS m"
            f" JOIN {table} AS t ON t.scope = m.scope AND t.session_id = m.session_id AND t.{ref} = m.ref"
            f" WHERE m.kind = '{kind}' ORDER BY m.id"
        )
    _map_triggers()
