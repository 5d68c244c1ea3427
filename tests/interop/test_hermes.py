"""The adapter inside the REAL Hermes Agent (hermes-agent==0.19.0), run by `make test-hermes`.

`make test-hermes` builds .cache/hermes-venv (hermes-agent + this project) and runs this file there. A
local OpenAI-compatible server (tests/fake_openai.py) answers on 127.0.0.1; the plugin is installed with
`transcript-store hermes install` into a temporary HERMES_HOME. Success is never inferred from a reply:
the engine's type, the store's rows, the recall tools and the requests Hermes really sent are checked.
Without hermes-agent the tests skip, except with CI=true, where they fail.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fake_openai import FakeOpenAI

pytestmark = pytest.mark.hermes
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
THRESHOLD = 2500
WORDS = " ".join(["filler"] * 300)

try:
    import agent.context_engine  # noqa: F401

    HAVE_HERMES = True
except ImportError:
    HAVE_HERMES = False


@pytest.fixture(scope="module", autouse=True)
def _need_hermes() -> None:
    if not HAVE_HERMES:
        if ON_CI:
            pytest.fail("hermes-agent is not importable: run `make test-hermes` (CI never skips it)")
        pytest.skip("hermes-agent is not installed here; run `make test-hermes`")


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as srv:
        yield srv


@pytest.fixture(scope="module")
def home(server: FakeOpenAI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # Under pytest's base temporary directory, which outlives the run: Hermes 0.19 writes its log files
    # through one queue listener of its own whose handlers no logger lists, so they cannot be detached
    # here, and a record the next module logs (the adapter's warnings) reopened a file in a removed home
    # ("Logging error" in the run's output). pytest removes the folder with its older runs' folders.
    path = tmp_path_factory.mktemp("hermes-home-")
    os.environ["HERMES_HOME"] = str(path)
    cli = Path(sys.executable).parent / "transcript-store"
    out = subprocess.run(
        [str(cli), "hermes", "install", "--home", str(path), "--threshold", str(THRESHOLD), "--merge-config"],
        check=True, capture_output=True, text=True,
    )
    assert "plugin written to" in out.stdout
    cfg = yaml.safe_load((path / "config.yaml").read_text())
    assert cfg["plugins"]["enabled"] == ["transcript-store"] and cfg["context"]["engine"] == "lossless"
    cfg["model"].update(default="fake-model", provider="custom", base_url=server.base_url, api_key="test-key")
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    yield path
    # Hermes' agents attach file handlers writing under the home (logs/agent.log): closed and detached before it
    # goes, or the next module's records fail to reopen the file ("--- Logging error ---" in the run's output).
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", [])):
            if str(getattr(handler, "baseFilename", "")).startswith(str(path)):
                logger.removeHandler(handler)
                handler.close()


def key(m: dict[str, Any]) -> str:
    """A message's identity for the exactly-once check (role, text, tool call ids)."""
    calls = [c.get("id") for c in (m.get("tool_calls") or []) if isinstance(c, dict)]
    return json.dumps([m.get("role"), m.get("content") or "", calls, m.get("tool_call_id")])


def originals(lists: list[list[dict[str, Any]]]) -> list[str]:
    """Every conversation message Hermes held or sent (no system prompt, none of the adapter's)."""
    from transcript_store.hermes import is_context_message

    seen: dict[str, None] = {}
    for lst in lists:
        for m in lst:
            if isinstance(m, dict) and m.get("role") != "system" and not is_context_message(m):
                seen.setdefault(key(m), None)
    return list(seen)


def make_agent(server: FakeOpenAI, session_db: Any = None) -> Any:
    from run_agent import AIAgent

    return AIAgent(
        base_url=server.base_url, api_key="test-key", model="fake-model", quiet_mode=True,
        enabled_toolsets=["context_engine"], skip_context_files=True, skip_memory=True, session_db=session_db,
    )


def run_turns(agent: Any, n: int, tag: str) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    history: list[dict[str, Any]] | None = None
    seen: list[list[dict[str, Any]]] = []
    for i in range(n):
        hint = " please search and grep for it" if i == 2 else ""
        result = agent.run_conversation(f"{tag}{i} turn {i}: about topic {tag}{i}{hint}. {WORDS}",
                                        conversation_history=history)
        history = result["messages"]
        seen.append(list(history))
    assert history is not None
    return history, seen


