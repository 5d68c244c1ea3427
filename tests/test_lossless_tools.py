"""The lossless engine's recall tools and budgets against hostile input, on both backends.

The model writes a tool's arguments: any text, any id, any regex. None of it may raise out of the turn
(the host would quarantine the engine), hold the process, or reach the database as a value it refuses.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from conftest import module_store_fixtures
from sqlalchemy.exc import DataError

from engines.lossless import LosslessEngine
from engines.lossless import search as search_module
from engines.lossless import tools as tools_module
from engines.lossless.context import load_items
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext, EngineSelection, Limits, RuntimeSettings
from transcript_store.errors import StoreUnavailable, TransientStoreError
from transcript_store.host import HostRuntime
from transcript_store.model import ModelResponse
from transcript_store.models import ClosedRange
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-lt"
SMALL = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
         "condensed_summary_tokens": 160, "condense_fanin": 3}
#: arguments that once raised out of handle_tool_call (and so quarantined the engine)
BAD_ARGUMENTS = [
    ("lcm_describe", {"id": "sum_\u00b2"}),  # '²'.isdigit() is True, int('²') raises
    ("lcm_expand", {"id": "msg_\u00b2"}),
    ("lcm_describe", {"id": "msg_99999999999999999999"}),  # past SQLite's INTEGER
    ("lcm_expand", {"id": "sum_99999999999"}),  # past PostgreSQL's int4
    ("lcm_describe", {"id": "x\x00y"}),  # PostgreSQL takes no NUL in text
    ("lcm_describe", {"id": "abc\ud800"}),  # a lone surrogate (JSON "\ud800") cannot be encoded
    ("lcm_grep", {"pattern": "foo\x00bar"}),  # SQLite FTS5: 'unterminated string'
    ("lcm_grep", {"pattern": "caf\ud800"}),
    ("lcm_grep", {"pattern": "x" * 5000}),
    ("lcm_grep", {"pattern": " ".join(["word"] * 100)}),
    ("lcm_grep", {"pattern": "((a{1000}){1000}){1000}", "mode": "regex"}),  # compiling it would not end
]


shared_url, store, sid = module_store_fixtures(A, "lossless_tools")


def make_engine(store: TranscriptStore, config: dict[str, Any] | None = None) -> LosslessEngine:
    ctx = EngineContext(store=store, config=config or {}, summarizer=ExtractiveSummarizer(),
                        estimator=RoughEstimator())
    return LosslessEngine(ctx)


def turn(store: TranscriptStore, engine: LosslessEngine, sid: str, turn_id: str, *replies: str) -> None:
    """Admit, append and commit one finished turn."""
    admission = store.admit(A, sid, {"role": "user", "content": f"question {turn_id} " + "words " * 30},
                            turn_id=turn_id)
    texts = replies or (f"answer {turn_id} " * 10,)
    appended = store.append_many(A, sid, [{"message": {"role": "assistant", "content": t}} for t in texts])
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    store.write(lambda c: engine.commit_turn(
        tx=c, advancement_key=turn_id, admission=admission.anchor, terminal=terminal, messages=closed.messages
    ))


def call(engine: LosslessEngine, sid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(engine.handle_tool_call(name, args, scope=A, session_id=sid))
    return out


def context_tokens(store: TranscriptStore, sid: str) -> int:
    return sum(i.tokens for i in store.read(lambda c: load_items(c, A, sid)))


# ---------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(("name", "args"), BAD_ARGUMENTS, ids=[repr(a)[:40] for _, a in BAD_ARGUMENTS])
def test_bad_arguments_are_answered_not_raised(
    store: TranscriptStore, sid: str, name: str, args: dict[str, Any]
) -> None:
    engine = make_engine(store, SMALL)
    for n in range(6):
        turn(store, engine, sid, f"t{n}")
    engine.compact(scope=A, session_id=sid, force=True)
    assert set(call(engine, sid, name, args)) == {"error"}
    assert call(engine, sid, "lcm_describe", {"id": "msg_0"})["id"] == "msg_0"  # and the engine goes on


def test_an_id_is_taken_as_the_store_names_one_past_640_bytes_too(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 640-byte limit is for ids given to something new (README, ids): a tool's id names what the store
    holds, and an entry id an earlier release stored past it is still described; past 255 characters, an
    id no store holds, the model is told so."""
    import transcript_store.core as core_module

    engine = make_engine(store)
    wide = "\U0001f642" * 161  # 644 bytes of UTF-8, 161 characters
    monkeypatch.setattr(core_module, "MAX_ID_BYTES", 10_000)  # an earlier release, without the limit
    admission = store.admit(A, sid, {"role": "user", "content": "question"}, turn_id="t1")
    appended = store.append_many(A, sid, [{"message": {"role": "assistant", "content": "an answer"},
                                           "entry_id": wide}])
    monkeypatch.undo()
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    store.write(lambda c: engine.commit_turn(
        tx=c, advancement_key="t1", admission=admission.anchor, terminal=terminal, messages=closed.messages
    ))
    found = call(engine, sid, "lcm_describe", {"id": wide})
    assert "error" not in found and found["entry_id"] == wide, found
    refused = call(engine, sid, "lcm_describe", {"id": "x" * 256})
    assert set(refused) == {"error"} and "255 characters" in refused["error"]


