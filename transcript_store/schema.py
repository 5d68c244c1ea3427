"""SQLAlchemy Core tables of the store.

The migrations create these; this module is what the code queries. Every key starts with
(scope, session_id), so a sharded PostgreSQL can distribute every table by session.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    text,
)

metadata = MetaData()

ID = String(255)

sessions = Table(
    "ts_sessions",
    metadata,
    Column("scope", ID, nullable=False),
    Column("session_id", ID, nullable=False),
    Column("session_key", ID, nullable=True),
    Column("active", Boolean, nullable=False),
    Column("generation", Integer, nullable=False),
    # Dense raw seq: the next entry gets last_seq + 1 (an UPDATE ... RETURNING takes the row lock).
    Column("last_seq", Integer, nullable=False),
    Column("head_seq", Integer, nullable=True),
    Column("head_entry_id", ID, nullable=True),
    Column("path_length", Integer, nullable=False),
    Column("visible_count", Integer, nullable=False),
    Column("created_us", BigInteger, nullable=False),
    Column("updated_us", BigInteger, nullable=False),
    # Which creation of this (scope, session_id) the row is: random for every session created or
    # imported, so cursors of a deleted session are not honoured on a later one under the same id, even
    # when an import carries the same creation time (revision 0007; before it, created_us was used).
    Column("incarnation", BigInteger, nullable=False),
    PrimaryKeyConstraint("scope", "session_id", name="ts_sessions_pk"),
)
Index(
    "ts_sessions_active_key",
    sessions.c.scope,
    sessions.c.session_key,
    unique=True,
    sqlite_where=text("active AND session_key IS NOT NULL"),
    postgresql_where=text("active AND session_key IS NOT NULL"),
)

entries = Table(
    "ts_entries",
    metadata,
    Column("scope", ID, nullable=False),
    Column("session_id", ID, nullable=False),
    Column("seq", Integer, nullable=False),
    Column("entry_id", ID, nullable=False),
    Column("parent_id", ID, nullable=True),
    # Depth and message position along the entry's own root path never change (parents are fixed),
    # so an entry's active position is intrinsic: only *which* entries are active changes.
    Column("depth", Integer, nullable=False),
    Column("position", Integer, nullable=True),
    Column("generation", Integer, nullable=False),
    Column("kind", String(16), nullable=False),
    Column("role", String(16), nullable=True),
    Column("size_bytes", Integer, nullable=False),
    Column("idempotency_key", ID, nullable=True),
    Column("turn_id", ID, nullable=True),
    Column("created_us", BigInteger, nullable=False),
    # Last (revision 0018, SQLite): a column after a payload too large for its page is reached only by
    # walking the payload's overflow pages, so reading the sizes alone read every large message whole.
    # PostgreSQL keeps 0001's order: a large payload is stored out of line there (TOAST).
    Column("payload", Text, nullable=False),
    PrimaryKeyConstraint("scope", "session_id", "seq", name="ts_entries_pk"),
    ForeignKeyConstraint(
        ["scope", "session_id"],
        ["ts_sessions.scope", "ts_sessions.session_id"],
        ondelete="CASCADE",
        name="ts_entries_session_fk",
    ),
)
Index("ts_entries_entry_id", entries.c.scope, entries.c.session_id, entries.c.entry_id, unique=True)
Index(
    "ts_entries_idempotency_key",
    entries.c.scope,
    entries.c.session_id,
    entries.c.idempotency_key,
    unique=True,
    sqlite_where=text("idempotency_key IS NOT NULL"),
    postgresql_where=text("idempotency_key IS NOT NULL"),
)
Index(
    "ts_entries_turn_id",
    entries.c.scope,
    entries.c.session_id,
    entries.c.turn_id,
    unique=True,
    sqlite_where=text("turn_id IS NOT NULL"),
    postgresql_where=text("turn_id IS NOT NULL"),
)

# The materialized active branch: one row per depth on the path root -> head. Visible messages are
# the rows with a position; reads by position use the partial unique index and cost O(page).
active_path = Table(
    "ts_active_path",
    metadata,
    Column("scope", ID, nullable=False),
    Column("session_id", ID, nullable=False),
    Column("depth", Integer, nullable=False),
    Column("seq", Integer, nullable=False),
    Column("position", Integer, nullable=True),
    PrimaryKeyConstraint("scope", "session_id", "depth", name="ts_active_path_pk"),
    ForeignKeyConstraint(
        ["scope", "session_id"],
        ["ts_sessions.scope", "ts_sessions.session_id"],
        ondelete="CASCADE",
        name="ts_active_path_session_fk",
    ),
)
Index(
    "ts_active_path_position",
    active_path.c.scope,
    active_path.c.session_id,
    active_path.c.position,
    unique=True,
    sqlite_where=text("position IS NOT NULL"),
    postgresql_where=text("position IS NOT NULL"),
)


def _session_fk(table: str) -> ForeignKeyConstraint:
    return ForeignKeyConstraint(
        ["scope", "session_id"],
        ["ts_sessions.scope", "ts_sessions.session_id"],
        ondelete="CASCADE",
        name=f"{table}_session_fk",
    )


# Host side: one durable intent per logical turn, admitted -> accepted -> ready | blocked.
outbox = Table(
    "ts_outbox",
    metadata,
    Column("scope", ID, nullable=False),
    Column("session_id", ID, nullable=False),
    Column("turn_id", ID, nullable=False),
    Column("engine_id", ID, nullable=False),
    Column("state", String(16), nullable=False),
    # The admission entry's raw seq: a durable per-session order, never wall-clock time.
    Column("enqueue_seq", Integer, nullable=False),
    Column("admission", Text, nullable=False),
    Column("terminal", Text, nullable=True),
    Column("messages", Text, nullable=True),
    Column("is_heartbeat", Boolean, nullable=False),
    Column("block_reason", Text, nullable=True),
    Column("attempt_count", Integer, nullable=False),
    Column("last_error", Text, nullable=True),
    Column("last_attempt_us", BigInteger, nullable=True),
    Column("lease_owner", String(128), nullable=True),
    Column("lease_expires_us", BigInteger, nullable=True),
    Column("created_us", BigInteger, nullable=False),
    Column("updated_us", BigInteger, nullable=False),
    # An admitted turn that retries took over from live attempts: those attempts' leases, a JSON list
    # [{"owner": ..., "expires_us": ...}, ...] oldest first (at most 16, the abandoned ones pruned at every
    # write), which their workers keep renewing; the turn is abandoned only once the holder's lease and
    # every one of these are (revision 0013). NULL: no attempt displaced (every turn but a retried one).
    Column("displaced_leases", Text, nullable=True),
    PrimaryKeyConstraint("scope", "session_id", "turn_id", name="ts_outbox_pk"),
    _session_fk("ts_outbox"),
)
# The queue indexes hold the rows still to deliver or discard, never a blocked one (blocked rows stay for
# good): the head of a session's queue is found without passing its blocked rows, and a lookup of one
# turn's row, which names no state, can only take the primary key. When they held every row, PostgreSQL
# on tables never analyzed costed ts_outbox_order (it starts with the session too) the same as the
# primary key for such a lookup, took it, and filtered every row of the session (revision 0014).
# outbox._queued writes the condition in statements that read them.
_QUEUED = text("state <> 'blocked'")
Index(
    "ts_outbox_order",
    outbox.c.scope,
    outbox.c.session_id,
    outbox.c.engine_id,
    outbox.c.enqueue_seq,
    sqlite_where=_QUEUED,
    postgresql_where=_QUEUED,
)
Index("ts_outbox_state", outbox.c.state, outbox.c.scope, outbox.c.session_id, sqlite_where=_QUEUED,
      postgresql_where=_QUEUED)

# Engine side: the commit ledger. The receipt's key is the idempotency; its hash catches reuse.
receipts = Table(
    "ts_receipts",
    metadata,
    Column("scope", ID, nullable=False),
    Column("session_id", ID, nullable=False),
    Column("advancement_key", ID, nullable=False),
    Column("engine_id", ID, nullable=False),
    # Fixed-width columns ahead of the text ones: on PostgreSQL a BIGINT after text is padded to its
    # 8-byte alignment in every row (revision 0006).
    Column("committed_us", BigInteger, nullable=False),
    Column("message_count", Integer, nullable=False),
    Column("is_heartbeat", Boolean, nullable=False),
    # The SHA-256 as its 32 bytes; Receipt.payload_hash is the hex of it (revision 0006).
    Column("payload_hash", LargeBinary(32), nullable=False),
    # The anchors' entry ids, NULL where the seqs below name them (every receipt written since 0017, and
    # every one 0017 converted whose ids were those of the entries at its seqs): two
    # 22-character ids were 46 of a receipt's ~156 bytes on PostgreSQL (bench/README.md, "Profiling" 43).
    Column("admission_entry_id", ID, nullable=True),
    Column("terminal_entry_id", ID, nullable=True),
    # Raw seqs of the turn's message entries, comma-separated; NULL when they are every seq from
    # ``admission_seq`` to ``terminal_seq`` (the common turn), and on receipts from before revision 0005,
    # whose messages are in ts_turn_messages (and which have no ``admission_seq`` either).
    Column("message_seqs", Text, nullable=True),
    # The raw seqs of the admitted entry and the terminal (revision 0017): the ledger references the
    # transcript (entries are immutable, and leave only with their session, whose receipts go with it)
    # instead of copying it; 0017 set them on every receipt stored with a seq list. NULL on a receipt from
    # before revision 0005 (its messages copied, ids stored) and on one a process of an earlier release
    # still running after the upgrade writes: its entry ids and ``message_seqs`` say it. Last,
    # where 0017's ALTER TABLE put them: on PostgreSQL a receipt is no larger for it (measured: the same
    # heap as with them ahead of the text columns, the 4-byte alignment costing at most 3 bytes a row).
    Column("admission_seq", Integer, nullable=True),
    Column("terminal_seq", Integer, nullable=True),
    # Key order (session, advancement key, engine): one index answers both "this engine's receipt of
    # this key" and "every engine's receipt of this logical turn" (revision 0005).
    PrimaryKeyConstraint("scope", "session_id", "advancement_key", "engine_id", name="ts_receipts_pk"),
    _session_fk("ts_receipts"),
)

# Copies of committed messages, written only before revision 0005 (read for those receipts).
turn_messages = Table(
    "ts_turn_messages",
    metadata,
    Column("scope", ID, nullable=False),
    Column("session_id", ID, nullable=False),
    Column("engine_id", ID, nullable=False),
    Column("advancement_key", ID, nullable=False),
    Column("idx", Integer, nullable=False),
    Column("role", String(16), nullable=False),
    Column("payload", Text, nullable=False),
    PrimaryKeyConstraint(
        "scope", "session_id", "engine_id", "advancement_key", "idx", name="ts_turn_messages_pk"
    ),
    _session_fk("ts_turn_messages"),
)

# Small per-session engine state (cursors, counters) written in the commit's own transaction.
engine_state = Table(
    "ts_engine_state",
    metadata,
    Column("scope", ID, nullable=False),
    Column("session_id", ID, nullable=False),
    Column("engine_id", ID, nullable=False),
    Column("key", ID, nullable=False),
    Column("value", Text, nullable=False),
    Column("updated_us", BigInteger, nullable=False),
    PrimaryKeyConstraint("scope", "session_id", "engine_id", "key", name="ts_engine_state_pk"),
    _session_fk("ts_engine_state"),
)

# Tombstones: the incarnation of each session ``delete_session`` deleted, written in the delete's own
# transaction (never on the hot path). A retry of a create whose COMMIT was lost reads its own incarnation
# here: the create landed and was deleted since, so it must not make the session again (revision 0015).
# Pruned by every delete once older than ``core.TOMBSTONE_SECONDS``: the age index serves that alone.
deleted_sessions = Table(
    "ts_deleted_sessions",
    metadata,
    Column("scope", ID, nullable=False),
    Column("session_id", ID, nullable=False),
    Column("incarnation", BigInteger, nullable=False),
    Column("deleted_us", BigInteger, nullable=False),
    PrimaryKeyConstraint("scope", "session_id", "incarnation", name="ts_deleted_sessions_pk"),
)
Index("ts_deleted_sessions_age", deleted_sessions.c.deleted_us)

# Engines isolated by a host process (pid + start time + token), so `doctor` elsewhere can show them.
quarantine = Table(
    "ts_quarantine",
    metadata,
    Column("engine_id", String(255), nullable=False),
    Column("process", String(255), nullable=False),
    Column("operation", String(64), nullable=False),
    Column("reason", Text, nullable=False),
    Column("created_us", BigInteger, nullable=False),
    PrimaryKeyConstraint("engine_id", "process", name="ts_quarantine_pk"),
)
