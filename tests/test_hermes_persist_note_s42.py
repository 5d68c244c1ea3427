"""``spelling.noted``: a user message Hermes sent with a note before it (``persist_user_message``) is the same
message as its clean text, and nothing else is."""

from __future__ import annotations

import pytest

from transcript_store.hermes.spelling import noted, spelled

CLEAN = {"role": "user", "content": "please fix the build"}


@pytest.mark.parametrize("note", [
    "[Thu 2026-05-28 20:26:40 UTC] ",
    "[System note: A new message has arrived. Address it FIRST.]\n\n",
    "[Voice input — respond concisely and conversationally, 2-3 sentences max. No code blocks or markdown.] ",
    "[USER INITIATED SKILLS RELOAD:\n\nAdded Skills:\n  - x\n\nUse skills_list to see the updated catalog.]\n\n",
])
def test_the_text_sent_with_a_note_is_the_clean_message(note: str) -> None:
    sent = {**CLEAN, "content": note + CLEAN["content"]}
    assert noted(sent, CLEAN) and spelled(sent, CLEAN)


@pytest.mark.parametrize("live, saved", [
    ({"role": "user", "content": "could you please fix the build"}, CLEAN),  # a shorter edit: no note
    ({"role": "user", "content": "[note]please fix the build"}, CLEAN),  # no whitespace before the text
    ({"role": "assistant", "content": "[x] please fix the build"}, {**CLEAN, "role": "assistant"}),
    ({"role": "user", "content": "[x] "}, {"role": "user", "content": " "}),
    ({"role": "user", "content": "[x] please fix the build"}, {**CLEAN, "name": "other"}),
    (CLEAN, {"role": "user", "content": "[x] please fix the build"}),  # the other way round
])
def test_anything_else_is_not_the_same_message(live: dict[str, str], saved: dict[str, str]) -> None:
    assert not noted(live, saved)