class ToolCallingModel:
    """Calls one tool with the given arguments on the user's message, then answers."""

    name = "m"

    def __init__(self, tool: str, args: dict[str, Any]) -> None:
        self.tool, self.args = tool, args

    def complete(self, messages: list[dict[str, Any]], tools: Any = None, *, max_tokens: Any = None,
                 timeout: Any = None) -> ModelResponse:
        if messages[-1]["role"] == "user":
            fn = {"name": self.tool, "arguments": json.dumps(self.args)}
            msg: dict[str, Any] = {"role": "assistant", "content": None,
                                   "tool_calls": [{"id": "c1", "type": "function", "function": fn}]}
        else:
            msg = {"role": "assistant", "content": "ok"}
        return ModelResponse(message=msg, usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                             model="m")


@pytest.mark.parametrize(("name", "args"), BAD_ARGUMENTS[:8], ids=[repr(a)[:40] for _, a in BAD_ARGUMENTS[:8]])
def test_a_bad_tool_call_never_quarantines_the_engine(
    store: TranscriptStore, sid: str, name: str, args: dict[str, Any]
) -> None:
    host = HostRuntime(store, load_settings(config_path=None, engine="lossless"), ToolCallingModel(name, args),
                       registry=EngineRegistry(), summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())
    out = host.run_turn(A, sid, "hello", turn_id="t1")
    assert out.engine_id == "lossless" and "lossless" not in host.quarantined
    assert set(json.loads(out.messages[2]["content"])) == {"error"}


