"""Token estimators, summarizers and models: offline behaviour, and the HTTP ones against tests/fake_openai.py."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_openai import FakeOpenAI, Fault

from transcript_store.errors import InvalidInput, ModelError, ModelTimeout, SummarizerError, TokenizerUnavailable
from transcript_store.model import LocalResponder, Model, ModelResponse, OpenAIChatModel, model_from_settings
from transcript_store.summarize import ExtractiveSummarizer, OpenAISummarizer, Summarizer, summarizer_from_env
from transcript_store.tokens import RoughEstimator, TiktokenEstimator, TokenEstimator, default_estimator

ENV_VARS = (
    "OPENAI_BASE_URL", "OPENAI_API_KEY", "TRANSCRIPT_STORE_MODEL", "TRANSCRIPT_STORE_TOKENIZER",
    "TRANSCRIPT_STORE_SUMMARIZER", "TRANSCRIPT_STORE_SUMMARIZER_MODEL",
)
KEY = "sk-test-secret-0123456789"
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(api_key=KEY) as server:
        yield server


def run_tool(call: dict[str, Any]) -> dict[str, Any]:
    """The test's tool executor: deterministic results for the two TOOLS."""
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_time":
        result = f"It is 14:05 in {args['city']}."
    else:
        result = "84" if args["expression"] == "12 * (3+4)" else "unknown"
    return {"role": "tool", "tool_call_id": call["id"], "content": result}


def tool_loop(model: Model, question: str) -> list[dict[str, Any]]:
    """user -> assistant tool_call -> tool result -> final answer, through ``model``."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    for _ in range(4):
        reply = model.complete(messages, TOOLS).message
        messages.append(reply)
        if not reply.get("tool_calls"):
            return messages
        messages += [run_tool(call) for call in reply["tool_calls"]]
    raise AssertionError("the tool loop did not end")


# ------------------------------------------------------------------------------------------------ tokens


def test_rough_estimator_counts_text_monotonically() -> None:
    est = RoughEstimator()
    assert isinstance(est, TokenEstimator)
    assert est.count_text("") == 0
    assert est.count_text("abcd" * 10) == 10  # 4 letters per token
    text = "The quick brown fox, 42 times! 你好 ünïcode. "
    counts = [est.count_text(text[:i]) for i in range(len(text) + 1)]
    assert counts == sorted(counts)
    assert est.count_text(text * 10) >= 9 * est.count_text(text)


def test_rough_estimator_counts_cjk_about_one_token_per_character() -> None:
    est = RoughEstimator()
    chinese = "我们今天讨论数据库的事务隔离级别" * 5
    japanese = "こんにちは、カタカナとひらがな" * 5
    assert est.count_text(chinese) == len(chinese)
    assert est.count_text(japanese) == len(japanese)
    assert est.count_text(chinese) > 3 * est.count_text("a" * len(chinese))


def test_rough_estimator_counts_messages_framing_and_tool_calls() -> None:
    est = RoughEstimator()
    assert est.count_messages([]) == 0
    one = est.count_messages([{"role": "user", "content": ""}])
    assert one == RoughEstimator.per_message + RoughEstimator.priming
    plain = {"role": "assistant", "content": "ok"}
    calling = {"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": json.dumps({"q": "x" * 400})}}]}
    assert est.count_messages([calling]) >= est.count_messages([plain]) + 100
    parts = {"role": "user", "content": [{"type": "text", "text": "hello " * 20}, {"type": "image_url",
                                                                                   "image_url": {"url": "data:,x"}}]}
    assert est.count_messages([parts]) > est.count_messages([{"role": "user", "content": "hello " * 20}])
    history = [{"role": "user", "content": f"message {i}"} for i in range(10)]
    assert [est.count_messages(history[:i]) for i in range(11)] == sorted(est.count_messages(history[:i])
                                                                         for i in range(11))
    with pytest.raises(InvalidInput):
        est.count_messages(["not a dict"])  # type: ignore[list-item]


def test_tiktoken_estimator_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` raise ImportError
    with pytest.raises(TokenizerUnavailable, match="pip install tiktoken"):
        TiktokenEstimator()
    monkeypatch.setenv("TRANSCRIPT_STORE_TOKENIZER", "tiktoken")
    with pytest.raises(ImportError):
        default_estimator()


def test_tiktoken_estimator_uses_the_encoding_with_cookbook_framing(monkeypatch: pytest.MonkeyPatch) -> None:
    class WordEncoding:
        def encode(self, text: str, disallowed_special: Any = ()) -> list[int]:
            return [0] * len(text.split())

    fake_module = types.ModuleType("tiktoken")
    fake_module.get_encoding = lambda name: WordEncoding()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tiktoken", fake_module)
    est = TiktokenEstimator()
    assert est.count_text("one two three") == 3
    messages = [{"role": "user", "content": "one two", "name": "ann"}, {"role": "assistant", "content": "three"}]
    assert est.count_messages(messages) == 3 + (3 + 2 + 1 + 1) + (3 + 1)
    monkeypatch.setenv("TRANSCRIPT_STORE_TOKENIZER", "tiktoken")
    assert isinstance(default_estimator(), TiktokenEstimator)


def test_default_estimator_is_rough_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(default_estimator(), RoughEstimator)
    monkeypatch.setenv("TRANSCRIPT_STORE_TOKENIZER", "rough")
    assert isinstance(default_estimator(), RoughEstimator)
    monkeypatch.setenv("TRANSCRIPT_STORE_TOKENIZER", "sentencepiece")
    with pytest.raises(InvalidInput):
        default_estimator()


# ------------------------------------------------------------------------------------ extractive summarizer


def conversation(n: int, *, needle_at: int | None = None) -> list[dict[str, Any]]:
    """A long conversation with tool calls; message ``needle_at`` mentions the PostgreSQL migration on line 2."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        text = f"Turn {i} asks about topic {i % 7}. It goes on with detail number {i} and more words here.\nfiller"
        if i == needle_at:
            text += "\nWe agreed the PostgreSQL migration runs on Friday."
        out.append({"role": "user", "content": text})
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"i": {i}}}'}}
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        out.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"result {i} " + "data " * 60})
        out.append({"role": "assistant", "content": f"Answer {i}. Second sentence that is not kept."})
    return out


