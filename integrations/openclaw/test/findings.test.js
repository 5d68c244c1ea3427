// The plugin against a real `transcript-store serve` (testing/service.js: a child process on a free loopback
// port, SQLite in a temporary directory) and a scripted OpenClaw host (its transcript, its compaction and its
// memory prompt helper): `node --test test/`.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { createEngine } from "../src/engine.js";
import { contentText } from "../src/messages.js";
import { assistantMessage, logOf, MiB, pngOf, toolCall, toolResult, userMessage } from "../testing/messages.js";
import { startService as startServiceWith } from "../testing/service.js";

const TOKEN = "tok-findings-0123456789";

/** The service with this file's token (testing/service.js). */
const startService = (options = {}) => startServiceWith({ token: TOKEN, ...options });

/**
 * A scripted OpenClaw host session: its visible transcript (entry ids, messages), read the way
 * readSessionTranscriptVisibleMessageDelta reads it (a cursor of the transcript's generation; a cursor of
 * an older generation answers `reset`), and a runtime compaction that keeps the last `keep` messages after
 * a compaction summary, as OpenClaw's summarising compaction does.
 */
function hostSession(sessionId) {
  let generation = 1;
  let entries = [];
  let made = 0;
  const host = {
    sessionId,
    sessionKey: `agent:main:${sessionId}`,
    fence: undefined, // the entry id of the running turn's admitted message, while reads are fenced
    compactions: [], // OpenClaw's compactions: their summary and first kept entry id
    /** The messages OpenClaw's own context shows: the latest summary, then from its first kept message. */
    context() {
      const last = host.compactions.at(-1);
      if (!last) return entries.map((entry) => entry.message);
      const from = entries.findIndex((entry) => entry.entryId === last.firstKept);
      return [{ role: "user", content: `[Summary of the earlier conversation]\n${last.summary}` },
        ...entries.slice(from).map((entry) => entry.message)];
    },
    get entries() { return entries; },
    /** OpenClaw's summarising compaction keeping the last `keep` messages: its `compaction` entry. */
    compact(keep = 2) {
      const firstKept = entries[entries.length - keep];
      host.compactions.push({ id: `${sessionId}-c${(made += 1)}`, after: entries.length, at: new Date().toISOString(),
        summary: `Summary of ${entries.length - keep} earlier messages.`, firstKept: firstKept.entryId });
    },
    /** Append messages (a turn's first ones); their entries. */
    append(messages) {
      const added = messages.map((message) => ({ entryId: `${sessionId}-e${(made += 1)}`, message }));
      entries = [...entries, ...added];
      return added;
    },
    target() { return { agentId: "main", sessionId, sessionKey: host.sessionKey, storePath: "/host/sessions" }; },
    /** Append a turn's messages; the commitTurn params of that turn. */
    turn(key, messages) {
      const start = entries.length;
      const added = messages.map((message) => ({ entryId: `${sessionId}-e${(made += 1)}`, message }));
      entries = [...entries, ...added];
      return {
        advancementKey: key, sessionId, sessionKey: host.sessionKey, isHeartbeat: false,
        sessionTarget: host.target(),
        admission: { entryId: added[0].entryId, activeMessagePosition: start },
        terminal: { entryId: added[added.length - 1].entryId, activeMessagePosition: start + added.length - 1 },
        messages,
      };
    },
    sdk: {
      readSessionTranscriptVisibleMessageDelta: async ({ cursor, maxMessages, maxBytes }) => {
        let start = 0;
        if (cursor !== undefined) {
          const [gen, at] = String(cursor).split(":").map(Number);
          if (gen !== generation) return { kind: "reset", cursor: `${generation}:0`, reason: "generation_mismatch" };
          start = at;
        }
        const page = [];
        let bytes = 0;
        const fenced = host.fence === undefined ? -1 : entries.findIndex((e) => e.entryId === host.fence);
        if (fenced >= 0 && start > fenced) {
          throw new Error("SessionTranscriptReadFenceError: the read cursor has crossed the current-turn admission fence");
        }
        for (const entry of fenced >= 0 ? entries.slice(start, fenced) : entries.slice(start)) {
          const size = Buffer.byteLength(JSON.stringify(entry.message));
          if (page.length >= maxMessages || (page.length > 0 && bytes + size > maxBytes)) break;
          if (page.length === 0 && size > maxBytes) {
            return { kind: "page", cursor: `${generation}:${start}`, hasMore: true, entries: [], requiredBytes: size };
          }
          page.push(entry);
          bytes += size;
        }
        const end = start + page.length;
        const last = fenced >= 0 ? fenced : entries.length;
        return { kind: "page", cursor: `${generation}:${end}`, hasMore: end < last, entries: page };
      },
      // readSessionTranscriptRawDelta: every event of the transcript in the order it was written, its
      // `compaction` entries among the messages (OpenClaw 2026.9.6's raw events: type, id, parentId and, for
      // a compaction, summary and firstKeptEntryId), up to the fence; a cursor of the transcript's generation.
      readSessionTranscriptRawDelta: async ({ cursor, maxEvents, maxBytes }) => {
        let start = 0;
        if (cursor !== undefined) {
          const [gen, at] = String(cursor).split(":").map(Number);
          if (gen !== generation) return { kind: "reset", cursor: `${generation}:0`, reason: "generation_mismatch" };
          start = at;
        }
        const events = [];
        let parentId = null;
        entries.forEach((entry, i) => {
          events.push({ type: "message", id: entry.entryId, parentId, message: entry.message });
          parentId = entry.entryId;
          for (const c of host.compactions.filter((made) => made.after === i + 1)) {
            events.push({ type: "compaction", id: c.id, parentId, timestamp: c.at,
              summary: c.summary, firstKeptEntryId: c.firstKept, tokensBefore: 5000 });
            parentId = c.id;
          }
        });
        const fenced = host.fence === undefined ? -1 : events.findIndex((e) => e.id === host.fence);
        const last = fenced >= 0 ? fenced : events.length;
        if (start > last) throw new Error("SessionTranscriptReadFenceError: the read cursor has crossed the current-turn admission fence");
        const page = [];
        let bytes = 0;
        for (const event of events.slice(start, last)) {
          const size = Buffer.byteLength(JSON.stringify(event)) + 1;
          if (page.length >= maxEvents || bytes + size > maxBytes) break;
          page.push({ event, seq: start + page.length });
          bytes += size;
        }
        const end = start + page.length;
        return { kind: "page", cursor: `${generation}:${end}`, hasMore: end < last, events: page, serializedBytes: bytes };
      },
      // As OpenClaw 2026.9.6 compacts (seen through its /compact): a `compaction` entry after the last
      // message (its summary and the first message it kept), which is no message: every message stays
      // visible where it was, and the visible delta shows nothing new.
      delegateCompactionToRuntime: async () => {
        host.compact();
        const firstKept = host.compactions.at(-1).firstKept;
        return {
          ok: true, compacted: true,
          result: { summary: host.compactions.at(-1).summary, firstKeptEntryId: firstKept, tokensBefore: 5000, tokensAfter: 300 },
        };
      },
    },
  };
  return host;
}



let service;
let small; // a service with a lower entry cap and body limit than the defaults
let large; // a service with a larger body limit than its turn cap

