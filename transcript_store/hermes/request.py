"""``select_context``'s requests: the incoming message, prefill messages, each message as sent."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from .context import is_context_message, split_system
from .messages import canonical, clean, identity


def with_incoming(conversation: list[dict[str, Any]], incoming: Any) -> list[dict[str, Any]]:
    """The conversation with the turn's incoming message at its end when its current turn (what follows its
    last reply without tool calls) does not hold it: ``select_context``'s host may pass the new user
    message beside the conversation rather than in it."""
    if not isinstance(incoming, dict):
        return conversation
    start = next(
        (i + 1 for i in range(len(conversation) - 1, -1, -1)
         if conversation[i].get("role") == "assistant" and not conversation[i].get("tool_calls")),
        0,
    )
    own = canonical(identity(clean(incoming)))
    if any(canonical(identity(clean(m))) == own for m in conversation[start:]):
        return conversation
    return [*conversation, incoming]


def prefill_count(request: Sequence[dict[str, Any]], conversation: Sequence[dict[str, Any]]) -> int:
    """How many messages the request holds between its system prompt and the conversation: hermes-agent's
    ``prefill_messages`` (few-shot examples from its config), which it puts there in every request and
    never into the conversation. The request's extra leading messages when the rest holds the
    conversation's roles in order; 0 when it cannot tell."""
    _system, sent = split_system(list(request))
    _system, held = split_system(list(conversation))
    k = len(sent) - len(held)
    if k > 0 and all(a.get("role") == b.get("role") for a, b in zip(sent[k:], held, strict=True)):
        return k
    return 0


def as_sent(
    selected: list[dict[str, Any]], request: Sequence[dict[str, Any]], conversation: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A selection with each message as this request sends it: the request's own copy when it holds the
    message, else the stored message as Hermes' request build makes one of it (``request_copy``: its
    ``api_content``, Hermes' record of the bytes it sent, as its content, without the keys that build pops).

    The selection is assembled from what is stored, the conversation's clean messages. hermes-agent sends
    the current user message with its memory provider's prefetch and ``pre_llm_call`` plugin context
    appended, in the request only (the conversation keeps the clean text, the sent one as ``api_content``,
    which it pops from every outgoing message and replays for earlier turns): rebuilt from the store, the
    selection dropped that context from the turn, sent a key no provider knows, and changed the bytes of
    earlier turns, each request's cached prefix with them. A request message is paired with the
    conversation message at its place when both lists hold the same roles in the same order (the
    request's copy of the current turn differs by its injected text); any other by its identity.
    """
    _system, sent = split_system(list(request))
    _system, held = split_system(list(conversation))

    def key(m: dict[str, Any]) -> str:
        return canonical(identity(clean(m)))

    wire = {key(m): m for m in sent}
    if len(sent) == len(held) and all(a.get("role") == b.get("role") for a, b in zip(sent, held, strict=True)):
        wire.update({key(c): r for c, r in zip(held, sent, strict=True)})
    # Hermes gives every assistant message a reasoning_content exactly when its provider requires one
    pad = any(m.get("role") == "assistant" and "reasoning_content" in m for m in sent)
    out: list[dict[str, Any]] = []
    for m in selected:
        own = wire.get(key(m)) if not is_context_message(m) else None
        out.append(copy.deepcopy(own) if own is not None else request_copy(m, pad=pad))
    return out


def request_copy(message: dict[str, Any], *, pad: bool) -> dict[str, Any]:
    """A stored message as hermes-agent's request build makes the message it sends of a conversation message
    (``agent/conversation_loop.py``, the ``api_messages`` loop, and its ``copy_reasoning_content_for_api``):
    its ``api_content`` as its content, ``reasoning`` and ``finish_reason`` popped (strict providers such as
    Mistral refuse them), and ``reasoning_content`` on an assistant message only when the provider requires
    one (``pad``: DeepSeek, Kimi, MiMo thinking models; strict providers refuse it): the stored one (an
    empty one as a space), else the ``reasoning`` text when the message has no tool calls, else a space.
    The rest (``timestamp``, ``tool_name``, ``codex_*``) is its transport's to strip, as from its own messages
    (the contract runs ``select_context`` before every request sanitizer).
    """
    out = dict(message)
    api = out.pop("api_content", None)
    if isinstance(api, str) and api and out.get("role") in ("user", "assistant"):
        out["content"] = api
    reasoning = out.pop("reasoning", None)
    out.pop("finish_reason", None)
    if out.get("role") != "assistant":
        return out
    stored = out.pop("reasoning_content", None)
    if not pad:
        return out
    if isinstance(stored, str):
        out["reasoning_content"] = stored or " "
    elif isinstance(reasoning, str) and reasoning and not out.get("tool_calls"):
        out["reasoning_content"] = reasoning
    else:  # another provider's thoughts behind a tool call are not passed on (Hermes' #15748)
        out["reasoning_content"] = " "
    return out


def settled(messages: Any) -> list[dict[str, Any]]:
    """The messages of a list before its pending tool round (the last assistant message with tool calls,
    when only tool results follow it): what ``handle_tool_call`` stores of the live conversation. Stored
    with it, the recall tool's own call was its newest hit, and every later search found the earlier
    searches first."""
    if not isinstance(messages, list):
        return []
    items = [m for m in messages if isinstance(m, dict)]
    for at in range(len(items) - 1, -1, -1):
        m = items[at]
        if m.get("role") == "tool":
            continue
        return items[:at] if m.get("role") == "assistant" and m.get("tool_calls") else items
    return items