def input_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls", ""))) for m in messages)


def test_extractive_summarizer_is_deterministic_and_extracts() -> None:
    messages = conversation(3)
    a = ExtractiveSummarizer().summarize(messages)
    assert a == ExtractiveSummarizer().summarize(messages)
    assert isinstance(ExtractiveSummarizer(), Summarizer)
    assert a.startswith("Summary of 12 messages:")
    assert "- user: Turn 0 asks about topic 0." in a
    assert "called lookup({\"i\": 0})" in a
    assert "- tool lookup -> result 0" in a
    assert "Second sentence" not in a


@pytest.mark.parametrize("level", ["normal", "aggressive"])
@pytest.mark.parametrize("max_tokens", [64, 300, 1024])
def test_extractive_summary_is_shorter_and_within_budget(level: Any, max_tokens: int) -> None:
    messages = conversation(120)
    assert input_chars(messages) > max_tokens * 4
    summary = ExtractiveSummarizer().summarize(messages, level=level, max_tokens=max_tokens)
    assert len(summary) < input_chars(messages)
    assert RoughEstimator().count_text(summary) <= max_tokens
    cjk = [{"role": "user", "content": "数据库事务隔离级别的讨论。" * 40} for _ in range(20)]
    summary = ExtractiveSummarizer().summarize(cjk, level=level, max_tokens=max_tokens)
    assert RoughEstimator().count_text(summary) <= max_tokens
    assert len(summary) < input_chars(cjk)