before(async () => {
  [service, small, large] = await Promise.all([
    startService(),
    startService({ env: { TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES: String(MiB) }, args: ["--max-body", String(3 * MiB)] }),
    startService({ args: ["--max-body", String(16 * MiB)] }),
  ]);
});

after(async () => {
  await Promise.all([service?.stop(), small?.stop(), large?.stop()]);
});

async function engineFor(host, { engine = "legacy", on = service, ...more } = {}) {
  return createEngine({ serviceUrl: on.url, token: TOKEN, engine, sdk: host.sdk, ...more });
}

// Three turns of `host` committed through the plugin, each by an engine of its own process (bootstrap
// first); the params of the session's later calls.
async function threeCommittedTurns(host) {
  const params = { sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() };
  for (let k = 0; k < 3; k += 1) {
    const engine = await engineFor(host);
    await engine.bootstrap(params);
    assert.deepEqual(await engine.commitTurn(host.turn(`k${k}`, [userMessage(`question ${k}`), assistantMessage(`answer ${k}`)])),
      { status: "committed" });
  }
  return params;
}

test("finding 1: OpenClaw's delegated compaction (engine legacy) is what the next assemble returns", async () => {
  const host = hostSession("s-compact");
  const engine = await engineFor(host);
  assert.equal(engine.info.ownsCompaction, false);
  await engine.bootstrap({ sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() });
  for (let k = 0; k < 4; k += 1) {
    const turn = host.turn(`k${k}`, [userMessage(`question ${k}`), assistantMessage(`answer ${k}`)]);
    assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  }
  const before = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey });
  assert.equal(before.messages.length, 8);

  const compacted = await engine.compact({
    sessionId: host.sessionId, sessionKey: host.sessionKey, force: true, sessionTarget: host.target() });
  assert.equal(compacted.compacted, true);
  const assembled = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey });
  // What OpenClaw's own context shows after its compaction: the summary and the two messages it kept
  // (its compaction moved no message: OpenClaw's compaction is a marker in its transcript).
  assert.deepEqual(assembled.messages.map((m) => contentText(m.content)), host.context().map((m) => contentText(m.content)));
  assert.deepEqual(assembled.messages.slice(1), host.context().slice(1));
  assert.ok(assembled.estimatedTokens < before.estimatedTokens);
  // Dated when it was written (OpenClaw shows the date of a user message to the model), not 1970.
  assert.ok(Math.abs(assembled.messages[0].timestamp - Date.now()) < 60000, String(assembled.messages[0].timestamp));

  // The next turn commits on top of the mirror (the summary stays), and an import finds nothing new.
  const turn = host.turn("k-after", [userMessage("after the compaction"), assistantMessage("noted")]);
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  const boot = await engine.bootstrap({ sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() });
  assert.equal(boot.importedMessages, 0);
  const last = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey });
  assert.deepEqual(last.messages.map((m) => contentText(m.content)), host.context().map((m) => contentText(m.content)));
  assert.equal((await service.get(`/v1/sessions/${host.sessionId}`)).visible_count, 10); // positions as the host's
});

test("finding 1: OpenClaw's in-run auto-compaction, which calls no engine, is what the next turn assembles", async () => {
  // OpenClaw compacts inside a run on its own (compaction mode `default`, for an engine that does not own
  // compaction) without calling engine.compact: only the `compaction` entry in its transcript tells. The
  // next turn's assemble returned the whole history it had summarised, and its provider overflowed again.
  const host = hostSession("s-auto-compact");
  const params = { sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() };
  for (let k = 0; k < 3; k += 1) {
    const engine = await engineFor(host);
    await engine.bootstrap(params);
    const turn = host.turn(`k${k}`, [userMessage(`question ${k}`), assistantMessage(`answer ${k}`)]);
    if (k === 2) host.compact(2); // during the last turn's run, after its reply
    assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  }
  const engine = await engineFor(host);
  const [prompt] = host.append([userMessage("next question")]);
  host.fence = prompt.entryId;
  await engine.bootstrap(params);
  const assembled = await engine.assemble({ ...params, tokenBudget: 100000 });
  const own = host.context().slice(0, -1); // OpenClaw's context before the running turn
  assert.deepEqual(assembled.messages.map((m) => contentText(m.content)), own.map((m) => contentText(m.content)));
  assert.deepEqual(assembled.messages.slice(1), own.slice(1));
  // Found once: a later bootstrap (another engine of the process) leaves its time alone.
  const [again] = [await engineFor(host)];
  await again.bootstrap(params);
  const later = await again.assemble({ ...params, tokenBudget: 100000 });
  assert.equal(later.messages[0].timestamp, assembled.messages[0].timestamp);
  assert.deepEqual(later.messages, assembled.messages);
});

test("finding 1: OpenClaw's compaction inside a turn that kept only that turn leaves its summary alone", async () => {
  // An overflow recovery whose turn alone fills the window keeps only the turn: the summary is all that
  // precedes it, and the retry's assemble must not return the history it summarised.
  const host = hostSession("s-compact-turn");
  const params = await threeCommittedTurns(host);
  const engine = await engineFor(host);
  const [prompt] = host.append([userMessage("CURRENT PROMPT")]);
  host.fence = prompt.entryId;
  await engine.bootstrap(params);
  host.fence = undefined;
  host.append([toolCall("c1", "read", { path: "big.log" })]); // the turn's own messages: OpenClaw keeps these two
  const compacted = await engine.compact({ ...params, force: true, tokenBudget: 100000 });
  assert.equal(compacted.compacted, true);
  host.fence = prompt.entryId; // the retry
  await engine.bootstrap(params);
  const retry = await engine.assemble({ ...params, tokenBudget: 100000 });
  assert.deepEqual(retry.messages.map((m) => contentText(m.content)), [`[Summary of the earlier conversation]\n${host.compactions[0].summary}`]);
  host.fence = undefined;
  const [reply] = host.append([assistantMessage("read it")]);
  const turn = {
    advancementKey: "k3", sessionId: host.sessionId, sessionKey: host.sessionKey, isHeartbeat: false, sessionTarget: host.target(),
    admission: { entryId: prompt.entryId, activeMessagePosition: 6 },
    terminal: { entryId: reply.entryId, activeMessagePosition: 8 },
    messages: host.entries.slice(6).map((entry) => entry.message),
  };
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  const after = await engine.assemble({ ...params, tokenBudget: 100000 });
  assert.deepEqual(after.messages.slice(1), turn.messages); // the summary, then the turn it kept
});

