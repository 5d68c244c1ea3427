"""A condensed summary carries its children's content, not their bookkeeping, on both backends.

Compaction gave the summarizer each child of a condensation as a user message whose first line was the
child's id and range (``[sum_1 | msg_0..msg_3]``). The extractive summarizer takes a message's first line
for its gist: every line of a condensed summary read ``- user: [sum_1 | msg_0..msg_3]``, then at most two
"key" lines of the child (those that happen to hold "result", "error", ...); the rest of the child's
content was lost, its header counted the children as "messages" ("Summary of 3 messages" for 12), and a
deeper condensation quoted ids of ids. A model summarizer was shown the children as the user's words.
Now a child is given as an earlier summary (``summarize.summary_input``): the extractive summarizer
keeps its content lines (not its header, notes, or the ``Earlier:`` lines it repeated from the summary
before it), counts the messages it covers, and a model is shown it as a summary of so many messages.
The DAG (``ts_lcm_summary_children``) already says which children a condensed summary covers.
"""

from __future__ import annotations

import re
from typing import Any

from conftest import module_store_fixtures
from fake_openai import FakeOpenAI
from sqlalchemy import select

from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from engines.lossless.tables import summaries, summary_children
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.ledger import CommitResult
from transcript_store.models import ClosedRange
from transcript_store.summarize import ExtractiveSummarizer, OpenAISummarizer, summarized, summary_input
from transcript_store.tokens import RoughEstimator

A = "scope-ct"
SMALL = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
         "condensed_summary_tokens": 400, "condense_fanin": 3}
#: a line a compaction or the summarizer writes about summaries, not about the conversation
BOOKKEEPING = re.compile(r"sum_\d|msg_\d|^Summary of |older lines omitted|^Earlier: ", re.M)

shared_url, store, sid = module_store_fixtures(A, "condensed_text")


def make_engine(store: TranscriptStore, summarizer: Any = None) -> LosslessEngine:
    ctx = EngineContext(store=store, config=SMALL, summarizer=summarizer or ExtractiveSummarizer(),
                        estimator=RoughEstimator())
    return LosslessEngine(ctx)


def turn(store: TranscriptStore, engine: LosslessEngine, sid: str, n: int) -> CommitResult:
    admission = store.admit(A, sid, {"role": "user", "content": f"Question {n} about topic{n}. Details follow."},
                            turn_id=f"t{n}")
    appended = store.append_many(A, sid, [{"message": {"role": "assistant", "content": f"Answer {n}: use tool{n}."}}])
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    return store.write(lambda c: engine.commit_turn(
        tx=c, advancement_key=admission.turn_id, admission=admission.anchor, terminal=terminal,
        messages=closed.messages))


def grow(store: TranscriptStore, engine: LosslessEngine, sid: str, turns: int) -> None:
    for n in range(turns):
        turn(store, engine, sid, n)
        engine.compact(scope=A, session_id=sid, force=False, token_budget=600)


def stored(store: TranscriptStore, sid: str) -> tuple[dict[int, Any], dict[int, list[int]]]:
    """The session's summaries by seq, and each condensed one's children in order."""

    def run(c: Any) -> tuple[dict[int, Any], dict[int, list[int]]]:
        rows = c.conn.execute(select(summaries).where(summaries.c.session_id == sid)).all()
        edges = c.conn.execute(select(summary_children).where(summary_children.c.session_id == sid)
                               .order_by(summary_children.c.parent_seq, summary_children.c.idx)).all()
        children: dict[int, list[int]] = {}
        for e in edges:
            children.setdefault(e.parent_seq, []).append(e.child_seq)
        return {r.summary_seq: r for r in rows}, children

    return store.read(run)


