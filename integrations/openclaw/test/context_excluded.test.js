// Messages OpenClaw keeps out of the model's context (`excludeFromContext` on a message entry), against a
// real `transcript-store serve` (SQLite in a temporary directory) and a scripted OpenClaw host transcript.
// OpenClaw 2026.9.6 writes them for a context-free command (the user's command and the gateway's reply,
// `chat-send-handler` and `chat-transcript-persistence`) and for a hidden talk-consult run (its prompt,
// `display: false` too): its visible messages (readSessionTranscriptVisibleMessageDelta) and a turn's closed
// range (commitTurn's `messages`) hold them, its own context (buildSessionContext) skips them.
import assert from "node:assert/strict";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { createEngine } from "../src/engine.js";
import { contentText } from "../src/messages.js";
import { assistantMessage, userMessage } from "../testing/messages.js";
import { startService } from "../testing/service.js";

const TOKEN = "tok-excluded-0123456789";

let service;

before(async () => {
  service = await startService({ token: TOKEN, dir: mkdtempSync(join(tmpdir(), "ts-openclaw-excluded-")) });
});

after(async () => { await service?.stop(); });

/** A host transcript read as readSessionTranscriptVisibleMessageDelta reads it (no fence, one generation). */
function hostSession(sessionId) {
  const entries = [];
  const host = {
    sessionId,
    sessionKey: `agent:main:${sessionId}`,
    target: () => ({ agentId: "main", sessionId, sessionKey: host.sessionKey, storePath: "/host/sessions" }),
    params: () => ({ sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() }),
    /** What OpenClaw's own context holds: every message but those it excludes from it. */
    context: () => entries.map((entry) => entry.message).filter((message) => message.excludeFromContext !== true),
    append(messages) {
      const start = entries.length;
      const added = messages.map((message, i) => ({ entryId: `${sessionId}-e${start + i}`, message }));
      entries.push(...added);
      return { added, start };
    },
    /** Append a turn's messages; the commitTurn params of that turn. */
    turn(key, messages) {
      const { added, start } = host.append(messages);
      return {
        advancementKey: key, sessionId, sessionKey: host.sessionKey, isHeartbeat: false, sessionTarget: host.target(),
        admission: { entryId: added[0].entryId, activeMessagePosition: start },
        terminal: { entryId: added.at(-1).entryId, activeMessagePosition: start + added.length - 1 },
        messages,
      };
    },
    sdk: {
      readSessionTranscriptVisibleMessageDelta: async ({ cursor, maxMessages }) => {
        const start = cursor === undefined ? 0 : Number(cursor);
        const page = entries.slice(start, start + maxMessages);
        const end = start + page.length;
        return { kind: "page", cursor: String(end), hasMore: end < entries.length, entries: page };
      },
    },
  };
  return host;
}

// A context-free command (`/status`) as OpenClaw 2026.9.6 writes it: the user's command and the gateway's
// reply, both excluded from the model's context.
const contextFree = (message) => ({ ...message, excludeFromContext: true, __openclaw: { contextFreeCommand: true } });

for (const engineId of ["legacy", "lossless"]) {
  test(`messages OpenClaw excludes from the model's context are mirrored, never assembled (${engineId})`, async () => {
    const host = hostSession(`s-excluded-${engineId}`);
    const engine = await createEngine({ serviceUrl: service.url, token: TOKEN, engine: engineId, sdk: host.sdk });
    await engine.bootstrap(host.params());
    assert.deepEqual(await engine.commitTurn(host.turn("k0", [userMessage("question 0", 10), assistantMessage("answer 0", 11)])),
      { status: "committed" });
    // Between turns: a context-free command, which no turn commits (the next bootstrap imports it).
    host.append([contextFree(userMessage("/status", 12)),
      contextFree(assistantMessage(`status: ${"all systems nominal ".repeat(200)}`, 13))]);
    await engine.bootstrap(host.params());
    // A hidden run (a talk consult): its prompt hidden from the user and excluded from the model's context.
    const consult = { ...userMessage(`consult prompt ${"hidden instructions ".repeat(200)}`, 14), display: false, excludeFromContext: true };
    assert.deepEqual(await engine.commitTurn(host.turn("k1", [consult, assistantMessage("consult answer", 15)])),
      { status: "committed" });
    assert.deepEqual(await engine.commitTurn(host.turn("k2", [userMessage("question 2", 16), assistantMessage("answer 2", 17)])),
      { status: "committed" });

    // The mirror holds every host message where the host has it.
    assert.equal((await service.get(`/v1/sessions/${host.sessionId}`)).visible_count, 8);
    const assembled = await engine.assemble({ ...host.params(), messages: host.context() });
    assert.deepEqual(assembled.messages.map((m) => contentText(m.content)), host.context().map((m) => contentText(m.content)));
    assert.ok(assembled.messages.every((m) => m.excludeFromContext !== true));
    // Their tokens are not counted either, by the service's engine itself (they took the budget of the
    // messages shown): its answer holds none of them and its estimate is the plugin's.
    const whole = await service.post(`/v1/engines/${engineId}/sessions/${host.sessionId}/assemble`, { token_budget: null });
    assert.ok(Number.isFinite(whole.estimated_tokens), JSON.stringify(whole).slice(0, 500));
    assert.equal(whole.messages.length, host.context().length);
    assert.ok(whole.messages.every((m) => !JSON.stringify(m).includes("excludeFromContext")));
    assert.equal(assembled.estimatedTokens, whole.estimated_tokens);
  });
}
