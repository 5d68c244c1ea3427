"""The seeded workload: turns of four OpenAI-format messages, 200-2000 characters of text each.

A turn is a user message, an assistant message calling the ``lookup`` tool, the tool's result and the
final assistant answer. Text is cut from one seeded corpus of words at seeded offsets, so generating
100,000 messages costs a fraction of a second and every run (and every process) sees the same bytes.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

TOOL_NAME = "lookup"
MIN_CHARS, MAX_CHARS = 200, 2000

_WORDS = (  # noqa: SIM905 (a sentence reads better than a column of strings)
    "the store session entry anchor fence cursor page reset receipt outbox engine turn admission "
    "visible branch generation commit ledger transaction index durable append read write a an of to "
    "in for with on by at from is are was were be been this that these those it its we you they model "
    "tool result answer question context summary message user assistant system token budget latency "
    "replica postgres sqlite disk page cache lock retry worker process thread queue order key hash "
    "payload"
).split()


def _corpus(seed: int, chars: int = 1 << 20) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars + MAX_CHARS:
        word = rng.choice(_WORDS)
        if rng.random() < 0.05:
            word = f"{word}{rng.randrange(10_000)}."
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


@dataclass(frozen=True)
class Turn:
    """The four messages of one turn; ``tool_result`` is what the host's tool returns."""

    user: dict[str, Any]
    call: dict[str, Any]
    tool: dict[str, Any]
    final: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, Any]]:
        """user, assistant tool call, tool result, final assistant."""
        return [self.user, self.call, self.tool, self.final]

    @property
    def replies(self) -> list[dict[str, Any]]:
        """What the model and the tool add after the admitted user message."""
        return [self.call, self.tool, self.final]


class Workload:
    """A seeded stream of turns."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._rng = random.Random(seed)
        self._text = _corpus(seed)
        self._count = 0

    def text(self) -> str:
        """200-2000 characters of words, at a seeded offset of the corpus."""
        n = self._rng.randint(MIN_CHARS, MAX_CHARS)
        at = self._rng.randrange(len(self._text) - n)
        return self._text[at : at + n]

    def turn(self) -> Turn:
        """The next turn of the stream."""
        self._count += 1
        call_id = f"call_{self.seed}_{self._count}"
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"query": self.text()})},
        }
        return Turn(
            user={"role": "user", "content": self.text()},
            call={"role": "assistant", "content": None, "tool_calls": [call]},
            tool={"role": "tool", "tool_call_id": call_id, "content": self.text()},
            final={"role": "assistant", "content": self.text()},
        )

    def messages(self, count: int) -> list[dict[str, Any]]:
        """``count`` messages as a transcript: whole turns, the last one cut short if needed."""
        out: list[dict[str, Any]] = []
        while len(out) < count:
            out.extend(self.turn().messages)
        return out[:count]


def serialize(message: dict[str, Any]) -> str:
    """The JSON text both the store and the raw baseline keep for one message."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))