def test_only_argument_failures_become_tool_errors(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last line of defence: a value the checks let through is the model's to hear about; a database
    outage, a full disk or a transient error is not, and propagates to the host."""
    engine = make_engine(store)
    turn(store, engine, sid, "t1")
    refused = DataError("SELECT", {}, Exception("integer out of range"))

    def failing(error: BaseException) -> None:
        def run(*_args: Any) -> Any:
            raise error
        monkeypatch.setattr(tools_module, "run_describe", run)

    for error in (OverflowError("too large"), UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogate")):
        failing(error)
        assert set(call(engine, sid, "lcm_describe", {"id": "msg_0"})) == {"error"}
    outage = StoreUnavailable("database error: the server closed the connection")
    failing(outage)
    with pytest.raises(StoreUnavailable):
        call(engine, sid, "lcm_describe", {"id": "msg_0"})
    data = StoreUnavailable("database error: integer out of range")
    data.__cause__ = refused
    failing(data)
    assert set(call(engine, sid, "lcm_describe", {"id": "msg_0"})) == {"error"}
    transient = TransientStoreError("transient database error")
    transient.__cause__ = refused
    failing(transient)
    with pytest.raises(TransientStoreError):
        call(engine, sid, "lcm_describe", {"id": "msg_0"})
    failing(RuntimeError("a bug"))
    with pytest.raises(RuntimeError):
        call(engine, sid, "lcm_describe", {"id": "msg_0"})


def test_full_text_takes_any_text(store: TranscriptStore, sid: str) -> None:
    """Every pattern is a search, never an FTS5 query syntax or LIKE/GLOB wildcard error."""
    engine = make_engine(store)
    nasty = ['"quoted" NEAR(x y) -z *', 'a"b', '""', "'", "a%_\\", "* ? [ ] [x ^ - +", "AND OR NOT", "^a$",
             "col:umn", "(((", "\t\x01\x1f", "\u200b\u202e", "e\u0301t\u00e9", "🙂🙂🙂", "x" * 1000,
             " ".join(["ab"] * 32)]
    turn(store, engine, sid, "t1", *nasty[:-2], "2*3 and 23", "why? [x] found")
    for pattern in nasty:
        for sort in ("recency", "relevance"):
            out = call(engine, sid, "lcm_grep", {"pattern": pattern, "sort": sort})
            assert "error" not in out and out["count"] >= 0, (pattern, out)
    assert call(engine, sid, "lcm_grep", {"pattern": '"quoted"'})["count"] == 1
    snippets = [r["snippet"] for r in call(engine, sid, "lcm_grep", {"pattern": "2*", "search_in": "messages"})
                ["results"]]
    assert snippets == ["2*3 and 23"]  # GLOB's wildcards are literal
    brackets = {r["snippet"] for r in call(engine, sid, "lcm_grep", {"pattern": "[x"})["results"]}
    assert {"* ? [ ] [x ^ - +", "why? [x] found"} <= brackets  # (PostgreSQL's tsvector also finds "x")


def test_short_terms_fold_case_beyond_ascii(store: TranscriptStore, sid: str) -> None:
    """Terms under a trigram (SQLite: not in the FTS index) fold non-ASCII letters like PostgreSQL's ILIKE."""
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "ÉTÉ à Paris", "ΣΟΦΙΑ says hi", "plain ascii OX")

    def found(pattern: str) -> list[str]:
        out = call(engine, sid, "lcm_grep", {"pattern": pattern, "search_in": "messages"})
        return [r["snippet"] for r in out["results"]]

    assert found("ét") == ["ÉTÉ à Paris"]
    assert found("É") == ["ÉTÉ à Paris"]
    assert found("\u03c3\u03bf") == ["ΣΟΦΙΑ says hi"]  # Greek sigma, omicron
    assert found("ox") == ["plain ascii OX"]
    assert found("été") == ["ÉTÉ à Paris"]  # a trigram: the index folds it too