def test_real_agent_uses_our_engine_and_loses_nothing(home: Path, server: FakeOpenAI) -> None:
    from transcript_store.hermes import CONTEXT_MARKER, engine_class, is_valid_sequence

    server.reset()
    agent = make_agent(server)
    engine = agent.context_compressor
    assert type(engine) is engine_class()
    assert engine.name == "lossless" and engine.context_length >= 64000 and engine.threshold_tokens == THRESHOLD
    assert {"lcm_grep", "lcm_describe", "lcm_expand"} <= set(agent.valid_tool_names)

    history, seen = run_turns(agent, 6, "kiwi")
    # A forced compaction through Hermes' own compression path (what /compress runs).
    compressed, _prompt = agent._compress_context(history, None, force=True)
    assert is_valid_sequence(compressed) and any(CONTEXT_MARKER in str(m.get("content")) for m in compressed)
    final = agent.run_conversation("kiwi-final last turn", conversation_history=compressed)
    seen.append(final["messages"])
    agent.shutdown_memory_provider(final["messages"])
    assert engine.compression_count >= 2

    requests = server.chat_requests
    lists = [r["messages"] for r in requests] + seen
    expected = originals(lists)
    stored = [key(m) for m in engine.stored_messages(agent.session_id)]
    missing = [k for k in expected if k not in stored]
    dupes = {k for k in stored if stored.count(k) > 1}
    assert not missing, f"{len(missing)} messages never stored: {missing[:2]}"
    assert not dupes, f"stored twice: {list(dupes)[:2]}"

    # Hermes really sent our compressed context, and every request it sent was a valid sequence.
    assert any(CONTEXT_MARKER in str(m.get("content")) for r in requests for m in r["messages"])
    for r in requests:
        assert is_valid_sequence(r["messages"]), r["messages"]
    # Hermes dispatched a recall tool to the engine and got real results.
    tool_results = [m for r in requests for m in r["messages"] if m.get("role") == "tool"]
    assert any('"results"' in str(m.get("content")) and '"pattern"' in str(m.get("content")) for m in tool_results)
    # Every original user turn is reachable through the recall tools.
    for i in range(6):
        found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": f"kiwi{i}"}))
        assert found.get("results"), found
        hit = found["results"][-1]["id"]
        described = json.loads(engine.handle_tool_call("lcm_describe", {"id": hit}))
        assert "error" not in described, described


def test_failing_summarizer_loses_nothing(home: Path, server: FakeOpenAI) -> None:
    from transcript_store.hermes import is_valid_sequence
    from transcript_store.summarize import SummarizerError

    class Broken:
        def summarize(self, *args: Any, **kwargs: Any) -> str:
            raise SummarizerError("the summary model is down")

    server.reset()
    agent = make_agent(server)
    engine = agent.context_compressor
    engine.close()
    engine.summarizer_factory = Broken
    warnings: list[str] = []
    agent._emit_warning = warnings.append  # what Hermes shows the user in the chat
    history, seen = run_turns(agent, 4, "plum")
    compressed, _ = agent._compress_context(history, None, force=True)
    assert is_valid_sequence(compressed)
    # The user is told in the chat, not only in our log: Hermes reads the failure off its compressor.
    assert [w for w in warnings if "the summary model is down" in w], warnings
    agent.shutdown_memory_provider(history)
    expected = originals([r["messages"] for r in server.chat_requests] + seen)
    stored = [key(m) for m in engine.stored_messages(agent.session_id)]
    assert not [k for k in expected if k not in stored]
    assert len(stored) == len(set(stored))


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
def test_a_compaction_whose_summary_fails_is_reported_to_the_user_by_hermes(
    home: Path, server: FakeOpenAI, engine_id: str
) -> None:
    """A failing summarizer: Hermes tells the user in the chat ("aborted" when the conversation came back
    unchanged, "summary failed" when the answer is shorter without the summary); a compaction that works
    afterwards clears it."""
    from transcript_store.summarize import SummarizerError

    class Switch:
        broken = True

        def summarize(self, *args: Any, **kwargs: Any) -> str:
            if Switch.broken:
                raise SummarizerError("the summary model is down")
            return "a summary of what was said"

    server.reset()
    agent = make_agent(server)
    engine = agent.context_compressor
    engine.close()
    engine.engine_id = engine_id
    engine.summarizer_factory = Switch
    warnings: list[str] = []
    agent._emit_warning = warnings.append  # what Hermes shows the user
    history, _seen = run_turns(agent, 4, f"quince-{engine_id}")
    compressed, _ = agent._compress_context(history, None, force=True)
    assert engine._last_compress_aborted is (compressed == history)
    assert "the summary model is down" in str(engine._last_summary_error)
    told = [w for w in warnings if "the summary model is down" in w]
    assert told and all("compression aborted" in w.lower() or "summary failed" in w.lower() for w in told), warnings
    Switch.broken = False
    warnings.clear()
    compressed, _ = agent._compress_context([*compressed, {"role": "user", "content": "one more"}], None, force=True)
    assert not engine._last_compress_aborted and engine._last_summary_error is None
    assert not [w for w in warnings if "summary" in w.lower() or "aborted" in w.lower()], warnings
    agent.shutdown_memory_provider(compressed)