test("finding 1: the retry inside a turn after its compaction gets the turn's own messages", async () => {
  // OpenClaw's overflow recovery retries the turn with "Continue the current task ..." as its prompt: the
  // user's message, which the first attempt persisted, is in OpenClaw's own history (the `messages` it
  // gives assemble), after the summary. The fenced assembly ends before it: the model got the summary and
  // "Continue the current task" without the question, where OpenClaw's own context has it.
  const host = hostSession("s-compact-retry");
  const params = await threeCommittedTurns(host);
  const engine = await engineFor(host);
  const [prompt] = host.append([userMessage("CURRENT PROMPT", 10)]);
  host.fence = prompt.entryId;
  await engine.bootstrap(params);
  // The first attempt: OpenClaw's history holds what precedes the turn (the prompt comes separately).
  const first = await engine.assemble({ ...params, tokenBudget: 100000, messages: host.entries.slice(0, 6).map((e) => e.message) });
  assert.deepEqual(first.messages, host.entries.slice(0, 6).map((e) => e.message));
  host.fence = undefined;
  host.append([toolCall("c1", "read", { path: "big.log" })]);
  assert.equal((await engine.compact({ ...params, force: true, tokenBudget: 100000 })).compacted, true);
  host.fence = prompt.entryId; // the retry
  await engine.bootstrap(params);
  // OpenClaw's own history after its compaction: its summary, then the messages it kept (the turn's).
  const summary = { role: "compactionSummary", summary: host.compactions[0].summary, tokensBefore: 5000, timestamp: 20 };
  const own = [summary, ...host.entries.slice(6).map((e) => e.message)];
  const retry = await engine.assemble({ ...params, tokenBudget: 100000, messages: own, prompt: "Continue the current task" });
  assert.deepEqual(retry.messages.map((m) => contentText(m.content)), host.context().map((m) => contentText(m.content)));
  assert.deepEqual(retry.messages.slice(1), host.entries.slice(6).map((e) => e.message));
});

// readSessionTranscriptRawDelta over fixed events (OpenClaw's raw events: every branch, in the order written).
function rawOf(events) {
  return async ({ cursor, maxEvents }) => {
    const start = cursor === undefined ? 0 : Number(String(cursor).split(":")[1]);
    const page = events.slice(start, start + maxEvents).map((event, i) => ({ event, seq: start + i }));
    const end = start + page.length;
    return { kind: "page", cursor: `1:${end}`, hasMore: end < events.length, events: page, serializedBytes: 0 };
  };
}

/** Points the host's raw reader at a copy of its raw events so far; returns that copy, for the test to write on. */
async function fixedRawTranscript(host) {
  const read = host.sdk.readSessionTranscriptRawDelta;
  const raw = (await read({ maxEvents: 1000, maxBytes: 1e9 })).events.map(({ event }) => event);
  host.sdk.readSessionTranscriptRawDelta = rawOf(raw);
  return raw;
}

/** The raw message events of a two-message turn, its first one written under `parentId`. */
function rawTurn(turn, parentId) {
  return [{ type: "message", id: turn.admission.entryId, parentId, message: turn.messages[0] },
    { type: "message", id: turn.terminal.entryId, parentId: turn.admission.entryId, message: turn.messages[1] }];
}

/** An OpenClaw raw `compaction` event written now. */
function rawCompaction(id, parentId, summary, firstKeptEntryId) {
  return { type: "compaction", id, parentId, timestamp: new Date().toISOString(), summary, firstKeptEntryId, tokensBefore: 5000 };
}

/** An OpenClaw raw `reset` event written now (`more`: its firstKeptEntryId, when it keeps a tail). */
function rawReset(id, parentId, reason, more = {}) {
  return { type: "reset", id, parentId, timestamp: new Date().toISOString(), reason, ...more };
}

/** The message texts a new engine of this process assembles for the session, after its bootstrap. */
async function assembledTexts(host, params) {
  const engine = await engineFor(host);
  await engine.bootstrap(params);
  return (await engine.assemble({ ...params, tokenBudget: 100000 })).messages.map((m) => contentText(m.content));
}

let processes = 0;

/** An engine of another plugin process: a module of its own, nothing remembered of this one's reads. */
async function engineOfNewProcess(host, engine) {
  const fresh = await import(`../src/engine.js?process=${(processes += 1)}`);
  return fresh.createEngine({ serviceUrl: service.url, token: TOKEN, engine, sdk: host.sdk });
}

test("review 1: a compaction on a branch OpenClaw left is not what the next turn assembles", async () => {
  // OpenClaw's transcript is a tree: a /rewind, a retry or a branch switch leaves entries on a branch the
  // active one no longer goes through. The plugin recorded the newest `compaction` entry of the raw
  // transcript whatever its branch, and the next assemble showed a summary OpenClaw's own context does not.
  const host = hostSession("s-branch-compaction");
  const params = await threeCommittedTurns(host);
  const visible = host.entries.slice();
  const raw = await fixedRawTranscript(host);
  const last = visible.at(-1).entryId;
  raw.push({ type: "message", id: "gone-u", parentId: last, message: userMessage("a question taken back") },
    { type: "message", id: "gone-a", parentId: "gone-u", message: assistantMessage("an answer taken back") },
    rawCompaction("gone-c", "gone-a", "A summary of the branch taken back.", visible[4].entryId),
    { type: "leaf", id: "back", parentId: "gone-c", targetId: last });
  const turn = host.turn("k3", [userMessage("question 3"), assistantMessage("answer 3")]);
  raw.push(...rawTurn(turn, last));
  const engine = await engineFor(host);
  await engine.bootstrap(params);
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  assert.deepEqual(await assembledTexts(host, params), host.entries.map((e) => contentText(e.message.content)));

  // A compaction on the active branch is recorded, the one left behind still not.
  const kept = host.entries[6].entryId;
  raw.push(rawCompaction("live-c", turn.terminal.entryId, "A summary of the active branch.", kept));
  assert.deepEqual(await assembledTexts(host, params),
    ["[Summary of the earlier conversation]\nA summary of the active branch.", "question 3", "answer 3"]);
});

test("a reset in OpenClaw's transcript is a boundary the active branch never goes back across", async () => {
  // OpenClaw re-parents what follows a `reset` entry: an entry naming a parent before the reset (or none)
  // hangs after the leaf, and a branch switch to an entry before the reset changes nothing; and a reset
  // is a boundary like a compaction (its context starts again there). The plugin followed the parents as
  // written and recorded a compaction OpenClaw's context no longer had: the next assemble showed its summary.
  const host = hostSession("s-reset");
  const params = await threeCommittedTurns(host);
  const visible = host.entries.slice();
  const raw = await fixedRawTranscript(host);
  const last = visible.at(-1).entryId;
  raw.push({ type: "message", id: "old-u", parentId: last, message: userMessage("a question on a branch left behind") },
    rawCompaction("old-c", "old-u", "A summary of the branch left behind.", visible[4].entryId),
    { type: "leaf", id: "back", parentId: "old-c", targetId: last },
    rawReset("r", last, "reset"));
  // The turn's first entry names a parent on the branch left behind (a stale append cursor): OpenClaw
  // hangs it after the reset, and its context starts again at the reset.
  const turn = host.turn("k3", [userMessage("question 3"), assistantMessage("answer 3")]);
  raw.push(...rawTurn(turn, "old-c"));
  const engine = await engineFor(host);
  await engine.bootstrap(params);
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  assert.deepEqual(await assembledTexts(host, params), ["question 3", "answer 3"]);
  // A branch switch back to before the reset: OpenClaw leaves the leaf where it is.
  raw.push({ type: "leaf", id: "jump", parentId: turn.terminal.entryId, targetId: "old-c" });
  assert.deepEqual(await assembledTexts(host, params), ["question 3", "answer 3"]);
  // A compaction before a second reset on the active branch: the reset is the newer boundary, and nothing
  // follows it yet.
  raw.push(rawCompaction("pre-c", turn.terminal.entryId, "A summary before the second reset.", turn.terminal.entryId),
    rawReset("r2", "pre-c", "new"));
  assert.deepEqual(await assembledTexts(host, params), []);
  // The turn after it, and OpenClaw's compaction after the reset, on the active branch: recorded.
  const next = host.turn("k4", [userMessage("question 4"), assistantMessage("answer 4")]);
  raw.push(...rawTurn(next, "r2"));
  const fourth = await engineFor(host);
  await fourth.bootstrap(params);
  assert.deepEqual(await fourth.commitTurn(next), { status: "committed" });
  assert.deepEqual(await assembledTexts(host, params), ["question 4", "answer 4"]);
  raw.push(rawCompaction("live-c", next.terminal.entryId, "A summary after the reset.", next.terminal.entryId));
  assert.deepEqual(await assembledTexts(host, params), ["[Summary of the earlier conversation]\nA summary after the reset.", "answer 4"]);
});

