"""Anthropic and Responses API media parts in the token estimate (review 4).

Anthropic's ``image`` and ``document`` parts (base64 in ``source.data``), the Responses API's
``input_file`` (base64 in ``file_data``) and images inside a ``tool_result``'s ``content`` were counted as
the text of their base64: a 300 KB screenshot ~100,000 tokens, a 1 MB scanned PDF ~350,000, so the turn
carrying one was refused (PromptTooLarge) at the default budget of 32,000 tokens.
"""

from __future__ import annotations

import base64
import os
from typing import Any

from test_compaction_tokens_review2 import Recording
from test_host import SCOPE
from test_tokens_media_review3 import pdf, with_part

from transcript_store import TranscriptStore
from transcript_store.host import HostRuntime
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import FILE_PAGE_TOKENS, IMAGE_TOKENS, IMAGE_TOKENS_LOW, RoughEstimator

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + os.urandom(300_000)).decode()


def image(data: str = PNG) -> dict[str, Any]:
    """An Anthropic ``image`` part with a base64 source."""
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def document(pages: int, filler: int = 20_000) -> dict[str, Any]:
    """An Anthropic ``document`` part: a PDF of ``pages`` pages as a base64 source (no ``data:`` prefix)."""
    data = pdf(pages, filler).partition(",")[2]
    return {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": data}}


def alone() -> int:
    """The count of the message ``with_part`` builds, without its part."""
    question = {"role": "user", "content": [{"type": "text", "text": "what is in this?"}]}
    return RoughEstimator().count_messages([question])


def counted(part: dict[str, Any]) -> int:
    """What ``part`` adds to a user message's count."""
    return RoughEstimator().count_messages(with_part(part)) - alone()


def test_anthropic_images_and_documents_count_as_images_and_pages_never_their_base64() -> None:
    assert counted(image()) == IMAGE_TOKENS
    assert counted({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}) == IMAGE_TOKENS
    for pages in (1, 3, 12):
        assert counted(document(pages)) == pages * FILE_PAGE_TOKENS
    assert counted(document(4, 250_000)) == 4 * FILE_PAGE_TOKENS  # a 1 MB scan: ~350,000 tokens of base64
    # A document by URL or by file id: one page; a plain-text document: its text, not a page.
    by_url = {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}}
    assert counted(by_url) == FILE_PAGE_TOKENS
    text = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "short note"}}
    assert 0 < counted(text) < 50


def test_responses_api_parts_count_as_images_and_pages() -> None:
    assert counted({"type": "input_image", "image_url": "data:image/png;base64," + PNG}) == IMAGE_TOKENS
    assert counted({"type": "input_image", "file_id": "file-abc", "detail": "low"}) == IMAGE_TOKENS_LOW
    assert counted({"type": "input_file", "file_data": pdf(3), "filename": "scan.pdf"}) == 3 * FILE_PAGE_TOKENS
    assert counted({"type": "input_file", "file_id": "file-abc"}) == FILE_PAGE_TOKENS


def test_images_inside_a_tool_result_count_as_images() -> None:
    """A tool result carrying a screenshot (Anthropic's ``tool_result`` parts, a document of parts): the
    screenshot is an image, its text is text, the rest of the part its JSON."""
    result = {"type": "tool_result", "tool_use_id": "toolu_1",
              "content": [{"type": "text", "text": "the screen now:"}, image()]}
    assert IMAGE_TOKENS < counted(result) < IMAGE_TOKENS + 40
    nested = {"type": "document", "source": {"type": "content", "content": [image(), {"type": "text", "text": "p. 2"}]}}
    assert IMAGE_TOKENS < counted(nested) < IMAGE_TOKENS + 40
    # An OpenAI tool message of parts: the same.
    est = RoughEstimator()
    shot = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}
    message = {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "ok"}, shot]}
    assert est.count_messages([message]) < IMAGE_TOKENS + 40


def test_a_turn_carrying_an_anthropic_screenshot_and_scan_runs_at_the_default_budget(store: TranscriptStore) -> None:
    """A 300 KB screenshot and a 1 MB scan as Anthropic parts: refused before (PromptTooLarge, ~450,000
    tokens of base64 against 32,000); they commit, and the next turn's context still holds them."""
    sid = store.create_session(SCOPE, session_id="anthropic", session_key="agent:main:anthropic").session_id
    model = Recording()
    host = HostRuntime(store, load_settings(config_path=None, engine="legacy"), model, registry=EngineRegistry(),
                       summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())
    first = host.run_turn(SCOPE, sid, {"role": "user", "content": [
        {"type": "text", "text": "compare the screenshot with the scan"}, image(), document(4, 250_000)]},
        turn_id="t1")
    assert first.commit_status == "committed", first
    second = host.run_turn(SCOPE, sid, "and which page differs?", turn_id="t2")
    assert second.commit_status == "committed", second
    assert any(isinstance(m.get("content"), list) for m in model.requests[-1]), "the parts left the context"
    host.dispose()