def test_a_condensed_summary_holds_its_childrens_content(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    grow(store, engine, sid, 30)
    rows, children = stored(store, sid)
    condensed = [r for r in rows.values() if r.kind == "condensed"]
    assert condensed, "the session is long enough for a condensed summary"
    for r in condensed:
        header, *lines = r.content.splitlines()
        # its header counts the messages it covers, not its children
        assert header == f"Summary of {r.message_count} messages:", r.content
        if lines and re.fullmatch(r"\(\d+ older lines omitted\)", lines[0]):
            lines = lines[1:]  # its own note (the children's notes are not its content)
        body = "\n".join(lines)
        assert not BOOKKEEPING.search(body), r.content  # no child's id, range, header or note
        # each of its lines is a content line of one of its children (the last one dropped may be cut)
        below = {ln for c in children[r.summary_seq] for ln in rows[c].content.splitlines()}
        below |= {ln.removeprefix("Earlier: ") for ln in below}
        for line in lines:
            assert line in below or (line.endswith("…") and any(b.startswith(line[:-1]) for b in below)), line
        assert any(re.match(r"- (user|assistant): (Question|Answer) \d+", ln) for ln in lines), r.content
    # The newest child's text is in its parent: what the conversation said survives a condensation.
    top = max(condensed, key=lambda r: r.summary_seq)
    newest = rows[children[top.summary_seq][-1]]
    assert newest.content.splitlines()[-1] in top.content.splitlines(), (newest.content, top.content)
    assert not store.read(lambda c: audit(c, A, sid)).problems


class Terse:
    """The fake server's model: a short note of how many lines it was asked to summarize."""

    estimator = RoughEstimator()

    def reply(self, messages: list[dict[str, Any]], tools: Any, *, max_tokens: Any = None) -> tuple[Any, str]:
        lines = str(messages[-1]["content"]).count("\n")
        return {"role": "assistant", "content": f"Noted {lines} lines."}, "stop"


def test_a_model_is_shown_the_children_as_summaries(store: TranscriptStore, sid: str) -> None:
    with FakeOpenAI(responder=Terse()) as server:  # type: ignore[arg-type]
        engine = make_engine(store, OpenAISummarizer(server.base_url, "fake-model"))
        grow(store, engine, sid, 30)
        rows, _ = stored(store, sid)
        assert any(r.kind == "condensed" for r in rows.values())
        prompts = [str(body["messages"][-1]["content"]) for body in server.chat_requests]
    folds = [p for p in prompts if "[summary of " in p]
    assert folds, prompts
    for prompt in folds:
        # a child is a summary of its messages, never a user's message opening with its id
        assert not re.search(r"\[user\]\n\[?sum_\d", prompt) and not re.search(r"sum_\d+ \|", prompt), prompt
        assert re.search(r"^\[summary of \d+ earlier messages\]$", prompt, re.M), prompt


class Echo(ExtractiveSummarizer):
    """Summarizes messages; answers a condensation with its inputs ten times over (nothing summarized)."""

    def summarize(self, messages: Any, **kw: Any) -> str:
        if any(summarized(m) is not None for m in messages):
            return "\n".join(str(m["content"]) for m in messages) * 10
        return super().summarize(messages, **kw)


def test_a_condensation_cut_to_its_budget_keeps_a_line_of_each_child(store: TranscriptStore, sid: str) -> None:
    """The deterministic last resort (a summarizer's answer as long as its sources): one line a child, its
    content's start, never its id."""
    engine = make_engine(store, Echo())
    grow(store, engine, sid, 30)
    rows, children = stored(store, sid)
    cut = [r for r in rows.values() if r.kind == "condensed"]
    assert cut and {r.level for r in cut} == {"truncated"}, [(r.summary_seq, r.level) for r in cut]
    for r in cut:
        head, *lines = r.content.split("\n")
        assert head == "(truncated)" and not BOOKKEEPING.search("\n".join(lines)), r.content
        assert 0 < len(lines) <= len(children[r.summary_seq]), r.content
        first = rows[children[r.summary_seq][0]].content
        assert lines[0].rstrip("…").split(" | ")[0] in first, (lines[0], first)
    assert not store.read(lambda c: audit(c, A, sid)).problems


def test_the_extractive_summarizer_reads_an_earlier_summary_as_one() -> None:
    """On the summarizer alone: a summary input gives its content lines and counts the messages it covers."""
    s = ExtractiveSummarizer()
    first = s.summarize([{"role": "user", "content": "We chose PostgreSQL.\nThe error was a timeout."},
                         {"role": "assistant", "content": "Fixed by raising the pool size."}])
    second = s.summarize([{"role": "user", "content": "Next: migrate the ledger."}], previous_summary=first)
    assert second.splitlines()[1].startswith("Earlier: ")
    out = s.summarize([summary_input(first, 2), summary_input(second, 1)], max_tokens=400)
    assert out.splitlines() == [
        "Summary of 3 messages:",
        "- user: We chose PostgreSQL. | The error was a timeout.",
        "- assistant: Fixed by raising the pool size.",
        "- user: Next: migrate the ledger.",
    ], out
    # a user's own text that looks like a summary stays a message
    mimic = s.summarize([{"role": "user", "content": "Summary of 9 messages:\n- user: hi"}])
    assert mimic.splitlines()[0] == "Summary of 1 messages:", mimic