def test_aggressive_is_shorter_than_normal() -> None:
    messages = conversation(40)
    normal = ExtractiveSummarizer().summarize(messages, max_tokens=4000)
    aggressive = ExtractiveSummarizer().summarize(messages, level="aggressive", max_tokens=4000)
    assert len(aggressive) < len(normal)


def test_extractive_summary_keeps_focus_lines_first() -> None:
    messages = conversation(80, needle_at=2)  # an early message: dropped first when over budget
    plain = ExtractiveSummarizer().summarize(messages, max_tokens=300)
    focused = ExtractiveSummarizer().summarize(messages, focus="postgresql", max_tokens=300)
    assert "PostgreSQL migration" not in plain
    assert "PostgreSQL migration runs on Friday" in focused
    assert "(focused)" in focused.splitlines()[0] and "postgresql" not in focused.splitlines()[0].lower()
    assert re.search(r"\(\d+ older lines omitted\)", focused)


def test_extractive_summary_keeps_previous_gist_without_stacking() -> None:
    first = ExtractiveSummarizer().summarize(
        [{"role": "user", "content": "Use WAL mode. Always."}], previous_summary="Decided: SQLite with FULL sync."
    )
    second = ExtractiveSummarizer().summarize([{"role": "user", "content": "Next question."}], previous_summary=first)
    assert "Earlier: Decided: SQLite with FULL sync." in second
    assert "Earlier: - user: Use WAL mode." in second
    assert "Earlier: Earlier:" not in second
    assert second.count("Summary of") == 1


def test_summarizers_refuse_bad_arguments() -> None:
    with pytest.raises(InvalidInput):
        ExtractiveSummarizer().summarize([], level="extreme")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        ExtractiveSummarizer().summarize([], max_tokens=3)


# ------------------------------------------------------------------------------------- OpenAI summarizer


def test_openai_summarizer_sends_a_prompt_and_returns_the_summary(fake: FakeOpenAI) -> None:
    fake.queue(Fault(reply={"role": "assistant", "content": "  The user set up SQLite.  "}))
    summarizer = OpenAISummarizer(fake.base_url, "sum-model", KEY, timeout=5)
    out = summarizer.summarize(conversation(2), previous_summary="Before: hello", focus="sqlite",
                               level="aggressive", max_tokens=200)
    assert out == "The user set up SQLite."
    [body] = fake.chat_requests
    assert body["model"] == "sum-model" and body["max_tokens"] == 200
    system, user = body["messages"]
    assert system["role"] == "system" and "at most 200 tokens" in system["content"]
    assert "Earlier summary:\nBefore: hello" in user["content"]
    assert "[tool result: lookup]" in user["content"] and "Focus:" in user["content"]
    assert fake.requests[-1].headers["Authorization"] == f"Bearer {KEY}"
    assert KEY not in repr(summarizer)


def test_openai_summarizer_errors_are_typed(fake: FakeOpenAI) -> None:
    summarizer = OpenAISummarizer(fake.base_url, "sum-model", KEY, timeout=5)
    fake.queue(Fault(status=500, message=f"boom, key was {KEY}"))
    with pytest.raises(SummarizerError) as caught:
        summarizer.summarize(conversation(1))
    assert caught.value.status == 500 and KEY not in str(caught.value) and "boom" in str(caught.value)
    fake.queue(Fault(reply={"role": "assistant", "content": "   "}))
    with pytest.raises(SummarizerError, match="empty"):
        summarizer.summarize(conversation(1))
    wrong = OpenAISummarizer(fake.base_url, "sum-model", "sk-wrong", timeout=5)
    with pytest.raises(SummarizerError) as caught:
        wrong.summarize(conversation(1))
    assert caught.value.status == 401


def test_summarizer_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(summarizer_from_env(), ExtractiveSummarizer)
    monkeypatch.setenv("TRANSCRIPT_STORE_SUMMARIZER", "openai")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("TRANSCRIPT_STORE_SUMMARIZER_MODEL", "small-sum")
    built = summarizer_from_env()
    assert isinstance(built, OpenAISummarizer) and built.name == "small-sum" and KEY not in repr(built)
    monkeypatch.setenv("TRANSCRIPT_STORE_SUMMARIZER", "magic")
    with pytest.raises(InvalidInput):
        summarizer_from_env()


