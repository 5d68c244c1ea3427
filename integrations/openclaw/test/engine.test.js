// Unit tests of the plugin with a scripted service (no OpenClaw, no network): `node --test test/`.
import assert from "node:assert/strict";
import { test } from "node:test";

import { createEngine, PLUGIN_ID } from "../src/engine.js";
import { contentText, fromStored, ORIGINAL, toStored } from "../src/messages.js";
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

// What the service refuses, as it does: an entry over its cap (4 MiB of compact JSON), a body over its
// --max-body, a lone surrogate anywhere, a focus over 10000 characters, more than 1000 tool names.
const CAP = 4 * 1024 * 1024;
function strictService(routes, { maxBody = 8 * 1024 * 1024 } = {}) {
  const svc = service(routes);
  const fetchImpl = async (url, init) => {
    if (init.body && Buffer.byteLength(init.body) > maxBody) {
      return new Response(JSON.stringify({ error: { code: "request_too_large", message: "too large" } }), { status: 413 });
    }
    if (init.body && /\\ud[89a-f][0-9a-f]{2}/i.test(init.body)) {
      return new Response(JSON.stringify({ error: { code: "invalid_input", message: "lone surrogate" } }), { status: 400 });
    }
    const body = init.body ? JSON.parse(init.body) : {};
    const messages = [...(body.messages || []), ...((body.page && body.page.entries) || []).map((e) => e.message)];
    if (messages.some((m) => Buffer.byteLength(JSON.stringify(m)) > CAP)) {
      return new Response(JSON.stringify({ error: { code: "payload_too_large", message: "entry over the cap" } }), { status: 413 });
    }
    if ((body.focus && body.focus.length > 10000) || (body.available_tools && body.available_tools.length > 1000)) {
      return new Response(JSON.stringify({ error: { code: "invalid_request", message: "bounds" } }), { status: 422 });
    }
    return svc.fetchImpl(url, init);
  };
  return { calls: svc.calls, fetchImpl };
}

function turnOf(key, messages, start = 0) {
  return {
    advancementKey: key, sessionId: "s1", sessionKey: "k",
    sessionTarget: { agentId: "main", sessionId: "s1", sessionKey: "k" },
    admission: { entryId: `${key}-0`, activeMessagePosition: start },
    terminal: { entryId: `${key}-${messages.length - 1}`, activeMessagePosition: start + messages.length - 1 },
    messages,
  };
}