test("a reset in OpenClaw's transcript leaves what preceded it out of the assembly, as OpenClaw's context does", async () => {
  // OpenClaw's /new or /reset of a session that keeps its transcript appends a `reset` entry: its context
  // starts again after it (from the tail before it that its firstKeptEntryId keeps, when it keeps one),
  // while the visible messages it reads still hold everything before it. The plugin mirrored those and
  // the assembly returned them (and OpenClaw's compaction of them) in front of the new conversation.
  const host = hostSession("s-reset-context");
  const params = await threeCommittedTurns(host);
  const compacted = await (await engineFor(host)).compact({ ...params, force: true, tokenBudget: 100000 });
  assert.equal(compacted.compacted, true);
  const raw = await fixedRawTranscript(host);
  raw.push(rawReset("r1", raw.at(-1).id, "new"));
  // The first turn after the reset: its message is past the fence, so nothing precedes it.
  const turn = host.turn("k3", [userMessage("question 3"), assistantMessage("answer 3")]);
  host.fence = turn.admission.entryId;
  const engine = await engineFor(host);
  await engine.bootstrap(params);
  assert.deepEqual((await engine.assemble({ ...params, tokenBudget: 100000 })).messages, []);
  host.fence = undefined;
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  raw.push(...rawTurn(turn, "r1"));
  assert.deepEqual(await assembledTexts(host, params), ["question 3", "answer 3"]);
  // A new process reads the transcript from its start: the compaction before the reset stays out.
  const fresh = await engineOfNewProcess(host, "legacy");
  await fresh.bootstrap(params);
  assert.deepEqual((await fresh.assemble({ ...params, tokenBudget: 100000 })).messages.map((m) => contentText(m.content)),
    ["question 3", "answer 3"]);
  // A reset that keeps the tail before it from its firstKeptEntryId: that tail, then what follows.
  raw.push(rawReset("r2", turn.terminal.entryId, "reset", { firstKeptEntryId: turn.terminal.entryId }));
  const next = host.turn("k4", [userMessage("question 4"), assistantMessage("answer 4")]);
  raw.push(...rawTurn(next, "r2"));
  const fourth = await engineFor(host);
  await fourth.bootstrap(params);
  assert.deepEqual(await fourth.commitTurn(next), { status: "committed" });
  assert.deepEqual(await assembledTexts(host, params), ["answer 3", "question 4", "answer 4"]);
});

test("a reset in OpenClaw's transcript reaches a service engine that owns compaction (lossless)", async () => {
  // The plugin looked for OpenClaw's resets only for an engine that does not own compaction: with lossless
  // the first turn after a /new assembled the whole earlier conversation, and its summaries, in front of
  // the new one. It now records the reset for every engine (a compaction entry only for one that does not
  // own compaction), and lossless assembles from the reset on, keeping what preceded it stored.
  const host = hostSession("s-reset-lossless");
  const params = { sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() };
  for (let k = 0; k < 6; k += 1) { // past lossless's fresh tail of 8 messages
    const engine = await engineFor(host, { engine: "lossless" });
    await engine.bootstrap(params);
    assert.deepEqual(await engine.commitTurn(host.turn(`k${k}`, [userMessage(`question ${k}`), assistantMessage(`answer ${k}`)])),
      { status: "committed" });
  }
  const compacted = await (await engineFor(host, { engine: "lossless" })).compact({ ...params, force: true, tokenBudget: 60 });
  assert.equal(compacted.compacted, true);
  const summarised = (await (await engineFor(host, { engine: "lossless" })).assemble({ ...params, tokenBudget: 100000 })).messages;
  assert.match(contentText(summarised[0].content), /^\[Summary sum_/);
  const raw = await fixedRawTranscript(host);
  raw.push(rawReset("r1", raw.at(-1).id, "new"));
  const turn = host.turn("k6", [userMessage("question 6"), assistantMessage("answer 6")]);
  host.fence = turn.admission.entryId;
  const engine = await engineFor(host, { engine: "lossless" });
  assert.equal(engine.info.ownsCompaction, true);
  await engine.bootstrap(params);
  assert.deepEqual((await engine.assemble({ ...params, tokenBudget: 100000 })).messages, []);
  host.fence = undefined;
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  // OpenClaw's compaction entry after it (the engine's own compaction, as OpenClaw notes it): not a boundary
  // the plugin records for an engine that owns compaction; a new process still finds the reset.
  raw.push(...rawTurn(turn, "r1"),
    rawCompaction("c-own", turn.terminal.entryId, "Not this one.", turn.terminal.entryId));
  const fresh = await engineOfNewProcess(host, "lossless");
  await fresh.bootstrap(params);
  assert.deepEqual((await fresh.assemble({ ...params, tokenBudget: 100000 })).messages.map((m) => contentText(m.content)),
    ["question 6", "answer 6"]);
});

test("an entry naming OpenClaw's raw append cursor while the leaf is elsewhere hangs after the leaf", async () => {
  // OpenClaw keeps the raw append cursor apart from the leaf: a branch switch (a `leaf` entry) leaves it at
  // the old branch's end (its appendParentId), a side entry moves it to itself. A canonical entry whose
  // parentId is that cursor while the leaf is elsewhere hangs after the leaf (its transcript-tree.ts). The
  // walk followed the parent as written and recorded the compaction of the branch OpenClaw had left.
  const host = hostSession("s-append-cursor");
  const params = await threeCommittedTurns(host);
  const visible = host.entries.slice();
  const raw = await fixedRawTranscript(host);
  // A compaction on a branch off the second turn, then a switch back to the last message that leaves the
  // append cursor at that branch's end.
  raw.push({ type: "message", id: "side-u", parentId: visible[3].entryId, message: userMessage("a question on another branch") },
    rawCompaction("side-c", "side-u", "A summary of the other branch.", visible[2].entryId),
    { type: "leaf", id: "back", parentId: "side-c", targetId: visible.at(-1).entryId, appendParentId: "side-c" });
  const turn = host.turn("k3", [userMessage("question 3"), assistantMessage("answer 3")]);
  raw.push(...rawTurn(turn, "side-c"));
  const engine = await engineFor(host);
  await engine.bootstrap(params);
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  assert.deepEqual(await assembledTexts(host, params), host.entries.map((e) => contentText(e.message.content)));
});

test("review 1: a new process leaves a newer compaction of the service in place of OpenClaw's older one", async () => {
  // A new plugin process reads OpenClaw's raw transcript from its start and found the compaction there
  // (made before the service's own since): recorded again, the older summary replaced the newer one, and
  // the context grew back by what the newer one had compacted.
  const host = hostSession("s-older-compaction");
  const params = { sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() };
  const long = " and so on".repeat(40);
  for (let k = 0; k < 5; k += 1) {
    const engine = await engineFor(host);
    await engine.bootstrap(params);
    const turn = host.turn(`k${k}`, [userMessage(`question ${k}${long}`), assistantMessage(`answer ${k}${long}`)]);
    if (k === 4) host.compact(8); // OpenClaw's in-run compaction, found by the next bootstrap
    assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  }
  // It was made before the service's compaction below, by a clock an hour ahead of the service's: the
  // service compared the two clocks and put it back in place of its own newer one.
  host.compactions[0].at = new Date(Date.now() + 3600000).toISOString();
  const first = await engineFor(host);
  await first.bootstrap(params);
  const older = await first.assemble({ ...params, tokenBudget: 100000 });
  assert.equal(contentText(older.messages[0].content), `[Summary of the earlier conversation]\n${host.compactions[0].summary}`);
  // The service's own compaction (an operator's `compact`, the legacy engine's).
  const response = await fetch(`${service.url}/v1/engines/legacy/sessions/${host.sessionId}/compact`, {
    method: "POST", headers: { authorization: `Bearer ${TOKEN}`, "content-type": "application/json" }, body: JSON.stringify({ force: true }) });
  assert.equal((await response.json()).compacted, true);
  const newer = await first.assemble({ ...params, tokenBudget: 100000 });
  assert.notDeepEqual(newer.messages, older.messages);
  // Another process (a module of its own: nothing remembered of this one's reads).
  const other = await engineOfNewProcess(host, "legacy");
  await other.bootstrap(params);
  assert.deepEqual((await other.assemble({ ...params, tokenBudget: 100000 })).messages, newer.messages);
});

test("finding 2: images and thinking blocks count against the token budget of assemble", async () => {
  const host = hostSession("s-media");
  const engine = await engineFor(host);
  const image = { type: "image", data: pngOf(1200, 900), mimeType: "image/png" }; // 1440 tokens (1200*900/750)
  const thinking = { type: "thinking", thinking: "Let me think about this carefully. ".repeat(240) }; // 8400 characters
  const turns = [
    host.turn("m0", [{ role: "user", content: [{ type: "text", text: "what is in this picture?" }, image], timestamp: 1 },
      assistantMessage([thinking, { type: "text", text: "A cat." }])]),
    host.turn("m1", [userMessage("thanks"), assistantMessage("you are welcome")]),
  ];
  for (const turn of turns) assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });

  const whole = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey, tokenBudget: 100000 });
  assert.equal(whole.messages.length, 4);
  // The image (1440 tokens) and the thinking (about 2100 tokens at 4 characters a token) are counted.
  assert.ok(whole.estimatedTokens >= 1440 + 2000, `estimatedTokens ${whole.estimatedTokens}`);

  // A budget the text fits in but not the image and the thinking: they are left out, and the estimate
  // stays within the budget.
  const tight = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey, tokenBudget: 1000 });
  assert.ok(tight.estimatedTokens <= 1000, `estimatedTokens ${tight.estimatedTokens} over the budget of 1000`);
  assert.ok(tight.messages.length >= 2, "the last turn fits");
  assert.ok(tight.messages.every((m) => !JSON.stringify(m.content).includes('"image"')
    && !JSON.stringify(m.content).includes('"thinking"')), "what is over the budget is left out");
});

