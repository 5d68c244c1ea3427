"""Audio and file parts in the token estimate (review 3).

An ``input_audio`` part (base64 in ``data``) or a ``file`` part (base64 in ``file_data``) was counted as
the text of its base64: 1 MB of audio was ~300,000 tokens, so the turn carrying it was refused at the
default budget of 32,000 tokens, though a provider counts it at 10 tokens a second.
"""

from __future__ import annotations

import base64
import io
import os
import wave
from typing import Any

from test_compaction_tokens_review2 import Recording
from test_host import SCOPE

from transcript_store import TranscriptStore
from transcript_store.host import HostRuntime
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import (
    AUDIO_MIN_BYTES_PER_SECOND,
    AUDIO_TOKENS_PER_SECOND,
    FILE_BYTES_PER_PAGE,
    FILE_PAGE_TOKENS,
    RoughEstimator,
)


def wav(seconds: int, rate: int = 16_000) -> str:
    """Base64 of a mono 16-bit WAV of ``seconds`` of noise at ``rate`` Hz."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(os.urandom(2 * rate * seconds))
    return base64.b64encode(buffer.getvalue()).decode()


def audio(data: str, fmt: str = "wav") -> dict[str, Any]:
    """An ``input_audio`` part."""
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def pdf(pages: int, filler: int = 20_000) -> str:
    """A data URL of a PDF with ``pages`` plain page objects (each followed by ``filler`` bytes)."""
    body = b"".join(b"%d 0 obj\n<< /Type /Page /Parent 1 0 R >>\nendobj\n" % (i + 2) + os.urandom(filler)
                    for i in range(pages))
    raw = b"%%PDF-1.4\n1 0 obj\n<< /Type /Pages /Count %d >>\nendobj\n" % pages + body + b"%EOF\n"
    return "data:application/pdf;base64," + base64.b64encode(raw).decode()


def with_part(part: dict[str, Any]) -> list[dict[str, Any]]:
    """A user message asking about ``part``."""
    return [{"role": "user", "content": [{"type": "text", "text": "what is in this?"}, part]}]


def test_audio_counts_by_its_duration_never_its_base64() -> None:
    est = RoughEstimator()
    alone = est.count_messages([{"role": "user", "content": [{"type": "text", "text": "what is in this?"}]}])
    for seconds in (1, 30, 60):  # a WAV's header gives its byte rate: 32,000 bytes a second here
        counted = est.count_messages(with_part(audio(wav(seconds)))) - alone
        assert seconds * AUDIO_TOKENS_PER_SECOND <= counted <= seconds * AUDIO_TOKENS_PER_SECOND + 2
    # 1 MB of MP3 (no header read): at 32 kbit/s, the lowest common bitrate, ~250 s; its base64 was ~300,000.
    mp3 = base64.b64encode(b"ID3" + os.urandom(1_000_000)).decode()
    counted = est.count_messages(with_part(audio(mp3, "mp3"))) - alone
    assert counted == -(-1_000_003 * AUDIO_TOKENS_PER_SECOND // AUDIO_MIN_BYTES_PER_SECOND)
    assert est.count_text(mp3) > 100 * counted
    # A WAV header claiming a tiny byte rate does not make a clip count more than the floor gives.
    head = bytearray(base64.b64decode(wav(1)))
    head[28:32] = (10).to_bytes(4, "little")
    tiny = est.count_messages(with_part(audio(base64.b64encode(bytes(head)).decode()))) - alone
    assert tiny == -(-len(head) * AUDIO_TOKENS_PER_SECOND // AUDIO_MIN_BYTES_PER_SECOND)
    # No data, a part with no type but the key: counted the same way, never raising.
    assert est.count_messages(with_part({"type": "input_audio", "input_audio": {}})) == alone
    assert est.count_messages(with_part({"input_audio": {"data": wav(2)}})) - alone >= 2 * AUDIO_TOKENS_PER_SECOND


def test_a_file_counts_by_its_pages_never_its_base64() -> None:
    est = RoughEstimator()
    alone = est.count_messages([{"role": "user", "content": [{"type": "text", "text": "what is in this?"}]}])
    for pages in (1, 3, 12):
        part = {"type": "file", "file": {"file_data": pdf(pages), "filename": "scan.pdf"}}
        assert est.count_messages(with_part(part)) - alone == pages * FILE_PAGE_TOKENS
    # Pages that cannot be counted (compressed object streams, another format): one per 10,000 bytes.
    opaque = "data:application/pdf;base64," + base64.b64encode(os.urandom(95_000)).decode()
    part = {"type": "file", "file": {"file_data": opaque}}
    assert est.count_messages(with_part(part)) - alone == -(-95_000 // FILE_BYTES_PER_PAGE) * FILE_PAGE_TOKENS
    # A file the provider holds (by id): one page; a scanned 1 MB PDF of 4 pages, 4 pages, not its base64.
    assert est.count_messages(with_part({"type": "file", "file": {"file_id": "file-abc"}})) - alone == FILE_PAGE_TOKENS
    scanned = pdf(4, 250_000)
    counted = est.count_messages(with_part({"type": "file", "file": {"file_data": scanned}})) - alone
    assert counted == 4 * FILE_PAGE_TOKENS and est.count_text(scanned) > 30 * counted
    # Bad base64 is counted by its size, never an error.
    bad = {"type": "file", "file": {"file_data": "data:application/pdf;base64,@@@" + "A" * 40_001}}
    assert est.count_messages(with_part(bad)) - alone == 4 * FILE_PAGE_TOKENS  # 30,003 bytes


def test_a_turn_carrying_a_voice_note_and_a_scan_runs_at_the_default_budget(store: TranscriptStore) -> None:
    """1 MB of audio and a scanned PDF in one message: refused before (PromptTooLarge, ~700,000 tokens of
    base64 against 32,000); they commit, and the next turn's context still holds them."""
    sid = store.create_session(SCOPE, session_id="voice", session_key="agent:main:voice").session_id
    model = Recording()
    host = HostRuntime(store, load_settings(config_path=None, engine="legacy"), model, registry=EngineRegistry(),
                       summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())
    mp3 = base64.b64encode(b"ID3" + os.urandom(1_000_000)).decode()
    first = host.run_turn(SCOPE, sid, {"role": "user", "content": [
        {"type": "text", "text": "summarize the voice note and the scan"}, audio(mp3, "mp3"),
        {"type": "file", "file": {"file_data": pdf(3, 300_000), "filename": "scan.pdf"}}]}, turn_id="t1")
    assert first.commit_status == "committed", first
    second = host.run_turn(SCOPE, sid, "and what was the date on the scan?", turn_id="t2")
    assert second.commit_status == "committed", second
    sent = model.requests[-1]
    assert any(isinstance(m.get("content"), list) for m in sent), "the voice note left the context"
    host.dispose()