def test_real_hermes_cli_oneshot(home: Path, server: FakeOpenAI) -> None:
    from transcript_store.hermes import CONTEXT_MARKER, DEFAULT_SCOPE, is_valid_sequence
    from transcript_store.store import TranscriptStore

    server.reset()
    hermes = Path(sys.executable).parent / "hermes"
    prompt = f"melon0 one-shot question about melon0, please search and grep for it. {WORDS}"
    env = dict(os.environ, HERMES_HOME=str(home))
    argv = [str(hermes), "-z", prompt, "-t", "context_engine"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    requests = server.chat_requests
    assert requests, "hermes -z sent nothing"
    for r in requests:
        assert is_valid_sequence(r["messages"])
    # The CLI's agent ran our engine: Hermes offered our recall tools, dispatched one to the engine (a
    # real lcm_grep answer came back), and the store holds the one-shot conversation, once.
    assert any("lcm_grep" in json.dumps(r.get("tools") or []) for r in requests)
    results = [m for r in requests for m in r["messages"] if m.get("role") == "tool"]
    assert any('"results"' in str(m.get("content")) and '"pattern"' in str(m.get("content")) for m in results)
    assert not any(CONTEXT_MARKER in str(m.get("content")) for m in results)
    settings = json.loads((home / "plugins" / "transcript_store_hermes" / "settings.json").read_text())
    with TranscriptStore(settings["db_url"]) as store:
        hits = []
        for s in store.list_sessions(DEFAULT_SCOPE, limit=1000):
            entries = store.list_entries(DEFAULT_SCOPE, s.session_id, limit=10000)
            keys = [key(e.message) for e in entries if e.kind == "message" and e.message is not None]
            assert len(keys) == len(set(keys)), "a message stored twice"
            hits += [
                e.seq for e in entries
                if e.role == "user" and "melon0 one-shot" in str((e.message or {}).get("content"))
            ]
    assert len(hits) == 1, f"one-shot prompt stored {len(hits)} times"


@pytest.mark.parametrize("engine_id", ["lossless", "legacy"])
def test_compression_runs_once_per_crossing_and_keeps_the_turn(home: Path, server: FakeOpenAI, engine_id: str) -> None:
    """Crossing the trigger compresses once: the answer Hermes sends next is under the trigger, so the
    following turns do not compress again until the conversation grows back over it. The current user
    message reaches the model verbatim each turn (never merged into, nor summarised away), and nothing
    Hermes held or sent is lost."""
    from agent.model_metadata import estimate_request_tokens_rough

    from transcript_store.hermes import is_valid_sequence

    server.reset()
    agent = make_agent(server)
    engine = agent.context_compressor
    engine.close()
    engine.engine_id = engine_id  # the plugin runs either engine; the runtime reopens with this one
    calls: list[int] = []
    compress = engine.compress

    def counted(messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        calls.append(len(server.chat_requests))  # the request the answer goes out with
        return compress(messages, *args, **kwargs)

    engine.compress = counted  # Hermes calls the instance's compress; this one counts the calls
    # A trigger the answer can get well under beside the ~1,500 tokens of system prompt and tools, and
    # turns large enough that a compaction to the whole window (8 fresh messages) stays over it.
    engine.threshold_percent = 6000
    engine.update_model(engine.model, engine.context_length)
    trigger = engine.threshold_tokens
    words = " ".join(["filler"] * 700)
    turns = 12
    history: list[dict[str, Any]] | None = None
    seen: list[list[dict[str, Any]]] = []
    texts = [f"fig{i} turn {i}: about topic fig{i}. {words}" for i in range(turns)]
    turn_of: list[int] = []
    for i, text in enumerate(texts):
        result = agent.run_conversation(text, conversation_history=history)
        history = result["messages"]
        seen.append(list(history))
        turn_of += [i] * (len(server.chat_requests) - len(turn_of))
    agent.shutdown_memory_provider(history)

    requests = server.chat_requests
    # The conversation crossed the trigger, and each crossing compressed once (several turns apart).
    assert calls, "the conversation never reached the trigger"
    assert len({turn_of[n] for n in calls}) == len(calls), f"compressed twice in one turn: {calls}"
    assert len(calls) <= turns // 2, f"{len(calls)} compressions in {turns} turns"
    assert engine.compression_count == len(calls)
    for n in set(calls):  # what Hermes sent with each answer is under the trigger, by its own estimate
        msgs = requests[n]["messages"]
        tokens = estimate_request_tokens_rough(msgs[1:], system_prompt=msgs[0]["content"], tools=requests[n]["tools"])
        assert tokens < trigger, f"request {n} after a compression: {tokens} >= {trigger}"
    # Every turn's user message went out verbatim, as a message of its own.
    for n, r in enumerate(requests):
        assert {"role": "user", "content": texts[turn_of[n]]} in r["messages"], f"request {n} lost its turn"
        assert is_valid_sequence(r["messages"])
    # Nothing Hermes held or sent is lost: each is stored once.
    expected = originals([r["messages"] for r in requests] + seen)
    stored = [key(m) for m in engine.stored_messages(agent.session_id)]
    assert not [k for k in expected if k not in stored], "a message was never stored"
    assert len(stored) == len(set(stored))




def test_a_turn_over_the_trigger_by_itself_reaches_the_model_whole_and_the_next_turn_compresses(
    home: Path, server: FakeOpenAI
) -> None:
    """A user message over the trigger's room by itself, answered after three tool rounds with long
    replies: Hermes asks to compress before and after each round; every request of the turn carries the
    user message verbatim and every round whole (within the engine's fresh window), as valid sequences.
    The next turn, the big one being history, compresses under the trigger; each message is stored once."""
    from agent.model_metadata import estimate_request_tokens_rough
    from fake_openai import Fault

    from transcript_store.hermes import is_valid_sequence

    server.reset()
    agent = make_agent(server)
    engine = agent.context_compressor
    engine.close()
    engine.threshold_percent = 6000  # room for the summaries beside ~2,000 tokens of system prompt and tools
    engine.update_model(engine.model, engine.context_length)
    trigger = engine.threshold_tokens
    history, seen = run_turns(agent, 4, "pear")
    big = "pear-big turn: " + " ".join(["filler"] * 3600)  # over the trigger's room by itself
    musings = [f"pear-round{r} thinking aloud: " + " ".join([f"step{r}"] * 900) for r in range(3)]
    server.queue(*(
        Fault(reply={"role": "assistant", "content": musings[r], "tool_calls": [{
            "id": f"call_pear_{r}", "type": "function",
            "function": {"name": "lcm_grep", "arguments": json.dumps({"pattern": f"pear{r}"})},
        }]})
        for r in range(3)
    ))
    before, count_before = len(server.chat_requests), engine.compression_count
    result = agent.run_conversation(big, conversation_history=history)
    seen.append(list(result["messages"]))
    requests = server.chat_requests[before:]
    assert len(requests) == 4, "three tool rounds and the answer"
    for n, r in enumerate(requests):
        assert {"role": "user", "content": big} in r["messages"], "the turn was summarised away"
        assert is_valid_sequence(r["messages"])
        texts = [m.get("content") for m in r["messages"]]
        assert all(musings[k] in texts for k in range(n)), f"request {n} lost a round of its own turn"
    # The history before the turn was compacted (once: later passes have nothing more to compact).
    assert engine.compression_count - count_before == 1
    # The next turn: the big one is history now, and compressing gets the request under the trigger.
    follow = agent.run_conversation("pear-after a short question", conversation_history=result["messages"])
    seen.append(list(follow["messages"]))
    last = server.chat_requests[-1]
    msgs = last["messages"]
    tokens = estimate_request_tokens_rough(msgs[1:], system_prompt=msgs[0]["content"], tools=last["tools"])
    assert tokens < trigger and big not in [m.get("content") for m in msgs]
    assert engine.compression_count - count_before == 2
    agent.shutdown_memory_provider(follow["messages"])
    expected = originals([r["messages"] for r in server.chat_requests] + seen)
    stored = [key(m) for m in engine.stored_messages(agent.session_id)]
    assert not [k for k in expected if k not in stored], "a message was never stored"
    assert len(stored) == len(set(stored))


@pytest.mark.parametrize("in_place", [False, True])
def test_with_a_session_database_every_compaction_continues_one_lineage(
    home: Path, server: FakeOpenAI, in_place: bool
) -> None:
    """The `hermes` CLI and gateway run with a session database, and Hermes marks every message it saved
    there (``_db_persisted``): the compress answer it took came back marked and was never recognised. No
    candidate was adopted; with ``in_place: false`` (a new Hermes session id at each compaction) each
    compaction began an empty store session: the earlier summaries left the model's context and the
    recall tools could not find the first turns."""
    import uuid

    from hermes_state import SessionDB
    from run_agent import AIAgent

    from transcript_store.hermes import CONTEXT_MARKER

    server.reset()
    agent = AIAgent(
        base_url=server.base_url, api_key="test-key", model="fake-model", quiet_mode=True,
        enabled_toolsets=["context_engine"], skip_context_files=True, skip_memory=True,
        session_db=SessionDB(home / f"state-{uuid.uuid4().hex[:8]}.db"),
    )
    agent.compression_in_place = in_place
    engine = agent.context_compressor
    engine.threshold_percent = 6000
    engine.update_model(engine.model, engine.context_length)
    words = " ".join(["filler"] * 700)
    history: list[dict[str, Any]] | None = None
    marked = 0
    ids = {agent.session_id}
    for i in range(14):
        history = agent.run_conversation(f"fig{i} turn {i}: about topic fig{i}. {words}",
                                         conversation_history=history)["messages"]
        ids.add(agent.session_id)
        marked += sum(1 for m in history if isinstance(m, dict) and m.get("_db_persisted"))
    assert marked, "Hermes marked no message it saved: the case under test did not arise"
    rt = engine.runtime()
    assert engine.compression_count >= 2 and rt.adopted, (engine.compression_count, rt.adopted)
    # one store session for the whole lineage (the module's other conversations have their own)
    lineages = {rt.aliases.get(i) for i in ids}
    assert len(lineages) == 1 and None not in lineages, (ids, rt.aliases)
    last = " ".join(str(m.get("content")) for m in server.chat_requests[-1]["messages"]
                    if CONTEXT_MARKER in str(m.get("content")))
    assert "fig0" in last or "fig1" in last, "the first turns' summaries left the model's context"
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "fig0 turn 0"}))
    assert found.get("count", 0) >= 1, found
    # The engine's system-prompt addition (the recall hint) reaches the model: Hermes sends compress no
    # system prompt, and an addition put on one reached no request.
    from engines.lossless.engine import RECALL_HINT

    assert any(RECALL_HINT in json.dumps(r["messages"]) for r in server.chat_requests)
    agent.shutdown_memory_provider(history)


