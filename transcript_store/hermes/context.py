"""The engine's context as Hermes gets it: system prompt, context block, fresh tail, tool pairs."""

from __future__ import annotations

import contextlib
import copy
import importlib
import re
from collections.abc import Sequence
from typing import Any, get_args

from ..compaction import SUMMARY_HEAD
from ..errors import EngineContractError
from ..models import Role
from .forms import storable
from .messages import canonical, clean, host_copy, identity


def split_system(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(leading system messages, the rest)."""
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    return list(messages[:n]), list(messages[n:])


def with_addition(system: Sequence[dict[str, Any]], addition: str | None) -> list[dict[str, Any]]:
    """A copy of the leading system messages with an engine's system-prompt addition after the first one's
    text (once: not again when it is there already; nowhere without a text system prompt)."""
    head = copy.deepcopy(list(system))
    if addition and head and isinstance(head[0].get("content"), str) and addition not in head[0]["content"]:
        head[0]["content"] = f"{head[0]['content']}\n\n{addition}"
    return head


MEMORY_HEAD = "What the memory provider recalled before this compaction:"
#: a memory provider's text beyond this is cut (hermes-agent's own sanitizer caps it first when present)
MAX_MEMORY_CHARS = 8000


def memory_block(memory_context: Any) -> str | None:
    """A memory provider's pre-compaction text as the handoff carries it, or None when there is none.

    hermes-agent passes ``compress`` what its memory provider returned just before compaction and asks
    summarizing engines to carry it in their handoff; it goes where the engine's system-prompt addition
    goes (``place_addition``), after it. hermes-agent's ``sanitize_memory_context`` (redaction, length)
    is applied when it is importable; otherwise the text is stripped and cut at MAX_MEMORY_CHARS.
    """
    if not isinstance(memory_context, str) or not memory_context.strip():
        return None
    text = memory_context.strip()
    with contextlib.suppress(Exception):  # an older hermes-agent, or none (the stand-in base)
        text = str(importlib.import_module("agent.context_engine").sanitize_memory_context(text)).strip()
    if len(text) > MAX_MEMORY_CHARS:
        text = text[:MAX_MEMORY_CHARS] + "\n[... cut]"
    return f"{MEMORY_HEAD}\n{text}" if text else None


def addition_of(assembled: Any, memory: str | None) -> str | None:
    """The engine's system-prompt addition, followed by the memory provider's block when there is one."""
    parts = [p for p in (getattr(assembled, "system_prompt_addition", None), memory) if isinstance(p, str) and p]
    return "\n\n".join(parts) if parts else None


def place_addition(
    system: Sequence[dict[str, Any]], answer: list[dict[str, Any]], addition: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system messages, answer) with an engine's system-prompt addition where the model will see it, once.

    After the system prompt's text when the list has one (``with_addition``). hermes-agent passes
    ``compress`` the conversation without its system prompt (it builds that itself for each request),
    so there the addition ends our context block, the answer's first message: put on a system prompt
    the list does not hold, it reached no request. Nowhere when the answer has no block either.
    """
    if not addition:
        return list(system), answer
    if system and isinstance(system[0].get("content"), str):
        return with_addition(system, addition), answer
    first = answer[0] if answer else None
    if first is None or first.get("role") != "user" or not is_context_message(first):
        return list(system), answer
    content = first.get("content")
    if not isinstance(content, str) or addition in content:
        return list(system), answer
    return list(system), [{**first, "content": f"{content}\n\n{addition}"}, *answer[1:]]


_CHAT_ROLES = frozenset(get_args(Role))


def checked_assembly(answer: Any) -> Any:
    """An engine's ``assemble`` answer when each of its messages has a chat role, as the host checks its
    engines' (``host._assembled``); else EngineContractError, which the callers here log and answer
    without the engine's context. A message without one was sent on in Hermes' request, which the
    provider refused."""
    for message in getattr(answer, "messages", None) or []:
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _CHAT_ROLES:
            raise EngineContractError(f"the engine assembled a message without a chat role: {role!r}")
    return answer


def valid_sequence(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with no split tool pair: orphan tool results dropped, unanswered tool calls removed."""
    out: list[dict[str, Any]] = []
    i = 0
    msgs = list(messages)
    while i < len(msgs):
        m = msgs[i]
        if m.get("role") == "tool":
            i += 1  # a result whose call is not right before it
            continue
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if not calls:
            out.append(m)
            i += 1
            continue
        j = i + 1
        results: list[dict[str, Any]] = []
        while j < len(msgs) and msgs[j].get("role") == "tool":
            results.append(msgs[j])
            j += 1
        wanted = {c.get("id") for c in calls if isinstance(c, dict)}
        answered = {r.get("tool_call_id") for r in results}
        if wanted <= answered:
            out.append(m)
            out.extend(r for r in results if r.get("tool_call_id") in wanted)
        elif m.get("content"):
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
        i = j
    return out


CONTEXT_MARKER = "[transcript-store context]"
ACK = "Understood: earlier turns are condensed above; I will use the recall tools for details."


ACK_MESSAGE = f"{CONTEXT_MARKER} {ACK}"


# The heads of the summaries engines render: legacy's fixed line, lossless' id line
# (engines/lossless/context.py render_summary). Matched whole, not by a prefix a user could type:
# a user message that merely starts with "[Summary" or with our marker is the user's, and stored.
_LOSSLESS_HEAD = re.compile(
    r"\[Summary sum_\d+ \| (?:leaf|condensed) depth \d+ \| \d+ messages msg_\d+\.\.msg_\d+"
    r" \| details: lcm_expand sum_\d+\]\n"
)


def _is_summary_text(text: str) -> bool:
    """Whether ``text`` starts with the head of a summary an engine rendered."""
    return text.startswith(SUMMARY_HEAD) or _LOSSLESS_HEAD.match(text) is not None


def is_context_message(message: dict[str, Any]) -> bool:
    """Whether a message is one the adapter produced (a summary block or its acknowledgement).

    Told by shape, not by a prefix: the block is the marker on a line of its own followed by a rendered
    summary head, the acknowledgement is exactly ``ACK_MESSAGE``. An assistant message that only starts
    with the acknowledgement is not ours: Hermes merges consecutive assistant messages, and a reply
    merged into it is the host's, to be stored. A message the user typed with our marker in front
    (pasted from a log, say) is the user's.
    """
    content = message.get("content")
    if message.get("_transcript_store_context"):
        return True
    if not isinstance(content, str):
        return False
    role = message.get("role")
    if role == "assistant":
        return content == ACK_MESSAGE
    if role != "user":
        return False
    head = CONTEXT_MARKER + "\n"
    if content.startswith(head):
        return _is_summary_text(content[len(head):])
    return _LOSSLESS_HEAD.match(content) is not None  # a lossless summary sent unmerged


def is_summary(message: dict[str, Any]) -> bool:
    """Whether a message is an engine's summary (lossless ``[Summary sum_N | ...]``, legacy ``[Summary of ...]``)."""
    content = message.get("content")
    return message.get("role") == "user" and isinstance(content, str) and _is_summary_text(content)


def merge_context(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading summary messages as ONE marked user message (plus an acknowledgement before a user turn).

    Hermes merges consecutive user messages before sending; one block keeps our answer byte-stable.
    """
    msgs = list(messages)
    n = 0
    while n < len(msgs) and is_summary(msgs[n]):
        n += 1
    if n == 0:
        return msgs
    text = "\n\n".join(str(m.get("content") or "") for m in msgs[:n])
    out = [{"role": "user", "content": f"{CONTEXT_MARKER}\n{text}"}]
    rest = msgs[n:]
    if not rest or rest[0].get("role") in ("user", "tool"):
        out.append({"role": "assistant", "content": ACK_MESSAGE})
    return out + rest


#: how hermes-agent's user-role scaffolding starts (as its ``_SYNTHETIC_USER_PREFIXES``, which tells human
#: intent from them the same way): its ``[System: ...]`` recovery notes, the todo snapshot it appends after
#: a compaction (its ``_todo_snapshot_synthetic`` flag is not saved: a list reloaded from the session
#: database has it bare) and a background process's notification, sent as a turn's user message
HOST_SCAFFOLDING = (
    "[System:",
    "[Your active task list was preserved across context compression]",
    "[IMPORTANT: Background process ",
)


def is_user_turn(message: dict[str, Any]) -> bool:
    """Whether a message is a turn the user typed: a user message with text that is neither ours nor
    Hermes' scaffolding (flagged ``_..._synthetic``, or starting as one of ``HOST_SCAFFOLDING``)."""
    if message.get("role") != "user" or is_context_message(message):
        return False
    if any(str(k).endswith("_synthetic") and v for k, v in message.items()):
        return False
    content = message.get("content")
    if isinstance(content, list):  # a multimodal turn: its text parts (an image alone is the user's too)
        texts = [str(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = "\n".join(texts) if texts else None
    return not (isinstance(content, str) and content.strip().startswith(HOST_SCAFFOLDING))


def fresh_tail(body: Sequence[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the current user message, the pending exchange): what ``compress`` keeps verbatim, whatever the budget.

    The current user message is the last turn the user typed; the pending exchange is what follows the
    last assistant message after it, that message included (a tool call and its results, which Hermes
    needs to continue the turn), or, before any reply, whatever follows the user message. Both are copies
    that keep Hermes' flags (``host_copy``); None / [] when the host's list has no such message.
    """
    at = next((i for i in range(len(body) - 1, -1, -1) if is_user_turn(body[i])), -1)
    last = next(
        (i for i in range(len(body) - 1, at, -1)
         if body[i].get("role") == "assistant" and not is_context_message(body[i])),
        at + 1,
    )
    pending = [host_copy(m) for m in body[last:] if not is_context_message(m)]
    return (host_copy(body[at]) if at >= 0 else None), pending


def with_fresh_tail(
    assembled: Sequence[dict[str, Any]], current: dict[str, Any] | None, pending: list[dict[str, Any]],
    cap: int | None = None,
) -> list[dict[str, Any]]:
    """The engine's context with the fresh tail verbatim: the answer's body (see ``fresh_tail``).

    The pending exchange ends the list (the engine's copies of it are dropped). The current user message
    stays where the engine kept it; summarised or cut away by the engine, it goes right after the
    summaries: an engine summarises and cuts oldest first, so what it kept raw came after it. ``cap``:
    the store's, with which a message the store refused as it is was stored in another form
    (``storable``), the engine's copy of it.
    """
    # By identity, not the exact JSON: the engine's copy is the form first stored, and Hermes may hold
    # the same message reloaded from its session database (a timestamp added, texts stripped); compared
    # whole, the current turn went in twice and moved (a review found it).
    def same(m: dict[str, Any]) -> str:
        return canonical(identity(clean(m)))

    def forms(m: dict[str, Any]) -> set[str]:
        # Both forms of a message stored in another one: the answer held its stored copy (the text of
        # its JSON, a cut tool result of megabytes) besides the message itself.
        if cap is None:
            return {same(m)}
        m = clean(m)
        return {same(m), same(storable(m, cap)[0]), same(storable(m, cap, keep_round=False)[0])}

    own = {f for m in pending for f in forms(m)}
    context = valid_sequence(copy.deepcopy(list(assembled)))
    while context and same(context[-1]) in own:  # the engine's copies are its newest messages
        context.pop()
    if current is not None and not forms(current) & {same(m) for m in context}:
        n = 0
        while n < len(context) and is_summary(context[n]):
            n += 1
        context.insert(n, copy.deepcopy(current))
    # One merge over the whole list: the acknowledgement goes in only before a user or tool message,
    # never before an assistant message Hermes would merge it with.
    return merge_context(context + copy.deepcopy(pending))


def is_valid_sequence(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether an OpenAI message list has every tool result right after its call and every call answered."""
    # The roles first: valid_sequence reads every item as a dict (an AttributeError on anything else).
    return all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool", "developer") for m in messages
    ) and list(messages) == valid_sequence(messages)
