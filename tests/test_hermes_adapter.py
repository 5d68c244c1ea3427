"""The Hermes adapter against the documented ContextEngine contract, without a running Hermes.

Under `make test-hermes` the adapter subclasses the real ``agent.context_engine.ContextEngine``; under
plain `make test` (no hermes-agent) a stand-in base is used, the adapter logic being the same.
"""

from __future__ import annotations

import copy
import json
import logging
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from transcript_store.cli import cli
from transcript_store.hermes import (
    CONTEXT_MARKER,
    create_engine,
    is_context_message,
    is_valid_sequence,
    resolve_threshold,
    valid_sequence,
)
from transcript_store.summarize import ExtractiveSummarizer, SummarizerError
from transcript_store.tokens import RoughEstimator


def conversation(tag: str, turns: int) -> list[dict[str, Any]]:
    """A Hermes-style message list (no system prompt) with tool-call pairs."""
    out: list[dict[str, Any]] = []
    for i in range(turns):
        out.append({"role": "user", "content": f"{tag} question {i} " + "lorem ipsum " * 60})
        if i % 2 == 0:
            call = {"id": f"call_{tag}_{i}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            out.append({"role": "tool", "tool_call_id": call["id"], "content": f"{tag} tool result {i}"})
        out.append({"role": "assistant", "content": f"{tag} answer {i} " + "dolor sit " * 40})
    return out


def make(tmp_path: Path, **kwargs: Any) -> Any:
    kwargs.setdefault("db_url", f"sqlite:///{tmp_path / 'store.db'}")
    kwargs.setdefault("context_length", 64000)
    kwargs.setdefault("threshold_percent", 2000)
    return create_engine(allow_stand_in=True, **kwargs)


def stored(engine: Any, session: str) -> list[str]:
    return [json.dumps(m, sort_keys=True) for m in engine.stored_messages(session)]


def assert_once(engine: Any, session: str, messages: list[dict[str, Any]]) -> None:
    rows = stored(engine, session)
    assert len(rows) == len(set(rows)), "a message stored twice"
    for m in messages:
        if not is_context_message(m):
            assert json.dumps(m, sort_keys=True) in rows


def test_compress_keeps_everything_and_answers_a_valid_list(tmp_path: Path) -> None:
    engine = make(tmp_path)
    engine.on_session_start("s1")
    convo = conversation("alpha", 12)
    system = {"role": "system", "content": "You are a test agent."}
    out = engine.compress([system, *convo], focus_topic="alpha")
    assert out[0]["role"] == "system" and out[0]["content"].startswith("You are a test agent.")
    assert is_valid_sequence(out) and len(out) < len(convo) + 1
    assert any(CONTEXT_MARKER in str(m.get("content")) for m in out)
    assert engine.compression_count == 1
    for _ in range(2):  # repeated compress / session end: nothing stored twice
        engine.compress([system, *convo])
        engine.on_session_end("s1", convo)
    assert_once(engine, "s1", convo)
    assert len(stored(engine, "s1")) == len(convo)
    # the host continues with our answer: only the new messages are added, once
    more = [{"role": "user", "content": "alpha follow-up"}, {"role": "assistant", "content": "alpha reply"}]
    engine.on_session_end("s1", out[1:] + more)
    engine.on_turn_complete(out[1:] + more)
    assert len(stored(engine, "s1")) == len(convo) + 2
    # every original is reachable through the recall tools
    names = {s["name"] for s in engine.get_tool_schemas()}
    assert names == {"lcm_grep", "lcm_describe", "lcm_expand"}
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "alpha question 0"}))
    assert found["results"]


def test_deepcopy_and_pickle_carry_no_runtime(tmp_path: Path) -> None:
    engine = make(tmp_path)
    engine.on_session_start("s1")
    engine.on_turn_complete(conversation("beta", 2))
    assert engine._rt is not None
    clone = copy.deepcopy(engine)
    assert clone._rt is None and type(clone) is type(engine)
    restored = pickle.loads(pickle.dumps(engine))
    assert restored._rt is None
    clone.on_turn_complete(conversation("beta", 2))  # opens its own store; nothing new stored
    assert len(stored(clone, "s1")) == len(conversation("beta", 2))
    clone.close()


def test_copies_of_one_engine_share_one_store(store_url: str, tmp_path: Path) -> None:
    """hermes-agent deep-copies the engine for every agent and closes none: each copy opened a store of
    its own, on PostgreSQL a server connection per copy (the gateway caches 128 agents; a server's
    default is 100 connections), each with caches of its own."""
    proto = make(tmp_path, db_url=store_url)
    copies = [copy.deepcopy(proto) for _ in range(6)]
    for i, c in enumerate(copies):
        c.on_session_start(f"s{i}")
        c.on_turn_complete(conversation(f"c{i}", 1))
    assert len({id(c.runtime().store) for c in copies}) == 1
    if store_url.startswith("postgresql"):
        import psycopg
        from sqlalchemy.engine import make_url

        url = make_url(store_url)
        with psycopg.connect(host=url.host, port=url.port, user=url.username, dbname="postgres") as conn:
            held = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (url.database,)).fetchone()
        assert held is not None and held[0] <= 2, held  # one pool's, not one per copy
    other = make(tmp_path, db_url=store_url, scope="elsewhere")  # another configuration: its own
    assert other.runtime() is not copies[0].runtime()
    other.close()
    store = copies[0].runtime().store
    for c in copies[:-1]:
        c.close()
    assert not store.closed  # the last copy still uses it
    copies[-1].on_turn_complete(conversation("c5", 2))
    assert len(copies[-1].stored_messages("s5")) == len(conversation("c5", 2))
    copies[-1].close()
    proto.close()
    assert store.closed
    again = copy.deepcopy(proto)  # a copy made after: opens a runtime again
    assert len(again.stored_messages("s0")) == len(conversation("c0", 1))
    again.close()


def test_select_context_is_fail_open_and_stable(tmp_path: Path) -> None:
    engine = make(tmp_path)
    engine.on_session_start("s1")
    for bad in (None, [], "text", [1, 2], [{"role": "user", "content": "x"}, "y"]):
        assert engine.select_context(bad, budget_tokens=10) is None
    convo = conversation("gamma", 10)
    assert engine.select_context(convo, budget_tokens=10**6) is None  # under budget: unchanged
    assert engine.select_context(convo, budget_tokens=500) is None  # nothing compacted yet
    out = engine.compress(convo)
    assert engine.select_context(convo, budget_tokens=500) is None  # compacted but not taken by the host
    taken = [*out, {"role": "user", "content": "gamma next"}]
    # compress answers below the trigger: the request is over a budget under its own size
    budget = RoughEstimator().count_messages(taken) - 100
    first = engine.select_context(taken, budget_tokens=budget)
    assert isinstance(first, list) and is_valid_sequence(first)
    again = engine.select_context(taken, budget_tokens=budget)
    assert again == first and again is not first  # stable while nothing changed, and each caller's own
    assert_once(engine, "s1", convo)


def test_on_turn_complete_is_idempotent(tmp_path: Path) -> None:
    engine = make(tmp_path)
    engine.on_session_start("s1")
    convo = conversation("delta", 3)
    usage = {"prompt_tokens": 1234, "completion_tokens": 5, "total_tokens": 1239}
    for _ in range(3):
        assert engine.on_turn_complete(convo, usage=usage) is None
    assert engine.last_prompt_tokens == 1234 and engine.last_total_tokens == 1239
    assert len(stored(engine, "s1")) == len(convo)
    engine.on_turn_complete("not a list")  # ignored, never raises


class SlowSummarizer:
    """Extractive, but slow: a pass the host abandons after its timeout."""

    def __init__(self) -> None:
        self.inner = ExtractiveSummarizer()

    def summarize(self, messages: Any, **kwargs: Any) -> str:
        time.sleep(0.5)
        return self.inner.summarize(messages, **kwargs)


def test_timed_out_pass_changes_nothing_visible_and_loses_nothing(tmp_path: Path) -> None:
    engine = make(tmp_path, summarizer_factory=SlowSummarizer)
    engine.on_session_start("s1")
    convo = conversation("eps", 10)
    with ThreadPoolExecutor(max_workers=1) as pool:  # the host's pooled thread, private deep copy
        future = pool.submit(engine.compress, copy.deepcopy(convo))
        with pytest.raises(FutureTimeout):
            future.result(timeout=0.05)
        future.result(timeout=60)  # still running work finishes; the host discards it
    # The host keeps its uncompressed list: nothing the discarded pass wrote is shown.
    assert engine.select_context(convo, budget_tokens=500) is None
    nxt = [*convo, {"role": "user", "content": "eps next"}]
    engine.on_turn_complete(nxt)
    engine.on_turn_complete(nxt)
    assert_once(engine, "s1", nxt)
    assert len(stored(engine, "s1")) == len(nxt)


def test_two_sessions_compress_concurrently_on_one_instance(tmp_path: Path) -> None:
    engine = make(tmp_path)
    convos = {f"sess{i}": conversation(f"zeta{i}", 10) for i in range(2)}
    barrier = threading.Barrier(2)
    results: dict[str, list[dict[str, Any]]] = {}

    def run(session: str) -> None:
        barrier.wait()
        for _ in range(2):
            results[session] = engine.compress(copy.deepcopy(convos[session]), session_id=session)

    threads = [threading.Thread(target=run, args=(s,)) for s in convos]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for session, convo in convos.items():
        assert is_valid_sequence(results[session])
        rows = stored(engine, session)
        assert len(rows) == len(convo) and len(set(rows)) == len(rows)
        other = next(s for s in convos if s != session)
        assert not any(other.replace("sess", "zeta") in r for r in rows)


def test_failing_summarizer_loses_nothing(tmp_path: Path) -> None:
    class Broken:
        def summarize(self, *args: Any, **kwargs: Any) -> str:
            raise SummarizerError("down")

    for engine_id in ("lossless", "legacy"):
        engine = make(tmp_path / engine_id, engine=engine_id, summarizer_factory=Broken)
        (tmp_path / engine_id).mkdir()
        engine.on_session_start("s1")
        convo = conversation("eta", 8)
        out = engine.compress(convo)
        assert is_valid_sequence(out)
        assert_once(engine, "s1", convo)


def test_thresholds_and_counters(tmp_path: Path) -> None:
    engine = make(tmp_path, threshold_percent=0.5)
    for attr in ("last_prompt_tokens", "last_completion_tokens", "last_total_tokens", "threshold_tokens",
                 "context_length", "compression_count"):
        assert isinstance(getattr(engine, attr), int)
    engine.model_thresholds = {"gpt": 0.6, "gpt-4o": 0.9}
    engine.update_model("openai/gpt-4o-mini", 100000)
    assert engine.context_length == 100000 and engine.threshold_tokens == 90000
    engine.update_model("other-model", 100000)
    assert engine.threshold_tokens == 50000
    assert resolve_threshold("GPT-4o", {"gpt": 0.6, "gpt-4o": 0.9}, 0.5) == 0.9
    assert engine.should_compress(95000) and not engine.should_compress(1000)
    engine.last_prompt_tokens = -1  # what Hermes writes after each compaction
    assert not engine.should_compress()
    # ... and its status shows 0, not a negative count or usage (as Hermes's own base class clamps it).
    status = engine.get_status()
    assert status["last_prompt_tokens"] == 0 and status["usage_percent"] == 0
    # A positive fraction too small for one token of the window is the smallest trigger, not none (0 turned
    # compression off: `hermes install --threshold 1e-300` was taken and never compressed).
    engine.threshold_percent = 1e-300
    engine.update_model("other-model", 100000)
    assert engine.threshold_tokens == 1 and engine.should_compress(5)