# ---------------------------------------------------------------------------------------- local responder


def test_local_responder_runs_the_tool_loop() -> None:
    model = LocalResponder()
    assert isinstance(model, Model)
    messages = tool_loop(model, "Please calculate 12 * (3+4) for me")
    _user, call_msg, result, final = messages[1:]
    [call] = call_msg["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "12 * (3+4)"}'}
    assert result["content"] == "84"
    assert '"84"' in final["content"] and "calculator" in final["content"]
    assert "I see 4 messages of context" in final["content"]
    assert tool_loop(LocalResponder(), "Please calculate 12 * (3+4) for me") == messages  # ids too
    time_loop = tool_loop(model, "What time is it in Paris?")
    assert json.loads(time_loop[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert "14:05 in Paris" in time_loop[-1]["content"]


def test_local_responder_echoes_with_the_context_it_saw() -> None:
    model = LocalResponder()
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(6)]
    response = model.complete([*history, {"role": "user", "content": "Hello there"}])
    assert isinstance(response, ModelResponse)
    assert response.message == {"role": "assistant", "content": (
        '(local responder) You said: "Hello there". I see 7 messages of context.')}
    assert response.usage["total_tokens"] == response.usage["prompt_tokens"] + response.usage["completion_tokens"] > 0
    assert response.model == "local-responder" and response.finish_reason == "stop"


def test_local_responder_calls_tools_for_about_a_third_of_plain_texts() -> None:
    texts = [f"plain message number {i}" for i in range(300)]
    share = sum(LocalResponder.wants_tool(t) for t in texts) / len(texts)
    assert 0.2 < share < 0.45
    assert LocalResponder.wants_tool("please LOOK UP the docs")
    plain = next(t for t in texts if not LocalResponder.wants_tool(t))
    assert "tool_calls" not in LocalResponder().complete([{"role": "user", "content": plain}], TOOLS).message


def test_local_responder_fault_injection_and_max_tokens() -> None:
    model = LocalResponder(fail_every=2)
    hello = [{"role": "user", "content": "hello"}]
    model.complete(hello)
    with pytest.raises(ModelTimeout):
        model.complete(hello)
    model.complete(hello)
    flaky = LocalResponder(timeout_predicate=lambda msgs: "flaky" in msgs[-1]["content"])
    with pytest.raises(ModelTimeout):
        flaky.complete([{"role": "user", "content": "a flaky one"}])
    short = LocalResponder().complete([{"role": "user", "content": "x " * 200}], max_tokens=8)
    assert short.finish_reason == "length" and RoughEstimator().count_text(short.message["content"]) <= 8
    with pytest.raises(InvalidInput):
        LocalResponder().complete([])


# ---------------------------------------------------------------------------------------- OpenAI chat model


def test_openai_chat_model_answers_through_the_fake_server(fake: FakeOpenAI) -> None:
    model = OpenAIChatModel(fake.base_url, "fake-model", KEY, timeout=5)
    response = model.complete([{"role": "system", "content": "s"}, {"role": "user", "content": "Hello there"}],
                              max_tokens=50)
    assert response.message["content"] == '(local responder) You said: "Hello there". I see 2 messages of context.'
    assert response.usage["prompt_tokens"] > 0 and response.usage["completion_tokens"] > 0
    assert response.model == "fake-model" and response.finish_reason == "stop"
    assert fake.chat_requests[-1]["max_tokens"] == 50 and "tools" not in fake.chat_requests[-1]
    assert KEY not in repr(model)


def test_openai_chat_model_tool_calls_round_trip(fake: FakeOpenAI) -> None:
    model = OpenAIChatModel(fake.base_url, "fake-model", KEY, timeout=5)
    messages = tool_loop(model, "What time is it in Tokyo?")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"]["name"] == "get_time"
    assert "It is 14:05 in Tokyo." in messages[-1]["content"]
    first, second = fake.chat_requests
    assert first["tools"] == TOOLS
    assert second["messages"][-1] == messages[3]  # the tool result reached the server
    assert messages == tool_loop(LocalResponder(), "What time is it in Tokyo?")


def test_openai_chat_model_http_errors_are_typed(fake: FakeOpenAI) -> None:
    model = OpenAIChatModel(fake.base_url, "fake-model", KEY, timeout=5)
    hello = [{"role": "user", "content": "hello"}]
    fake.queue(Fault(status=500, message=f"internal error near {KEY}"))
    with pytest.raises(ModelError) as caught:
        model.complete(hello)
    assert type(caught.value) is ModelError and caught.value.status == 500
    assert "HTTP 500" in str(caught.value) and "internal error" in str(caught.value) and KEY not in str(caught.value)
    fake.queue(Fault(status=504))
    with pytest.raises(ModelTimeout):
        model.complete(hello)
    with pytest.raises(ModelError) as caught:
        OpenAIChatModel(fake.base_url, "fake-model", "sk-wrong", timeout=5).complete(hello)
    assert caught.value.status == 401
    assert model.complete(hello).message["role"] == "assistant"  # the server itself is fine


def test_openai_chat_model_delay_is_a_timeout(fake: FakeOpenAI) -> None:
    model = OpenAIChatModel(fake.base_url, "fake-model", KEY, timeout=5)
    fake.queue(Fault(delay=3.0))
    started = time.monotonic()
    with pytest.raises(ModelTimeout, match="timed out"):
        model.complete([{"role": "user", "content": "slow"}], timeout=0.3)
    assert time.monotonic() - started < 2.5
    assert len(fake.chat_requests) == 1  # it reached the server: a retry is the same logical turn again


def test_openai_chat_model_unreachable_is_a_model_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ModelError) as caught:
        OpenAIChatModel(f"http://127.0.0.1:{port}/v1?key=pw", "m", KEY, timeout=2).complete(
            [{"role": "user", "content": "hi"}])
    assert not isinstance(caught.value, ModelTimeout)
    assert "unreachable" in str(caught.value) and "pw" not in str(caught.value)
    with pytest.raises(InvalidInput) as refused:  # credentials in the URL: never sent, refused
        OpenAIChatModel(f"http://user:pw@127.0.0.1:{port}/v1", "m", KEY)
    assert "pw" not in str(refused.value)
    with pytest.raises(InvalidInput):
        OpenAIChatModel("ftp://example", "m")


def test_model_from_settings_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(model_from_settings(None, None, None), LocalResponder)
    assert isinstance(model_from_settings(None, "gpt-x", KEY), LocalResponder)  # no URL: local, offline
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("TRANSCRIPT_STORE_MODEL", "env-model")
    from_env = model_from_settings(None, None, None)
    assert isinstance(from_env, OpenAIChatModel)
    assert (from_env.base_url, from_env.name, from_env._api_key) == ("http://127.0.0.1:9/v1", "env-model", "sk-env")
    explicit = model_from_settings("http://127.0.0.1:10/v1/", "arg-model", "sk-arg")
    assert isinstance(explicit, OpenAIChatModel)
    assert (explicit.base_url, explicit.name, explicit._api_key) == ("http://127.0.0.1:10/v1", "arg-model", "sk-arg")
    monkeypatch.delenv("TRANSCRIPT_STORE_MODEL")
    assert model_from_settings(None, None, None).name == "gpt-4o-mini"


# ------------------------------------------------------------------------------------ the fake server itself


def sse_events(url: str, body: dict[str, Any]) -> list[Any]:
    request = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        lines = response.read().decode().split("\n\n")
    data = [ln.removeprefix("data: ") for ln in lines if ln.strip()]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_fake_server_streams_content_and_tool_call_deltas(fake: FakeOpenAI) -> None:
    events = sse_events(fake.base_url, {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                                        "messages": [{"role": "user", "content": "What time is it in Oslo?"}],
                                        "tools": TOOLS})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    calls: dict[int, dict[str, str]] = {}
    for event in events[:-1]:
        for delta in event["choices"][0]["delta"].get("tool_calls", []):
            slot = calls.setdefault(delta["index"], {"id": "", "name": "", "arguments": ""})
            slot["id"] += delta.get("id") or ""
            slot["name"] += delta.get("function", {}).get("name") or ""
            slot["arguments"] += delta.get("function", {}).get("arguments") or ""
    assert calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] > 0

    events = sse_events(fake.base_url, {"model": "m", "stream": True,
                                        "messages": [{"role": "user", "content": "Hello there"}]})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == '(local responder) You said: "Hello there". I see 1 messages of context.'
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and "usage" not in events[-1]


