// Unit tests of the plugin with a scripted service (no OpenClaw, no network): `node --test test/`.
import assert from "node:assert/strict";
import { test } from "node:test";

import { createEngine, PLUGIN_ID } from "../src/engine.js";
import { fromStored, ORIGINAL, toStored } from "../src/messages.js";
import plugin from "../index.js";

const user = { role: "user", content: "hello", timestamp: 1 };
const reply = {
  role: "assistant",
  content: [{ type: "text", text: "hi" }, { type: "toolCall", id: "c1", name: "lookup", arguments: { q: "x" } }],
  api: "openai-completions", provider: "fake", model: "m", usage: {}, stopReason: "toolUse", timestamp: 2,
};
const result = { role: "toolResult", toolCallId: "c1", toolName: "lookup", content: [{ type: "text", text: "found" }],
  isError: false, timestamp: 3 };

function service(routes) {
  const calls = [];
  const fetchImpl = async (url, init) => {
    const path = new URL(url).pathname;
    const body = init.body ? JSON.parse(init.body) : undefined;
    calls.push({ method: init.method, path, body, auth: init.headers.authorization });
    const key = `${init.method} ${path.replace(/\/sessions\/[^/]+/, "/sessions/:sid").replace(/\/engines\/[^/]+/, "/engines/:e")}`;
    const handler = routes[key];
    if (!handler) return new Response(JSON.stringify({ error: { code: "not_found", message: key } }), { status: 404 });
    const [status, answer] = handler(body, calls);
    return new Response(JSON.stringify(answer), { status });
  };
  return { calls, fetchImpl };
}

const describe = () => [200, { id: "lossless", durable: true, info: { owns_compaction: true, turn_maintenance_mode: "background" } }];
const opened = () => [200, {}];

test("messages keep the host's own form and a faithful OpenAI projection", () => {
  const stored = [user, reply, result].map(toStored);
  assert.deepEqual(stored.map((m) => m.role), ["user", "assistant", "tool"]);
  assert.equal(stored[0].content, "hello");
  assert.deepEqual(stored[1].tool_calls, [{ id: "c1", type: "function", function: { name: "lookup", arguments: '{"q":"x"}' } }]);
  assert.equal(stored[2].tool_call_id, "c1");
  assert.deepEqual(stored.map(fromStored), [user, reply, result]);
  assert.deepEqual(toStored(reply), toStored(JSON.parse(JSON.stringify(reply)))); // deterministic
  const summary = fromStored({ role: "user", content: "[Summary] earlier" });
  assert.equal(summary.role, "user");
  assert.equal(summary.content[0].text, "[Summary] earlier");
  assert.equal(ORIGINAL, "openclaw");
});

test("register() registers the engine under the plugin id", () => {
  const registered = [];
  plugin.register({ pluginConfig: { serviceUrl: "http://127.0.0.1:1", token: "t" }, registerContextEngine: (id, f) => registered.push([id, f]) });
  assert.equal(registered.length, 1);
  assert.equal(registered[0][0], PLUGIN_ID);
});

test("commitTurn forwards the turn and returns the service's status", async () => {
  const { calls, fetchImpl } = service({
    "GET /v1/engines/:e": describe,
    "POST /v1/sessions": opened,
    "POST /v1/engines/:e/sessions/:sid/commit_turn": (body, all) =>
      [200, { status: all.filter((c) => c.path.endsWith("commit_turn")).length === 1 ? "committed" : "duplicate" }],
  });
  const engine = await createEngine({ serviceUrl: "http://svc", token: "tok", engine: "lossless", fetchImpl, sdk: {} });
  assert.deepEqual(engine.info.transcriptSemantics, {
    currentTurnFence: "before-current-turn-entry-v1", turnAdvancementIdempotency: "atomic-idempotent-v1" });
  assert.equal(engine.info.ownsCompaction, true);
  const params = {
    advancementKey: "k1", sessionId: "s1", sessionKey: "agent:main:main", isHeartbeat: false,
    sessionTarget: { agentId: "main", sessionId: "s1", sessionKey: "agent:main:main" },
    admission: { entryId: "u1", activeMessagePosition: 4 }, terminal: { entryId: "a1", activeMessagePosition: 6 },
    messages: [user, reply, result],
  };
  assert.deepEqual(await engine.commitTurn(params), { status: "committed" });
  assert.deepEqual(await engine.commitTurn(params), { status: "duplicate" });
  const commit = calls.find((c) => c.path.endsWith("commit_turn"));
  assert.equal(commit.auth, "Bearer tok");
  assert.deepEqual(commit.body.admission, { entry_id: "u1", position: 4 });
  assert.deepEqual(commit.body.terminal, { entry_id: "a1", position: 6 });
  assert.equal(commit.body.messages.length, 3);
  assert.equal(commit.body.session_target.session_id, "s1");
  assert.equal(calls.filter((c) => c.path === "/v1/sessions").length, 1); // the session is opened once
});