def test_a_long_message_summarized_away_is_read_whole_a_piece_at_a_time(store: TranscriptStore, sid: str) -> None:
    """``lcm_expand`` cut every message to ``expand_max_chars`` (4,000) and a message's ``offset`` was
    ignored: of a 12,000-character tool output summarized away, the model could read the first third
    only, however it asked. A message's offset is a character offset: the pages, read from
    ``next_offset`` until it is None, give the whole text back."""
    engine = make_engine(store, SMALL)
    long_reply = "".join(f"line {n:05d} of a long tool output\n" for n in range(400)) + "NEEDLE at the very end"
    turn(store, engine, sid, "t0", long_reply)
    for n in range(1, 6):
        turn(store, engine, sid, f"t{n}")
    engine.compact(scope=A, session_id=sid, force=True, token_budget=1500)
    found = call(engine, sid, "lcm_describe", {"id": "msg_1"})
    assert not found["in_context"] and found["context_holder"] is not None, found
    leaf = call(engine, sid, "lcm_expand", {"id": found["summarized_in"][0]})
    item = next(i for i in leaf["items"] if i["id"] == "msg_1")
    assert item["truncated"] and len(item["content"]) < len(long_reply)
    pages, offset = [], 0
    while offset is not None:
        page = call(engine, sid, "lcm_expand", {"id": "msg_1", "offset": offset})
        assert page["total_chars"] == len(long_reply) and page["offset"] == offset
        pages.append(page["items"][0]["content"].removesuffix("…"))
        offset = page["next_offset"]
    assert "".join(pages) == long_reply and len(pages) == -(-len(long_reply) // 4000)
    end = call(engine, sid, "lcm_expand", {"id": "msg_1", "offset": len(long_reply)})
    assert end["items"][0]["content"] == "" and end["next_offset"] is None
    assert "past the end" in call(engine, sid, "lcm_expand", {"id": "msg_1", "offset": 10**9})["error"]


# ---------------------------------------------------------------------------------------------- regex


def test_a_regex_is_bounded_in_time_and_frees_the_process(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catastrophically backtracking regex answers an error within its bound, and other threads run
    meanwhile (matching releases the GIL)."""
    monkeypatch.setattr(search_module, "REGEX_SECONDS", 0.5, raising=False)
    engine = make_engine(store)
    # Unbounded, this pattern takes ~30 s over 38 a's on a 2-core VM (x1.6 a character); bounded, 0.5 s
    # plus the search's own reads: the 6 s allowed below leaves room for a loaded machine (3.1 s seen).
    turn(store, engine, sid, "t1", "a" * 38 + "!")
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.02)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        start = time.monotonic()
        out = call(engine, sid, "lcm_grep", {"pattern": "(a|aa)+$", "mode": "regex"})
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        ticker.join()
    assert "ran past its 0.5 s bound" in out.get("error", ""), out
    assert elapsed < 6, elapsed
    assert sum(start + 0.1 < t < start + elapsed for t in ticks) >= 5  # the ticker ran during the match
    assert call(engine, sid, "lcm_grep", {"pattern": r"a{3}!", "mode": "regex"})["count"] == 1


def test_regex_size_is_bounded_before_compiling(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "2024-01-31 " + "z" * 300)
    start = time.monotonic()
    # The comment and verbose-mode forms hid their repetitions from a hand-written size scanner: the
    # compile of the first ran for seconds holding the GIL. Sizes are read off Python's re parser now.
    for pattern in ("((a{1000}){1000}){1000}", "(?:x{400}){400}", "a{0,4294967294}", "y{99999999999999999999}",
                    "(?#[)(?:(?:(?:a{100}){100}){100}){10}", "(?x) (?:a{1000} # [ \n){1000}"):
        out = call(engine, sid, "lcm_grep", {"pattern": pattern, "mode": "regex"})
        assert out.get("error", "").startswith("regular expression too large"), (pattern, out)
    assert time.monotonic() - start < 2
    for pattern in (r"\d{4}-\d{2}-\d{2}", r"z{300}", r".{0,200}z{9}", r"[{]?\d{4}-", r"\p{L}{3}z"):
        assert call(engine, sid, "lcm_grep", {"pattern": pattern, "mode": "regex"})["count"] == 1, pattern
    assert search_module.expanded_size("(a{1000}){1000}") == 1_000_000
    assert search_module.expanded_size("ab{3}(cd){2,5}[x{9}]") == 1 + 3 + 10 + 1
    # Syntax Python's re does not know (recursion, here) is refused, not compiled.
    for pattern in ("a(?R)?b", "(?1)(a)"):
        out = call(engine, sid, "lcm_grep", {"pattern": pattern, "mode": "regex"})
        assert out.get("error", "").startswith("invalid regular expression"), (pattern, out)


# ---------------------------------------------------------------------------------------------- budgets


def test_a_configured_window_above_the_budget_still_compacts(store: TranscriptStore, sid: str) -> None:
    """context_window above the host's budget: the budget in force is the smaller, so assemble compacts
    (summaries take the old messages' place) instead of cutting raw history silently."""
    engine = make_engine(store, {**SMALL, "context_window": 128_000})
    for n in range(30):
        turn(store, engine, sid, f"t{n}", f"answer {n} " + "detail " * 40)
        engine.maintain(scope=A, session_id=sid)
    budget = 2000
    assert context_tokens(store, sid) > budget
    out = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=budget)
    items = store.read(lambda c: load_items(c, A, sid))
    assert len(out.messages) == len(items)  # nothing cut: all of the context fits
    assert any(i.summary is not None for i in items) and out.system_prompt_addition is not None
    assert engine.budget(A, sid).window == budget


def test_maintain_uses_the_runs_prompt_budget(store: TranscriptStore, sid: str) -> None:
    """A process that never assembled the session (the service, a restarted worker) compacts against the
    prompt token budget the host passes in runtime_settings, not a built-in default window."""
    engine = make_engine(store, SMALL)
    for n in range(30):
        turn(store, engine, sid, f"t{n}", f"answer {n} " + "detail " * 40)
    before = context_tokens(store, sid)

    def settings(prompt_budget: int) -> RuntimeSettings:
        return RuntimeSettings(context_engine_selection=EngineSelection(id="lossless", source="config"),
                               limits=Limits(prompt_token_budget=prompt_budget, max_output_tokens=256))

    large = make_engine(store, SMALL).maintain(scope=A, session_id=sid, runtime_settings=settings(before * 2))
    assert not large.changed and context_tokens(store, sid) == before
    small = make_engine(store, SMALL).maintain(scope=A, session_id=sid, runtime_settings=settings(before // 2))
    assert small.changed
    assert context_tokens(store, sid) <= int(before // 2 * 0.75)
