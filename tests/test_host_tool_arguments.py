"""A model's tool-call arguments the host cannot read never end the turn: the model hears an error.

``json.loads`` raises more than JSONDecodeError: ValueError for an integer of more digits than Python
converts, RecursionError for deep nesting. Only JSONDecodeError was caught: the turn raised out of
``run_turn`` (on any engine's tool or a host tool). Arguments that decode to no object (a list) reached
the tool as they were. (Arguments that are no string never get here: the reply is an invalid message.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import module_store_fixtures

from transcript_store import TranscriptStore
from transcript_store.host import HostRuntime
from transcript_store.model import ModelResponse
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

SCOPE = "tool-args"
shared_url, store, sid = module_store_fixtures(SCOPE, "tool-args")
USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
UNREADABLE = {
    "huge integer": '{"id": "msg_0", "offset": 1' + "0" * 5000 + "}",
    "deep nesting": "[" * 5_000 + "]" * 5_000,
    "a list": "[1, 2]",
    "malformed": '{"id": ',
}


class OneCall:
    """Calls ``tool`` with ``arguments`` once, then answers."""

    name = "one-call"

    def __init__(self, tool: str, arguments: Any) -> None:
        self.tool, self.arguments = tool, arguments
        self.heard: list[str] = []

    def complete(self, messages: Sequence[dict[str, Any]], tools: Any = None, **_kw: Any) -> ModelResponse:
        if messages[-1]["role"] == "user":
            fn = {"name": self.tool, "arguments": self.arguments}
            msg = {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c1", "type": "function", "function": fn}]}
        else:
            self.heard.append(str(messages[-1]["content"]))
            msg = {"role": "assistant", "content": "ok"}
        return ModelResponse(message=msg, usage=USAGE, model=self.name)


@pytest.mark.parametrize("tool", ["lcm_expand", "lookup"])
@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_unreadable_tool_arguments_are_an_error_the_model_hears(
    store: TranscriptStore, sid: str, tool: str, case: str
) -> None:
    called: list[Any] = []
    schema = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    model = OneCall(tool, UNREADABLE[case])
    host = HostRuntime(store, load_settings(config_path=None, engine="lossless"), model,
                       summarizer=ExtractiveSummarizer(), estimator=RoughEstimator(),
                       host_tools={"lookup": (schema, lambda args: called.append(args) or "found")})
    try:
        outcome = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    finally:
        host.dispose()
    assert outcome.commit_status == "committed" and outcome.reply["content"] == "ok"
    assert model.heard and "error" in json.loads(model.heard[0]) and not called
    assert not host.quarantined