def test_threshold_percent_is_the_fraction_of_the_window_hermes_reads_it_as(tmp_path: Path) -> None:
    """Hermes multiplies a window by ``threshold_percent`` (its startup line, its /model switch warning): a
    threshold set in tokens read there as the count ("compress at 250000%", no switch warning). The token
    count stays the trigger across windows; Hermes' own write of a fraction is the setting from then on."""
    engine = make(tmp_path, threshold_percent=2000, context_length=64000)
    assert engine.threshold_tokens == 2000 and engine.threshold_percent == 2000 / 64000
    engine.update_model("other-model", 100000)
    assert engine.threshold_tokens == 2000 and engine.threshold_percent == 2000 / 100000
    engine.model_thresholds = {"other": 0.6}  # a fraction for this model: itself
    engine.update_model("other-model", 100000)
    assert engine.threshold_tokens == 60000 and engine.threshold_percent == 0.6
    engine.model_thresholds = {}
    engine.update_model("other-model", 100000)
    for clone in (copy.deepcopy(engine), pickle.loads(pickle.dumps(engine))):
        clone.update_model("other-model", 50000)
        assert clone.threshold_tokens == 2000 and clone.threshold_percent == 2000 / 50000
    old = make(tmp_path, threshold_percent=0.5)  # a copy pickled before the setting had a name of its own
    state = old.__getstate__()
    state["threshold_percent"] = state.pop("threshold_setting")
    restored = object.__new__(type(old))
    restored.__setstate__(state)
    restored.update_model("m", 100000)
    assert restored.threshold_tokens == 50000 and restored.threshold_percent == 0.5
    engine.threshold_percent = 0.25  # as Hermes writes it
    engine.update_model("other-model", 100000)
    assert engine.threshold_tokens == 25000 and engine.threshold_percent == 0.25
    engine.threshold_percent = 1  # the whole window: 85% of it, as the trigger is
    engine.update_model("other-model", 100000)
    assert engine.threshold_tokens == 85000 and engine.threshold_percent == 0.85
    engine.threshold_percent = "no number"  # type: ignore[assignment]  # no trigger, and no error
    engine.update_model("other-model", 100000)
    assert engine.threshold_tokens == 0 and engine.threshold_percent == 0.0