test("finding 3: the memory plugin's prompt guidance is part of the systemPromptAddition", async () => {
  const host = hostSession("s-memory");
  const seen = [];
  host.sdk.buildMemorySystemPromptAddition = (params) => {
    seen.push(params);
    return params.availableTools.has("memory_search") ? "## Memory Recall\nRun memory_search before answering." : undefined;
  };
  const engine = await engineFor(host, { engine: "lossless" });
  await engine.commitTurn(host.turn("r0", [userMessage("remember the blue door"), assistantMessage("noted")]));
  const tools = new Set(["memory_search", "memory_get", "read"]);
  const out = await engine.assemble({
    sessionId: host.sessionId, sessionKey: host.sessionKey, availableTools: tools, citationsMode: "on", tokenBudget: 50000,
  });
  assert.match(out.systemPromptAddition ?? "", /## Memory Recall\nRun memory_search before answering\./);
  assert.equal(seen.length, 1);
  assert.equal(seen[0].availableTools, tools); // forwarded as the host gave them
  assert.equal(seen[0].citationsMode, "on");
  assert.equal(seen[0].agentSessionKey, host.sessionKey);
  // No guidance (no memory tools): no addition of its own.
  const none = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey, availableTools: new Set(["read"]) });
  assert.equal(none.systemPromptAddition, undefined);
});

// Two tool results of 3.5 MiB (each under the 4 MiB entry cap once stored) after a pasted 1.2 MiB log:
// over the service's 8 MiB turn cap (and its 8 MiB request body) together.
function bigTurn(host, key) {
  return host.turn(key, [
    userMessage(`why does this fail?\n${logOf("paste", 1.2)}`),
    toolCall("c1", "read", { path: "a.log" }), toolResult("c1", logOf("alpha", 3.5)),
    toolCall("c2", "read", { path: "b.log" }), toolResult("c2", logOf("beta", 3.5)),
    assistantMessage("Both logs say the same thing."),
  ]);
}

test("finding 4: a turn over the service's turn cap (two 3.5 MiB tool results) is cut to fit and commits", async () => {
  const host = hostSession("s-turn");
  const engine = await engineFor(host, { engine: "lossless" });
  await engine.commitTurn(host.turn("t0", [userMessage("hello"), assistantMessage("hi")]));
  const turn = bigTurn(host, "t1");
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  assert.deepEqual(await engine.commitTurn(turn), { status: "duplicate" }); // a host replay
  assert.equal((await service.get(`/v1/sessions/${host.sessionId}`)).visible_count, 8);
  const assembled = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey, tokenBudget: 10000000 });
  assert.equal(assembled.messages.length, 8);
  const [paste, , first, , second, reply] = assembled.messages.slice(2);
  assert.deepEqual(paste, turn.messages[0]); // what came first is whole
  for (const [result, whole] of [[first, logOf("alpha", 3.5)], [second, logOf("beta", 3.5)]]) {
    const text = contentText(result.content);
    assert.match(text, /\n\[\.\.\. \d+ characters cut by transcript-store: the turn is over the \d+ bytes the store takes in one turn\]$/);
    assert.ok(text.length > 500000 && whole.startsWith(text.slice(0, text.indexOf("\n[... "))), "a head of the result is kept");
  }
  assert.deepEqual(reply, turn.messages[5]);
  // An import of the same host transcript finds every message of the turn where the commit put it.
  const boot = await engine.bootstrap({ sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() });
  assert.equal(boot.importedMessages, 0);
  assert.equal((await service.get(`/v1/sessions/${host.sessionId}`)).visible_count, 8);
});

test("finding 4: the turn cap holds where the body limit is larger", async () => {
  // --max-body 16 MiB: the body passes, and the service's 8 MiB turn cap is what refuses the turn.
  const host = hostSession("s-turn-cap");
  const engine = await engineFor(host, { engine: "legacy", on: large });
  const turn = bigTurn(host, "c0");
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  const assembled = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey, tokenBudget: 10000000 });
  assert.match(contentText(assembled.messages[4].content), /cut by transcript-store: the turn is over the 8388608 bytes/);
});