test("a message too large to be kept twice is kept once, read back whole, and commits", async () => {
  const big = { ...result, content: [{ type: "text", text: "head" }, { type: "text", text: "x".repeat(2.5 * 1024 * 1024) }],
    details: { echo: "y".repeat(2000) } };
  const stored = toStored(big);
  assert.ok(Buffer.byteLength(JSON.stringify(stored)) <= CAP);
  assert.equal(stored.content, contentText(big.content)); // what engines read is unchanged
  assert.equal(stored[ORIGINAL], undefined);
  assert.deepEqual(fromStored(stored), big);
  assert.deepEqual(toStored(JSON.parse(JSON.stringify(big))), stored); // deterministic
  const args = { ...reply, content: [{ type: "toolCall", id: "w", name: "write", arguments: { content: '"\\\n'.repeat(250000) } }] };
  assert.ok(Buffer.byteLength(JSON.stringify(args)) < CAP && !toStored(args)[ORIGINAL]);
  assert.deepEqual(fromStored(toStored(args)), args);
  // Over the cap even once: cut, with a marker, under the cap.
  const huge = { ...result, content: [{ type: "text", text: "z".repeat(9 * 1024 * 1024) }] };
  const cut = toStored(huge);
  assert.ok(Buffer.byteLength(JSON.stringify(cut)) <= CAP);
  assert.match(cut.content, /characters cut by transcript-store/);
  assert.match(fromStored(cut).content[0].text, /^z{1000000,}\n\[\.\.\. \d+ characters cut by transcript-store/);
  assert.equal(fromStored(cut).toolCallId, "c1");

  const { calls, fetchImpl } = strictService({
    "GET /v1/engines/:e": describe, "POST /v1/sessions": opened,
    "POST /v1/engines/:e/sessions/:sid/commit_turn": () => [200, { status: "committed" }],
  });
  const engine = await createEngine({ serviceUrl: "http://svc-big", token: "tok", fetchImpl, sdk: {} });
  assert.deepEqual(await engine.commitTurn(turnOf("big", [user, reply, big, huge])), { status: "committed" });
  assert.equal(calls.filter((c) => c.path.endsWith("commit_turn")).length, 1);
});

test("lone surrogates in what the host wrote are sent as U+FFFD", async () => {
  const cutEmoji = "log line \u{1F600}".slice(0, -1);
  const broken = { ...result, content: [{ type: "text", text: cutEmoji }], details: { ["k\udc00"]: "\ud800" } };
  const stored = toStored(broken);
  assert.equal(stored.content, "log line \ufffd");
  assert.deepEqual(stored[ORIGINAL].details, { "k\ufffd": "\ufffd" });
  const { calls, fetchImpl } = strictService({
    ...mirrorRoutes(1).routes,
    "POST /v1/engines/:e/sessions/:sid/commit_turn": () => [200, { status: "committed" }],
    "POST /v1/engines/:e/sessions/:sid/assemble": () => [200, { messages: [], estimated_tokens: 0 }],
    "POST /v1/engines/:e/sessions/:sid/compact": () => [200, { ok: true, compacted: false }],
  });
  const sdk = { readSessionTranscriptVisibleMessageDelta: async () =>
    ({ kind: "page", cursor: "c1", hasMore: false, entries: [{ entryId: "h0", message: broken }] }) };
  const engine = await createEngine({ serviceUrl: "http://svc-sur", token: "tok", fetchImpl, sdk });
  assert.deepEqual(await engine.commitTurn(turnOf("sur", [broken])), { status: "committed" });
  await engine.assemble({ sessionId: "s1", sessionKey: "k", prompt: `why ${cutEmoji}`, availableTools: ["t\udbff"] });
  await engine.compact({ sessionId: "s1", sessionKey: "k", customInstructions: `keep ${cutEmoji}` });
  assert.equal(calls.find((c) => c.path.endsWith("/assemble")).body.prompt, "why log line \ufffd");
  assert.equal(calls.find((c) => c.path.endsWith("/compact")).body.focus, "keep log line \ufffd");
  assert.equal(calls.find((c) => c.method === "POST" && c.path.endsWith("/bootstrap")).body.page.entries[0].message.content,
    "log line \ufffd");
});

test("import pages are sized by the request body, and a page refused as too large is read again smaller", async () => {
  // Source code written by tool calls: its arguments are escaped twice in the projection, so 3.9 MB
  // of host bytes (one host page) made a body over the service's 8 MiB.
  const source = 'print("a\\\\b", "c")\n'.repeat(15000);
  const host = [];
  for (let k = 0; k < 10; k += 1) {
    host.push({ entryId: `h${k}a`, message: { ...reply, content: [{ type: "toolCall", id: `c${k}`, name: "write", arguments: { content: source } }] } });
    host.push({ entryId: `h${k}b`, message: { ...result, toolCallId: `c${k}` } });
  }
  const reads = [];
  const sdk = {
    readSessionTranscriptVisibleMessageDelta: async ({ cursor, maxMessages }) => {
      reads.push(maxMessages);
      const start = cursor === undefined ? 0 : Number(cursor);
      const entries = host.slice(start, start + maxMessages);
      return { kind: "page", cursor: String(start + entries.length), hasMore: start + entries.length < host.length, entries };
    },
  };
  for (const maxBody of [8 * 1024 * 1024, 1024 * 1024]) { // the default --max-body, and a smaller one
    const mirror = mirrorRoutes(host.length);
    const importPage = mirror.routes["POST /v1/engines/:e/sessions/:sid/bootstrap"];
    const { calls, fetchImpl } = strictService({ ...mirror.routes,
      "POST /v1/engines/:e/sessions/:sid/bootstrap": (body, all) => (body.done ? [200, { result: { bootstrapped: true } }] : importPage(body, all)),
    }, { maxBody });
    const engine = await createEngine({ serviceUrl: `http://svc-pages-${maxBody}`, token: "tok", fetchImpl, sdk });
    const out = await engine.bootstrap({ sessionId: "s1", sessionKey: "k", sessionTarget: { agentId: "main", sessionId: "s1" } });
    assert.equal(out.importedMessages, host.length);
    const pages = calls.filter((c) => c.method === "POST" && c.path.endsWith("/bootstrap") && c.body.page);
    assert.ok(pages.every((c) => c.body.done === false));
    assert.ok(pages.length > 1);
  }
});

test("a session gone from the store is created again and the call retried", async () => {
  const sessions = new Set();
  const gone = (f) => (body, all) => {
    const sid = all[all.length - 1].path.split("/")[5];
    if (!sessions.has(sid)) return [404, { error: { code: "session_not_found", message: "unknown session" } }];
    return f(body, all);
  };
  const { calls, fetchImpl } = service({
    "GET /v1/engines/:e": describe,
    "POST /v1/sessions": (body) => { sessions.add(body.session_id); return [200, {}]; },
    "POST /v1/engines/:e/sessions/:sid/assemble": gone(() => [200, { messages: [], estimated_tokens: 0 }]),
    "POST /v1/engines/:e/sessions/:sid/maintain": gone(() => [200, { changed: false, bytes_freed: 0, rewritten_entries: 0 }]),
    "POST /v1/engines/:e/sessions/:sid/commit_turn": gone(() => [200, { status: "committed" }]),
  });
  const engine = await createEngine({ serviceUrl: "http://svc-gone", token: "tok", fetchImpl, sdk: {} });
  assert.deepEqual(await engine.commitTurn(turnOf("g1", [user, reply])), { status: "committed" });
  sessions.clear(); // deleted from the store, or the database restored
  assert.equal((await engine.assemble({ sessionId: "s1", sessionKey: "k" })).estimatedTokens, 0);
  sessions.clear();
  assert.deepEqual(await engine.commitTurn(turnOf("g2", [user, reply], 2)), { status: "committed" });
  sessions.clear();
  assert.equal((await engine.maintain({ sessionId: "s1", sessionKey: "k" })).changed, false);
  assert.equal(calls.filter((c) => c.path === "/v1/sessions").length, 4);
  // Retried once only: a session that cannot be created again stays an error.
  const { fetchImpl: never } = service({
    "GET /v1/engines/:e": describe, "POST /v1/sessions": opened,
    "POST /v1/engines/:e/sessions/:sid/assemble": () => [404, { error: { code: "session_not_found", message: "unknown" } }],
  });
  const stuck = await createEngine({ serviceUrl: "http://svc-gone2", token: "tok", fetchImpl: never, sdk: {} });
  await assert.rejects(stuck.assemble({ sessionId: "s1", sessionKey: "k" }), (error) => error.code === "session_not_found");
});

test("instructions and tool lists longer than the service takes are cut", async () => {
  const { calls, fetchImpl } = strictService({
    ...mirrorRoutes(0).routes,
    "POST /v1/engines/:e/sessions/:sid/assemble": () => [200, { messages: [], estimated_tokens: 0 }],
    "POST /v1/engines/:e/sessions/:sid/compact": () => [200, { ok: true, compacted: false }],
  });
  const sdk = { readSessionTranscriptVisibleMessageDelta: async () => ({ kind: "page", cursor: "c", hasMore: false, entries: [] }) };
  const engine = await createEngine({ serviceUrl: "http://svc-bounds", token: "tok", fetchImpl, sdk });
  const tools = new Set(Array.from({ length: 1200 }, (_, i) => `mcp__srv__tool_${i}`));
  await engine.assemble({ sessionId: "s1", sessionKey: "k", availableTools: tools });
  const sent = calls.find((c) => c.path.endsWith("/assemble")).body.available_tools;
  assert.deepEqual(sent, [...tools].slice(0, 1000));
  const instructions = "keep the API decisions. ".repeat(499) + "\u{1F600}".repeat(10);
  await engine.compact({ sessionId: "s1", sessionKey: "k", customInstructions: instructions });
  const focus = calls.find((c) => c.path.endsWith("/compact")).body.focus;
  assert.ok(focus.length <= 10000 && focus.length >= 9999 && focus.isWellFormed());
  assert.ok(instructions.startsWith(focus));
});

test("compact and maintain honour the host's abortSignal", async () => {
  // OpenClaw gives up on a compaction after its safety timeout and aborts it: the plugin's import and
  // its /compact request went on in the background.
  let hold = null; // a /compact request that answers only when aborted
  const { calls, fetchImpl } = service({
    ...mirrorRoutes(0).routes,
    "POST /v1/engines/:e/sessions/:sid/maintain": () => [200, { changed: false }],
  });
  const slow = async (url, init) => {
    if (new URL(url).pathname.endsWith("/compact")) {
      calls.push({ method: init.method, path: new URL(url).pathname });
      return new Promise((_resolve, reject) => {
        hold = () => reject(new DOMException("aborted", "AbortError"));
        init.signal.addEventListener("abort", hold, { once: true });
      });
    }
    return fetchImpl(url, init);
  };
  const sdk = { readSessionTranscriptVisibleMessageDelta: async () => ({ kind: "page", cursor: "c0", hasMore: false, entries: [] }) };
  const engine = await createEngine({ serviceUrl: "http://svc-abort", token: "tok", fetchImpl: slow, sdk });
  const params = { sessionId: "s1", sessionKey: "k", force: true, sessionTarget: { agentId: "main", sessionId: "s1" } };
  const gone = AbortSignal.abort();
  await assert.rejects(engine.compact({ ...params, abortSignal: gone }), (error) => error.code === "aborted");
  assert.equal(calls.filter((c) => c.path.endsWith("/compact")).length, 0);
  await assert.rejects(engine.maintain({ ...params, abortSignal: gone }), (error) => error.code === "aborted");
  const controller = new AbortController();
  const running = engine.compact({ ...params, abortSignal: controller.signal });
  while (!hold) await new Promise((resolve) => setTimeout(resolve, 5));
  controller.abort();
  await assert.rejects(running, (error) => error.code === "aborted");
  assert.equal((await engine.maintain(params)).changed, false); // without a signal, as before
});

// OpenClaw 2026.9.6's isContextEngineAbortRejection (src/context-engine/registry.ts): an error a
// lifecycle call rejects with after the host aborted it is the abort only when it is the signal's
// reason, is named AbortError (or says "This operation was aborted"), or has the reason in its causes;
// any other error is the engine failing, and the engine is quarantined.
function takenAsAbort(error, signal) {
  if (!signal?.aborted) return false;
  if (error === signal.reason || error?.name === "AbortError" || error?.message === "This operation was aborted") return true;
  for (let current = error, seen = new Set(); current instanceof Error && !seen.has(current); current = current.cause) {
    seen.add(current);
    if (current.cause === signal.reason) return true;
  }
  return false;
}

test("a compaction or maintenance the host aborted is an abort to OpenClaw, not a failure that quarantines the engine", async () => {
  // Its ServiceError ("aborted by the host") was taken as the engine failing: a /compact OpenClaw gave
  // up on (its safety timeout) quarantined the plugin for the gateway process.
  let hold = null;
  const { fetchImpl } = service({ ...mirrorRoutes(0).routes });
  const slow = async (url, init) => {
    if (/\/(compact|maintain)$/.test(new URL(url).pathname)) {
      return new Promise((_resolve, reject) => {
        hold = () => reject(new DOMException("This operation was aborted", "AbortError"));
        init.signal.addEventListener("abort", hold, { once: true });
      });
    }
    return fetchImpl(url, init);
  };
  const sdk = { readSessionTranscriptVisibleMessageDelta: async () => ({ kind: "page", cursor: "c0", hasMore: false, entries: [] }) };
  const engine = await createEngine({ serviceUrl: "http://svc-abort-kind", token: "tok", fetchImpl: slow, sdk });
  const params = { sessionId: "s1", sessionKey: "k", force: true, sessionTarget: { agentId: "main", sessionId: "s1" } };
  for (const call of [(signal) => engine.compact({ ...params, abortSignal: signal }),
    (signal) => engine.maintain({ ...params, abortSignal: signal })]) {
    hold = null;
    const controller = new AbortController();
    const running = call(controller.signal);
    while (!hold) await new Promise((resolve) => setTimeout(resolve, 5));
    controller.abort(new Error("compaction timed out")); // as OpenClaw's safety timeout aborts it
    await assert.rejects(running, (error) => error.code === "aborted" && takenAsAbort(error, controller.signal));
    const gone = AbortSignal.abort();
    await assert.rejects(call(gone), (error) => error.code === "aborted" && takenAsAbort(error, gone));
  }
});

test("a compaction or maintenance that fails answers that it did nothing, never throws (OpenClaw would quarantine the engine)", async () => {
  // OpenClaw 2026.9.6 quarantines for the gateway process an engine it resolved for a /compact whose
  // compact or maintain throws: a /compact while the service was away (or slower than timeoutMs) left
  // every later /compact of that gateway on OpenClaw's legacy engine.
  const down = async () => { throw new TypeError("fetch failed", { cause: { code: "ECONNREFUSED" } }); };
  let up = true;
  const { fetchImpl } = service({
    "GET /v1/engines/:e": describe,
    "POST /v1/sessions": opened,
    "GET /v1/engines/:e/sessions/:sid/bootstrap": () => [200, { cursor: null, position: 0 }],
    "POST /v1/engines/:e/sessions/:sid/compact": () => [503, { error: { code: "store_unavailable", message: "cannot connect to the database" } }],
  });
  const warned = [];
  const sdk = { readSessionTranscriptVisibleMessageDelta: async () => ({ kind: "page", cursor: "c0", hasMore: false, entries: [] }) };
  const engine = await createEngine({ serviceUrl: "http://svc-fails", token: "tok", sdk,
    fetchImpl: (url, init) => (up ? fetchImpl(url, init) : down()), logger: { warn: (m) => warned.push(m) } });
  const params = { sessionId: "s1", sessionKey: "k", force: true, tokenBudget: 1000 };
  const refused = await engine.compact(params);
  assert.deepEqual([refused.ok, refused.compacted], [false, false]);
  assert.match(refused.reason, /cannot connect to the database/);
  up = false;
  const away = await engine.maintain(params);
  assert.deepEqual([away.changed, away.bytesFreed, away.rewrittenEntries], [false, 0, 0]);
  assert.match(away.reason, /unreachable/);
  assert.equal(warned.length, 2);
  // OpenClaw's own compaction throwing (the engine delegates it) is answered the same way.
  const { fetchImpl: legacy } = service({ "GET /v1/engines/:e": () => [200, { id: "legacy", durable: true, info: { owns_compaction: false } }] });
  const delegating = await createEngine({ serviceUrl: "http://svc-delegates", token: "tok", engine: "legacy", fetchImpl: legacy,
    sdk: { delegateCompactionToRuntime: async () => { throw new Error("runtime compaction failed"); } } });
  assert.deepEqual(await delegating.compact(params), { ok: false, compacted: false, reason: "transcript-store: runtime compaction failed" });
});

test("a delegated compaction that moves the session to a successor says its summary is not recorded", async () => {
  // The summary goes to the service as a host compaction of the caller's session only; a compaction that
  // continues in another session id is imported there, and its summary left out with a warning.
  const { calls, fetchImpl } = service({
    ...mirrorRoutes(0).routes,
    "GET /v1/engines/:e": () => [200, { id: "legacy", durable: true, info: { owns_compaction: false } }],
  });
  const warnings = [];
  const sdk = {
    delegateCompactionToRuntime: async () => ({
      ok: true, compacted: true, result: { sessionId: "s2", summary: "what came before", firstKeptEntryId: "h1" },
    }),
    readSessionTranscriptVisibleMessageDelta: async () => ({ kind: "page", cursor: "c0", hasMore: false, entries: [] }),
  };
  const logger = { warn: (message) => warnings.push(message), info: () => {} };
  const engine = await createEngine({ serviceUrl: "http://svc-successor", token: "t", engine: "legacy", fetchImpl, sdk, logger });
  const out = await engine.compact({ sessionId: "s1", sessionKey: "k", force: true, sessionTarget: { agentId: "main", sessionId: "s1" } });
  assert.equal(out.compacted, true);
  assert.equal(calls.filter((c) => c.path.endsWith("/host_compaction")).length, 0);
  assert.ok(warnings.some((w) => /moved the session to s2; its summary is not recorded/.test(w)), warnings);
});

test("the service engine's host requirements reach OpenClaw, which runs it on no host lacking them", async () => {
  // OpenClaw checks info.hostRequirements before an operation (a generic CLI backend never calls assemble)
  // and does not run the engine on a host without the capabilities; dropped, the engine ran there anyway.
  const { fetchImpl } = service({
    "GET /v1/engines/:e": () => [200, { id: "recall", durable: true, info: { owns_compaction: true, host_requirements: {
      "agent-run": { required_capabilities: ["assemble-before-prompt"], unsupported_message: "Use the embedded runtime." },
      "manual-compact": { required_capabilities: ["compact"], unsupported_message: null },
    } } }],
  });
  const engine = await createEngine({ serviceUrl: "http://svc-requirements", token: "t", engine: "recall", fetchImpl, sdk: {} });
  assert.deepEqual(engine.info.hostRequirements, {
    "agent-run": { requiredCapabilities: ["assemble-before-prompt"], unsupportedMessage: "Use the embedded runtime." },
    "manual-compact": { requiredCapabilities: ["compact"] },
  });
  const plain = await createEngine({ serviceUrl: "http://svc-requirements", token: "t", engine: "lossless",
    fetchImpl: service({ "GET /v1/engines/:e": describe }).fetchImpl, sdk: {} });
  assert.equal(plain.info.hostRequirements, undefined); // none declared: none added
});
