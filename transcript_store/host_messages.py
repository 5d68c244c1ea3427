"""The host's request helpers: a tool round fitted to the token budget, tool calls paired with results,
old tool results trimmed, the system-prompt addition, and the default host tools (request only: storage
is never touched; split out of host.py, which re-exports every name)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .models import RESULT_ROLES, call_answered, calls_made

HostTool = tuple[dict[str, Any], Callable[[dict[str, Any]], str]]


def prune_tool_results(messages: list[dict[str, Any]], keep_recent: int, max_chars: int) -> list[dict[str, Any]]:
    """Trim old, long tool results in the request only (storage is never touched)."""
    tool_idx = [i for i, m in enumerate(messages) if m.get("role") in RESULT_ROLES]
    old = set(tool_idx[: max(0, len(tool_idx) - keep_recent)])
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if i in old and isinstance(content, str) and len(content) > max_chars:
            half = max_chars // 2
            trimmed = f"{content[:half]}\n[... {len(content) - max_chars} characters trimmed ...]\n{content[-half:]}"
            m = {**m, "content": trimmed}
        out.append(m)
    return out


#: what a tool result of this turn becomes in a request it would take over the budget (request only)
CUT_TOOL_RESULT = "[tool result cut: the request's token budget has no room left for it]"


def fit_tool_round(
    estimator: Any, context: list[dict[str, Any]], replies: list[dict[str, Any]], limit: int
) -> tuple[list[dict[str, Any]], int, list[dict[str, Any]]]:
    """A tool round's request within ``limit`` tokens (system prompt, user message and tools reserved
    apart): (the context, its tokens, the replies to send). The engine's context gives way first, oldest
    messages first, a tool round never split; then this turn's own tool results, oldest first, are cut
    to a marker in the request (storage is never touched). Only a request that would not fit runs this."""
    def tokens(messages: list[dict[str, Any]]) -> int:
        return int(estimator.count_messages(messages)) if messages else 0

    own = tokens(replies)
    context = list(context)
    size = tokens(context)
    while context and size + own > limit:
        context = pair_tool_calls(context[1:])  # a result whose call left goes with it
        size = tokens(context)
    sent = list(replies)
    for i, m in enumerate(sent):
        if size + own <= limit:
            break
        if m.get("role") == "tool" and m.get("content") != CUT_TOOL_RESULT:
            sent[i] = {**m, "content": CUT_TOOL_RESULT}
            own = tokens(sent)
    return context, size, sent


#: the turn's last message when its own tool calls leave no room in the token budget for another request
STOPPED_OVER_BUDGET = "(stopped: this turn's tool calls outgrew the token budget)"


#: the stand-in result of a tool call the transcript holds no result for (request only, never stored)
UNANSWERED_TOOL_CALL = "(no result: the transcript holds no answer to this tool call)"


def pair_tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages with every tool call answered and every tool result answering a call.

    A branch to the middle of a tool round, or a rewrite, can leave an assistant's tool call without its
    result, or a result after another message than its call: chat APIs refuse such a request outright.
    A call without a result gets a stand-in result right after its round; a result that answers no open
    call is left out. The older format's ``function_call`` and ``function`` result pair the same way (by
    the function's name). Request only: storage is never touched.
    """
    # Every turn's request passes here: one plain loop, no work for a message outside a tool round.
    out: list[dict[str, Any]] = []
    open_calls: list[Any] = []
    for m in messages:
        role = m.get("role")
        if role in RESULT_ROLES:
            key = call_answered(m)
            if key in open_calls:
                open_calls.remove(key)
                out.append(m)
            continue
        if open_calls:
            out.extend(_stand_in(c) for c in open_calls)
            open_calls = []
        out.append(m)
        if role == "assistant":
            open_calls = calls_made(m)
    out.extend(_stand_in(c) for c in open_calls)
    return out


def _stand_in(call: Any) -> dict[str, Any]:
    """The stand-in result of an unanswered call (``calls_made``'s key: a tool call id or ("function", name))."""
    if isinstance(call, tuple):
        return {"role": "function", "name": call[1], "content": UNANSWERED_TOOL_CALL}
    return {"role": "tool", "tool_call_id": call, "content": UNANSWERED_TOOL_CALL}


def with_addition(system_prompt: str, addition: str | None) -> str:
    """The request's system prompt: an engine's ``system_prompt_addition`` goes in front (OpenClaw's place)."""
    return f"{addition}\n\n{system_prompt}" if addition else system_prompt


def default_host_tools() -> dict[str, HostTool]:
    """Small deterministic host tools, so the local responder can exercise the tool loop offline."""

    def lookup(args: dict[str, Any]) -> str:
        query = str(args.get("query", ""))
        return json.dumps({"query": query, "result": f"reference notes about {query!r}", "source": "local"})

    schema = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up reference notes about a topic.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
    return {"lookup": (schema, lookup)}