test("finding 4: a turn imported before its commit is cut the same way, then commits as imported", async () => {
  // An import that reads the host's transcript past a turn not yet committed (the compaction's import of
  // a turn that timed out, a catch-up import) stores the turn as its commit then sends it.
  const host = hostSession("s-turn-import");
  const engine = await engineFor(host, { engine: "legacy" });
  await engine.commitTurn(host.turn("d0", [userMessage("hello"), assistantMessage("hi")]));
  const turn = bigTurn(host, "d1");
  const boot = await engine.bootstrap({ sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() });
  assert.equal(boot.importedMessages, 6); // in several pages (4 MiB of host bytes each)
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  assert.equal((await service.get(`/v1/sessions/${host.sessionId}`)).visible_count, 8); // matched, not stored again
  const again = await engine.bootstrap({ sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() });
  assert.equal(again.importedMessages, 0);
  assert.equal((await service.get(`/v1/sessions/${host.sessionId}`)).visible_count, 8);
});

test("finding 5: the plugin learns a lower entry cap and body limit from the service", async () => {
  const host = hostSession("s-small");
  const engine = await engineFor(host, { on: small }); // no maxEntryBytes given
  // 0.6 MiB of text is stored twice (the projection and the host's message) unless it is over the cap:
  // 1.2 MiB, over this service's 1 MiB entry cap; kept once, whole.
  const result = toolResult("c1", "y".repeat(0.6 * MiB));
  assert.deepEqual(await engine.commitTurn(host.turn("l0", [userMessage("read it"), toolCall("c1", "read", {}), result,
    assistantMessage("read")])), { status: "committed" });
  // Four results of 0.9 MiB each: under the entry cap, over the 3 MiB body limit together.
  const four = [userMessage("read four")];
  for (let k = 0; k < 4; k += 1) four.push(toolCall(`f${k}`, "read", {}), toolResult(`f${k}`, `${k}`.repeat(0.9 * MiB)));
  four.push(assistantMessage("read them all"));
  assert.deepEqual(await engine.commitTurn(host.turn("l1", four)), { status: "committed" });
  const assembled = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey, tokenBudget: 10000000 });
  assert.equal(assembled.messages.length, 14);
  assert.deepEqual(assembled.messages[2], result);
  assert.deepEqual(assembled.messages[6], four[2]); // the first results of the turn are whole
  assert.match(contentText(assembled.messages.at(-2).content), /characters cut by transcript-store: the turn is over the 3145728 bytes/);
  const boot = await engine.bootstrap({ sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() });
  assert.equal(boot.importedMessages, 0);
});

// Both on one service restarted once (the same store and port, now with a 1 MiB entry cap), each in a
// session of its own: a service start is most of what either costs.
test("a service restarted with a lower entry cap: running engines read its limits again (finding 5), and a replay is a duplicate, not a collision", async () => {
  const first = await startService();
  let second;
  try {
    // finding 5: limits that change under a running gateway are read again.
    const host = hostSession("s-restart");
    const engine = await engineFor(host, { on: first });
    assert.deepEqual(await engine.commitTurn(host.turn("r0", [userMessage("hello"), assistantMessage("hi")])),
      { status: "committed" });
    // A replay: 0.6 MiB of text kept twice (1.2 MiB): whole under the 4 MiB cap, kept once under a 1 MiB one.
    const replayHost = hostSession("s-replay-limits");
    const replayEngine = await engineFor(replayHost, { on: first });
    const replayed = toolResult("c1", "w".repeat(0.6 * MiB));
    const turn = replayHost.turn("x0", [userMessage("read it"), toolCall("c1", "read", {}), replayed, assistantMessage("read")]);
    assert.deepEqual(await replayEngine.commitTurn(turn), { status: "committed" }); // (its answer lost to the host)

    await first.stop({ keep: true });
    second = await startService({ dir: first.dir, port: first.port, env: { TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES: String(MiB) } });

    const result = toolResult("c1", "z".repeat(0.6 * MiB)); // 1.2 MiB stored twice, over the new cap
    assert.deepEqual(await engine.commitTurn(host.turn("r1", [userMessage("read it"), toolCall("c1", "read", {}), result,
      assistantMessage("read")])), { status: "committed" });
    const assembled = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey, tokenBudget: 10000000 });
    assert.deepEqual(assembled.messages[4], result);

    // The host's replay from its outbox, by the running engine and by a new one (a process started since).
    assert.deepEqual(await replayEngine.commitTurn(turn), { status: "duplicate" });
    assert.deepEqual(await (await engineFor(replayHost, { on: second })).commitTurn(turn), { status: "duplicate" });
    // Another turn under the same key still collides: only a cut by earlier limits is taken for the same.
    const other = { ...turn, messages: [...turn.messages.slice(0, 3), assistantMessage("read, differently")] };
    await assert.rejects(replayEngine.commitTurn(other), (error) => error.code === "advancement_key_collision");
    const receipts = await second.get(`/v1/engines/legacy/sessions/${replayHost.sessionId}/receipts`);
    assert.equal(receipts.receipts.length, 1);
  } finally {
    await (second ?? first).stop();
  }
});

test("a prompt longer than the service's body limit is cut to fit, and cut again when the limit falls", async () => {
  // A pasted log as the prompt: sent whole, every assemble of the turn was 413 near a small --max-body.
  const sent = [];
  const fetchImpl = async (url, init) => {
    if (String(url).endsWith("/assemble")) sent.push(JSON.parse(init.body));
    return fetch(url, init);
  };
  const head = `quote " backslash \\ tab \t emoji \u{1f642} control \u0001 ${"\u00e9".repeat(10)}\n`;
  // 3.5 MiB JSON-escaped: over the small service's 3 MiB body limit (and a body the 1 MiB service below
  // still reads to its end before its 413, rather than closing the connection under it).
  const prompt = head.repeat(Math.ceil(3.5 * MiB / (Buffer.byteLength(JSON.stringify(head)) - 2)));
  const bodies = () => sent.map((body) => Buffer.byteLength(JSON.stringify(body)));
  const host = hostSession("s-prompt");
  const engine = await engineFor(host, { on: small, fetchImpl }); // --max-body 3 MiB
  await engine.commitTurn(host.turn("p0", [userMessage("hello"), assistantMessage("hi")]));
  const ask = (on, of = host) => on.assemble({ sessionId: of.sessionId, sessionKey: of.sessionKey, tokenBudget: 100000,
    prompt, availableTools: new Set(["read", "write"]) });
  assert.equal((await ask(engine)).messages.length, 2);
  const [body] = sent;
  assert.ok(bodies()[0] <= 3 * MiB && bodies()[0] > 3 * MiB - 4096, `${bodies()[0]} bytes`);
  const kept = body.prompt.slice(0, body.prompt.indexOf("\n[... "));
  assert.ok(prompt.startsWith(kept) && kept.length > MiB);
  assert.equal(body.prompt.slice(kept.length),
    `\n[... ${prompt.length - kept.length} characters cut by transcript-store: the prompt is over the 3145728 bytes the service takes in one request]`);
  // A short prompt goes whole.
  sent.length = 0;
  await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey, tokenBudget: 100000, prompt: "go on" });
  assert.equal(sent[0].prompt, "go on");

  // The service restarted with a lower --max-body under a running engine: the 413 makes it read the
  // limits again and cut the prompt to them.
  const first = await startService();
  let second;
  try {
    const other = hostSession("s-prompt-restart");
    const running = await engineFor(other, { on: first, fetchImpl });
    await running.commitTurn(other.turn("q0", [userMessage("hello"), assistantMessage("hi")]));
    await first.stop({ keep: true });
    second = await startService({ dir: first.dir, port: first.port, args: ["--max-body", String(MiB)] });
    sent.length = 0;
    assert.equal((await ask(running, other).catch((error) => assert.fail(error.message))).messages.length, 2);
    assert.equal(sent.length, 2); // whole by the 8 MiB it knew (413), then cut by the 1 MiB it read again
    assert.ok(bodies()[0] > MiB && bodies()[1] <= MiB && bodies()[1] > MiB - 4096, `${bodies()} bytes`);
    assert.match(sent.at(-1).prompt, /the prompt is over the 1048576 bytes the service takes in one request\]$/);
  } finally {
    await (second ?? first).stop();
  }
});