def test_fake_server_lists_models_and_refuses_bad_requests(fake: FakeOpenAI) -> None:
    request = urllib.request.Request(fake.base_url + "/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert json.load(response)["data"][0]["id"] == "fake-model"
    bad = urllib.request.Request(fake.base_url + "/chat/completions", data=b'{"messages": []}',
                                 headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(bad, timeout=5)
    assert caught.value.code == 400


def test_fake_server_runs_as_a_script() -> None:
    script = Path(__file__).with_name("fake_openai.py")
    proc = subprocess.Popen([sys.executable, str(script), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = re.search(r"http://\S+", line)
        assert url, line
        reply = OpenAIChatModel(url.group(), "fake-model", timeout=5).complete([{"role": "user", "content": "hi"}])
        assert "I see 1 messages of context" in reply.message["content"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


class _Misbehaving:
    """A real HTTP server on loopback whose answers misbehave: trickled, endless or with an endless error."""

    def __init__(self, mode: str) -> None:
        import http.server
        import threading

        outer = self
        self.mode = mode
        self.stop = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = 500 if outer.mode == "endless-error" else 200
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                try:
                    if outer.mode == "trickle":  # a byte well inside every socket timeout, never the end
                        self.wfile.write(b'{"choices": ')
                        while not outer.stop.wait(0.05):
                            self.wfile.write(b" ")
                            self.wfile.flush()
                    else:  # more than any answer may be
                        block = b" " * 65536
                        while not outer.stop.is_set():
                            self.wfile.write(block)
                except OSError:
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("mode", ["trickle", "endless-error"])
def test_an_answer_that_never_ends_is_a_timeout_within_about_the_timeout(mode: str) -> None:
    """urllib's timeout bounds each socket read: a server sending a byte every 50 ms held the call (and
    the host's turn) for ever, and the body of an error answer was read to its end before the error."""
    server = _Misbehaving(mode)
    try:
        model = OpenAIChatModel(server.base_url, "m", KEY, timeout=1.0)
        started = time.monotonic()
        with pytest.raises(ModelError) as caught:
            model.complete([{"role": "user", "content": "hi"}])
        assert time.monotonic() - started < 4.0
        if mode == "trickle":
            assert isinstance(caught.value, ModelTimeout) and "timed out" in str(caught.value)
        else:
            assert "HTTP 500" in str(caught.value)
    finally:
        server.close()


def test_an_answer_larger_than_any_completion_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server streaming without end filled the host's memory: the answer is read up to a bound."""
    import transcript_store.model as model_module

    monkeypatch.setattr(model_module, "MAX_RESPONSE_BYTES", 1024 * 1024)
    server = _Misbehaving("endless")
    try:
        model = OpenAIChatModel(server.base_url, "m", KEY, timeout=30.0)
        started = time.monotonic()
        with pytest.raises(ModelError, match="more than 1048576 bytes") as caught:
            model.complete([{"role": "user", "content": "hi"}])
        assert not isinstance(caught.value, ModelTimeout) and time.monotonic() - started < 10
    finally:
        server.close()
