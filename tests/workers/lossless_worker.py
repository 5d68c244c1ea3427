"""Shared pieces of the lossless tests, and a real worker process for the compaction crash test.

- ``ConversationModel``: a seeded, scripted model. For a user message it either answers (with a fresh
  unique token) or calls the ``fetch_doc`` host tool, whose long result carries its own unique token;
  after a tool result it answers. Same request, same reply (a retried turn gets the same answer).
- ``make_host``: a HostRuntime on the lossless engine, discovered from engines/lossless/plugin.yaml.
- ``python tests/workers/lossless_worker.py churn --url URL --session S --seed N``: commits turns and
  forces compactions in a loop until it is killed (by the parent, or by a fault point chosen with
  TRANSCRIPT_STORE_FAULTS in the middle of a compaction's transaction). Prints ``ready`` first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from collections.abc import Sequence
from typing import Any

from engines.lossless import LosslessEngine
from transcript_store import StoreConfig, TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.host import HostRuntime, HostTool
from transcript_store.model import ModelResponse
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

SCOPE = "lcm-scope"
TOKEN = re.compile(r"zz[0-9a-f]{10}")
WORDS = ("alpha", "budget", "cache", "delta", "engine", "fence", "graph", "harbor", "index", "journal", "kernel")
CJK = ("会议记录", "北京开会", "東京の天気", "서울 날씨", "数据库迁移", "上下文压缩")


def token(seed: object) -> str:
    """A unique-looking token derived from ``seed`` (searchable as one word on every backend)."""
    return "zz" + hashlib.sha256(str(seed).encode()).hexdigest()[:10]


def filler(rng: random.Random, words: int) -> str:
    """Deterministic prose."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def fetch_doc(args: dict[str, Any]) -> str:
    """The host tool: a long document for ``doc``, with a token of its own."""
    doc = str(args.get("doc", ""))
    rng = random.Random(doc)
    body = "\n".join(f"line {i}: {filler(rng, 12)}" for i in range(rng.randint(8, 40)))
    return f"Document {doc} (result {token(('result', args.get('nonce')))})\n{body}"


FETCH_DOC: HostTool = (
    {
        "type": "function",
        "function": {
            "name": "fetch_doc",
            "description": "Fetch a document by id.",
            "parameters": {
                "type": "object",
                "properties": {"doc": {"type": "string"}, "nonce": {"type": "string"}},
                "required": ["doc"],
            },
        },
    },
    fetch_doc,
)


class ConversationModel:
    """The scripted stand-in model of the synthetic conversation (see module doc)."""

    name = "scripted-conversation-model"

    def __init__(self, seed: int, tool_rate: float = 0.35) -> None:
        self.seed, self.tool_rate = seed, tool_rate
        self.calls = 0

    def complete(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        max_tokens: int | None = None,
        timeout: float | None = None,
    ) -> ModelResponse:
        self.calls += 1
        last = messages[-1]
        rng = random.Random(f"{self.seed}:{json.dumps(last, sort_keys=True)}")
        names = {t["function"]["name"] for t in tools or []}
        if last["role"] == "user" and "fetch_doc" in names and rng.random() < self.tool_rate:
            args = {"doc": token(("doc", rng.random())), "nonce": token(("nonce", rng.random()))}
            call = {"id": f"call_{token(rng.random())[2:]}", "type": "function",
                    "function": {"name": "fetch_doc", "arguments": json.dumps(args)}}
            msg: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif last["role"] == "tool":
            lines = str(last["content"]).splitlines()
            quote = lines[1][:50] if len(lines) > 1 else ""
            msg = {"role": "assistant", "content": f"The document says {quote!r}. Noted as {token(rng.random())}."}
        else:
            msg = {"role": "assistant", "content": f"Answer {token(rng.random())}: {filler(rng, rng.randint(5, 60))}"}
        return ModelResponse(message=msg, usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                             model=self.name)


def user_text(rng: random.Random, n: int) -> str:
    """The user message of turn ``n``: a unique token, sometimes CJK, sometimes long."""
    parts = [f"turn {n}: look at {rng.choice(WORDS)} {token(('user', n, rng.random()))}"]
    if rng.random() < 0.2:
        parts.append(rng.choice(CJK))
    parts.append(filler(rng, rng.choice((3, 10, 40, 120))))
    return " ".join(parts)


def make_host(
    store: TranscriptStore, *, seed: int, token_budget: int, config: dict[str, Any] | None = None,
    engine: str = "lossless", **settings: Any
) -> tuple[HostRuntime, ConversationModel]:
    """A HostRuntime whose slot is a bundled engine (lossless unless ``engine`` names another)."""
    model = ConversationModel(seed)
    host = HostRuntime(
        store,
        load_settings(
            config_path=None, engine=engine, token_budget=token_budget,
            engine_config={"lossless": config or {}}, **settings,
        ),
        model,
        registry=EngineRegistry(),
        summarizer=ExtractiveSummarizer(),
        estimator=RoughEstimator(),
        host_tools={"fetch_doc": FETCH_DOC},
    )
    return host, model


CHURN_CONFIG = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "max_rounds": 3, "leaf_summary_tokens": 120,
                "condensed_summary_tokens": 160, "condense_fanin": 3}


def commit_one_turn(store: TranscriptStore, engine: LosslessEngine, session_id: str, turn_id: str,
                    rng: random.Random) -> None:
    """Admit a user message, append a reply, and commit the turn to the engine (no outbox: the ledger only)."""
    question = {"role": "user", "content": user_text(rng, len(turn_id))}
    admission = store.admit(SCOPE, session_id, question, turn_id=turn_id)
    replies = [{"role": "assistant", "content": f"reply {token((turn_id, rng.random()))} " + filler(rng, 30)}]
    appended = store.append_many(SCOPE, session_id, [{"message": m} for m in replies])
    terminal = store.anchor(SCOPE, session_id, appended[-1].entry_id)
    store.write(
        lambda c: engine.commit_turn(
            tx=c, advancement_key=turn_id, admission=admission.anchor, terminal=terminal, messages=[question, *replies]
        )
    )


def churn_engine(store: TranscriptStore) -> LosslessEngine:
    """The engine of the crash test (small chunks: many compactions)."""
    return LosslessEngine(EngineContext(store=store, config=CHURN_CONFIG, summarizer=ExtractiveSummarizer(),
                                        estimator=RoughEstimator()))


def churn(url: str, session_id: str, seed: int, budget: int) -> None:
    """Commit turns and force compactions until killed."""
    store = TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))
    engine = churn_engine(store)
    rng = random.Random(seed)
    print("ready", flush=True)
    for i in range(100_000):
        if rng.random() < 0.4:
            commit_one_turn(store, engine, session_id, f"k{seed}-{i}", rng)
            print(json.dumps({"turn": i}), flush=True)
        else:
            result = engine.compact(scope=SCOPE, session_id=session_id, force=True, token_budget=budget)
            print(json.dumps({"compacted": result.compacted, "ok": result.ok}), flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["churn"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=1200)
    args = parser.parse_args(argv)
    churn(args.url, args.session, args.seed, args.budget)


if __name__ == "__main__":
    main(sys.argv[1:])