def test_a_gateway_branch_of_a_compacted_conversation_keeps_its_own_store_session(
    home: Path, server: FakeOpenAI
) -> None:
    """The gateway's ``/branch`` copies the parent's saved rows into a new session marked
    ``_branched_from`` and builds a new agent for it, whose ``bind_session_state`` names no previous id:
    the branch joined the parent's store session (each side's turns written into the other's), and what
    the parent said since the adapter's last call was left out of the store."""
    import uuid

    from hermes_state import SessionDB
    from run_agent import AIAgent

    server.reset()
    db = SessionDB(home / f"state-{uuid.uuid4().hex[:8]}.db")
    parent, branch = f"20990101_000000_p{uuid.uuid4().hex[:6]}", f"20990101_000001_b{uuid.uuid4().hex[:6]}"

    def turn(session_id: str, text: str) -> Any:
        # as the gateway runs a turn: a new agent, the history reloaded from the session database
        agent = AIAgent(
            base_url=server.base_url, api_key="test-key", model="fake-model", quiet_mode=True,
            enabled_toolsets=["context_engine"], skip_context_files=True, skip_memory=True,
            session_db=db, session_id=session_id,
        )
        agent.compression_in_place = True
        history = db.get_messages_as_conversation(session_id, repair_alternation=True) or None
        agent.run_conversation(text, conversation_history=history)
        return agent

    for i in range(4):
        turn(parent, f"gw{i} parent turn {i}. {WORDS}")
    saved = db.get_messages_as_conversation(parent)
    from transcript_store.hermes import is_context_message

    assert any(is_context_message(m) for m in saved), "the parent never compacted: the case did not arise"
    # the gateway's /branch (gateway/slash_commands.py): a new session holding a copy of the parent's rows
    db.create_session(session_id=branch, source="telegram", model="fake-model",
                      model_config={"_branched_from": parent}, parent_session_id=parent)
    for m in saved:
        db.append_message(session_id=branch, role=m.get("role", "user"), content=m.get("content"),
                          tool_name=m.get("tool_name") or m.get("name"), tool_calls=m.get("tool_calls"),
                          tool_call_id=m.get("tool_call_id"))
    on_branch = turn(branch, "BRANCHONLY turn in the branch")
    on_parent = turn(parent, "PARENTONLY turn in the parent")
    on_branch.context_compressor.on_session_end(branch, db.get_messages_as_conversation(branch))
    on_parent.context_compressor.on_session_end(parent, db.get_messages_as_conversation(parent))
    engine = on_parent.context_compressor
    rt = engine.runtime()
    assert engine._store_session(rt, parent) != engine._store_session(rt, branch)
    everything = {
        sid: json.dumps([e.message for e in rt.store.list_entries(engine.scope, engine._store_session(rt, sid),
                                                                    after_seq=-1, limit=10000)])
        for sid in (parent, branch)
    }
    assert "PARENTONLY" in everything[parent] and "BRANCHONLY" not in everything[parent]
    assert "BRANCHONLY" in everything[branch] and "PARENTONLY" not in everything[branch]


