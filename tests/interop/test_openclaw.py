"""The plugin inside the real OpenClaw host: turns commit exactly once into our store, whatever happens.

Run by ``make test-openclaw`` (not by ``make test``). Node and OpenClaw are installed from the npm
registry into ``.cache/openclaw`` on first use; when that is impossible the test skips, except with
CI=true, where it fails. The host swallows engine failures (exit code 0 either way), so every check
reads our store, the service's log and the host's log, never an exit code.

The story: two embedded turns (``openclaw agent --local``), then through ``openclaw gateway run``: one
turn, a turn during which the service is stopped (the model is held until it is down, so the host's
commitTurn fails and stays in its outbox), and a turn after the service is back, whose pre-run drain
replays the failed one in the same gateway process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fake_openai import FakeOpenAI
from openclaw_host import PLUGIN_DIR, HostUnavailable, OpenClawHost, TurnRun, install
from service_process import ServiceProcess

from transcript_store import TranscriptStore
from transcript_store.ledger import committed_messages, list_receipts
from transcript_store.model import LocalResponder, message_text

pytestmark = pytest.mark.openclaw

SCOPE = "openclaw"
TOKEN = "openclaw-interop-token-5c1f0a"
ENGINE = "lossless"
SESSION_KEY = "agent:main:main"
MARK = re.compile(r"TURN-\d+")
INTERNAL = ("OPENCLAW_INTERNAL_CONTEXT",)
# Host log lines that mean our engine was not the one that ran a turn, or lost an operation.
FALLBACK = re.compile(
    r"degraded to|downgraded to legacy|context engine quarantine|context engine (assemble|bootstrap|maintain|"
    r"afterTurn) failed|deferred context engine maintenance failed|skipped accepted turn advancement|"
    r"remains queued|blocked unrecoverable|failed to retry pending",
    re.I,
)
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


class TurnResponder(LocalResponder):
    """Answers each marked turn with 'ack TURN-k; context had ...' (the turns it saw); holds SLOW turns."""

    def __init__(self) -> None:
        super().__init__(name="fake-model")
        self.replies: dict[str, str] = {}
        self.seen: dict[str, list[str]] = {}
        self.slow_started = threading.Event()
        self.release = threading.Event()

    def reply(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, *, max_tokens: int | None
    ) -> tuple[dict[str, Any], str]:
        """The deterministic answer to one request."""
        texts = [message_text(m) for m in messages]
        marked = [i for i, m in enumerate(messages)
                  if m.get("role") == "user" and MARK.search(texts[i]) and not any(x in texts[i] for x in INTERNAL)]
        if not marked:
            return {"role": "assistant", "content": "OK"}, "stop"
        current = marked[-1]
        found = MARK.search(texts[current])
        assert found is not None
        turn = found.group()
        seen = sorted(set(MARK.findall(" ".join(texts[:current]))) - {turn}, key=lambda t: int(t.split("-")[1]))
        if "SLOW" in texts[current]:
            self.slow_started.set()
            self.release.wait(180)
        text = f"ack {turn}; context had {', '.join(seen) or 'nothing'}"
        self.replies[turn], self.seen[turn] = text, seen
        return {"role": "assistant", "content": text}, "stop"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def host_tools() -> tuple[Path, Path]:
    if os.environ.get("TRANSCRIPT_STORE_OPENCLAW") != "1" and not ON_CI:
        pytest.skip("the OpenClaw interop test runs with `make test-openclaw` (TRANSCRIPT_STORE_OPENCLAW=1)")
    try:
        return install()
    except HostUnavailable as e:
        if ON_CI:
            pytest.fail(f"CI=true and OpenClaw cannot be installed or run here: {e}")
        pytest.skip(f"OpenClaw is not available: {e}")


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ts-openclaw-") as name:
        yield Path(name)


def no_fallback(run: TurnRun, host_log: str = "") -> None:
    """The turn ran on our engine: no degradation, quarantine or lost operation in what the host said."""
    for text in (run.output, host_log):
        bad = [line for line in text.splitlines() if FALLBACK.search(line)]
        assert not bad, f"host fell back or lost work in {run.args[1:4]}:\n" + "\n".join(bad[:10])


def host_messages(store: TranscriptStore, sid: str, key: str) -> list[dict[str, Any]]:
    """The ledger messages of one receipt, as the host sent them (the plugin keeps the host's own form)."""
    messages = store.read(lambda c: committed_messages(c, SCOPE, sid, ENGINE, key))
    return [m["openclaw"] for m in messages]


def content_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def assemble_counts(service_log: str, sid: str) -> list[int]:
    """How many messages each assemble of the session returned, in order (from the service's log)."""
    pattern = re.compile(rf"assemble engine={ENGINE} scope={SCOPE} session={re.escape(sid)} messages=(\d+)")
    return [int(m) for m in pattern.findall(service_log)]


def test_turns_commit_exactly_once_inside_openclaw(host_tools: tuple[Path, Path], workdir: Path) -> None:
    node_bin, openclaw = host_tools
    responder = TurnResponder()
    db_url = f"sqlite:///{workdir / 'store.db'}"
    fake = FakeOpenAI(responder=responder).start()
    service = ServiceProcess(db_url, {TOKEN: SCOPE}, workdir / "serve.log").start()
    host = OpenClawHost(node_bin, openclaw, workdir / "host", fake.base_url, free_port(), TOKEN)
    try:
        host.write_config()
        installed = host.install_plugin()
        assert "Linked plugin path" in installed.output, installed.output
        host.write_config({"plugins": {"entries": {"transcript-store": {"config": {
            "serviceUrl": service.url, "engine": ENGINE, "timeoutMs": 15000}}}}})
        config = json.loads(host.config_path.read_text())
        assert config["plugins"]["slots"]["contextEngine"] == "transcript-store"

        runs: dict[str, TurnRun] = {}
        runs["TURN-1"] = host.embedded_turn("TURN-1 please remember the blue door")
        runs["TURN-2"] = host.embedded_turn("TURN-2 which colour was the door")
        host.start_gateway()
        runs["TURN-3"] = host.gateway_turn("TURN-3 the same session through the gateway")
        for turn in ("TURN-1", "TURN-2", "TURN-3"):
            assert f"ack {turn}" in runs[turn].output, runs[turn].output[-3000:]
            no_fallback(runs[turn])
        no_fallback(runs["TURN-3"], host.logs())

        # TURN-4: the service goes down after assembly, before the gateway commits the accepted turn.
        slow = host.start("agent", "--agent", "main", "--message", "TURN-4 SLOW while the service stops",
                          "--timeout", "240")
        assert responder.slow_started.wait(300), "the host never asked the model for TURN-4"
        port = service.port
        service.stop()
        responder.release.set()
        slow.wait(300)
        failed = host.logs()
        queued = re.findall(r"durable turn advancement remains queued: (\S+): .*unreachable", failed)
        assert len(set(queued)) == 1, failed[-4000:]
        key4 = queued[0]

        # The service comes back (same port, same store); the next turn's drain replays TURN-4 first,
        # in the same gateway process: the failed commit did not cost the engine its slot.
        service = ServiceProcess(db_url, {TOKEN: SCOPE}, workdir / "serve.log", port=port).start()
        logged = len(host.logs())
        runs["TURN-5"] = host.gateway_turn("TURN-5 after the service is back")
        assert "ack TURN-5" in runs["TURN-5"].output, runs["TURN-5"].output[-3000:]
        no_fallback(runs["TURN-5"], host.logs()[logged:])
        host.stop_gateway()

        with TranscriptStore(db_url) as store:
            session = store.find_session(SCOPE, SESSION_KEY)
            assert session is not None
            sid = session.session_id
            receipts = store.read(lambda c: list_receipts(c, SCOPE, sid, ENGINE))
            keys = [r.advancement_key for r in receipts]
            assert len(keys) == len(set(keys)) == 5, keys  # each turn's receipt exactly once
            assert key4 in keys
            turns = [f"TURN-{k}" for k in range(1, 6)]
            for receipt, turn in zip(receipts, turns, strict=True):
                sent = host_messages(store, sid, receipt.advancement_key)
                assert [m["role"] for m in sent] == ["user", "assistant"], (turn, sent)
                assert content_text(sent[0]).startswith(turn), (turn, sent[0])
                assert content_text(sent[1]) == responder.replies[turn], (turn, sent[1])
                assert receipt.message_count == 2 and not receipt.is_heartbeat
            # The mirror holds every message once, in order.
            visible = store.read_visible(SCOPE, sid)
            assert [MARK.findall(message_text(e.message or {}))[0] for e in visible] == [
                t for t in turns for _ in (0, 1)]

        # Later turns' assembly saw the earlier turns: the service assembled them, the model saw them.
        counts = assemble_counts(service.log(), sid)
        assert list(dict.fromkeys(counts)) == [0, 2, 4, 6, 8], counts  # the host may assemble twice a turn
        for k, turn in enumerate(turns):
            assert responder.seen[turn] == turns[:k], (turn, responder.seen[turn])
        commits = re.findall(rf"commit_turn engine={ENGINE} scope={SCOPE} session=\S+ key=(\S+) status=(\w+)",
                             service.log())
        assert commits.count((key4, "committed")) == 1 and len(commits) == 5, commits

        # A host replay of a committed key through the plugin is "duplicate"; other content collides.
        replay = replay_params(db_url, sid, receipts[0].advancement_key)
        changed = json.loads(json.dumps(replay))
        changed["messages"][1]["content"] = [{"type": "text", "text": "something else"}]
        results = run_plugin(node_bin, service.url, [replay, replay, changed])
        assert results == [{"status": "duplicate"}, {"status": "duplicate"},
                           {"error": "advancement_key_collision"}], results
    finally:
        responder.release.set()
        host.close()
        service.stop()
        fake.stop()


def replay_params(db_url: str, sid: str, key: str) -> dict[str, Any]:
    """commitTurn parameters for an already committed turn, rebuilt from our store."""
    with TranscriptStore(db_url) as store:
        receipts = store.read(lambda c: list_receipts(c, SCOPE, sid, ENGINE))
        receipt = next(r for r in receipts if r.advancement_key == key)
        first, last = store.get_entries(SCOPE, sid, [receipt.admission_entry_id, receipt.terminal_entry_id])
        messages = host_messages(store, sid, key)
    identity = {"agentId": "main", "sessionId": sid, "sessionKey": SESSION_KEY}
    return {
        "advancementKey": key,
        "admission": {**identity, "entryId": first.entry_id, "activeMessagePosition": first.position,
                      "logicalTurnId": key, "role": "user"},
        "terminal": {**identity, "entryId": last.entry_id, "activeMessagePosition": last.position},
        "messages": messages,
        "sessionId": sid,
        "sessionKey": SESSION_KEY,
        "sessionTarget": identity,
        "isHeartbeat": False,
    }


def run_plugin(node_bin: Path, service_url: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The plugin's commitTurn, called directly by Node for each parameter set."""
    script = Path(__file__).with_name("replay_commit.mjs")
    payload = {"engineModule": str(PLUGIN_DIR / "src" / "engine.js"), "serviceUrl": service_url, "token": TOKEN,
               "engine": ENGINE, "calls": calls}
    done = subprocess.run([str(node_bin / "node"), str(script)], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result: list[dict[str, Any]] = json.loads(done.stdout)
    return result


def assert_turn_saw_the_compaction(
    fake: FakeOpenAI, db_url: str, turn: int, summarised: Sequence[str], kept: str
) -> None:
    """The last model request (``turn``'s) holds OpenClaw's newest summary and what it kept, not the history it
    summarised; the mirror keeps every message where OpenClaw has it, and each turn so far committed once."""
    sent = [content_text(m) for m in fake.chat_requests[-1]["messages"]]
    assert any(f"TURN-{turn} " in text for text in sent), sent  # the request of that turn
    assert any("[Summary of the earlier conversation]" in text for text in sent), sent
    raw = [text for text in sent if "[Summary of the earlier conversation]" not in text]
    assert not any(old in text for old in summarised for text in raw), sent  # summarised, not sent whole
    assert any(kept in text for text in raw), sent  # what OpenClaw kept
    with TranscriptStore(db_url) as store:
        session = store.find_session(SCOPE, SESSION_KEY)
        assert session is not None
        assert session.visible_count == 2 * turn
        assert len(store.read(lambda c: list_receipts(c, SCOPE, session.session_id, "legacy"))) == turn


def test_compactions_with_and_without_the_plugin_are_what_the_legacy_engine_assembles(
    host_tools: tuple[Path, Path], workdir: Path
) -> None:
    """OpenClaw with the plugin on the service's legacy engine, after three long turns of one session (gateway).

    First OpenClaw's own compaction (``openclaw sessions compact`` through the gateway), which the plugin
    delegates to for the legacy engine: a marker in OpenClaw's transcript that moves no message. Then a
    compaction OpenClaw makes without calling the plugin's ``compact`` (here its own legacy engine's, selected
    for a while; OpenClaw's in-run auto-compaction and a turn degraded to legacy write the same ``compaction``
    entry), found in its transcript at the next (embedded) bootstrap. After each, the next turn's model request
    holds the newest summary and the messages it kept, not the history it summarised (before, all of it)."""
    node_bin, openclaw = host_tools
    db_url = f"sqlite:///{workdir / 'store.db'}"
    fake = FakeOpenAI(responder=TurnResponder()).start()
    service = ServiceProcess(db_url, {TOKEN: SCOPE}, workdir / "serve.log").start()
    host = OpenClawHost(node_bin, openclaw, workdir / "host", fake.base_url, free_port(), TOKEN)
    try:
        host.write_config()
        host.link_plugin()  # what `openclaw plugins install -l` writes (that command is the first test's)
        host.write_config({"plugins": {"entries": {"transcript-store": {"config": {
            "serviceUrl": service.url, "engine": "legacy", "timeoutMs": 15000}}}}})
        # Three long turns through the gateway (a client start each, not a whole embedded host: the embedded
        # path is the first test's), the plugin's compact delegated to OpenClaw's runtime, the next turn.
        host.start_gateway()
        for k in range(1, 4):
            run = host.gateway_turn(f"TURN-{k} " + f"tell me about topic {k}. " * 30)
            assert f"ack TURN-{k}" in run.output, run.output[-3000:]
        compacted = host.command("sessions", "compact", SESSION_KEY)
        assert "Compacted session" in compacted.output, compacted.output[-3000:]
        run = host.gateway_turn("TURN-4 " + "tell me about topic 4. " * 30)
        assert "ack TURN-4" in run.output, run.output[-3000:]
        no_fallback(run, host.logs())
        host.stop_gateway()
        assert_turn_saw_the_compaction(fake, db_url, 4, ["TURN-1 tell me about topic 1"], "ack TURN-3")

        # A compaction by OpenClaw's own legacy engine, the plugin out of its slot; the plugin back for TURN-5.
        host.write_config({"plugins": {"slots": {"contextEngine": "legacy"}}})
        host.start_gateway()
        compacted = host.command("sessions", "compact", SESSION_KEY)
        assert "Compacted session" in compacted.output, compacted.output[-3000:]
        host.stop_gateway()
        host.write_config({"plugins": {"slots": {"contextEngine": "transcript-store"}}})
        run = host.embedded_turn("TURN-5 after the second compaction")
        assert "ack TURN-5" in run.output, run.output[-3000:]
        no_fallback(run, host.logs())
        # TURN-3's answer, which the first compaction kept (TURN-4 was sent it), is summarised by the second.
        assert_turn_saw_the_compaction(fake, db_url, 5, ["TURN-3 tell me about topic 3", "ack TURN-3"], "ack TURN-4")
    finally:
        host.close()
        service.stop()
        fake.stop()