// The service's mirror of one session, scripted: each imported page moves its import resume point.
function mirrorRoutes(visibleCount) {
  const mirror = { state: { cursor: null, position: 0, visible_count: 0 } };
  mirror.routes = {
    "GET /v1/engines/:e": describe,
    "POST /v1/sessions": opened,
    "GET /v1/engines/:e/sessions/:sid/bootstrap": () => [200, mirror.state],
    "POST /v1/engines/:e/sessions/:sid/bootstrap": (body) => {
      const position = mirror.state.position + body.page.entries.length;
      mirror.state = { cursor: body.page.next_cursor, position, visible_count: visibleCount };
      return [200, { imported: body.page.entries.length, matched: 0, rewound: false, ...mirror.state }];
    },
  };
  return mirror;
}

test("a commit behind the mirror imports the host transcript up to the turn, then commits", async () => {
  let committed = false;
  const mirror = mirrorRoutes(2);
  const { calls, fetchImpl } = service({
    ...mirror.routes,
    "POST /v1/engines/:e/sessions/:sid/commit_turn": () => {
      if (!committed && mirror.state.position < 2) return [409, { error: { code: "transcript_mirror", message: "behind", reason: "behind" } }];
      committed = true;
      return [200, { status: "committed" }];
    },
  });
  const reads = [];
  const sdk = {
    readSessionTranscriptVisibleMessageDelta: async (args) => {
      reads.push(args);
      if (args.cursor === undefined) return { kind: "reset", cursor: "fresh", reason: "generation_mismatch" };
      return { kind: "page", cursor: "after-2", hasMore: true, entries: [
        { entryId: "h0", message: user }, { entryId: "h1", message: reply }].slice(0, args.maxMessages) };
    },
  };
  const engine = await createEngine({ serviceUrl: "http://svc", token: "tok", fetchImpl, sdk });
  const answer = await engine.commitTurn({
    advancementKey: "k2", sessionId: "s1", sessionKey: "key",
    admission: { entryId: "u2", activeMessagePosition: 2, agentId: "main", sessionId: "s1", sessionKey: "key", storePath: "/db" },
    terminal: { entryId: "a2", activeMessagePosition: 3 }, messages: [user, reply],
  });
  assert.deepEqual(answer, { status: "committed" });
  assert.equal(reads[1].cursor, "fresh"); // reset honoured: read again from the fresh cursor
  assert.equal(reads[1].maxMessages, 4); // never past the turn's terminal position
  const page = calls.find((c) => c.method === "POST" && c.path.endsWith("/bootstrap")).body.page;
  assert.equal(page.cursor, null); // told as "from the start" after the reset
  assert.deepEqual(page.entries.map((e) => e.entry_id), ["h0", "h1"]);
});