class WindowedOpenAI(FakeOpenAI):
    """A provider with a real context window: a request over ``window`` tokens is refused with the
    400 an OpenAI-compatible server sends ("maximum context length is N tokens"), which Hermes parses."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.refused = 0

    def _record(self, request: Any) -> Any:
        from fake_openai import Fault

        fault = super()._record(request)
        body = request.body
        if isinstance(body, dict) and isinstance(body.get("messages"), list):
            est = self.responder.estimator
            tools = body.get("tools")
            n = est.count_messages(body["messages"]) + (est.count_text(json.dumps(tools)) if tools else 0)
            if n > self.window:
                self.refused += 1
                return Fault(status=400, message=(
                    f"This model's maximum context length is {self.window} tokens. However, your messages "
                    f"resulted in {n} tokens. Please reduce the length of the messages."))
        return fault


def test_a_token_threshold_over_a_smaller_window_still_compresses_before_the_provider_refuses(home: Path) -> None:
    """A threshold set in tokens (``hermes install --threshold 100000``) stayed the trigger when Hermes
    learned a smaller window (a provider's "maximum context length is 64000 tokens", a /model switch,
    a fallback): a trigger over the window, so Hermes never compressed before the provider refused a
    request, and every time the conversation grew back it sent one the provider refused first (Hermes'
    built-in compressor triggers at 85% of a window its threshold would reach)."""
    window = 64000
    with WindowedOpenAI(window) as server:
        agent = make_agent(server)
        engine = agent.context_compressor
        engine.threshold_percent = 100000  # tokens, as settings.json holds it
        engine.update_model(engine.model, engine.context_length)
        assert engine.context_length > 100000 and engine.threshold_tokens == 100000
        words = " ".join(["filler"] * 2800)
        history: list[dict[str, Any]] = []
        for i in range(16):  # ~80,000 tokens: under the trigger, over the provider's real window
            history += [{"role": "user", "content": f"win{i} question {i}. {words}"},
                        {"role": "assistant", "content": f"win{i} answer {i}."}]
        result = agent.run_conversation("win-short a short question", conversation_history=history)
        assert not result.get("failed"), result.get("error")
        assert server.refused == 1 and engine.context_length == window, "Hermes learned the window"
        assert engine.threshold_tokens < window
        big = " ".join(["filler"] * 7000)  # ~10,000 tokens a turn: the conversation grows back over the window
        messages = result["messages"]
        for i in range(8):
            result = agent.run_conversation(f"win-grow{i} turn {i}. {big}", conversation_history=messages)
            assert not result.get("failed"), result.get("error")
            messages = result["messages"]
        assert engine.compression_count >= 2, "the conversation never grew back over the trigger"
        assert server.refused == 1, f"{server.refused - 1} requests over the known window were sent"
        agent.shutdown_memory_provider(messages)


def test_a_todo_list_hermes_merges_into_the_answer_keeps_each_turn_once(home: Path, server: FakeOpenAI) -> None:
    """With an active todo list Hermes appends its snapshot (a user message) after every compress answer,
    and before the next request merges it in place into the answer's last message, the current user
    message of a compaction at the start of a turn. The answer was never recognised again: no candidate
    adopted, and the compacted list was appended after the transcript, the current user message a second
    time, at every such compaction."""
    from collections import Counter

    server.reset()
    agent = make_agent(server)
    agent._todo_store.write([{"id": "1", "content": "finish the grape report", "status": "in_progress"}])
    engine = agent.context_compressor
    engine.threshold_percent = 6000
    engine.update_model(engine.model, engine.context_length)
    words = " ".join(["filler"] * 700)
    history: list[dict[str, Any]] | None = None
    merged = 0
    for i in range(12):
        history = agent.run_conversation(f"grape{i} turn {i}: about topic grape{i}. {words}",
                                         conversation_history=history)["messages"]
        merged += sum(1 for m in history if isinstance(m, dict) and m.get("role") == "user"
                      and "grape report" in str(m.get("content")) and str(m.get("content")).startswith("grape"))
    agent.shutdown_memory_provider(history)
    assert engine.compression_count >= 2 and merged, "Hermes merged no todo snapshot: the case did not arise"
    rt = engine.runtime()
    store_session = engine._store_session(rt, agent.session_id)
    assert rt.adopted.get(store_session), "no compress answer was recognised"
    visible = [e.message or {} for e in rt.store.read_visible(engine.scope, store_session)]
    turns = Counter(str(m.get("content")).split(":")[0] for m in visible if m.get("role") == "user")
    assert not [t for t, n in turns.items() if n > 1], f"user turns twice on the visible transcript: {turns}"
    assert set(turns) >= {f"grape{i} turn {i}" for i in range(12)}


class HookedOpenAI(FakeOpenAI):
    """The fake provider, calling ``on_request(body, fault)`` as each chat request arrives."""

    on_request: Any = None

    def _record(self, request: Any) -> Any:
        fault = super()._record(request)
        if self.on_request is not None and isinstance(request.body, dict):
            self.on_request(request.body, fault)
        return fault


def test_a_compaction_during_hermes_recovery_keeps_its_scaffolding_ephemeral(home: Path) -> None:
    """After an empty reply to a tool round Hermes appends an "(empty)" assistant message and a nudge,
    flagged ``_empty_recovery_synthetic``, and pops them by that flag when the real reply comes. The
    compress answer's fresh tail was a copy without Hermes' flags: compacted at that retry, the scaffolding
    stayed in the conversation for good (saved, replayed on resume, stored), as if the user had said it.
    Hermes' own compressor keeps the flags (only its persistence marker ``_db_persisted`` goes)."""
    from agent.model_metadata import _estimate_tools_tokens_rough, estimate_messages_tokens_rough
    from fake_openai import Fault

    with HookedOpenAI() as server:
        agent = make_agent(server)
        engine = agent.context_compressor
        engine.threshold_percent = 100000
        engine.update_model(engine.model, engine.context_length)
        history: list[dict[str, Any]] | None = None
        for i in range(6):
            history = agent.run_conversation(f"lime{i} turn {i}. {WORDS}", conversation_history=history)["messages"]
        call = {"id": "call_lime", "type": "function",
                "function": {"name": "lcm_grep", "arguments": json.dumps({"pattern": "lime1"})}}
        empty = Fault(reply={"role": "assistant", "content": ""})

        def trigger_at_the_retry(body: dict[str, Any], fault: Any) -> None:
            # The request that gets the empty reply sets the trigger at its own size: the retry, the same
            # request plus Hermes' scaffolding, is the first over it (Hermes' pre-call check compresses).
            if fault is empty:
                size = estimate_messages_tokens_rough(body["messages"]) + _estimate_tools_tokens_rough(body["tools"])
                engine.threshold_percent = size + 1
                engine.update_model(engine.model, engine.context_length)

        server.on_request = trigger_at_the_retry
        server.queue(Fault(reply={"role": "assistant", "content": "", "tool_calls": [call]}), empty)
        count = engine.compression_count
        result = agent.run_conversation("lime-last please look it up", conversation_history=history)
        assert engine.compression_count == count + 1, "no compaction at the retry: the case did not arise"
        assert server.chat_requests[-1]["messages"][-1]["content"].startswith("You just executed tool calls")
        final = result["messages"]
        assert not [m for m in final if m.get("content") == "(empty)"], "Hermes' scaffolding stayed"
        assert not [m for m in final if str(m.get("content")).startswith("You just executed tool calls")]
        assert final[-1]["role"] == "assistant" and final[-2]["role"] == "tool"
        agent.shutdown_memory_provider(final)