test("finding 6: a compaction inside a turn leaves the turn's own message out of the mirror", async () => {
  // OpenClaw reads under the turn's fence in bootstrap and assemble only; its overflow recovery compacts
  // without one. The import before (owned) or after (delegated) the compaction took the turn's user
  // message into the mirror: the retry's assemble sent it twice, its fenced bootstrap failed (crossed).
  for (const engineId of ["lossless", "legacy"]) {
    const host = hostSession(`s-midturn-${engineId}`);
    const params = { sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() };
    for (let k = 0; k < 3; k += 1) {
      const engine = await engineFor(host, { engine: engineId });
      await engine.bootstrap(params);
      const turn = host.turn(`k${k}`, [userMessage(`question ${k}`), assistantMessage(`answer ${k}`)]);
      assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
    }
    const engine = await engineFor(host, { engine: engineId }); // one engine a turn, as OpenClaw builds them
    const [prompt] = host.append([userMessage("CURRENT PROMPT")]);
    host.fence = prompt.entryId;
    await engine.bootstrap(params);
    host.fence = undefined; // the recovery's compaction reads without the fence
    await engine.compact({ ...params, force: true, tokenBudget: 100000 });
    host.fence = prompt.entryId; // the retry of the same turn
    await engine.bootstrap(params);
    const retry = await engine.assemble({ ...params, tokenBudget: 100000, prompt: "CURRENT PROMPT" });
    assert.ok(!JSON.stringify(retry.messages).includes("CURRENT PROMPT"), `${engineId}: ${JSON.stringify(retry.messages)}`);
  }
});


test("finding 7: a service that stopped fails the engine's build, so OpenClaw runs the turn on legacy", async () => {
  // The description was cached for the process: a stopped service built an engine in 0 ms, and each of
  // the turn's calls failed only after its whole timeout, the turn kept on the plugin.
  const own = await startService();
  const host = hostSession("s-down");
  const engine = await engineFor(host, { on: own });
  await engine.bootstrap({ sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() });
  await own.stop();
  await assert.rejects(engineFor(host, { on: own }));
});

test("finding 8: an import resuming in a large group remembers its weight across engines of one process", async () => {
  // OpenClaw builds an engine for each logical turn: what the open group weighed where the last import
  // stopped lived in the engine, so the next turn's engine counted the group from zero, stored its next
  // message differently from the commit of that turn, and the mirror branched.
  const stored = async (host, engines) => {
    const params = { sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() };
    const [head, tail] = [bigTurn(hostSession("scratch"), "x").messages.slice(0, 3), bigTurn(hostSession("scratch"), "x").messages.slice(3)];
    host.append(head); // a turn that ran out (never committed): its first messages
    await engines[0].bootstrap(params);
    host.append(tail); // ... and the rest, imported by the next engine
    await engines[1].bootstrap(params);
    const assembled = await engines[1].assemble({ ...params, tokenBudget: 10000000 });
    return assembled.messages.map((m) => contentText(m.content));
  };
  const single = hostSession("s-group-one");
  const one = await engineFor(single);
  const together = await stored(single, [one, one]);
  const split = hostSession("s-group-two");
  const apart = await stored(split, [await engineFor(split), await engineFor(split)]);
  assert.equal(apart.length, together.length);
  assert.ok(apart.every((text, i) => text === together[i]), "each message stored as one engine stores it");
  // The second tool result was cut to the group's share (what the messages before it left), not whole.
  assert.match(together[4], /cut by transcript-store: the turn is over/);
});

test("finding 9: an owned compaction inside a turn makes room from the turn's own messages when it must", async () => {
  // The turn's own tool results overflow a short history: compacting what preceded the turn made no
  // progress, and OpenClaw (no compaction of its own for an engine that owns it) ended the turn.
  const host = hostSession("s-own-overflow");
  const params = { sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() };
  const engine0 = await engineFor(host, { engine: "lossless" });
  await engine0.bootstrap(params);
  assert.deepEqual(await engine0.commitTurn(host.turn("o0", [userMessage("hello"), assistantMessage("hi")])),
    { status: "committed" });
  const engine = await engineFor(host, { engine: "lossless" }); // one engine a turn, as OpenClaw builds them
  const [prompt] = host.append([userMessage("read the logs")]);
  host.fence = prompt.entryId;
  await engine.bootstrap(params);
  host.fence = undefined; // the overflow recovery's compaction reads without the fence
  const rounds = [];
  for (let k = 0; k < 6; k += 1) {
    rounds.push(toolCall(`r${k}`, "read", { path: `${k}.log` }), toolResult(`r${k}`, logOf(`part${k}`, 0.02)));
  }
  host.append(rounds);
  // As OpenClaw's overflow recovery asks: forced, with the token count the failed request had.
  const compacted = await engine.compact({ ...params, force: true, tokenBudget: 8000, currentTokenCount: 90000 });
  assert.equal(compacted.ok && compacted.compacted, true, JSON.stringify(compacted));
  host.fence = prompt.entryId; // the retry: its fenced bootstrap finds the mirror past the fence
  await engine.bootstrap(params);
  const retry = await engine.assemble({ ...params, tokenBudget: 8000 });
  assert.ok(retry.estimatedTokens <= 8000, String(retry.estimatedTokens));
  host.fence = undefined;
  const [reply] = host.append([assistantMessage("the logs agree")]);
  const turn = {
    advancementKey: "o1", sessionId: host.sessionId, sessionKey: host.sessionKey, isHeartbeat: false,
    sessionTarget: host.target(),
    admission: { entryId: prompt.entryId, activeMessagePosition: 2 },
    terminal: { entryId: reply.entryId, activeMessagePosition: 2 + rounds.length + 1 },
    messages: [prompt.message, ...rounds, reply.message],
  };
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  assert.equal((await service.get(`/v1/sessions/${host.sessionId}`)).visible_count, 2 + 1 + rounds.length + 1);
});

