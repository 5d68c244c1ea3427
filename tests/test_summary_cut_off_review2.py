"""A summary the OpenAI-compatible model cut off at its token limit (``finish_reason: "length"``) is kept,
marked as cut and logged; it was accepted silently, its missing end unseen. The endpoint is the local fake
(tests/fake_openai.py), whose responder cuts an answer at max_tokens as a provider does."""

from __future__ import annotations

from typing import Any

import pytest
from fake_openai import FakeOpenAI

from transcript_store.summarize import CUT_OFF_MARK, OpenAISummarizer


@pytest.fixture
def fake() -> Any:
    with FakeOpenAI() as server:
        yield server


def test_a_summary_the_model_cut_off_is_kept_and_marked(fake: FakeOpenAI, caplog: pytest.LogCaptureFixture) -> None:
    """The fake answers with the local responder, which cuts its answer at max_tokens with
    finish_reason "length", as a provider does."""
    summ = OpenAISummarizer(fake.base_url, "fake-model", timeout=5.0)
    messages = [{"role": "user", "content": "tell me about the deployment " * 20}]
    whole = summ.summarize(messages, max_tokens=1024)
    assert CUT_OFF_MARK not in whole
    with caplog.at_level("WARNING", logger="transcript_store.summarize"):
        cut = summ.summarize(messages, max_tokens=16)
    assert cut.endswith("\n" + CUT_OFF_MARK) and cut.removesuffix("\n" + CUT_OFF_MARK)
    assert any("cut off" in r.getMessage() for r in caplog.records)