def test_a_background_process_notification_turn_keeps_the_users_request_verbatim(
    home: Path, server: FakeOpenAI
) -> None:
    """The gateway and the CLI send a background process's notification ("[IMPORTANT: Background process
    ...]") as a turn's user message. Compacted at that turn's start, the adapter kept the notification as
    the current user message and the engine summarised the user's real request away; Hermes counts our
    context block as a human turn, so it did not put the request back either (its own compressor keeps
    the last real human message): the model went on from a paraphrase of what it was asked to do."""
    server.reset()
    agent = make_agent(server)
    engine = agent.context_compressor
    engine.threshold_percent = 6000
    engine.update_model(engine.model, engine.context_length)
    history, _seen = run_turns(agent, 4, "quince")
    request = "quince-deploy: once the build finishes, deploy to staging and tag release 4.2. " + WORDS
    history = agent.run_conversation(request, conversation_history=history)["messages"]
    notification = (
        "[IMPORTANT: Background process proc_q1 completed normally (exit code 0).\nCommand: make build\n"
        "Output:\n" + " ".join(["built"] * 2000) + "]"
    )
    count = engine.compression_count
    result = agent.run_conversation(notification, conversation_history=history)
    assert engine.compression_count == count + 1, "no compaction at the notification's turn: the case did not arise"
    sent = [m.get("content") for m in server.chat_requests[-1]["messages"]]
    assert notification in sent
    assert request in sent, "the user's request was summarised away: the notification was taken for it"
    agent.shutdown_memory_provider(result["messages"])


