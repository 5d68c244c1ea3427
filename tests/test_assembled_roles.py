"""The service's and the Hermes adapter's own assemble paths check that an engine's assembled messages have
a chat role, as the host does (``host._assembled``): one without was handed on to a model's provider."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from transcript_store import TranscriptStore
from transcript_store.engine import AssembleResult, EngineInfo
from transcript_store.errors import EngineContractError
from transcript_store.hermes import create_engine
from transcript_store.service import Service
from transcript_store.service_models import AssembleRequest
from transcript_store.settings import load_settings

ROLELESS_ENGINE = """
from engines.legacy import LegacyEngine


class Roleless(LegacyEngine):
    info = LegacyEngine.info.model_copy(update={"id": "roleless", "name": "roleless"})

    def assemble(self, **kw):
        result = super().assemble(**kw)
        return result.model_copy(update={"messages": [{"foo": 1}, *result.messages]})


def create_engine(ctx):
    return Roleless(ctx)
"""


@pytest.mark.parametrize("bad", [{"foo": 1}, {"role": "wizard", "content": "x"}])
def test_the_service_refuses_an_assembly_with_a_message_without_a_chat_role(
    store: TranscriptStore, bad: dict[str, Any]
) -> None:
    class Bad:
        info = EngineInfo(id="bad", name="Bad")

        def assemble(self, **kw: Any) -> AssembleResult:
            return AssembleResult(messages=[{"role": "user", "content": "hi"}, bad], estimated_tokens=2)

    service = Service(store, load_settings(config_path=None))
    assert service.runtime.registry is not None
    service.runtime.registry.register_factory("bad", lambda ctx: Bad())
    sid = store.create_session("scope-a").session_id
    with pytest.raises(EngineContractError, match="without a chat role"):
        service.assemble("scope-a", "bad", sid, AssembleRequest())


def test_the_hermes_adapter_leaves_the_conversation_alone_when_the_engine_assembles_no_chat_role(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "my-engines" / "roleless"
    folder.mkdir(parents=True)
    (folder / "plugin.yaml").write_text("name: roleless\nversion: 1.0\nentry: create_engine\n")
    (folder / "__init__.py").write_text(ROLELESS_ENGINE)
    engine = create_engine(allow_stand_in=True, db_url=f"sqlite:///{tmp_path / 'store.db'}", context_length=64000,
                           threshold_percent=2000, engine="roleless", plugin_dirs=[str(tmp_path / "my-engines")])
    try:
        engine.on_session_start("s1")
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are careful."}]
        for i in range(30):
            messages += [{"role": "user", "content": f"question {i} " + "lorem ipsum " * 60},
                         {"role": "assistant", "content": f"answer {i} " + "dolor sit " * 40}]
        messages.append({"role": "user", "content": "and now?"})
        out = engine.compress(list(messages), current_tokens=10**6)
        assert all("role" in m for m in out)
        assert out == messages and engine.compression_count == 0  # left uncompressed, as any failed assembly
        assert "without a chat role" in caplog.text
    finally:
        engine.close()
