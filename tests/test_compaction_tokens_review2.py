"""Token counting, compaction and summarizing as a demanding user meets them (review 2), over both backends.

An image a user sends inline (a ``data:`` URL, as every chat client sends a pasted screenshot) was counted
as the text of its base64: a 100 KB picture was ~40,000 tokens, more than the default budget, so the turn
that carried it was refused (PromptTooLarge) and any context holding it lost everything older. A provider
counts an image by its tiles (at most 1,445 tokens at ``high`` detail, 85 at ``low``).
"""

from __future__ import annotations

import base64
import os
from typing import Any

from test_host import SCOPE

from transcript_store import TranscriptStore
from transcript_store.host import HostRuntime
from transcript_store.model import LocalResponder
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator


def picture(size: int = 100_000, detail: str | None = None) -> dict[str, Any]:
    """An ``image_url`` part holding ``size`` bytes of a PNG as a data URL."""
    data = base64.b64encode(b"\x89PNG\r\n\x1a\n" + os.urandom(size)).decode()
    image: dict[str, Any] = {"url": f"data:image/png;base64,{data}"}
    if detail is not None:
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def test_an_inline_image_counts_as_an_image_not_as_its_base64() -> None:
    from transcript_store.tokens import IMAGE_TOKENS, IMAGE_TOKENS_LOW

    est = RoughEstimator()
    text = {"type": "text", "text": "what is in this picture?"}
    alone = est.count_messages([{"role": "user", "content": [text]}])
    for detail, cost in ((None, IMAGE_TOKENS), ("auto", IMAGE_TOKENS), ("high", IMAGE_TOKENS),
                         ("low", IMAGE_TOKENS_LOW)):
        small = est.count_messages([{"role": "user", "content": [text, picture(100, detail)]}])
        large = est.count_messages([{"role": "user", "content": [text, picture(400_000, detail)]}])
        assert small == large == alone + cost
    assert IMAGE_TOKENS_LOW == 85 and IMAGE_TOKENS == 85 + 8 * 170  # OpenAI's tile formula, its largest
    # Two images cost twice; a URL image the same as an inline one.
    two = est.count_messages([{"role": "user", "content": [text, picture(10), picture(10_000)]}])
    assert two == alone + 2 * IMAGE_TOKENS
    url = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    assert est.count_messages([{"role": "user", "content": [text, url]}]) == alone + IMAGE_TOKENS


class Recording(LocalResponder):
    """The local responder (it answers from a message's text parts), its requests kept."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[list[dict[str, Any]]] = []

    def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
        self.requests.append([dict(m) for m in messages])
        return super().complete(messages, tools, **kw)


def test_a_turn_carrying_a_screenshot_runs_at_the_default_budget(store: TranscriptStore) -> None:
    sid = store.create_session(SCOPE, session_id="shot", session_key="agent:main:shot").session_id
    model = Recording()
    host = HostRuntime(store, load_settings(config_path=None, engine="legacy"), model, registry=EngineRegistry(),
                       summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())
    first = host.run_turn(SCOPE, sid, {"role": "user", "content": [
        {"type": "text", "text": "what does this error dialog say?"}, picture(120_000)]}, turn_id="t1")
    assert first.commit_status == "committed"
    # The next turn's context still holds the picture and the question (it fits the budget by far).
    second = host.run_turn(SCOPE, sid, "and how do I fix it?", turn_id="t2")
    assert second.commit_status == "committed"
    sent = model.requests[-1]
    assert any(isinstance(m.get("content"), list) for m in sent), "the image message left the context"
    host.dispose()