def test_a_subagent_and_a_closed_agent_store_their_turns_without_a_session_end(
    home: Path, server: FakeOpenAI
) -> None:
    """Cron jobs and ``delegate_task`` subagents end with ``AIAgent.close()``, which calls no
    ``on_session_end``, and hermes-agent 0.19.0 passes the engine no conversation after a turn: a turn
    without a compaction or a recall tool before it never reached the store. The plugin's
    ``post_llm_call`` hook stores each finished turn, the subagent's in a store session of its own."""
    from fake_openai import Fault

    server.reset()
    agent = make_delegating_agent(server)
    call = {"id": "call_delegate", "type": "function", "function": {
        "name": "delegate_task", "arguments": json.dumps({"goal": "rowan-child: count the rowan berries"})}}
    server.queue(Fault(reply={"role": "assistant", "content": "", "tool_calls": [call]}))
    result = agent.run_conversation("rowan-parent: please delegate the berry count")
    engine = agent.context_compressor
    rt = engine.runtime()

    def child() -> list[dict[str, Any]]:
        sessions = [s for s in rt.store.list_sessions(engine.scope) if s.session_key not in (agent.session_id, None)]
        return [m for s in sessions for m in engine.stored_messages(s.session_key)
                if "rowan-child" in str(m.get("content"))]

    deadline = time.monotonic() + 20  # delegate_task runs its subagent in the background
    while not child() and time.monotonic() < deadline:
        time.sleep(0.2)
    agent.close()  # what a cron job does after its one turn: no session end
    assert engine.compression_count == 0
    parent = [key(m) for m in engine.stored_messages(agent.session_id)]
    assert parent == [key(m) for m in result["messages"]], "the parent's turn never reached the store"
    assert child(), "the subagent's turn never reached the store"


def make_delegating_agent(server: FakeOpenAI) -> Any:
    """An agent with the delegate_task tool as well as the recall tools."""
    from run_agent import AIAgent

    return AIAgent(
        base_url=server.base_url, api_key="test-key", model="fake-model", quiet_mode=True,
        enabled_toolsets=["context_engine", "delegation"], skip_context_files=True, skip_memory=True,
    )


def run_interrupted(agent: Any, server: FakeOpenAI, text: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    """``agent`` runs a turn asking ``text`` after ``history``, interrupted while the model is slow to
    answer (before any reply); its ``run_conversation`` result."""
    import threading

    from fake_openai import Fault

    server.queue(Fault(delay=8))
    asked = len(server.chat_requests)
    done: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: done.update(agent.run_conversation(text, conversation_history=history)))
    worker.start()
    deadline = time.monotonic() + 20
    while len(server.chat_requests) == asked and time.monotonic() < deadline:
        time.sleep(0.05)
    agent.interrupt("stop")
    worker.join(30)
    assert done.get("interrupted"), "the case did not arise: the turn was not interrupted"
    return done


def assert_a_turn_interrupted_before_its_reply_is_stored(agent: Any, server: FakeOpenAI, tag: str) -> None:
    """``agent`` runs a first turn, then one interrupted before its reply: the store holds it, each message once."""
    first = agent.run_conversation(f"{tag}-one: a first question")
    done = run_interrupted(agent, server, f"{tag}-two: the question interrupted before its reply", first["messages"])
    assert not [m for m in done["messages"] if m.get("role") == "assistant" and f"{tag}-two" in str(m)]
    engine = agent.context_compressor
    stored = [key(m) for m in engine.stored_messages(agent.session_id)]
    assert any(f"{tag}-two" in k for k in stored), "the interrupted turn's user message never reached the store"
    assert stored == [key(m) for m in done["messages"]], "not the conversation, each message once"