def test_valid_sequence_never_splits_tool_pairs() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "x", "arguments": "{}"}}
    msgs = [
        {"role": "tool", "tool_call_id": "c0", "content": "orphan"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    assert valid_sequence(msgs) == [{"role": "user", "content": "q"}]
    assert not is_valid_sequence(msgs)


def test_install_command_writes_plugin_and_merges_config(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text(yaml.safe_dump({"plugins": {"enabled": ["other"]}, "model": {"default": "m"}}))
    result = CliRunner().invoke(cli, ["hermes", "install", "--home", str(home), "--merge-config"])
    assert result.exit_code == 0, result.output
    plugin = home / "plugins" / "transcript_store_hermes"
    manifest = yaml.safe_load((plugin / "plugin.yaml").read_text())
    assert manifest["name"] == "transcript-store" and manifest["kind"] == "standalone"
    assert "register_context_engine" in (plugin / "__init__.py").read_text()
    assert "MemoryProvider" not in (plugin / "__init__.py").read_text()
    cfg = yaml.safe_load((home / "config.yaml").read_text())
    assert cfg["plugins"]["enabled"] == ["other", "transcript-store"]
    assert cfg["context"]["engine"] == "lossless" and cfg["model"]["context_length"] >= 64000
    assert cfg["model"]["default"] == "m"


def visible(engine: Any, session: str) -> list[dict[str, Any]]:
    """The store session's visible transcript (the active branch), in order."""
    rt = engine.runtime()
    store_session = engine._store_session(rt, session)
    return [e.message for e in rt.store.read_visible(engine.scope, store_session)]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
def test_undo_then_repeated_message_stores_the_new_branch(store_url: str, tmp_path: Path, engine_id: str) -> None:
    engine = make(tmp_path, engine=engine_id, db_url=store_url)
    engine.on_session_start("s1")
    system = {"role": "system", "content": "sys"}
    engine.on_turn_complete([system, user("hi"), reply("hello")])
    engine.on_turn_complete([system, user("hi"), reply("hello"), user("continue"), reply("done")])
    # /undo drops the last exchange; the user asks something new, then says "continue" again: the
    # repeated message must not make the adapter skip what comes before it.
    convo = [user("hi"), reply("hello"), user("what is the tide at noon?"), reply("high tide, 3.2 m"),
             user("continue"), reply("next high tide 00:41")]
    for _ in range(2):  # the second pass is a re-send: nothing new
        engine.on_turn_complete([system, *convo])
    assert visible(engine, "s1") == convo
    every = engine.stored_messages("s1")
    assert reply("done") in every, "the undone reply stays stored, off the visible transcript"
    assert all(m in every for m in convo)
    assert len(every) == len(convo) + 2  # the new branch, plus the undone "continue" and "done"
    # The next turn only appends to the new branch.
    more = [*convo, user("thanks"), reply("you are welcome")]
    engine.on_turn_complete([system, *more])
    assert visible(engine, "s1") == more
    assert len(engine.stored_messages("s1")) == len(more) + 2


def test_edits_rewrite_the_visible_transcript_and_lose_nothing(store_url: str, tmp_path: Path) -> None:
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s1")
    first = [user("plan a trip"), reply("where to?"), user("ok"), reply("Lisbon it is")]
    engine.on_turn_complete(first)
    # The first message edited: the new branch repeats "ok" at the ordinal the old branch had it.
    edited = [user("plan a short trip"), reply("where to?"), user("ok"), reply("Porto it is")]
    engine.on_turn_complete(edited)
    assert visible(engine, "s1") == edited
    # Back to the first version (a redo): the visible transcript follows the host again.
    engine.on_turn_complete(first)
    assert visible(engine, "s1") == first
    # A host list that is a stale prefix of what is stored writes nothing and moves nothing.
    engine.on_turn_complete(first[:2])
    assert visible(engine, "s1") == first
    every = engine.stored_messages("s1")
    assert all(m in every for m in first + edited)


def test_an_edit_after_a_taken_compaction_aligns_after_the_compacted_view(tmp_path: Path) -> None:
    engine = make(tmp_path)
    engine.on_session_start("s1")
    convo = conversation("theta", 10)
    out = engine.compress(convo)
    assert any(is_context_message(m) for m in out)
    engine.on_turn_complete([*out, user("theta next"), reply("theta reply")])
    # The host regenerates the last reply: only that reply changes, after the compacted view.
    engine.on_turn_complete([*out, user("theta next"), reply("theta other reply")])
    assert visible(engine, "s1") == [*convo, user("theta next"), reply("theta other reply")]
    assert reply("theta reply") in engine.stored_messages("s1")


class CountingSummarizer(ExtractiveSummarizer):
    """Extractive, counting its calls (each would be a model call with a real summarizer)."""

    calls = 0

    def summarize(self, *args: Any, **kwargs: Any) -> str:
        CountingSummarizer.calls += 1
        return super().summarize(*args, **kwargs)


def turn_with_tool(tag: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The current user message and its pending exchange: a tool call and its result."""
    call = {"id": f"call_{tag}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    return user(f"{tag} now: " + "lorem ipsum " * 60), [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": f"{tag} pending result"},
    ]


class RecordingSummarizer(ExtractiveSummarizer):
    """Extractive, keeping the texts of every message it was asked to summarize."""

    texts: list[str] = []

    def summarize(self, messages: Any, *args: Any, **kwargs: Any) -> str:
        RecordingSummarizer.texts += [str(m.get("content")) for m in messages]
        return super().summarize(messages, *args, **kwargs)


def test_a_compress_inside_a_turn_never_summarizes_the_current_user_message(store_url: str, tmp_path: Path) -> None:
    """Hermes compresses after a tool round when the request is over the trigger. The lossless engine
    summarized the turn's user message with the messages before it (it was just outside the engine's
    fresh tail, which the turn's tool rounds filled): a summarizer call whose summary the answer left
    out, since the answer shows that message verbatim. The older turns are still summarized."""
    RecordingSummarizer.texts = []
    engine = make(tmp_path, engine="lossless", db_url=store_url, threshold_percent=3000,
                  summarizer_factory=RecordingSummarizer)
    engine.on_session_start("s1")
    est = RoughEstimator()
    current, pending = turn_with_tool("lambda")
    rounds = [m for i in range(3) for m in turn_with_tool(f"lambda round {i}")[1]]  # with pending: the tail
    messages = [*conversation("lambda", 12), current, *rounds, *pending]
    tokens = est.count_messages(messages) + 800
    assert engine.should_compress(tokens)
    out = engine.compress(copy.deepcopy(messages), current_tokens=tokens)
    assert engine.compression_count == 1 and is_valid_sequence(out)
    assert out[-2:] == pending and out[-9:-2] == [current, *rounds]
    assert RecordingSummarizer.texts and current["content"] not in RecordingSummarizer.texts
    assert any("lambda question 0" in t for t in RecordingSummarizer.texts)
    engine.close()


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
def test_compress_answers_below_the_trigger_with_the_fresh_tail_verbatim(
    store_url: str, tmp_path: Path, engine_id: str
) -> None:
    """The answer, with the system prompt and tools Hermes adds, is under the trigger: Hermes does not
    compress again on its next call. The current user message and the pending tool exchange are kept
    verbatim, never summarised away (Hermes would then send the model our summary instead of the turn)."""
    engine = make(tmp_path, engine=engine_id, db_url=store_url, threshold_percent=3000,
                  summarizer_factory=CountingSummarizer)
    engine.on_session_start("s1")
    est = RoughEstimator()
    current, pending = turn_with_tool("iota")
    messages = [*conversation("iota", 12), current, *pending]
    overhead = 800  # system prompt and tool schemas: in Hermes' count, not in the list
    tokens = est.count_messages(messages) + overhead
    assert engine.should_compress(tokens)
    out = engine.compress(copy.deepcopy(messages), current_tokens=tokens)
    assert engine.compression_count == 1 and engine.request_overhead == overhead
    assert is_valid_sequence(out) and any(is_context_message(m) for m in out)
    assert est.count_messages(out) + overhead <= 0.75 * engine.threshold_tokens
    assert not engine.should_compress(est.count_messages(out) + overhead)
    assert out[-2:] == pending and current in out[:-2]
    assert_once(engine, "s1", messages)
    # Hermes retries a request up to three times: our answer back with nothing new costs nothing.
    calls = CountingSummarizer.calls
    assert engine.compress(copy.deepcopy(out), current_tokens=tokens) == out
    assert engine.compression_count == 1 and CountingSummarizer.calls == calls
    # The next turns grow it back over the trigger: one compression more, the new turn kept verbatim.
    grown = [*out, reply("iota reply " * 30)]
    while not engine.should_compress(est.count_messages(grown) + overhead):
        grown += [user(f"iota later {len(grown)} " + "lorem ipsum " * 60), reply(f"iota {len(grown)} " * 30)]
    again = engine.compress(copy.deepcopy(grown), current_tokens=est.count_messages(grown) + overhead)
    assert engine.compression_count == 2 and again[-2:] == grown[-2:]
    assert not engine.should_compress(est.count_messages(again) + overhead)
    assert_once(engine, "s1", [m for m in grown if not is_context_message(m)])


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
def test_a_turn_larger_than_the_trigger_is_kept_whole_and_compressed_once(
    tmp_path: Path, engine_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The fresh tail alone over the trigger: the answer keeps it (the summaries get MIN_CONTEXT), is
    still over, a warning says so once, and compressing the same list again is no progress."""
    engine = make(tmp_path, engine=engine_id, threshold_percent=2000)
    engine.on_session_start("s1")
    current = user("kappa now: " + "lorem ipsum " * 800)  # ~2,400 tokens alone
    messages = [*conversation("kappa", 10), current]
    with caplog.at_level(logging.WARNING, logger="transcript_store.hermes"):
        out = engine.compress(copy.deepcopy(messages))
        assert out[-1] == current and engine.compression_count == 1
        assert any(is_context_message(m) for m in out)
        assert engine.should_compress(RoughEstimator().count_messages(out))  # still over: it cannot help
        assert engine.compress(copy.deepcopy(out)) == out and engine.compression_count == 1
        # The turn goes on (a tool round): the tail grows, is kept, and is not warned about again.
        _current, pending = turn_with_tool("kappa")
        more = engine.compress([*copy.deepcopy(out), *pending])
        assert more[-3:] == [current, *pending]
    warnings = [r for r in caplog.records if "fresh tail" in r.getMessage()]
    assert len(warnings) == 1
    assert_once(engine, "s1", [*messages, *pending])


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
def test_a_compress_inside_a_turn_over_the_trigger_never_answers_a_larger_list(
    store_url: str, tmp_path: Path, engine_id: str
) -> None:
    """The user message over the trigger stays raw in the lossless engine while it is its newest one; a
    tool round later it is an older one, and the engine summarized it. The answer keeps it verbatim (the
    fresh tail), so the summary came in beside it: Hermes was told "done" with a request ~1,700 tokens
    larger (and a compaction counted). An answer not smaller than the list given is no progress."""
    engine = make(tmp_path, engine=engine_id, db_url=store_url, threshold_percent=2000)
    engine.on_session_start("s1")
    current = user("mu now: " + "lorem ipsum " * 800)  # ~2,400 tokens alone
    out = engine.compress([*conversation("mu", 10), copy.deepcopy(current)])
    assert out[-1] == current and engine.compression_count == 1
    est = RoughEstimator()
    for r in range(3):  # tool rounds with long musings, Hermes asking to compress after each
        call = {"id": f"call_mu_{r}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        given = [
            *out,
            {"role": "assistant", "content": f"mu round {r}: " + "step " * 500, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"mu result {r} " + "row " * 100},
        ]
        out = engine.compress(copy.deepcopy(given))
        assert current in out and is_valid_sequence(out)
        assert out == given or est.count_messages(out) < est.count_messages(given), f"round {r} grew"
    assert_once(engine, "s1", [m for m in out if not is_context_message(m)])


def test_a_reply_hermes_merged_into_our_acknowledgement_is_stored(tmp_path: Path) -> None:
    """Hermes merges consecutive assistant messages: a reply merged into our acknowledgement is the
    host's message (stored), not ours (skipped)."""
    from transcript_store.hermes import ACK_MESSAGE

    engine = make(tmp_path)
    engine.on_session_start("s1")
    ack = {"role": "assistant", "content": ACK_MESSAGE}
    merged = {"role": "assistant", "content": f"{ACK_MESSAGE}\nthe model's reply"}
    assert is_context_message(ack) and not is_context_message(merged)
    out = engine.compress(conversation("lambda", 10))
    engine.on_turn_complete([*out, merged, user("lambda next")])
    assert merged in engine.stored_messages("s1")


FILLER_ENGINE = """
from engines.legacy import LegacyEngine

ADDITION = "Standing orders: " + "keep every promise made earlier in this conversation. " * 10


class Filler(LegacyEngine):
    info = LegacyEngine.info.model_copy(update={"id": "filler", "name": "filler"})

    def assemble(self, **kw):
        result = super().assemble(**kw)  # the legacy engine fills its budget with the latest messages
        return result.model_copy(update={"system_prompt_addition": ADDITION})


def create_engine(ctx):
    return Filler(ctx)
"""


def test_a_plugin_folder_engine_installed_for_hermes_loads_and_its_addition_is_reserved(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hermes install --engine X` accepted an engine of the settings' plugin folders, but the adapter
    looked only at entry points: every compress then failed to load it. And an engine that fills its
    budget and adds to the system prompt put the answer over the aim by its addition."""
    import importlib.util

    import transcript_store.hermes as adapter

    folder = tmp_path / "my-engines" / "filler"
    folder.mkdir(parents=True)
    (folder / "plugin.yaml").write_text("name: filler\nversion: 1.0\nentry: create_engine\n")
    (folder / "__init__.py").write_text(FILLER_ENGINE)
    monkeypatch.setenv("TRANSCRIPT_STORE_PLUGIN_DIRS", str(tmp_path / "my-engines"))
    home = tmp_path / "home"
    home.mkdir()
    result = CliRunner().invoke(cli, ["--db", store_url, "hermes", "install", "--home", str(home), "--engine", "filler",
                                      "--threshold", "3000"])
    assert result.exit_code == 0, result.output
    monkeypatch.delenv("TRANSCRIPT_STORE_PLUGIN_DIRS")  # Hermes runs with its own environment
    registered: list[Any] = []
    monkeypatch.setattr(adapter, "create_engine", lambda **kw: create_engine(allow_stand_in=True, **kw))
    plugin = home / "plugins" / "transcript_store_hermes"
    spec = importlib.util.spec_from_file_location("hermes_plugin_under_test", plugin / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.register(type("Ctx", (), {"register_context_engine": staticmethod(registered.append)})())
    engine = registered[0]
    engine.on_session_start("s1")
    est = RoughEstimator()
    system = {"role": "system", "content": "You are a careful assistant."}
    current = user("omega now: what did we settle?")
    messages = [system, *conversation("omega", 30), current]
    overhead = 800
    out = engine.compress(copy.deepcopy(messages), current_tokens=est.count_messages(messages) + overhead)
    assert engine.compression_count == 1 and out[-1] == current
    assert out[0]["content"].startswith(system["content"]) and "Standing orders" in out[0]["content"]
    aim = 0.75 * engine.threshold_tokens
    assert est.count_messages(out) + overhead <= aim, (est.count_messages(out) + overhead, aim)
    assert_once(engine, "s1", messages[1:])
    engine.close()


def _persisted(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Hermes' turn-end flush to its session database leaves on every message it saved."""
    return [{**m, "_db_persisted": True} for m in copy.deepcopy(messages)]


def test_an_answer_hermes_saved_to_its_session_database_is_recognised(
    store_url: str, tmp_path: Path
) -> None:
    """Hermes marks every message it saves to its session database (``_db_persisted``: the CLI and the
    gateway always have one), so the compress answer it took comes back marked. The candidate was
    fingerprinted without the mark and matched with it: never adopted. With ``in_place: false`` (a new
    Hermes session id at each compaction) every compaction then started an empty store session, and the
    earlier summaries and the recall tools' history were gone from the lineage."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("hermes-A")
    first = engine.compress(conversation("alpha", 12))
    assert engine.compression_count == 1
    engine.on_session_start("hermes-B", boundary_reason="compression", old_session_id="hermes-A")
    second = engine.compress(_persisted(first) + conversation("beta", 12))
    summaries = "\n".join(str(m["content"]) for m in second if is_context_message(m))
    assert "alpha" in summaries, "the first compaction's summaries are not in the lineage's answer"
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "alpha question 0"}))
    assert found.get("count", 0) >= 1, found
    # the answer sent back unchanged, marked, is ours: no compaction again
    count = engine.compression_count
    again = _persisted(second)
    assert engine.compress(again) == again and engine.compression_count == count
    engine.close()


def test_a_rotation_at_a_compaction_boundary_keeps_the_recall_tools_on_the_lineage(
    store_url: str, tmp_path: Path
) -> None:
    """Hermes with ``in_place: false`` moves to a new session id after a compaction and says so
    (``on_session_start(new, boundary_reason="compression", old_session_id=old)``). The turns after it
    stay under the trigger (no compress links the new id through its adopted answer), and their recall
    tools ran in a new, empty store session: lcm_grep found nothing of the conversation."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("hermes-A")
    engine.compress(conversation("alpha", 12))
    engine.on_session_start("hermes-B", boundary_reason="compression", old_session_id="hermes-A")
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "alpha question 0"}))
    assert found.get("count", 0) >= 1, found
    # a new conversation (no compaction boundary) is a session of its own
    engine.on_session_start("hermes-C", boundary_reason="new_session", old_session_id="hermes-B")
    assert json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "alpha question 0"})).get("count") == 0
    engine.close()


def test_a_rotations_link_survives_a_restart(store_url: str, tmp_path: Path) -> None:
    """The boundary's link (new Hermes id -> the lineage's store session) was held in the process: a
    gateway restarted under the new id (Hermes resumes it, no boundary told again) ran its recall tools
    in a new, empty store session until a compress happened to adopt an answer."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("hermes-A")
    engine.compress(conversation("alpha", 12))
    engine.on_session_start("hermes-B", boundary_reason="compression", old_session_id="hermes-A")
    engine.on_session_start("hermes-B", boundary_reason="compression", old_session_id="hermes-A")  # again
    engine.close()
    restarted = make(tmp_path, db_url=store_url)
    restarted.on_session_start("hermes-B")
    found = json.loads(restarted.handle_tool_call("lcm_grep", {"pattern": "alpha question 0"}))
    assert found.get("count", 0) >= 1, found
    # a second rotation continues the same lineage, after a restart too
    restarted.on_session_start("hermes-C", boundary_reason="compression", old_session_id="hermes-B")
    restarted.close()
    again = make(tmp_path, db_url=store_url)
    again.on_session_start("hermes-C")
    assert json.loads(again.handle_tool_call("lcm_grep", {"pattern": "alpha question 0"})).get("count", 0) >= 1
    # an unrelated session is still a session of its own
    again.on_session_start("hermes-D")
    assert json.loads(again.handle_tool_call("lcm_grep", {"pattern": "alpha question 0"})).get("count") == 0
    again.close()


def _reloaded(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as hermes-agent's session database gives it back (``get_messages_as_conversation``):
    timestamps, ``tool_name`` for ``name``, no ``None`` fields, texts stripped."""
    out = []
    for m in copy.deepcopy(messages):
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("role") == "tool" and "name" in m:
            m["tool_name"] = m.pop("name")
        if isinstance(m.get("content"), str):
            m["content"] = m["content"].strip()
        if m.get("role") == "user":
            m["timestamp"] = 1764900000.5
        if m.get("role") == "assistant":
            m["finish_reason"] = "tool_calls" if m.get("tool_calls") else "stop"
        out.append(m)
    return out


def test_a_conversation_reloaded_from_hermes_session_database_is_not_stored_again(
    store_url: str, tmp_path: Path
) -> None:
    """The gateway rebuilds every turn's history from its session database, and there the messages are
    not byte-identical to the live ones: the first difference branched the store session and the whole
    conversation was stored a second time (12 messages of 26 twice in a real run)."""
    engine = make(tmp_path, db_url=store_url)
    live = conversation("kappa", 4)
    for m in live:
        if m["role"] == "tool":
            m["name"] = "lookup"
        if m["role"] == "assistant":
            m["reasoning"] = None
        if m["role"] == "user":
            m["content"] += "  \n"
    engine.on_session_end("s1", live)
    before = stored(engine, "s1")
    assert len(before) == len(live)
    more = [{"role": "user", "content": "kappa next"}, {"role": "assistant", "content": "kappa reply"}]
    engine.on_session_end("s1", _reloaded(live) + more)
    after = stored(engine, "s1")
    assert after[: len(before)] == before and len(after) == len(live) + len(more), len(after)
    # a message that really differs (an edited question) still branches, as before
    edited = _reloaded(live) + more
    edited[0] = {**edited[0], "content": "kappa edited question"}
    engine.on_session_end("s1", edited)
    assert len(stored(engine, "s1")) == len(after) + len(edited)
    engine.close()


def test_two_conversations_may_get_the_same_compress_answer(store_url: str, tmp_path: Path) -> None:
    """A candidate was keyed by its answer alone: a second conversation whose compress answer was the
    same (a conversation run again) could not record it (IdempotencyConflict), and compress failed."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("first")
    one = engine.compress(conversation("same", 12))
    engine.on_session_start("second")
    two = engine.compress(conversation("same", 12))
    assert engine.compression_count == 2 and two == one
    # each conversation's answer is adopted into its own lineage, whichever recorded it last: the list
    # "first" sends on matched the newest record, the second's, and wrote into its lineage
    engine.compress(_persisted(two) + conversation("later", 2), session_id="second")
    engine.compress(_persisted(one) + conversation("firstonly", 2), session_id="first")

    def found(session: str, pattern: str) -> int:
        engine.on_session_start(session)
        return int(json.loads(engine.handle_tool_call("lcm_grep", {"pattern": pattern})).get("count", 0))

    assert found("first", "later question 0") == 0 and found("second", "later question 0") >= 1
    assert found("second", "firstonly question 0") == 0 and found("first", "firstonly question 0") >= 1
    engine.close()
    # and after a restart (the lineages known from the store, not the process)
    again = make(tmp_path, db_url=store_url)
    again.compress(_persisted(one) + conversation("firstonly", 2) + conversation("more", 1), session_id="first")
    again.on_session_start("second")
    assert json.loads(again.handle_tool_call("lcm_grep", {"pattern": "more question 0"})).get("count") == 0
    again.close()


def test_an_answer_recorded_before_message_identities_is_still_recognised(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Candidates were fingerprinted on the whole cleaned messages before; after the upgrade a rotated
    session's answer recorded by the older release was never recognised, and its lineage was lost."""
    import transcript_store.hermes as adapter
    from transcript_store.hermes import forms, ingest, lineage, runtime

    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("hermes-A")
    with monkeypatch.context() as m:  # the older release's fingerprint, in every module that calls it
        for module in (adapter, forms, ingest, lineage, runtime):
            m.setattr(module, "fingerprint", lambda ms: adapter.digest(adapter.canonical(list(ms))))
        first = engine.compress(conversation("alpha", 12))
    engine.close()
    upgraded = make(tmp_path, db_url=store_url)
    upgraded.on_session_start("hermes-B")  # a rotation the older release did not record durably
    second = upgraded.compress(_persisted(first) + conversation("beta", 12), session_id="hermes-B")
    summaries = "\n".join(str(m["content"]) for m in second if is_context_message(m))
    assert "alpha" in summaries, "the lineage was lost at the upgrade"
    upgraded.close()


def test_a_real_edit_of_another_field_is_still_an_edit(store_url: str, tmp_path: Path) -> None:
    """Message identity leaves out only Hermes' bookkeeping: a user message's ``name`` or images edited
    is an edit (the session branches and stores it); whitespace around a text is not one."""
    engine = make(tmp_path, db_url=store_url)
    base = [{"role": "user", "name": "alice", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    engine.on_session_end("s1", base)
    engine.on_session_end("s1", [{**base[0], "content": "  hello\n"}, base[1]])
    assert len(stored(engine, "s1")) == 2
    engine.on_session_end("s1", [{**base[0], "name": "mallory"}, base[1]])
    assert visible(engine, "s1")[0]["name"] == "mallory" and len(stored(engine, "s1")) == 4
    engine.on_session_end("s1", [{**base[0], "name": "mallory", "images": ["a.png"]}, base[1]])
    assert visible(engine, "s1")[0].get("images") == ["a.png"]
    engine.close()


def test_a_session_switch_without_a_start_hook_follows_the_new_id(store_url: str, tmp_path: Path) -> None:
    """``/new``, ``/resume`` and ``/branch`` change hermes-agent's session id and call
    ``bind_session_state`` (and ``on_session_reset``), not ``on_session_start``: the adapter kept the old
    id and the next conversation was written into the old one's store session."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("old")
    alpha = conversation("alpha", 2)
    engine.on_session_end("old", alpha)
    engine.bind_session_state(session_db=None, session_id="new")
    engine.on_session_reset()
    beta = conversation("beta", 2)
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "alpha question 0"}, messages=beta))
    assert found.get("count") == 0, found
    assert len(stored(engine, "old")) == len(alpha) and len(stored(engine, "new")) == len(beta)
    engine.bind_session_state(session_db=None, session_id="")  # nothing to bind: the id stays
    assert engine.session_id == "new"
    engine.close()


class FakeSessionDB:
    """What the adapter reads of hermes-agent's SessionDB: sessions (a /branch's mark) and their messages."""

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, Any]] = {}
        self.messages: dict[str, list[dict[str, Any]]] = {}

    def get_session(self, session_id: str) -> dict[str, Any] | None:
        return self.sessions.get(session_id)

    def get_messages_as_conversation(
        self, session_id: str, repair_alternation: bool = False, **_: Any
    ) -> list[dict[str, Any]]:
        """The saved rows; ``repair_alternation``: consecutive user messages merged, as hermes-agent's
        ``repair_message_sequence`` merges them in the live list before every request."""
        out: list[dict[str, Any]] = []
        for m in copy.deepcopy(self.messages.get(session_id, [])):
            prev = out[-1] if out else None
            if repair_alternation and prev is not None and prev.get("role") == m.get("role") == "user":
                prev["content"] = f"{prev['content']}\n\n{m['content']}"
                prev.pop("api_content", None)
                continue
            out.append(m)
        return out


def _grep(engine: Any, session: str, pattern: str) -> int:
    engine.session_id = session
    return int(json.loads(engine.handle_tool_call("lcm_grep", {"pattern": pattern})).get("count", 0))


def _branched_after_a_compress(tmp_path: Path, store_url: str) -> tuple[FakeSessionDB, Any, list[dict[str, Any]]]:
    """Hermes' database and an engine switched to "B", a ``/branch`` of "A" after A's compress; and its answer."""
    db = FakeSessionDB()
    engine = make(tmp_path, db_url=store_url)
    engine.bind_session_state(session_db=db, session_id="A")
    answer = engine.compress(conversation("alpha", 12))
    db.sessions["A"] = {"id": "A", "model_config": "{}", "end_reason": "branched"}
    db.messages["A"] = _persisted(answer)
    db.sessions["B"] = {"id": "B", "parent_session_id": "A", "model_config": json.dumps({"_branched_from": "A"})}
    engine.bind_session_state(session_db=db, session_id="B")
    return db, engine, answer


def test_a_branch_of_a_compacted_conversation_gets_a_lineage_of_its_own(store_url: str, tmp_path: Path) -> None:
    """``/branch`` after a compaction: the branch's list starts with the parent's compress answer, which
    made it join the parent's store session (its turns written into the parent's, each switch branching
    that session again, each one's recall finding the other's turns). It forks a copy now."""
    db, engine, answer = _branched_after_a_compress(tmp_path, store_url)
    engine.on_session_end("B", _persisted(answer) + conversation("bravo", 2))
    assert _grep(engine, "B", "bravo question 0") >= 1 and _grep(engine, "A", "bravo question 0") == 0
    assert _grep(engine, "B", "alpha question 0") >= 1  # the branch keeps the parent's history
    engine.bind_session_state(session_db=db, session_id="A")  # /resume A: A is no branch
    engine.on_session_end("A", _persisted(answer) + conversation("again", 1))
    assert _grep(engine, "A", "again question 0") >= 1 and _grep(engine, "B", "again question 0") == 0
    engine.close()
    # after a restart, B's next list (the same answer first) stays in B's lineage
    restarted = make(tmp_path, db_url=store_url)
    restarted.on_session_end("B", _persisted(answer) + conversation("bravo", 2) + conversation("later", 1))
    assert _grep(restarted, "B", "later question 0") >= 1 and _grep(restarted, "A", "later question 0") == 0
    restarted.close()


def _refuse_candidates(engine: Any, refuse: bool) -> None:
    """Make the store refuse (or accept again) every candidate record, by a trigger of its own database:
    a write that fails part way, as a dropped connection or a full disk makes one."""
    from sqlalchemy import text

    db = engine.runtime().store.db
    with db.engine.begin() as conn:
        if db.dialect.is_sqlite:
            conn.execute(text("DROP TRIGGER IF EXISTS ts_test_refuse"))
            if refuse:
                conn.execute(text(
                    "CREATE TRIGGER ts_test_refuse BEFORE INSERT ON ts_entries"
                    " WHEN NEW.payload LIKE '%hermes-candidate%' BEGIN SELECT RAISE(ABORT, 'refused'); END"
                ))
            return
        conn.execute(text("DROP TRIGGER IF EXISTS ts_test_refuse ON ts_entries"))
        if refuse:
            conn.execute(text(
                "CREATE OR REPLACE FUNCTION ts_test_refuse() RETURNS trigger AS $$ BEGIN"
                " IF NEW.payload LIKE '%hermes-candidate%' THEN RAISE EXCEPTION 'refused'; END IF;"
                " RETURN NEW; END $$ LANGUAGE plpgsql"
            ))
            conn.execute(text(
                "CREATE TRIGGER ts_test_refuse BEFORE INSERT ON ts_entries"
                " FOR EACH ROW EXECUTE FUNCTION ts_test_refuse()"
            ))


def test_a_branch_fork_that_fails_part_way_leaves_no_half_branch(store_url: str, tmp_path: Path) -> None:
    """A ``/branch`` fork was made in steps: the branch's store session, the copy of the parent's
    transcript, then the answer's candidate. Failing after the first (here the candidate's record
    refused), it left a session for the branch that the next call took for its lineage: it forked no
    more, and the branch's turns went into the parent's store session, as before the fork existed."""
    _, engine, answer = _branched_after_a_compress(tmp_path, store_url)
    _refuse_candidates(engine, True)
    try:
        engine.on_session_end("B", _persisted(answer) + conversation("bravo", 2))  # the fork fails
    finally:
        _refuse_candidates(engine, False)
    assert engine.runtime().store.find_session(engine.scope, "B") is None, "a half branch was left"
    engine.on_session_end("B", _persisted(answer) + conversation("bravo", 2))  # Hermes' next call
    assert _grep(engine, "B", "bravo question 0") >= 1 and _grep(engine, "A", "bravo question 0") == 0
    assert _grep(engine, "B", "alpha question 0") >= 1  # the branch keeps the parent's history
    engine.close()


def test_a_gateway_branch_forks_too_and_stores_the_parent_it_left(store_url: str, tmp_path: Path) -> None:
    """The gateway's ``/branch`` (and ``hermes --resume <branch>``) builds a new agent: its
    ``bind_session_state`` names the branch with no previous id. Only a switch within one agent was
    checked for the branch mark: the branch joined the parent's store session (each side's turns in the
    other's), and what the parent said since the adapter's last call was never stored."""
    db = FakeSessionDB()
    proto = make(tmp_path, db_url=store_url)  # hermes-agent deep-copies the engine for each agent
    parent = copy.deepcopy(proto)
    parent.bind_session_state(session_db=db, session_id="A")
    answer = parent.compress(conversation("alpha", 12))
    saved = _persisted(answer) + conversation("late", 1)  # a turn after the compress: in Hermes' database only
    db.sessions["A"] = {"id": "A", "model_config": "{}"}
    db.messages["A"] = saved
    db.sessions["B"] = {"id": "B", "parent_session_id": "A", "model_config": json.dumps({"_branched_from": "A"})}
    db.messages["B"] = copy.deepcopy(saved)
    branch = copy.deepcopy(proto)
    branch.bind_session_state(session_db=db, session_id="B")
    assert _grep(branch, "A", "late question 0") >= 1  # the parent's last turn, stored when it was left
    branch.on_session_end("B", copy.deepcopy(saved) + conversation("bravo", 2))
    assert _grep(branch, "B", "bravo question 0") >= 1 and _grep(branch, "A", "bravo question 0") == 0
    assert _grep(branch, "B", "late question 0") >= 1  # the branch keeps what it was made from
    back = copy.deepcopy(proto)  # the parent's next gateway turn: another new agent
    back.bind_session_state(session_db=db, session_id="A")
    back.on_session_end("A", copy.deepcopy(saved) + conversation("parentonly", 1))
    assert _grep(back, "A", "parentonly question 0") >= 1 and _grep(back, "B", "parentonly question 0") == 0
    for e in (proto, parent, branch, back):
        e.close()


def test_a_switch_stores_what_hermes_saved_of_the_conversation_it_leaves(store_url: str, tmp_path: Path) -> None:
    """``/resume`` and ``/branch`` call no ``on_session_end``: a conversation's turns since the adapter's
    last call (no compress, no tool call) were never stored."""
    db = FakeSessionDB()
    engine = make(tmp_path, db_url=store_url)
    engine.bind_session_state(session_db=db, session_id="K")
    db.messages["K"] = [{"role": "user", "content": "kilo1 question", "timestamp": 1.0},
                        {"role": "assistant", "content": "kilo1 answer"}]
    engine.bind_session_state(session_db=db, session_id="L")
    assert [m["content"] for m in engine.stored_messages("K")] == ["kilo1 question", "kilo1 answer"]
    engine.bind_session_state(session_db=db, session_id="K")  # and back: nothing of L's (none saved)
    assert engine.stored_messages("L") == []
    engine.close()


def test_a_recall_tool_does_not_store_its_own_pending_call(store_url: str, tmp_path: Path) -> None:
    """The live list hermes-agent passes ends with the assistant message making this very call: stored,
    it was the search's newest hit, and later searches found the earlier searches first."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s1")
    call = {"id": "c1", "type": "function", "function": {"name": "lcm_grep", "arguments": '{"pattern": "zebra0"}'}}
    live = [{"role": "user", "content": "the secret code is zebra0"}, {"role": "assistant", "content": "noted"},
            {"role": "user", "content": "what was it?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "zebra0"}, messages=live))
    assert found["count"] == 1 and "lcm_grep" not in json.dumps(found["results"]), found
    assert len(engine.stored_messages("s1")) == 3
    engine.close()


def test_a_recall_tool_sees_the_live_conversation(store_url: str, tmp_path: Path) -> None:
    """hermes-agent passes ``handle_tool_call`` the conversation in memory (``messages``, "for live
    ingestion"); it was ignored, and before the first compaction the recall tools found nothing of it."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s1")
    live = [{"role": "user", "content": "the secret code is zebra0"}, {"role": "assistant", "content": "noted"},
            {"role": "user", "content": "what was it?"}]
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "zebra0"}, messages=live))
    assert found.get("count", 0) >= 1, found
    # a list that is no list of messages is ignored; the tool still answers
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "zebra0"}, messages="nonsense"))
    assert found.get("count", 0) >= 1, found
    engine.close()


def test_compress_carries_the_memory_providers_context(store_url: str, tmp_path: Path) -> None:
    """hermes-agent passes ``compress`` its memory provider's pre-compaction text and asks summarizing
    engines to carry it in their handoff; it was accepted and dropped."""
    from transcript_store.hermes import MEMORY_HEAD

    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s1")
    out = engine.compress(conversation("nu", 12), memory_context="  The user prefers green tea.  ")
    text = "\n".join(str(m.get("content")) for m in out)
    assert f"{MEMORY_HEAD}\nThe user prefers green tea." in text and text.count(MEMORY_HEAD) == 1
    engine.on_session_start("s2")
    plain = engine.compress(conversation("xi", 12), memory_context="   ")
    assert MEMORY_HEAD not in json.dumps(plain)
    engine.close()


def test_the_engines_addition_reaches_the_model_when_hermes_sends_no_system_prompt(
    store_url: str, tmp_path: Path
) -> None:
    """hermes-agent passes compress the conversation without its system prompt (it builds that for each
    request): the addition went onto a system prompt the list does not hold, and no request carried it
    (the lossless engine's recall hint, 0 of 16 requests in a real run). It ends our context block now,
    once, and the answer sent back unchanged is still ours."""
    from engines.lossless.engine import RECALL_HINT

    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s1")
    out = engine.compress(conversation("theta", 12))
    assert engine.compression_count == 1 and out[0]["role"] == "user" and is_context_message(out[0])
    assert out[0]["content"].endswith(RECALL_HINT) and sum(RECALL_HINT in str(m.get("content")) for m in out) == 1
    again = engine.compress(copy.deepcopy(out))
    assert again == out and engine.compression_count == 1
    # with a system prompt in the list, the addition goes there, as before
    engine.on_session_start("s2")
    system = {"role": "system", "content": "You are careful."}
    out = engine.compress([system, *conversation("iota", 12)])
    assert out[0]["content"] == f"{system['content']}\n\n{RECALL_HINT}"
    assert sum(RECALL_HINT in str(m.get("content")) for m in out) == 1
    engine.close()


@pytest.mark.parametrize("value", ["5", "lots", {"n": 1}, float("nan"), None])
def test_should_compress_takes_any_count_without_raising(tmp_path: Path, value: Any) -> None:
    """A count that is no number raised TypeError ('>=' between str and int) into Hermes' turn loop."""
    engine = make(tmp_path)
    engine.threshold_tokens = 4
    assert engine.should_compress(value) is (value == "5")
    engine.close()


def test_empty_lists_hermes_may_replay_are_stored_as_what_they_mean(store_url: str, tmp_path: Path) -> None:
    """The store refuses an empty ``tool_calls`` or content list (the Chat Completions API does), and
    hermes-agent replays a ``tool_calls`` column it cannot parse as ``[]``: the whole conversation was
    then unstorable. Stored as no tool calls / an empty text, and the same conversation sent again
    (with or without the empty lists) stores nothing twice."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s1")
    odd = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": None, "tool_calls": []},
           {"role": "user", "content": []}, {"role": "assistant", "content": "done", "tool_calls": []}]
    engine.on_session_end("s1", odd)
    assert engine.stored_messages("s1") == [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": ""}, {"role": "assistant", "content": "done"},
    ]
    engine.on_session_end("s1", [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""},
                                 {"role": "user", "content": ""}, {"role": "assistant", "content": "done"}])
    assert len(engine.stored_messages("s1")) == 4
    engine.close()


def _contents(messages: list[dict[str, Any]]) -> list[str]:
    """The texts of a list's conversation messages (our context messages left out)."""
    return [m["content"] for m in messages if isinstance(m.get("content"), str) and m["content"]
            and not is_context_message(m)]


def test_compress_of_a_list_shorter_than_the_transcript_answers_that_list_only(store_url: str, tmp_path: Path) -> None:
    """``/undo`` then ``/compress``, or ``/compress here N`` (the head compressed, the tail appended
    again): compress gets the start of what is stored. Its answer brought the undone turn back (sent to
    the model again) and put the held-back tail in twice (a review found both in the real agent). The
    list compress gets is the conversation: what the transcript holds after it leaves the active branch."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s1")
    convo = conversation("alpha", 12)
    convo[-2]["content"] = "UNDONE question: drop the production database"
    engine.on_turn_complete(convo)
    undone = convo[:-2]
    out = engine.compress(undone, force=True)
    assert not any("UNDONE" in str(m.get("content")) for m in out) and is_valid_sequence(out)
    assert visible(engine, "s1") == undone
    assert any(m["content"] == convo[-2]["content"] for m in engine.stored_messages("s1"))  # kept, off-branch
    # /compress here 1: the head compressed, the last exchange appended to the answer again.
    engine.on_session_start("s2")
    convo = conversation("beta", 12)
    engine.on_turn_complete(convo, session_id="s2")
    head, tail = convo[:-2], convo[-2:]
    joined = engine.compress(head, force=True, session_id="s2") + copy.deepcopy(tail)
    texts = _contents(joined)
    assert len(texts) == len(set(texts)) and texts[-2:] == _contents(tail) and is_valid_sequence(joined)
    nxt = [*joined, user("beta follow-up"), reply("beta reply")]
    engine.on_turn_complete(nxt, session_id="s2")
    assert visible(engine, "s2") == [*convo, user("beta follow-up"), reply("beta reply")]
    # A hook's older copy of the list still moves nothing (only compress follows a shorter list).
    engine.on_turn_complete(convo[:4], session_id="s2")
    assert len(visible(engine, "s2")) == len(convo) + 2


def test_the_fresh_tail_reloaded_from_hermes_db_goes_in_once_in_its_place(store_url: str, tmp_path: Path) -> None:
    """The gateway rebuilds the conversation from its session database (a timestamp on every message,
    ``tool_name`` on tool results): the engine's copy of the current turn is the live form stored first.
    Compared as exact JSON, the current user message went in twice and moved before the last answer."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s1")
    convo = conversation("alpha", 12)
    question = user("LASTTURN please grep for alpha " + "words " * 40)
    call = {"id": "call_g", "type": "function", "function": {"name": "lcm_grep", "arguments": '{"pattern": "a"}'}}
    live = [*convo, question, {"role": "assistant", "content": "", "tool_calls": [call]}]
    engine.handle_tool_call("lcm_grep", {"pattern": "alpha"}, messages=live)  # stores the live form
    full = [*live, {"role": "tool", "tool_call_id": "call_g", "content": "grep results"},
            reply("FINAL reply to LASTTURN " + "ok " * 40)]
    reloaded = copy.deepcopy(full)
    for i, m in enumerate(reloaded):
        m["timestamp"] = 1_700_000_000.0 + i
        if m["role"] == "tool":
            m["tool_name"] = "lcm_grep"
    out = engine.compress(reloaded, current_tokens=20_000)
    texts = _contents(out)
    assert sum(t.startswith("LASTTURN") for t in texts) == 1 and is_valid_sequence(out)
    assert texts.index(question["content"]) > max(
        (i for i, t in enumerate(texts) if t.startswith("alpha answer")), default=-1)
    assert texts[-1].startswith("FINAL reply")


def test_a_count_of_more_than_the_messages_given_does_not_squeeze_every_later_answer(tmp_path: Path) -> None:
    """``/compress here N`` passes the whole history's count with its head only: the held-back tail,
    taken for the request's system prompt and tools, squeezed every later answer to the minimum."""
    engine = make(tmp_path, threshold_percent=30_000)
    engine.on_session_start("s1")
    convo = conversation("alpha", 10)
    engine.compress(convo, current_tokens=RoughEstimator().count_messages(convo) + 1_000)
    assert 900 <= engine.request_overhead <= 1_100
    engine.compress(convo[:-2], current_tokens=RoughEstimator().count_messages(convo) + 60_000, force=True)
    assert 900 <= engine.request_overhead <= 1_100  # one measure off: the lower median of the two
    assert engine.compress_target([], None) >= engine.threshold_tokens * 0.7
    for _ in range(2):  # measures that agree win
        engine.compress(convo, current_tokens=RoughEstimator().count_messages(convo) + 3_000, force=True)
    assert 2_900 <= engine.request_overhead <= 3_100


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
def test_a_count_from_before_the_tool_round_measures_the_system_prompt_and_tools(
    store_url: str, tmp_path: Path, engine_id: str
) -> None:
    """Hermes' check after a tool round passes ``last_prompt_tokens``: the provider's count of the request
    that asked for the tools, without the round. Set against the whole list, a large tool result was
    taken off the system prompt and tools (a real Hermes run measured 0 and 630 where they were 4,060),
    and the engine was given that much more than the aim."""
    engine = make(tmp_path, engine=engine_id, db_url=store_url, threshold_percent=4000)
    engine.on_session_start("s1")
    est = RoughEstimator()
    current, pending = turn_with_tool("kappa")
    pending[-1]["content"] = "kappa pending result " + "lorem ipsum " * 120
    before = [*conversation("kappa", 12), current]
    overhead = 800
    engine.update_from_response({"prompt_tokens": est.count_messages(before) + overhead, "completion_tokens": 20})
    messages = [*before, *pending]
    out = engine.compress(copy.deepcopy(messages), current_tokens=engine.last_prompt_tokens)
    assert engine.compression_count == 1 and engine.request_overhead == overhead
    assert engine.compress_target([], None) == int(0.75 * engine.threshold_tokens) - overhead
    assert est.count_messages(out) + overhead <= 0.75 * engine.threshold_tokens
    assert out[-2:] == pending
    # A count that is not the provider's last one (Hermes' estimate of the request) is of the whole list.
    engine.compress(copy.deepcopy(messages), current_tokens=est.count_messages(messages) + 900, force=True)
    assert sorted(engine._overheads) == [overhead, 900]


def test_an_answer_whose_last_message_hermes_merged_a_todo_snapshot_into_is_recognised(
    store_url: str, tmp_path: Path
) -> None:
    """A compaction at the start of a turn ends its answer with the current user message; with an active
    todo list Hermes appends its snapshot after the answer and, before the next request, merges it into
    that message in place (``repair_message_sequence``: consecutive user messages, joined by a blank line).
    The answer was never recognised: not adopted, and the list appended after the transcript (the user's
    message a second time, visible)."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("hermes-T")
    convo = conversation("alpha", 12)
    current = {"role": "user", "content": "alpha the question of this turn " + "lorem " * 30}
    answer = engine.compress([*convo, current])
    assert engine.compression_count == 1 and answer[-1]["content"] == current["content"]
    todo = "[Your active task list was preserved across context compression]\n- [>] 1. write it (in_progress)"
    live = copy.deepcopy(answer)
    live[-1]["content"] = f"{live[-1]['content']}\n\n{todo}"  # what Hermes' repair leaves of answer + snapshot
    live.append({"role": "assistant", "content": "alpha the reply of this turn"})
    engine.on_session_end("hermes-T", live)
    engine.on_session_end("hermes-T", live)  # again: nothing moves
    rt = engine.runtime()
    store_session = engine._store_session(rt, "hermes-T")
    assert rt.adopted.get(store_session), "the answer was not recognised"
    assert store_session not in rt.pending, "taken, yet select_context would still wait for it"
    visible = [e.message or {} for e in rt.store.read_visible(engine.scope, store_session)]
    users = [str(m.get("content")) for m in visible if m.get("role") == "user"]
    assert sum(1 for u in users if u.startswith("alpha the question of this turn")) == 1, users
    assert users[-1] == live[-2]["content"], "the visible transcript is not the host's list"
    assert visible[-1]["content"] == "alpha the reply of this turn"
    assert len(visible) == len(convo) + 2
    engine.close()


def test_compress_hands_back_the_fresh_tail_with_hermes_flags_but_its_persisted_mark(
    store_url: str, tmp_path: Path
) -> None:
    """Hermes tells its ephemeral messages by their flags (the "(empty)" reply and nudge of its recovery,
    ``_empty_recovery_synthetic``) and pops them when the real reply comes: the answer's copies of them
    must keep the flags. Its persistence mark goes, as its own compressor drops it (a marked copy is not
    saved with the compacted list). The store keeps no flag; the same list again is no progress."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("hermes-F")
    call = {"id": "call_f", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    tail = [
        {"role": "user", "content": "alpha the question of this turn", "_db_persisted": True},
        {"role": "assistant", "content": None, "tool_calls": [call], "_db_persisted": True},
        {"role": "tool", "tool_call_id": "call_f", "content": "alpha the result"},
        {"role": "assistant", "content": "(empty)", "_empty_recovery_synthetic": True},
        {"role": "user", "content": "Please process the tool results above.", "_empty_recovery_synthetic": True},
    ]
    answer = engine.compress([*conversation("alpha", 12), *copy.deepcopy(tail)])
    assert engine.compression_count == 1 and is_valid_sequence(answer)
    assert answer[-5:] == [{k: v for k, v in m.items() if k != "_db_persisted"} for m in tail]
    assert not any("_db_persisted" in m for m in answer)
    assert not any(str(k).startswith("_") for m in engine.stored_messages("hermes-F") for k in m)
    assert engine.compress(copy.deepcopy(answer)) == answer and engine.compression_count == 1
    engine.close()


def test_select_context_shows_the_incoming_message_the_host_passes_beside_the_conversation(
    store_url: str, tmp_path: Path
) -> None:
    """``select_context(request, conversation_messages=, incoming_message=, budget_tokens=)``: the host may
    pass the turn's new user message beside the conversation rather than in it. It was ignored: the
    selection, assembled from what was stored, ended with the previous reply, and the model got a
    request without the question it was to answer. Stored once, whichever way the host passes it."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s-in")
    out = engine.compress(conversation("gamma", 10))
    taken = [*out, {"role": "user", "content": "gamma next"}, {"role": "assistant", "content": "gamma reply"}]
    engine.on_session_end("s-in", taken)  # the host took the answer
    incoming = {"role": "user", "content": "gamma the incoming question"}
    request = [{"role": "system", "content": "You are a test agent."}, *taken, incoming]
    budget = RoughEstimator().count_messages(request) - 100
    selected = engine.select_context(request, conversation_messages=copy.deepcopy(taken),
                                     incoming_message=copy.deepcopy(incoming), budget_tokens=budget)
    assert isinstance(selected, list) and is_valid_sequence(selected)
    assert selected[-1] == incoming, selected[-3:]
    # the next request of the turn: the conversation holds it now (and a tool round after it)
    call = {"id": "call_in", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    later = [*taken, incoming, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_in", "content": "gamma result"}]
    again = engine.select_context([request[0], *later], conversation_messages=copy.deepcopy(later),
                                  incoming_message=copy.deepcopy(incoming), budget_tokens=budget)
    assert isinstance(again, list) and again[-1]["role"] == "tool" and incoming in again
    rows = stored(engine, "s-in")
    assert sum(1 for r in rows if "gamma the incoming question" in r) == 1
    engine.close()


def test_a_branch_of_an_answer_hermes_merged_its_todo_snapshot_into_keeps_its_lineage(
    store_url: str, tmp_path: Path
) -> None:
    """``/branch`` right after a compaction whose answer Hermes merged its todo snapshot into: the
    branch's lists start with that merged answer. The fork recorded, for the answer less its last
    message, the whole answer's fingerprint, which no list matches: after a restart the branch's next
    list joined no lineage and was stored again after its transcript."""
    db = FakeSessionDB()
    engine = make(tmp_path, db_url=store_url)
    engine.bind_session_state(session_db=db, session_id="A")
    current = {"role": "user", "content": "alpha the question of this turn"}
    answer = engine.compress([*conversation("alpha", 12), current])
    assert answer[-1]["content"] == current["content"]
    merged = copy.deepcopy(answer)
    merged[-1]["content"] += "\n\n[Your active task list was preserved across context compression]\n- [ ] 1. x"
    db.sessions["A"] = {"id": "A", "model_config": "{}", "end_reason": "branched"}
    db.messages["A"] = _persisted(merged)
    db.sessions["B"] = {"id": "B", "parent_session_id": "A", "model_config": json.dumps({"_branched_from": "A"})}
    engine.bind_session_state(session_db=db, session_id="B")
    branch = [*_persisted(merged), {"role": "assistant", "content": "bravo reply"}]
    engine.on_session_end("B", branch)
    engine.close()
    restarted = make(tmp_path, db_url=store_url)
    restarted.on_session_end("B", [*branch, *conversation("later", 1)])
    rt = restarted.runtime()
    visible = [e.message or {} for e in rt.store.read_visible(restarted.scope, restarted._store_session(rt, "B"))]
    users = [str(m.get("content")) for m in visible if m.get("role") == "user"]
    assert sum(1 for u in users if u.startswith("alpha the question of this turn")) == 1, users
    assert _grep(restarted, "B", "later question 0") >= 1 and _grep(restarted, "A", "later question 0") == 0
    restarted.close()


#: user-role messages hermes-agent 0.19.0 writes itself (``agent/conversation_compression.py``
#: ``_SYNTHETIC_USER_PREFIXES``): a background process's notification, which the gateway and the CLI send as
#: the turn's user message, and the todo snapshot, whose flag the session database does not keep
NOTIFICATION = (
    "[IMPORTANT: Background process proc_7 completed normally (exit code 0).\nCommand: make build\nOutput:\nok]"
)
SNAPSHOT = "[Your active task list was preserved across context compression]\n- [>] 1. ship the build"


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
@pytest.mark.parametrize("case", ["notification", "reloaded-snapshot"])
def test_hermes_scaffolding_is_never_taken_for_the_current_user_message(
    tmp_path: Path, engine_id: str, case: str
) -> None:
    """hermes-agent sends a background process's notification as the user message of a turn, and its todo
    snapshot, reloaded from its session database (the gateway reloads every turn; its hygiene compaction
    and ``/compress`` run on that list), has lost its flag. Taken for the current user message, it was
    the one kept verbatim: the user's real request was summarised away, and Hermes (which counts our
    context block as a human turn) did not put it back, so the model went on with a paraphrase of the
    task; a reloaded snapshot was kept as the turn's message next to the fresh one Hermes appends."""
    engine = make(tmp_path, engine=engine_id, threshold_percent=3000)
    engine.on_session_start("s1")
    request = user("omicron: deploy to staging once the build finishes, then tag release 4.2 " + "lorem " * 200)
    if case == "notification":
        tail = [request, reply("omicron: the build runs in the background"), user(NOTIFICATION + " step" * 700)]
    else:
        current, pending = turn_with_tool("omicron")
        request = current
        pending[-1]["content"] += " row" * 700  # a large tool result: the engine keeps less raw
        tail = [current, *pending, user(SNAPSHOT), reply("omicron: done, " + "dolor " * 30)]
    messages = [*conversation("omicron", 14), *tail]
    out = engine.compress(copy.deepcopy(messages))
    assert engine.compression_count == 1 and any(is_context_message(m) for m in out)
    assert request in out, "the user's request was summarised away; Hermes' scaffolding kept in its place"
    assert out[-1] == tail[-1] and is_valid_sequence(out)
    assert_once(engine, "s1", messages)


def test_the_turn_hook_stores_through_the_copy_that_ran_the_turn_only(tmp_path: Path) -> None:
    """``observe_turn`` (hermes-agent's ``post_llm_call`` plugin hook) stores the finished turn through the
    engine copy that made this thread's model calls, once. Hermes' background review runs the parent's
    history and a review prompt on an agent of its own whose session id it sets to the parent's: that
    is no turn of the conversation, and its copy (bound to its own id) stores nothing."""
    from transcript_store.hermes import observe_turn

    proto = make(tmp_path)
    engine, review = copy.deepcopy(proto), copy.deepcopy(proto)
    engine.on_session_start("s1")
    review.on_session_start("review-own-id")
    turn = [user("pi question " + "lorem " * 20), reply("pi answer")]
    review.should_compress(10)  # the review agent's model call, on this thread
    observe_turn(session_id="s1", conversation_history=[*turn, user("review the conversation"), reply("noted")])
    assert engine.stored_messages("s1") == []
    engine.update_from_response({"prompt_tokens": 10})
    observe_turn(session_id="s1", conversation_history=list(turn))
    observe_turn(session_id="s1", conversation_history=[*turn, user("pi later")])  # no model call since
    assert engine.stored_messages("s1") == turn
    for e in (engine, review, proto):
        e.close()


def test_a_selection_sends_the_context_hermes_injects_into_the_request_only(tmp_path: Path) -> None:
    """hermes-agent appends its memory provider's prefetch and ``pre_llm_call`` plugin context to the
    current user message of the request only; the conversation keeps the clean text and the sent one as
    ``api_content``, a key it pops from every outgoing message and replays for earlier turns.
    ``select_context`` rebuilt its selection from the stored messages: the injected context was dropped
    from the request, ``api_content`` went to the provider, and an earlier turn's bytes changed."""
    engine = make(tmp_path)
    engine.on_session_start("s-wire")
    out = engine.compress(conversation("rho", 10))
    memory = "\n\n<memory-context>the user prefers metric units</memory-context>"
    earlier = {"role": "user", "content": "rho next", "api_content": "rho next" + memory}
    taken = [*out, earlier, {"role": "assistant", "content": "rho reply"}]
    engine.on_session_end("s-wire", copy.deepcopy(taken))  # the host took the answer
    current = {"role": "user", "content": "rho the question", "api_content": "rho the question" + memory}
    held = [*taken, current]
    wire = [{k: v for k, v in m.items() if k != "api_content"} for m in held]
    for m, h in zip(wire, held, strict=True):
        m["content"] = h.get("api_content", m["content"])
    request = [{"role": "system", "content": "You are a test agent."}, *wire]
    budget = RoughEstimator().count_messages(request) - 100
    selected = engine.select_context(copy.deepcopy(request), conversation_messages=copy.deepcopy(held),
                                     budget_tokens=budget)
    assert isinstance(selected, list) and is_valid_sequence(selected)
    assert not [m for m in selected if "api_content" in m], "a key no provider knows was sent"
    assert selected[-1] == wire[-1], "the memory provider's context left the turn"
    assert wire[-3] in selected, "an earlier turn was sent with other bytes than it was"
    engine.close()


def hermes_request_copy(message: dict[str, Any], pad: bool) -> dict[str, Any]:
    """What hermes-agent 0.19.0's request build (``agent/conversation_loop.py``, the loop that makes
    ``api_messages``) makes of a conversation message, with Hermes' own ``copy_reasoning_content_for_api``:
    ``api_content`` sent as the content, ``reasoning_content`` as the provider needs it (``pad``: a
    DeepSeek / Kimi / MiMo thinking model), ``reasoning`` and ``finish_reason`` popped."""
    from types import SimpleNamespace

    from agent.agent_runtime_helpers import copy_reasoning_content_for_api  # type: ignore[import-not-found]

    api = message.copy()
    sidecar = api.pop("api_content", None)
    if isinstance(sidecar, str) and sidecar and message.get("role") in ("user", "assistant"):
        api["content"] = sidecar
    copy_reasoning_content_for_api(SimpleNamespace(_needs_thinking_reasoning_pad=lambda: pad), message, api)
    for key in ("reasoning", "finish_reason", "_thinking_prefill"):
        api.pop(key, None)
    return api


@pytest.mark.parametrize("pad", [False, True], ids=["strict-provider", "thinking-provider"])
def test_a_selected_message_from_the_store_goes_out_as_hermes_sends_its_own(
    store_url: str, tmp_path: Path, pad: bool
) -> None:
    """A selected message the request does not hold (here: the host left an earlier turn's tool round out
    of the request, and an earlier reply goes out as its ``api_content``) came from the store as stored:
    with ``finish_reason`` and ``reasoning``, keys Hermes pops from every message it sends because strict
    providers (Mistral) refuse them, and with a ``reasoning_content`` Hermes sends only to providers that
    require it (strict ones refuse it too). It now goes out as Hermes' own request build makes it of
    that message."""
    pytest.importorskip("agent.agent_runtime_helpers")
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s-shape")
    out = engine.compress(conversation("tau", 10))
    earlier = {"role": "assistant", "content": "tau reply", "api_content": "tau reply\u200b",
               "finish_reason": "stop", "reasoning": "the user wants the reply", "reasoning_content": "",
               "reasoning_details": [{"type": "reasoning.text", "text": "the user wants the reply"}]}
    call = {"id": "call_tau", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    tool_turn = {"role": "assistant", "content": "", "api_content": "looking", "tool_calls": [call],
                 "finish_reason": "tool_calls", "reasoning": "someone else's thoughts"}
    taken = [*out, user("tau next"), earlier, user("tau again"), tool_turn,
             {"role": "tool", "tool_call_id": "call_tau", "content": "tau result", "tool_name": "lookup"},
             reply("tau done")]
    engine.on_session_end("s-shape", copy.deepcopy(taken))  # the host took the answer
    held = [*taken, user("tau the question")]
    sent = [hermes_request_copy(m, pad) for m in held if m.get("role") != "tool"]
    sent[[m.get("content") for m in sent].index("looking")].pop("tool_calls")
    request = [{"role": "system", "content": "You are a test agent."}, *sent]
    budget = RoughEstimator().count_messages(request) - 100
    selected = engine.select_context(copy.deepcopy(request), conversation_messages=copy.deepcopy(held),
                                     budget_tokens=budget)
    assert isinstance(selected, list) and is_valid_sequence(selected)
    for m in (earlier, tool_turn):
        sent = next(s for s in selected if s.get("content") == m["api_content"])
        assert sent == hermes_request_copy(m, pad), sent
    leaked = [m for m in selected if {"finish_reason", "reasoning", "api_content"} & set(m)]
    assert not leaked, leaked
    assert pad == all("reasoning_content" in m for m in selected if m["role"] == "assistant")
    engine.close()


def test_the_session_end_hook_stores_an_unfinished_turn_from_hermes_session_database(
    store_url: str, tmp_path: Path
) -> None:
    """``end_turn`` (hermes-agent's ``on_session_end`` plugin hook, which ends every ``run_conversation``)
    stores what Hermes saved of a turn that ended without ``post_llm_call`` (interrupted, unfinished),
    through the copy bound to its session id. A finished turn reads nothing; Hermes' background review,
    whose agent saves nothing and runs under its parent's id, adds nothing; a copy keeps no database."""
    from transcript_store.hermes import end_turn

    db = FakeSessionDB()
    proto = make(tmp_path, db_url=store_url)
    engine, review = copy.deepcopy(proto), copy.deepcopy(proto)
    engine.bind_session_state(session_db=db, session_id="s1")
    review.bind_session_state(session_db=db, session_id="review-own-id")
    review.session_id = "s1"  # what hermes-agent does to its review agent after building it
    db.messages["s1"] = [{**user("sigma first"), "timestamp": 1.0}, reply("sigma answer"),
                         {**user("sigma interrupted"), "timestamp": 2.0}]
    end_turn(session_id="s1", completed=True, interrupted=False)
    assert engine.stored_messages("s1") == []
    end_turn(session_id="s1", completed=False, interrupted=True)
    end_turn(session_id="s1", completed=True, interrupted=True)  # the review's hook, or a second end
    assert [m["content"] for m in engine.stored_messages("s1")] == ["sigma first", "sigma answer", "sigma interrupted"]
    engine.on_session_start("s2", boundary_reason="compression", old_session_id="s1")  # a rotation
    db.messages["s2"] = [{**user("sigma after the rotation"), "timestamp": 3.0}]
    end_turn(session_id="s2", completed=False, interrupted=True)
    assert engine.stored_messages("s2")[-1]["content"] == "sigma after the rotation"
    assert copy.deepcopy(engine)._session_db is None and pickle.loads(pickle.dumps(engine))._session_db is None
    for e in (engine, review, proto):
        e.close()


def test_a_selection_keeps_the_prefill_messages_hermes_puts_after_the_system_prompt(
    store_url: str, tmp_path: Path
) -> None:
    """hermes-agent puts its ``prefill_messages`` (few-shot examples from its config) right after the system
    prompt of every request, never into the conversation. The selection was the system prompt and the
    stored context: each request it replaced went out without them."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s-prefill")
    out = engine.compress(conversation("phi", 10))
    taken = [*out, user("phi next"), reply("phi reply")]
    engine.on_session_end("s-prefill", copy.deepcopy(taken))  # the host took the answer
    held = [*taken, user("phi the question")]
    system = {"role": "system", "content": "You are a test agent."}
    prefill = [user("phi prefill example"), reply("phi prefill answer")]
    request = [system, *copy.deepcopy(prefill), *copy.deepcopy(held)]
    budget = RoughEstimator().count_messages(request) - 100
    selected = engine.select_context(copy.deepcopy(request), conversation_messages=copy.deepcopy(held),
                                     budget_tokens=budget)
    assert isinstance(selected, list) and is_valid_sequence(selected)
    assert selected[:3] == [system, *prefill], selected[:4]
    assert selected[-1] == held[-1]
    assert _grep(engine, "s-prefill", "phi prefill") == 0, "a prefill message was stored as the conversation's"
    engine.close()


def test_a_selection_fits_the_budget_with_the_system_prompt_it_keeps(store_url: str, tmp_path: Path) -> None:
    """``select_context`` replaces a request over ``budget_tokens`` (the model's window) with the request's
    system prompt and the engine's context; the engine was given the whole budget for its context, so
    with a long system prompt the selection was over the window too, and the provider refused it."""
    estimate = RoughEstimator().count_messages
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s-fit")
    taken = [*engine.compress(conversation("chi", 30)), *conversation("chi later", 12)]
    engine.on_session_end("s-fit", copy.deepcopy(taken))  # the host took the answer
    held = [*taken, user("chi the question")]
    system = {"role": "system", "content": "You are a test agent. " + "rule " * 4000}
    request = [system, *held]
    budget = estimate(request) - 100
    selected = engine.select_context(copy.deepcopy(request), conversation_messages=copy.deepcopy(held),
                                     budget_tokens=budget)
    assert isinstance(selected, list) and selected[0] == system and selected[-1] == held[-1]
    assert estimate(selected) <= budget, (estimate(selected), budget)
    engine.close()


# ---------------------------------------------------------------------------------------------- lost commits
# Every store write is one transaction retried whole on a transient error; a COMMIT that lands while the
# client sees the connection drop is run again (the helpers of test_lost_commit_review / _session_lifecycle).


def _store_ids(engine: Any, session: str) -> tuple[Any, str]:
    rt = engine.runtime()
    return rt.store, engine._store_session(rt, session)


def test_an_ingest_retried_after_its_store_session_was_made_again_writes_nothing_there(
    store_url: str, tmp_path: Path
) -> None:
    """An ingest whose COMMIT landed but was reported lost, its store session deleted and made again under
    the id (by another client) before the retry: the retry aligned the host's list with the new session
    and appended the conversation into it, someone else's transcript; with ``follow`` (compress) it also
    branched that one."""
    from test_session_lifecycle_review import commit_lost_then

    from transcript_store import TranscriptStore

    engine = make(tmp_path, db_url=store_url)
    other = TranscriptStore(store_url)
    try:
        for hermes, follow in (("s1", False), ("s2", True)):
            turn = [user(f"{hermes} question"), reply(f"{hermes} answer")]
            engine.ingest([turn[0]], hermes)
            store, sid = _store_ids(engine, hermes)

            def replace(sid: str = sid) -> None:
                other.delete_session(engine.scope, sid)
                other.create_session(engine.scope, session_id=sid)
                other.append(engine.scope, sid, user("theirs"))

            with commit_lost_then(store, replace):
                assert engine.ingest(turn, hermes, follow=follow) == (sid, 2)
            assert [e.message for e in other.read_visible(engine.scope, sid)] == [user("theirs")], hermes
            assert len(other.list_entries(engine.scope, sid)) == 1, hermes
    finally:
        other.close()
        engine.close()


def test_an_ingest_retried_after_its_store_session_was_deleted_answers_its_own_write(
    store_url: str, tmp_path: Path
) -> None:
    """The same, the store session only deleted before the retry: the retry raised UnknownSession, as if
    the conversation had never been stored (it was, then deleted): ``compress`` took it for a failed store
    and left the conversation uncompressed."""
    from test_session_lifecycle_review import commit_lost_then

    from transcript_store import TranscriptStore

    engine = make(tmp_path, db_url=store_url)
    other = TranscriptStore(store_url)
    try:
        engine.ingest([user("d question")], "s1")
        store, sid = _store_ids(engine, "s1")
        with commit_lost_then(store, lambda: other.delete_session(engine.scope, sid)):
            assert engine.ingest([user("d question"), reply("d answer")], "s1") == (sid, 2)
    finally:
        other.close()
        engine.close()


def test_an_ingest_retried_after_a_lost_commit_stores_each_message_once(store_url: str, tmp_path: Path) -> None:
    """An ingest whose COMMIT landed but was reported lost, retried alone: the retry finds its own write
    (the visible transcript holds the host's list) and writes nothing again, answering the same count;
    an edit's branch and an undo's move (``follow``) too. (A guard: this held before the two above.)"""
    from test_session_lifecycle_review import commit_lost_then

    engine = make(tmp_path, db_url=store_url)
    try:
        convo = [user("e q1"), reply("e a1"), user("e q2"), reply("e a2")]
        store, sid = _store_ids(engine, "s1")
        with commit_lost_then(store, lambda: None):
            assert engine.ingest(convo, "s1") == (sid, 4)
        edited = [*convo[:2], user("e q2 edited"), reply("e a2 again")]
        with commit_lost_then(store, lambda: None):
            assert engine.ingest(edited, "s1") == (sid, 4)
        with commit_lost_then(store, lambda: None):
            assert engine.ingest(edited[:2], "s1", follow=True) == (sid, 2)
        assert visible(engine, "s1") == edited[:2]
        assert len(store.list_entries(engine.scope, sid)) == 6
    finally:
        engine.close()


def test_a_store_session_made_again_under_its_id_is_aligned_afresh(store_url: str, tmp_path: Path) -> None:
    """A store session deleted and made again under its id (another client) between two ingests: the new
    one has a head, generation 0 and seqs from 0 of its own, and the cached transcript of the old one was
    kept as its prefix (its message taken for the host's first one): the next ingest appended the rest
    after someone else's message, a visible transcript that is no conversation of the host's."""
    from transcript_store import TranscriptStore

    engine = make(tmp_path, db_url=store_url)
    other = TranscriptStore(store_url)
    try:
        engine.ingest([user("f question")], "s1")
        _store, sid = _store_ids(engine, "s1")
        other.delete_session(engine.scope, sid)
        other.create_session(engine.scope, session_id=sid)
        other.append(engine.scope, sid, user("theirs"))
        convo = [user("f question"), reply("f answer")]
        assert engine.ingest(convo, "s1") == (sid, 2)
        assert visible(engine, "s1") == convo
    finally:
        other.close()
        engine.close()


def test_the_session_end_hook_stores_what_hermes_saved_as_hermes_replays_it(store_url: str, tmp_path: Path) -> None:
    """A turn after an interrupted one: Hermes merges the interrupted user message and the new one into
    one (``repair_message_sequence``, before the request) in the live list the turn hook stores, while
    its session database keeps the two rows. The next interrupted turn's ``end_turn`` stored the rows
    as saved: the list differed from the transcript at the merged message, the session branched there
    and everything after it was stored again (and once more by the next turn's hook, merged again)."""
    from transcript_store.hermes import end_turn

    db = FakeSessionDB()
    engine = make(tmp_path, db_url=store_url)
    engine.bind_session_state(session_db=db, session_id="s1")
    u1, a1, u2, u3, a3, u4 = (user("tau one"), reply("tau answer one"), user("tau two, interrupted"),
                              user("tau three"), reply("tau answer three"), user("tau four, interrupted"))
    engine.on_turn_complete([u1, a1], session_id="s1")
    db.messages["s1"] = [u1, a1, u2]
    end_turn(session_id="s1", completed=False, interrupted=True)
    merged = user(f"{u2['content']}\n\n{u3['content']}")
    engine.on_turn_complete([u1, a1, merged, a3], session_id="s1")  # the live list, merged by Hermes
    db.messages["s1"] = [u1, a1, u2, u3, a3, u4]
    end_turn(session_id="s1", completed=False, interrupted=True)
    assert visible(engine, "s1") == [u1, a1, merged, a3, u4]
    # u2 stored alone by the first interrupted turn's hook stays, off the active branch
    assert engine.stored_messages("s1") == [u1, a1, u2, merged, a3, u4]
    engine.close()


def _two_turns_stored_without_a_session_db(
    tmp_path: Path, store_url: str, tag: str
) -> tuple[Any, list[dict[str, Any]]]:
    """An engine of "s1" bound with no session database, two turns of ``tag`` stored; the engine and those turns."""
    engine = make(tmp_path, db_url=store_url)
    engine.bind_session_state(session_db=None, session_id="s1")
    convo = conversation(tag, 2)
    engine.on_turn_complete(convo, session_id="s1")
    return engine, convo


def test_an_interrupted_turn_of_an_agent_without_a_session_database_is_stored_at_its_end(
    store_url: str, tmp_path: Path
) -> None:
    """Without a session database ``end_turn`` had nothing to read: a turn interrupted before its reply
    (no ``post_llm_call``) reached the store only with the agent's next turn, and with none never. The
    live list the turn passed Hermes' ``pre_llm_call`` hook in its thread is
    stored when ``on_session_end`` tells the turn ended unfinished; a finished turn's end, or another
    agent's turn in the thread (Hermes' background review, under the parent's id), stores none of it."""
    from transcript_store.hermes import end_turn, note_turn

    engine, convo = _two_turns_stored_without_a_session_db(tmp_path, store_url, "gamma")
    live = [*convo, user("gamma interrupted before its reply")]
    note_turn(session_id="s1", conversation_history=list(live))
    end_turn(session_id="s1", completed=False, interrupted=True)
    assert [m["content"] for m in visible(engine, "s1")] == [m["content"] for m in live]
    # a finished turn: its end stores nothing of what it passed the hooks
    note_turn(session_id="s1", conversation_history=[*live, user("gamma finished elsewhere")])
    end_turn(session_id="s1", completed=True, interrupted=False)
    # the background review: an agent of its own, its engine copy under its own id, Hermes' hooks under ours
    review = copy.deepcopy(engine)
    review.bind_session_state(session_db=None, session_id="review")
    review.should_compress(0)  # its model calls mark this thread as its own
    note_turn(session_id="s1", conversation_history=[*live, user("gamma review prompt")])
    end_turn(session_id="s1", completed=False, interrupted=False)
    assert [m["content"] for m in visible(engine, "s1")] == [m["content"] for m in live]
    review.close()
    engine.close()


def test_the_selection_leaves_room_for_the_tool_schemas_hermes_sends(store_url: str, tmp_path: Path) -> None:
    """Hermes passes ``select_context`` its model's whole window (``budget_tokens`` is the engine's
    ``context_length``), and the request it sends carries the tool schemas beside the messages: no
    message, they were counted nowhere. A request whose messages fit the window went out unchanged over
    it by its schemas, and a selection filled the window less the system prompt only. Counted now:
    Hermes' own count of what its request carries besides the messages (the ``current_tokens`` compress
    gets: system prompt and tool schemas), and at least the engine's own recall tools, which every
    request carries, when no such count is known (after a restart)."""
    est = RoughEstimator()
    engine = make(tmp_path, db_url=store_url, threshold_percent=20000)
    engine.on_session_start("s1")
    system = {"role": "system", "content": "You are a test agent. " + "rules " * 300}
    convo = conversation("delta", 80)
    tools = 4000  # Hermes' estimate of its tool schemas (its terminal, file, web tools and ours)
    current = est.count_messages(convo) + est.count_messages([system]) + tools
    out = engine.compress(copy.deepcopy(convo), current_tokens=current)  # 0.19.0 passes no system prompt
    assert engine.compression_count == 1
    taken = [system, *out, user("delta next " + "lorem " * 40)]
    window = est.count_messages(taken) + tools - 200  # the messages fit; with the schemas, over by 200
    selected = engine.select_context(copy.deepcopy(taken), budget_tokens=window)
    sent = taken if selected is None else selected
    assert is_valid_sequence(sent) and sent[0] == system and sent[-1] == taken[-1]
    assert est.count_messages(sent) + tools <= window, "the request with its tool schemas is over the window"
    engine.close()
    restarted = make(tmp_path, db_url=store_url, threshold_percent=20000)  # no count of Hermes' requests yet
    own = est.count_text(json.dumps([{"type": "function", "function": s} for s in restarted.get_tool_schemas()]))
    assert own > 100
    window = est.count_messages(taken) + own - 50
    selected = restarted.select_context(copy.deepcopy(taken), budget_tokens=window, session_id="s1")
    sent = taken if selected is None else selected
    assert is_valid_sequence(sent) and sent[-1] == taken[-1]
    assert est.count_messages(sent) + own <= window, "the request with the recall tools is over the window"
    restarted.close()


def test_the_background_review_interrupted_before_its_first_answer_stores_nothing_in_its_parent(
    store_url: str, tmp_path: Path
) -> None:
    """Hermes' background review runs in a thread of its own, built there with an engine copy under an
    id of its own, then run under its parent's id with compression off (no ``should_compress``). Its
    first model call failed or was interrupted before answering (no ``update_from_response``): no copy
    marked the thread, ``end_turn`` took the copy following the parent's id, and its harness prompt
    ("review the conversation above") went into the parent's store session as the parent's turn. The
    copy last bound in the thread is the turn's: it follows another id, so nothing is stored."""
    from transcript_store.hermes import end_turn, note_turn

    engine, convo = _two_turns_stored_without_a_session_db(tmp_path, store_url, "delta")
    stored: list[Any] = []

    def review_thread() -> None:
        review = copy.deepcopy(engine)
        review.bind_session_state(session_db=None, session_id="review")
        note_turn(session_id="s1", conversation_history=[*convo, user("delta review prompt")])
        end_turn(session_id="s1", completed=False, interrupted=True)
        stored.append(review)

    t = threading.Thread(target=review_thread)
    t.start()
    t.join(60)
    assert [m["content"] for m in visible(engine, "s1")] == [m["content"] for m in convo]
    # The agent's own turn, interrupted before its first answer, in the thread that built it: stored.
    live = [*convo, user("delta interrupted before its first answer")]
    note_turn(session_id="s1", conversation_history=list(live))
    end_turn(session_id="s1", completed=False, interrupted=True)
    assert [m["content"] for m in visible(engine, "s1")] == [m["content"] for m in live]
    stored[0].close()
    engine.close()


def test_a_conversation_whose_store_session_was_deleted_is_stored_and_compressed_again(
    store_url: str, tmp_path: Path
) -> None:
    """A store session deleted while Hermes runs (``transcript-store sessions delete``): every later call of
    the process failed with UnknownSession on the id it had cached (logged only), so nothing of the
    conversation was stored again and compress left it uncompressed for good; a restarted process opened
    the Hermes session by its key anew. The running one now does the same."""
    from transcript_store import TranscriptStore

    engine = make(tmp_path, db_url=store_url)
    other = TranscriptStore(store_url)
    try:
        engine.on_session_start("s1")
        convo = conversation("del", 12)
        engine.on_turn_complete(copy.deepcopy(convo[:4]))
        _store, sid = _store_ids(engine, "s1")
        other.delete_session(engine.scope, sid)
        engine.on_turn_complete(copy.deepcopy(convo))
        _store, again = _store_ids(engine, "s1")
        assert again != sid and visible(engine, "s1") == convo
        system = {"role": "system", "content": "You are a test agent."}
        out = engine.compress([system, *copy.deepcopy(convo)])
        assert engine.compression_count == 1 and len(out) < len(convo) + 1 and is_valid_sequence(out)
        assert other.find_session(engine.scope, "s1") is not None
    finally:
        other.close()
        engine.close()


def test_a_compacted_conversation_whose_store_session_was_deleted_is_stored_again(
    store_url: str, tmp_path: Path
) -> None:
    """The same after a compress the host took: its answer (a candidate of the deleted session) starts the
    list, and the conversation goes on in a store session opened anew, without our context messages."""
    from transcript_store import TranscriptStore

    engine = make(tmp_path, db_url=store_url)
    other = TranscriptStore(store_url)
    try:
        engine.on_session_start("s1")
        out = engine.compress(copy.deepcopy(conversation("lin", 12)))
        taken = [*out, user("lin next"), reply("lin next answer")]
        engine.on_turn_complete(copy.deepcopy(taken))
        _store, sid = _store_ids(engine, "s1")
        other.delete_session(engine.scope, sid)
        more = [*taken, user("after the delete"), reply("stored")]
        engine.on_turn_complete(copy.deepcopy(more))
        _store, again = _store_ids(engine, "s1")
        assert again != sid
        assert visible(engine, "s1") == [m for m in more if not is_context_message(m)]
    finally:
        other.close()
        engine.close()