test("finding 10: a thinking block cut to fit its turn loses its signature, never sent cut and signed", async () => {
  // A long agentic turn: fourteen reads of 1 MiB each leave the reply a share far under its 48 KB of
  // thinking. Cut, the text no longer matches Anthropic's signature over it, and a replay of the history
  // with both was refused ("invalid signature in thinking block"); a redacted block's opaque data, cut
  // and given a marker, was refused the same way.
  const host = hostSession("s-signed");
  const engine = await engineFor(host);
  const rounds = [];
  for (let i = 0; i < 14; i += 1) {
    rounds.push(toolCall(`r${i}`, "read", { path: `part-${i}.log` }), toolResult(`r${i}`, logOf(`part ${i}`, 1)));
  }
  const signature = `EqQBCkYIBxgCKkA${"s".repeat(1400)}`;
  const reply = assistantMessage([
    { type: "thinking", thinking: "Weighing the logs against each other. ".repeat(1300), thinkingSignature: signature },
    { type: "thinking", thinking: "", thinkingSignature: "R".repeat(30000), redacted: true },
    { type: "text", text: "The logs agree." },
  ]);
  const turn = host.turn("sig", [userMessage("compare the logs"), ...rounds, reply]);
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  const assembled = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey });
  const [thinking, redacted, text] = assembled.messages.at(-1).content;
  assert.match(thinking.thinking, /characters cut by transcript-store/);
  assert.equal(thinking.thinkingSignature, undefined);
  assert.equal(redacted.redacted, undefined);
  assert.equal(redacted.thinkingSignature, undefined);
  assert.match(redacted.thinking, /^\[redacted thinking of 30000 characters dropped by transcript-store/);
  assert.deepEqual(text, { type: "text", text: "The logs agree." });
  // A block that fits keeps its signature, whole.
  const small = host.turn("sig-small", [userMessage("and now?"), reply]);
  assert.deepEqual(await engine.commitTurn(small), { status: "committed" });
  const again = await engine.assemble({ sessionId: host.sessionId, sessionKey: host.sessionKey });
  assert.deepEqual(again.messages.at(-1), reply);
});

test("finding 11: session ids with characters a URL escapes are addressed through the API", async () => {
  for (const id of ["team/alice", "a?b#c", "100%", "é ü", "%2F"]) {
    const host = hostSession(id);
    const engine = await engineFor(host);
    await engine.bootstrap({ sessionId: id, sessionKey: host.sessionKey, sessionTarget: host.target() });
    const turn = host.turn(`k-${id}`, [userMessage("hi"), assistantMessage("hello")]);
    assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
    const assembled = await engine.assemble({ sessionId: id, sessionKey: host.sessionKey });
    assert.deepEqual(assembled.messages, turn.messages, id);
  }
});

test("finding 12: signed thinking kept across a compaction is not replayed with its stale signature", async () => {
  // A thinking signature is bound to the prefix the reply was generated after. A compaction replaces
  // that prefix (a summary instead of the older messages), so the messages it kept carry signatures
  // a provider no longer verifies (Anthropic: "Invalid signature in thinking block", later
  // "prefix_binding_mismatch"). OpenClaw strips them from its own history after its compactions
  // (stripStaleThinkingSignaturesForCompactionReplay, then drops the unsigned blocks), but what a
  // context engine assembles is sent as it is: the plugin must do it. Replies after the compaction
  // keep theirs, byte for byte.
  const signed = (k, timestamp) => assistantMessage([
    { type: "thinking", thinking: `Weighing option ${k}. `.repeat(20), thinkingSignature: `EqQBCkYIBxgCKkA-${k}-${"s".repeat(300)}` },
    { type: "text", text: `answer ${k}` },
  ], timestamp);
  const redacted = (timestamp) => assistantMessage([
    { type: "thinking", thinking: "", thinkingSignature: "R".repeat(400), redacted: true },
  ], timestamp);
  const isStale = (message) => message.role === "assistant"
    && message.content.every((part) => part.type !== "thinking" && !("thinkingSignature" in part));
  for (const engineId of ["legacy", "lossless"]) {
    const host = hostSession(`s-stale-sig-${engineId}`);
    const params = { sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() };
    const old = Date.now() - 3600000;
    const before = [];
    for (let k = 0; k < 8; k += 1) {
      const engine = await engineFor(host, { engine: engineId });
      await engine.bootstrap(params);
      const reply = k === 7 ? redacted(old + 2 * k + 1) : signed(k, old + 2 * k + 1);
      before.push(reply);
      const turn = host.turn(`b${k}`, [userMessage(`question ${k} `.repeat(40), old + 2 * k), reply]);
      assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
    }
    const engine = await engineFor(host, { engine: engineId });
    const compacted = await engine.compact({ ...params, force: true, tokenBudget: 1500 });
    assert.equal(compacted.compacted, true, `${engineId}: ${JSON.stringify(compacted)}`);
    const now = Date.now() + 1000;
    const after = signed("after", now + 1);
    assert.deepEqual(await engine.commitTurn(host.turn("a0", [userMessage("and now?", now), after])),
      { status: "committed" });
    const assembled = await engine.assemble({ ...params, tokenBudget: 100000 });
    const replies = assembled.messages.filter((m) => m.role === "assistant");
    const kept = replies.slice(0, -1);
    assert.ok(kept.length >= 1, `${engineId}: the compaction kept a reply from before it`);
    for (const reply of kept) {
      assert.ok(isStale(reply), `${engineId}: a reply from before the compaction replays its signed thinking: ${JSON.stringify(reply).slice(0, 300)}`);
      const original = before.find((m) => m.timestamp === reply.timestamp);
      assert.deepEqual({ ...reply, content: undefined }, { ...original, content: undefined }); // only its thinking goes
      const text = original.content.filter((part) => part.type !== "thinking");
      assert.deepEqual(reply.content, text.length ? text : [{ type: "text", text: "[assistant reasoning omitted]" }]);
    }
    assert.deepEqual(replies.at(-1), after, `${engineId}: a reply after the compaction keeps its signature`);
  }
});

test("a host message nested deeper than the store takes is stored, its deepest values kept as JSON text", async () => {
  // The service refuses JSON nested past 64 levels, and a stored message holds the host's one level or two
  // deeper: a tool result whose details (an MCP tool's structured content, a parsed document) nested
  // about that deep failed its turn's commit and every import for good, and the session stayed on legacy.
  const nested = (levels) => { let value = "leaf"; for (let i = 0; i < levels; i += 1) value = { a: value }; return value; };
  const host = hostSession("deep-nesting");
  const engine = await engineFor(host);
  const params = { sessionId: host.sessionId, sessionKey: host.sessionKey, sessionTarget: host.target() };
  await engine.bootstrap(params);
  const call = toolCall("c1", "store", { tree: nested(70) });
  const output = { ...toolResult("c1", "stored"), details: nested(70) };
  const turn = host.turn("k-deep", [userMessage("store this tree"), call, output, assistantMessage("done", 4)]);
  assert.deepEqual(await engine.commitTurn(turn), { status: "committed" });
  const { messages } = await engine.assemble({ ...params, messages: [] });
  const back = messages.find((message) => message.role === "toolResult");
  let depth = 0;
  for (let value = back.details; value && typeof value === "object"; value = value.a) depth += 1;
  assert.ok(depth >= 50, `kept as objects down to ${depth} levels`);
  assert.equal(typeof JSON.parse(JSON.stringify(back.details)), "object");
  assert.deepEqual(messages.at(-1), turn.messages.at(-1));
  assert.deepEqual(await engine.commitTurn(turn), { status: "duplicate" }); // the replay maps to the same stored turn
  const again = await engineFor(host); // an import of the same messages finds the turn it holds
  await again.bootstrap(params);
});