test("bootstrap enlarges the page for a message larger than it", async () => {
  const { fetchImpl } = service({
    "GET /v1/engines/:e": describe,
    "POST /v1/sessions": opened,
    "GET /v1/engines/:e/sessions/:sid/bootstrap": () => [200, { cursor: "c0", position: 5, visible_count: 5 }],
    "POST /v1/engines/:e/sessions/:sid/bootstrap": (body) =>
      [200, { imported: body.page ? body.page.entries.length : 0, matched: 0, rewound: false, cursor: "c1", position: 6,
              visible_count: 6, result: body.done ? { bootstrapped: true } : null }],
  });
  const reads = [];
  const sdk = {
    readSessionTranscriptVisibleMessageDelta: async (args) => {
      reads.push(args);
      if (args.maxBytes < 5000) return { kind: "page", cursor: "c0", hasMore: true, entries: [], requiredBytes: 5000 };
      return { kind: "page", cursor: "c1", hasMore: false, entries: [{ entryId: "big", message: user }] };
    },
  };
  const engine = await createEngine({ serviceUrl: "http://svc", token: "tok", fetchImpl, sdk, pageBytes: 100 });
  const out = await engine.bootstrap({ sessionId: "s1", sessionKey: "k", sessionTarget: { agentId: "main", sessionId: "s1" } });
  assert.deepEqual(out, { bootstrapped: true, importedMessages: 1 });
  assert.equal(reads[0].cursor, "c0"); // resumed where the last import stopped
  assert.equal(reads[1].maxBytes, 5000);
});

test("an unreachable service makes the calls throw", async () => {
  const fetchImpl = async () => { throw new TypeError("fetch failed", { cause: { code: "ECONNREFUSED" } }); };
  await assert.rejects(createEngine({ serviceUrl: "http://127.0.0.1:9", token: "t", engine: "x-unreachable", fetchImpl }),
    (error) => error.code === "service_unreachable" && /ECONNREFUSED/.test(error.message));
});

test("compaction is delegated to OpenClaw when the service engine does not own it", async () => {
  const { fetchImpl } = service({
    "GET /v1/engines/:e": () => [200, { id: "legacy", durable: true, info: { owns_compaction: false } }],
  });
  const delegated = [];
  const sdk = { delegateCompactionToRuntime: async (params) => { delegated.push(params); return { ok: true, compacted: true }; } };
  const engine = await createEngine({ serviceUrl: "http://svc2", token: "t", engine: "legacy", fetchImpl, sdk });
  assert.equal(engine.info.ownsCompaction, false);
  assert.deepEqual(await engine.compact({ sessionId: "s", sessionKey: "k", force: true }), { ok: true, compacted: true });
  assert.equal(delegated.length, 1);
});

test("compaction imports what the mirror has not seen of the host transcript first", async () => {
  // A turn that timed out before its commit left its messages in the host transcript only: compacting
  // the mirror without them makes no progress, and the host's pre-prompt compaction then fails forever.
  const { calls, fetchImpl } = service({
    ...mirrorRoutes(3).routes,
    "POST /v1/engines/:e/sessions/:sid/compact": () => [200, { ok: true, compacted: true, tokens_before: 900, tokens_after: 300 }],
  });
  let unavailable = false;
  const sdk = {
    readSessionTranscriptVisibleMessageDelta: async () => unavailable
      ? { kind: "unavailable", reason: "locked" }
      : { kind: "page", cursor: "c3", hasMore: false, entries: [
        { entryId: "h0", message: user }, { entryId: "h1", message: reply }, { entryId: "h2", message: result }] },
  };
  const engine = await createEngine({ serviceUrl: "http://svc3", token: "tok", fetchImpl, sdk });
  const params = { sessionId: "s1", sessionKey: "k", force: true, sessionTarget: { agentId: "main", sessionId: "s1" } };
  const out = await engine.compact(params);
  assert.deepEqual(out, { ok: true, compacted: true, result: { tokensBefore: 900, tokensAfter: 300 } });
  const posts = calls.filter((c) => c.method === "POST" && c.path.startsWith("/v1/engines/")).map((c) => c.path.split("/").pop());
  assert.deepEqual(posts, ["bootstrap", "compact"]);
  assert.deepEqual(calls.find((c) => c.path.endsWith("/bootstrap") && c.method === "POST").body.page.entries.map((e) => e.entry_id),
    ["h0", "h1", "h2"]);
  unavailable = true; // a host transcript that cannot be read: the compaction still runs on the mirror
  assert.equal((await engine.compact(params)).compacted, true);
});
