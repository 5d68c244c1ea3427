"""Receipts name their anchors by raw seq, and list their messages' seqs only when the range has gaps.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07

A receipt kept its admission's and terminal's entry ids (two 22-character ids) and the raw seqs of the
turn's messages as text ("812,813,814,815"): 54 of a receipt's ~156 bytes on PostgreSQL, all of it
already in the entries the receipt references (immutable, and gone only with their session, whose
receipts go with it). Two integer columns now hold the anchors' seqs (``admission_seq``,
``terminal_seq``); the ids are read from the entries at those seqs (one probe of the entries' primary
key each), and ``message_seqs`` is kept only for a turn whose range holds something else (an event, or
another branch written during the turn). Receipts from before 0005 (no seqs: their messages are copies
in ``ts_turn_messages``) stay as they are.

The stored receipts are converted in place, by one UPDATE that writes each row once: each one with a
well-formed ``message_seqs`` gets its two seqs, loses the entry ids that the entries at those seqs have
(an id that differs stays, and is the one read), and loses ``message_seqs`` when it is exactly the
range. ``UPDATE`` leaves the old row versions to VACUUM on PostgreSQL; the space comes back to the file
once the table is rewritten (``VACUUM FULL``) or filled again. A process of an earlier release must not
run against the upgraded store: it would read a new receipt's ids as missing (the library refuses to
open a store newer than itself, but one already running does not look again). Downgrade: the ids and the
seq list written back from the entries, the two columns dropped, the ids NOT NULL again.
"""

from __future__ import annotations

import functools
import re

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

ID = sa.String(255)
#: a stored seq list this revision converts: one seq or more, comma-separated (anything else is left alone)
_LIST = re.compile(r"[0-9]+(,[0-9]+)*")


# The one UPDATE names a row's first and last seq several times each: the row's list is parsed once.
@functools.lru_cache(maxsize=1)
def _ends(seqs: str | None) -> tuple[int | None, int | None]:
    if seqs is None or not _LIST.fullmatch(seqs):
        return None, None
    return int(seqs.partition(",")[0]), int(seqs.rpartition(",")[2])


def _first(seqs: str | None) -> int | None:
    return _ends(seqs)[0]


def _last(seqs: str | None) -> int | None:
    return _ends(seqs)[1]


def _range_text(first: int | None, last: int | None) -> str | None:
    """The seq list of every seq from ``first`` to ``last``, as the ledger wrote it before this revision."""
    return None if first is None or last is None else ",".join(map(str, range(int(first), int(last) + 1)))


def _functions() -> tuple[str, str, str]:
    """SQL for a list's first seq, its last seq (of the column ``message_seqs``), and the list of a range
    (``{first}``, ``{last}``: SQL of its two ends), on this backend.

    SQLite gets them as Python functions on the migration's connection (as 0006 did for hex); PostgreSQL
    has them in SQL, the list's form checked by the same pattern."""
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        raw = bind.connection.driver_connection
        raw.create_function("ts_first_seq", 1, _first, deterministic=True)  # type: ignore[union-attr]
        raw.create_function("ts_last_seq", 1, _last, deterministic=True)  # type: ignore[union-attr]
        raw.create_function("ts_range_text", 2, _range_text, deterministic=True)  # type: ignore[union-attr]
        return (
            "ts_first_seq(ts_receipts.message_seqs)", "ts_last_seq(ts_receipts.message_seqs)",
            "ts_range_text({first}, {last})",
        )
    pattern = f"'^{_LIST.pattern}$'"
    seqs = "ts_receipts.message_seqs"
    first = f"CASE WHEN {seqs} ~ {pattern} THEN CAST(substring({seqs} FROM '^[0-9]+') AS INTEGER) END"
    last = f"CASE WHEN {seqs} ~ {pattern} THEN CAST(substring({seqs} FROM '[0-9]+$') AS INTEGER) END"
    listed = "(SELECT string_agg(CAST(g AS TEXT), ',' ORDER BY g) FROM generate_series({first}, {last}) g)"
    return first, last, listed


#: the id of the entry at a receipt's seq (``{seq}``: SQL of it), shaped for the primary key as the
#: ledger's read of it is (a bare equality took the entry-id index on PostgreSQL tables never analyzed)
_ENTRY_ID = (
    "(SELECT e.entry_id FROM ts_entries e WHERE e.scope = ts_receipts.scope"
    " AND e.session_id = ts_receipts.session_id AND e.seq >= {seq} AND e.seq <= {seq}"
    " ORDER BY e.seq LIMIT 1)"
)


# One UPDATE each way, every column of a receipt set at once: each UPDATE writes a new version of every
# row it touches, and on PostgreSQL none of them can be pruned inside the migration's one transaction.
# Four (the seqs, each id, the list) took ts_receipts from 15.7 to 71.5 MB of heap at 100,000 receipts,
# space back to the file system only with VACUUM FULL (tests/test_receipt_review_s42.py).
def upgrade() -> None:
    """Add the two seq columns, make the ids nullable, convert the stored receipts (one rewrite each)."""
    with op.batch_alter_table("ts_receipts") as batch:
        batch.add_column(sa.Column("admission_seq", sa.Integer, nullable=True))
        batch.add_column(sa.Column("terminal_seq", sa.Integer, nullable=True))
        batch.alter_column("admission_entry_id", existing_type=ID, nullable=True)
        batch.alter_column("terminal_entry_id", existing_type=ID, nullable=True)
    first, last, listed = _functions()
    adm, term = _ENTRY_ID.format(seq=first), _ENTRY_ID.format(seq=last)
    op.execute(
        f"UPDATE ts_receipts SET admission_seq = {first}, terminal_seq = {last},"
        f" admission_entry_id = CASE WHEN admission_entry_id = {adm} THEN NULL ELSE admission_entry_id END,"
        f" terminal_entry_id = CASE WHEN terminal_entry_id = {term} THEN NULL ELSE terminal_entry_id END,"
        f" message_seqs = CASE WHEN message_seqs = {listed.format(first=first, last=last)} THEN NULL"
        f" ELSE message_seqs END"
        f" WHERE {first} IS NOT NULL"
    )


def downgrade() -> None:
    """Write the ids and the seq lists back from the entries (one rewrite each); drop the two columns; ids
    NOT NULL again."""
    _, _, listed = _functions()
    seqs = listed.format(first="ts_receipts.admission_seq", last="ts_receipts.terminal_seq")
    adm, term = _ENTRY_ID.format(seq="ts_receipts.admission_seq"), _ENTRY_ID.format(seq="ts_receipts.terminal_seq")
    op.execute(
        f"UPDATE ts_receipts SET message_seqs = COALESCE(message_seqs, {seqs}),"
        f" admission_entry_id = COALESCE(admission_entry_id, {adm}),"
        f" terminal_entry_id = COALESCE(terminal_entry_id, {term})"
        " WHERE admission_seq IS NOT NULL"
        " AND (message_seqs IS NULL OR admission_entry_id IS NULL OR terminal_entry_id IS NULL)"
    )
    with op.batch_alter_table("ts_receipts") as batch:
        batch.alter_column("admission_entry_id", existing_type=ID, nullable=False)
        batch.alter_column("terminal_entry_id", existing_type=ID, nullable=False)
        batch.drop_column("terminal_seq")
        batch.drop_column("admission_seq")