def test_a_turn_interrupted_before_its_reply_stores_its_user_message(home: Path, server: FakeOpenAI) -> None:
    """A turn interrupted before any reply fires no ``post_llm_call`` (Hermes fires it for a turn with a
    reply only): its user message reached the store with the conversation's next turn, compaction or
    session end, and for a cron job or a subagent (closed, or interrupted with its parent) never. Hermes'
    ``on_session_end`` plugin hook ends every ``run_conversation``, the interrupted ones too, after
    Hermes saved the turn to its session database: the plugin stores what it saved from there."""

    from hermes_state import SessionDB

    server.reset()
    agent = make_agent(server, session_db=SessionDB())
    assert_a_turn_interrupted_before_its_reply_is_stored(agent, server, "sorrel")
    agent.close()


def test_an_interrupted_turn_after_a_merged_one_stores_nothing_twice(home: Path, server: FakeOpenAI) -> None:
    """The turn after an interrupted one: Hermes merges the interrupted user message and its own into one
    in the live list (``repair_message_sequence``), which the turn hook stores, while its session
    database keeps the two rows. The next interrupted turn's ``on_session_end`` hook stored the rows as
    saved: the session branched at the merged message and the rest of the conversation went in again."""

    from hermes_state import SessionDB

    server.reset()
    agent = make_agent(server, session_db=SessionDB())

    first = agent.run_conversation("tansy-one: a first question")
    second = run_interrupted(agent, server, "tansy-two: interrupted", first["messages"])
    third = agent.run_conversation("tansy-three: the next one", conversation_history=second["messages"])
    assert any("tansy-two" in str(m.get("content")) and "tansy-three" in str(m.get("content"))
               for m in third["messages"]), "the case did not arise: Hermes merged no user messages"
    fourth = run_interrupted(agent, server, "tansy-four: interrupted again", third["messages"])
    stored = [key(m) for m in agent.context_compressor.stored_messages(agent.session_id)]
    lone = key({"role": "user", "content": "tansy-two: interrupted"})  # stored by the first interrupt, off-branch
    assert len(stored) == len(set(stored)), "a message stored twice"
    assert [k for k in stored if k != lone] == [key(m) for m in fourth["messages"]]
    agent.close()


def test_a_turn_interrupted_before_its_reply_without_a_session_database_is_stored(
    home: Path, server: FakeOpenAI
) -> None:
    """An agent without a session database (a cron job, a subagent, an embedding program) saves nothing
    ``end_turn`` could read: its interrupted turn reached the store only with the next turn, and with
    none (the agent closed after it) never. Hermes' ``pre_llm_call`` plugin hook passes the live
    conversation in the turn's thread at its start: the plugin keeps it for the turn and stores it when
    the ``on_session_end`` hook tells the turn ended unfinished."""
    server.reset()
    agent = make_agent(server)
    assert getattr(agent, "_session_db", None) is None, "the case did not arise: the agent has a session database"
    assert_a_turn_interrupted_before_its_reply_is_stored(agent, server, "yarrow")
    agent.close()


def test_hermes_reads_a_token_threshold_as_the_share_of_the_window_it_is(
    home: Path, server: FakeOpenAI, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hermes reads an engine's ``threshold_percent`` as a fraction of the window: its startup line
    ("compress at N% = T") and its ``/model`` switch warning (the next message will compress) multiply
    the new window by it. A threshold set in tokens (``hermes install --threshold 2500``) was exposed
    there as the count itself: "compress at 250000%", and the warning never came (the trigger it
    predicted was 2,500 windows)."""
    from hermes_cli.context_switch_guard import merge_preflight_compression_warning
    from hermes_cli.model_switch import ModelSwitchResult
    from run_agent import AIAgent

    server.reset()
    capsys.readouterr()
    agent = AIAgent(
        base_url=server.base_url, api_key="test-key", model="fake-model", quiet_mode=False,
        enabled_toolsets=["context_engine"], skip_context_files=True, skip_memory=True,
    )
    engine = agent.context_compressor
    assert engine.threshold_tokens == THRESHOLD and engine.context_length > THRESHOLD
    printed = capsys.readouterr().out
    assert f"compress at {int(THRESHOLD / engine.context_length * 100)}% = {THRESHOLD:,}" in printed, printed
    # ~80,000 tokens of history, over Hermes' 64,000-token floor of a predicted trigger: a /model switch
    # to a model of the same window must warn that the next message compresses.
    words = " ".join(["filler"] * 3500)
    history: list[dict[str, Any]] = []
    for i in range(6):
        history += [{"role": "user", "content": f"q{i} {words}"}, {"role": "assistant", "content": f"a{i} {words}"}]
    result = ModelSwitchResult(success=True, new_model="fake-model", target_provider="custom",
                               base_url=server.base_url, api_key="test-key")
    merge_preflight_compression_warning(result, agent=agent, messages=history,
                                        config_context_length=engine.context_length)
    assert "preflight compression" in result.warning_message, result.warning_message
    # Set again as Hermes sets it (a fraction: its check of the compression model lowers the trigger),
    # it is that fraction of each window.
    engine.threshold_percent = 0.5
    engine.update_model(engine.model, 100000)
    assert engine.threshold_percent == 0.5 and engine.threshold_tokens == 50000
    agent.close()
