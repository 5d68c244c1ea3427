"""Below ~800 tokens of window the extractive summaries still carry the messages' text, on both backends.

Session 41 made the summary budgets follow a small window (``config.summary_caps``): a window of 768
tokens gives a leaf 48 tokens. The extractive summarizer writes one line per message (~100 tokens for a
message of a few sentences) and dropped whole lines until the rest fitted: under a budget smaller than a
line it dropped them all (a leaf of 15 messages read "Summary of 15 messages: (15 older lines omitted)").
Now the room the dropped lines leave holds the start of the newest one dropped, cut at a word boundary
and marked "…"; a summary whose lines all fit is unchanged, and none is ever over its budget.
"""

from __future__ import annotations

import random
import re
from typing import Any

from conftest import module_store_fixtures
from sqlalchemy import select
from test_lossless_small_window_s41 import exchange, make_engine

from engines.lossless.audit import audit
from engines.lossless.tables import summaries
from transcript_store import TranscriptStore
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-sw"  # the scope the imported helpers write to
shared_url, store, sid = module_store_fixtures(A, "small_summary")
#: a line of a summary that holds a message's text: its role, then at least three words
TEXT_LINE = re.compile(r"^- (user|assistant): (\S+ ){3,}")


def history(seed: int, turns: int) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    return [m for i in range(turns) for m in exchange(rnd, i)]


def flat(text: str) -> str:
    return " ".join(text.split())


def quoted(line: str, sources: list[dict[str, Any]]) -> bool:
    """Whether ``line`` (``- role: text…``) quotes a source message: its text, cut marks aside, is in one."""
    body = line.split(": ", 1)[1].rstrip("…")
    return any(all(part.rstrip("…") in flat(str(m["content"])) for part in body.split(" | ")) for m in sources)


def test_a_budget_smaller_than_a_line_keeps_the_start_of_one() -> None:
    summarizer, count = ExtractiveSummarizer(), RoughEstimator().count_text
    messages = history(3, 6)
    # every line, whole, at each level
    full = {level: summarizer.summarize(messages, max_tokens=4000, level=level).splitlines()[1:]
            for level in ("normal", "aggressive")}
    assert min(count(line) for line in full["normal"]) > 64

    def cut(line: str, level: str = "normal") -> bool:
        whole = full[level]
        return line not in whole and line.endswith("…") and any(f.startswith(line[:-1]) for f in whole)
    for max_tokens in (24, 32, 48, 64, 128):
        for level in ("normal", "aggressive"):
            out = summarizer.summarize(messages, max_tokens=max_tokens, level=level)
            budget = max_tokens if level == "normal" else max(16, max_tokens // 2)
            assert count(out) <= budget, (max_tokens, level, out)
            assert out == summarizer.summarize(messages, max_tokens=max_tokens, level=level)  # deterministic
            if budget < 24:
                continue  # the header and a role leave no room for three words
            text = [line for line in out.splitlines() if TEXT_LINE.match(line)]
            assert text and cut(text[-1], level), (max_tokens, level, out)  # the newest line dropped, cut
            assert all(quoted(line, messages) for line in text), out
    # Every line fits: the summary is the one it was (no note, no cut), down to the least budget its lines
    # fit (the summarizer adds up the counts of its lines, a newline each: at least the whole text's count).
    whole = summarizer.summarize(messages[:2], max_tokens=4000)
    header, *lines = whole.splitlines()
    least = count(header) + sum(count(line) + 1 for line in lines)
    assert "omitted" not in whole and summarizer.summarize(messages[:2], max_tokens=least) == whole
    assert summarizer.summarize(messages[:2], max_tokens=least - 1) != whole
    # Over by one line of many: the lines that fit stay whole, the note counts the dropped ones.
    some = summarizer.summarize(messages, max_tokens=400)
    assert count(some) <= 400 and re.search(r"^\(\d+ older lines omitted\)$", some, re.M), some
    kept = some.splitlines()[2:]
    assert cut(kept[0]) and all(line in full["normal"] for line in kept[1:]), some


def test_a_small_window_session_s_leaves_carry_the_messages_text(store: TranscriptStore, sid: str) -> None:
    """Compaction at a window of 768 tokens (leaf budget 48): each leaf was "(N older lines omitted)"."""
    messages = history(5, 8)
    store.append_many(A, sid, [{"message": m} for m in messages])
    engine = make_engine(store, ExtractiveSummarizer(), {"context_window": 768})
    engine.bootstrap(scope=A, session_id=sid, fence=None)
    marks = engine.budget(A, sid)
    assert (marks.leaf_summary_tokens, marks.condensed_summary_tokens) == (48, 96)

    compacted = engine.compact(scope=A, session_id=sid, force=True)
    assert compacted.ok and compacted.compacted, compacted
    rows = store.read(lambda c: c.conn.execute(
        select(summaries.c.kind, summaries.c.level, summaries.c.content)
        .where(summaries.c.scope == A, summaries.c.session_id == sid)
    ).all())
    leaves = [r for r in rows if r.kind == "leaf"]
    assert leaves, rows
    count = RoughEstimator().count_text
    for leaf in leaves:
        assert count(leaf.content) <= marks.leaf_summary_tokens, leaf
        text = [line for line in leaf.content.splitlines() if TEXT_LINE.match(line)]
        assert text and all(quoted(line, messages) for line in text), leaf.content
    assert all(count(r.content) <= marks.condensed_summary_tokens for r in rows if r.kind == "condensed")
    assert store.read(lambda c: audit(c, A, sid)).problems == []
