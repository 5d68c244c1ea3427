// The OpenClaw ContextEngine backed by a transcript-store service.
//
// The service keeps a mirror of each host session's transcript in its store (session id = the host's
// sessionId, session key = the host's sessionKey) and runs one of its engines over it:
// - bootstrap imports the host transcript through readSessionTranscriptVisibleMessageDelta, page by
//   page from where the last import stopped (the service records the host's cursor), honouring
//   `reset` (start again from the fresh cursor) and `requiredBytes` (re-read with a page that fits);
// - assemble returns the service engine's messages and estimatedTokens (images and thinking blocks,
//   which the service's count does not see, counted here and held to the budget), and as its
//   systemPromptAddition the memory plugin's prompt guidance (buildMemorySystemPromptAddition) with the
//   service engine's own;
// - commitTurn forwards the accepted turn (advancementKey, admission, terminal, messages,
//   isHeartbeat, sessionTarget); the service mirrors it and commits it through its ledger in one
//   transaction, so a host replay of the same key comes back "duplicate";
// - compact runs the service engine's compaction when it owns compaction, else OpenClaw's own
//   (delegateCompactionToRuntime), after which the compacted host transcript is imported, so the next
//   assemble returns it; OpenClaw's compactions that never called the engine (its in-run
//   auto-compaction) are found in its raw transcript at bootstrap and recorded the same way, and so are its
//   resets kept in the same transcript (/new, /reset: its context starts again after them).
// What is sent is sized by the service's limits (entry cap, turn cap, body limit), read from its
// description of the engine.
// Every failure to reach the service throws: the host then runs the turn on its legacy path and keeps
// the commit in its outbox, replaying it later with the same key.

import { createClient, ServiceError } from "./client.js";
import {
  contentText, cutToJsonBytes, ENTRY_CAP_BYTES, fromStored, jsonBytes, mediaTokens, roughMessageTokens, storedInGroups, storedTurn,
  toStored, TURN_CAP_BYTES, wellFormed, withoutStaleThinking,
} from "./messages.js";

export const PLUGIN_ID = "transcript-store";
export const VERSION = "0.1.0";
const CURRENT_TURN_FENCE = "before-current-turn-entry-v1";
const TURN_ADVANCEMENT_IDEMPOTENCY = "atomic-idempotent-v1";
const PAGE_MESSAGES = 500;
const PAGE_BYTES = 4 * 1024 * 1024;
// An import page's request body: at most half the service's --max-body (8 MiB by default), as a page's
// stored form (the host's message and its projection, tool-call arguments escaped twice) can weigh
// more than the host's bytes the page was read by.
const PAGE_BODY_BYTES = 4 * 1024 * 1024;
// The service's default --max-body, for a service that does not describe its limits (older than them).
const BODY_LIMIT_BYTES = 8 * 1024 * 1024;
// What a body holds besides one entry (an import page's or a commit's keys and ids).
const BODY_OVERHEAD = 64 * 1024;
// What an assemble body keeps free besides its prompt, tools and budget (its bytes are counted here as
// the client sends them: a little room all the same).
const ASSEMBLE_MARGIN = 512;
// Assembling again with a smaller budget when images and thinking blocks put the context over it.
const ASSEMBLE_ROUNDS = 4;
// The service's bounds on assemble's available_tools and compact's focus.
const MAX_TOOLS = 1000;
const MAX_FOCUS_CHARS = 10000;
// The service's bound on a token budget (assemble's and compact's): 1 to 100 million tokens.
const MAX_TOKEN_BUDGET = 100_000_000;
const MAX_PAGES = 100000;

/** Plugin config (plugins.entries.transcript-store.config) with environment fallbacks. */
export function resolveConfig(pluginConfig = {}, env = process.env) {
  return {
    serviceUrl: pluginConfig.serviceUrl || env.TRANSCRIPT_STORE_SERVICE_URL || "",
    token: pluginConfig.token || env.TRANSCRIPT_STORE_TOKEN || "",
    engine: pluginConfig.engine || env.TRANSCRIPT_STORE_ENGINE || "lossless",
    timeoutMs: timeoutOf(pluginConfig.timeoutMs || env.TRANSCRIPT_STORE_TIMEOUT_MS || 15000),
  };
}

// The bounds of the config schema, for the environment's value too: "15s" was NaN, and a timer
// of NaN fires at once, so every request to the service failed as "no answer within NaN ms".
function timeoutOf(value) {
  const ms = Number(value);
  if (!Number.isInteger(ms) || ms < 100 || ms > 600000) {
    throw new Error(`transcript-store: timeoutMs (or TRANSCRIPT_STORE_TIMEOUT_MS) must be a whole number of milliseconds in 100..600000, got ${JSON.stringify(String(value))}`);
  }
  return ms;
}

// A host's token budget as the service takes it: a whole number of tokens from 1 to 100 million; null (the
// service's own budget) when the host gives none. Sent as it came, a budget past the bound (a model
// configured with a context window over 100 million tokens) or under one token was refused (422): every
// assemble threw (OpenClaw then sends the model its own unassembled history) and an owned compaction did nothing.
function tokenBudgetOf(value) {
  if (!Number.isFinite(value) || value <= 0) return null;
  return Math.min(Math.max(Math.floor(value), 1), MAX_TOKEN_BUDGET);
}

// The session a compaction continues in: its successor when it names one, else the caller's.
function successorOf(target, result) {
  const next = result.result && typeof result.result === "object" ? result.result : {};
  const named = next.sessionTarget && typeof next.sessionTarget === "object" ? next.sessionTarget : null;
  const sessionId = named?.sessionId ?? next.sessionId;
  if (!sessionId || sessionId === target.sessionId) return target;
  return {
    agentId: named?.agentId ?? target.agentId,
    sessionId,
    sessionKey: named?.sessionKey ?? target.sessionKey,
    storePath: named?.storePath ?? target.storePath,
  };
}

// A token budget that leaves out the oldest of `stored` (the service's answer) until the rest fits in
// `budget` with their images and thinking blocks (`media`): the service's count of that rest. Each
// message's share of the service's `estimated` count is estimated by the service's rough rule (scaled
// to `estimated`, which a tiktoken count differs from); an engine fitting messages one by one counts
// each with the reply priming (3 tokens) of a list. Null when nothing fits.
function budgetWithout(stored, media, estimated, budget) {
  const rough = stored.map(roughMessageTokens);
  const total = rough.reduce((sum, tokens) => sum + tokens, 0);
  if (total <= 0) return null;
  const scale = Math.max(estimated - 3, 1) / total;
  let asked = 0;
  let used = 3;
  let kept = 0;
  for (let i = stored.length - 1; i >= 0; i -= 1) {
    const text = rough[i] * scale;
    if (used + text + media[i] > budget) break;
    used += text + media[i];
    asked += text + 3;
    kept += 1;
  }
  if (kept === 0) return null;
  return Math.min(Math.ceil(asked), estimated - 1); // at least one message fewer than now
}

// Whether OpenClaw keeps a host message out of the model's context: `excludeFromContext` on a message
// entry (a context-free command and the gateway's reply to it, a hidden talk-consult prompt). OpenClaw's
// own context (buildSessionContext) skips it, yet its visible messages and a turn's closed range, which
// the mirror stores, hold it.
function excludedFromContext(message) {
  return Boolean(message && typeof message === "object" && message.excludeFromContext === true);
}

// The service's estimate of the assembled messages whose `kept` is true: its estimate less the share of
// the others, by their rough size (the overhead of 3 stays).
function estimateOf(stored, kept, estimated) {
  if (kept.every(Boolean)) return estimated;
  const rough = stored.map(roughMessageTokens);
  const total = rough.reduce((sum, tokens) => sum + tokens, 0);
  const left = rough.reduce((sum, tokens, i) => (kept[i] ? sum : sum + tokens), 0);
  if (total <= 0) return estimated;
  return Math.max(3, Math.round(estimated - (Math.max(estimated - 3, 0) * left) / total));
}

// The service engine's host_requirements as OpenClaw's info.hostRequirements (undefined when it declares
// none): OpenClaw checks them before an operation starts and does not run the engine on a host lacking
// them (a generic CLI backend never calls assemble), which shields an engine such a host would leave in
// a wrong state.
function hostRequirementsOf(declared) {
  if (!declared || typeof declared !== "object") return undefined;
  const out = {};
  for (const [operation, requirement] of Object.entries(declared)) {
    const capabilities = requirement?.required_capabilities;
    if (!Array.isArray(capabilities)) continue;
    const message = requirement.unsupported_message;
    out[operation] = {
      requiredCapabilities: capabilities.map(String),
      ...(typeof message === "string" && message !== "" ? { unsupportedMessage: message } : {}),
    };
  }
  return Object.keys(out).length ? out : undefined;
}

// The summary the service engine shows for a compaction OpenClaw made (POST .../host_compaction).
const SUMMARY_HEAD = "[Summary of the earlier conversation]\n";

// What names one message in both OpenClaw's history and the assembly: its role, time, tool call and text
// (OpenClaw's history passed its sanitising, so not its bytes). OpenClaw's compaction summary and the
// summary the service shows for it name each other. Null when the message has no time.
function identityOf(message) {
  if (!message || typeof message !== "object") return null;
  if (message.role === "compactionSummary") return typeof message.summary === "string" ? `summary ${message.summary}` : null;
  const text = contentText(message.content);
  if (message.role === "user" && text.startsWith(SUMMARY_HEAD)) return `summary ${text.slice(SUMMARY_HEAD.length)}`;
  if (!Number.isFinite(message.timestamp)) return null;
  return JSON.stringify([message.role, message.timestamp, message.toolCallId ?? null, text]);
}

// The running turn's messages OpenClaw's own history holds and the fenced assembly ends before. A retry
// inside a turn (its overflow recovery, a timeout) prompts "Continue the current task ..." and gives
// assemble its history with the turn's user message (the first attempt persisted it) and tool results:
// without them the model never saw the question it was told to continue. They are what follows the last
// message the history and the assembly share; nothing when they share none, or on a first attempt (its
// history ends where the fence does).
// A message the history shows otherwise than the assembly (OpenClaw's sanitising) must not add again
// what the assembly holds: the turn opens at its user message, and none of it is older than the newest
// host message assembled.
function runningTurnOf(history, assembled) {
  if (!Array.isArray(history) || history.length === 0) return [];
  const shown = new Set(assembled.map(identityOf).filter((id) => id !== null));
  const newest = assembled.reduce((max, message) => (Number.isFinite(message?.timestamp)
    && !identityOf(message)?.startsWith("summary ") ? Math.max(max, message.timestamp) : max), -Infinity);
  for (let i = history.length - 1; i >= 0; i -= 1) {
    const id = identityOf(history[i]);
    if (id === null || !shown.has(id)) continue;
    const turn = history.slice(i + 1);
    if (turn.length === 0 || turn[0]?.role !== "user") return [];
    return turn.some((message) => Number.isFinite(message?.timestamp) && message.timestamp < newest) ? [] : turn;
  }
  return [];
}

async function defaultSdk() {
  const [transcripts, core] = await Promise.all([
    import("openclaw/plugin-sdk/session-transcript-runtime"),
    import("openclaw/plugin-sdk/core"),
  ]);
  return {
    readSessionTranscriptVisibleMessageDelta: transcripts.readSessionTranscriptVisibleMessageDelta,
    readSessionTranscriptRawDelta: transcripts.readSessionTranscriptRawDelta,
    delegateCompactionToRuntime: core.delegateCompactionToRuntime,
    buildMemorySystemPromptAddition: core.buildMemorySystemPromptAddition,
  };
}

// At most `max` UTF-16 units (so at most `max` characters for the service), a pair never split.
function cutText(text, max) {
  let end = Math.min(text.length, max);
  const code = text.charCodeAt(end - 1);
  if (end < text.length && code >= 0xd800 && code <= 0xdbff) end -= 1;
  return wellFormed(text.slice(0, end));
}

/**
 * What the plugin sends, sized by the service's limits (`limits` of its engine description: max_entry_bytes,
 * max_turn_bytes, max_body_bytes; the service's defaults when it gives none) and the explicit options.
 */
export function sizesOf(limits, options = {}) {
  const given = (value) => (Number.isInteger(value) && value > 0 ? value : undefined);
  const body = given(limits?.max_body_bytes) ?? BODY_LIMIT_BYTES;
  const entry = given(options.maxEntryBytes) ?? given(limits?.max_entry_bytes) ?? ENTRY_CAP_BYTES;
  const turn = given(limits?.max_turn_bytes) ?? TURN_CAP_BYTES;
  return {
    // One entry must also fit in a body (an import page of one message, a commit of one).
    maxEntryBytes: Math.max(Math.min(entry, body - BODY_OVERHEAD), 1024),
    // A turn's messages go in one commit body.
    turnLimit: Math.min(turn, body),
    // Half the body limit: a page's stored form can weigh more than the host bytes it was read by.
    pageBodyBytes: given(options.pageBodyBytes) ?? Math.min(PAGE_BODY_BYTES, Math.floor(body / 2)),
    // The service's --max-body: an assemble's prompt is cut to what it leaves.
    bodyLimit: body,
  };
}

const described = new Map();

// The limits this process has sized what it sends by, per service and engine (at most SEEN_SIZES, the
// newest last): a host's replay of a turn committed before the service was restarted with other limits
// is cut otherwise, and the ledger answers 409 advancement_key_collision; cut by the earlier limits, the
// replay is the committed payload again (see commitTurn).
const SEEN_SIZES = 8;
const seenSizes = new Map();

function rememberSizes(key, value) {
  const list = (seenSizes.get(key) ?? []).filter((known) => JSON.stringify(known) !== JSON.stringify(value));
  list.push(value);
  seenSizes.set(key, list.slice(-SEEN_SIZES));
}

async function describeEngine(client, engine, { fresh = false } = {}) {
  const key = `${client.base} ${engine}`;
  if (fresh || !described.has(key)) {
    const promise = client.get(`/v1/engines/${encodeURIComponent(engine)}`);
    described.set(key, promise);
    promise.catch(() => described.delete(key));
  }
  return described.get(key);
}

/**
 * Build the engine. Asks the service for the engine's declarations, every time (OpenClaw builds an
 * engine for each logical turn): an unreachable service fails here, before the turn starts, and OpenClaw
 * runs that turn on its legacy path. Answered from the process's cache, a stopped service was found only
 * by the turn's calls, each after its whole timeout, and the turn stayed on the plugin without a working
 * compaction.
 * @param {{serviceUrl: string, token: string, engine?: string, timeoutMs?: number,
 *          sdk?: object, fetchImpl?: typeof fetch, logger?: {warn?: Function, info?: Function},
 *          pageMessages?: number, pageBytes?: number, pageBodyBytes?: number,
 *          maxEntryBytes?: number}} options
 */
// Per session: where the last import stopped and what the open group of messages there weighed
// (storedInGroups), so that an import resuming there stores the group's next messages as a commit of
// their turn does. Module-wide, not per engine: OpenClaw builds an engine for each logical turn, and a
// per-engine memory was gone by the next turn's import (it counted the group from zero, stored a
// message differently from the turn's commit, and the mirror branched). The entry is used only when
// its cursor is the one the service recorded; at most GROUP_MEMORY sessions, the least recently
// imported forgotten first (an import resuming there counts the group from where it resumes).
const GROUP_MEMORY = 4096;
const importGroups = new Map();

function rememberGroup(key, value) {
  importGroups.delete(key);
  importGroups.set(key, value);
  if (importGroups.size > GROUP_MEMORY) importGroups.delete(importGroups.keys().next().value);
}

// Per session: the token budget of this process's last assemble of it, sent with maintain, which the
// service compacts against (without it the service took the last assemble budget its own process saw, or
// its default: another after a restart). Module-wide, as importGroups; at most GROUP_MEMORY sessions.
const assembleBudgets = new Map();

function rememberBudget(key, budget) {
  assembleBudgets.delete(key);
  assembleBudgets.set(key, budget);
  if (assembleBudgets.size > GROUP_MEMORY) assembleBudgets.delete(assembleBudgets.keys().next().value);
}

// Per session: where this process's last look for OpenClaw's compactions in the raw host transcript
// stopped (a raw cursor), so that a bootstrap reads only what was appended since. A process that has not
// looked yet (a gateway's first turn of the session, every `openclaw agent --local`) reads the session's
// raw transcript from its start once. At most GROUP_MEMORY sessions, the least recently read forgotten.
const compactionScans = new Map();
const RAW_PAGE_EVENTS = 1000;
const RAW_PAGE_BYTES = 4 * 1024 * 1024;

// OpenClaw's canonical transcript entry types (its transcript-tree.ts): each, unless appended "side", is
// the branch's new leaf.
const CANONICAL_ENTRIES = new Set(["message", "thinking_level_change", "model_change", "compaction", "reset",
  "branch_summary", "custom", "custom_message", "label", "session_info"]);

const nonBlank = (value) => (typeof value === "string" && value.trim() !== "" ? value : undefined);

// OpenClaw's transcript as the tree it is (its transcript-tree.ts, in what decides the active branch):
// each entry hangs after its parentId (one without a parentId, or a stale one, after the leaf); each
// canonical entry not appended "side" becomes the leaf; a `leaf` entry (a rewind, a branch switch) makes
// its targetId the leaf. The active branch runs from the leaf through the parents.
// A `reset` entry (OpenClaw's /new, /reset, an idle or daily reset kept in the same transcript) is a
// boundary nothing goes back across: after it, a canonical entry not appended "side" whose parent is not
// the reset or an entry after it (no parent, one before the reset, one on another branch) hangs after the
// leaf instead, and a `leaf` entry whose target is not after the reset changes nothing (read from
// OpenClaw's transcript-tree.ts, which re-parents them so when it reads the tree). Followed as written, an
// entry naming a parent before the reset, or a branch switch back past it, made the plugin record a
// compaction OpenClaw's context no longer has.
// OpenClaw also keeps the raw append cursor apart from the leaf (every entry moves it to itself, a `leaf`
// entry to its appendParentId, else its target): a canonical entry not appended "side" whose parentId is
// that cursor while the leaf is elsewhere (after a side entry, or a branch switch that left the cursor at
// the old branch's end) hangs after the leaf. Followed as written, the walk stayed on the branch left.
function transcriptTree() {
  const nodes = new Map();
  let leaf = null;
  let cursor = null; // the raw append cursor (OpenClaw's appendParentId)
  // The entries after the latest reset (the reset itself included); null before any reset.
  let afterReset = null;
  const pastReset = (id) => afterReset === null || (id !== null && afterReset.has(id));
  return {
    add(event) {
      if (!event || typeof event !== "object" || event.type === "session") return;
      const id = nonBlank(event.id);
      if (!id) return;
      const explicit = Object.hasOwn(event, "parentId");
      if (event.type === "leaf") {
        let target = event.targetId === null ? null : nonBlank(event.targetId);
        let appendTo = event.appendParentId === undefined ? target
          : (event.appendParentId === null ? null : nonBlank(event.appendParentId));
        if (!explicit || target === undefined || appendTo === undefined) return; // not a leaf entry
        if (event.appendMode !== undefined && event.appendMode !== "side") return;
        // A switch back across the reset stays where it is.
        if (leaf !== null && !pastReset(target)) [target, appendTo] = [leaf, leaf];
        if ((target !== null && !nodes.has(target)) || (appendTo !== null && !nodes.has(appendTo))) return; // not a valid one
        nodes.set(id, { parent: target });
        if (afterReset !== null && target !== null && afterReset.has(target)) afterReset.add(id);
        leaf = target;
        cursor = appendTo;
        return;
      }
      const canonical = CANONICAL_ENTRIES.has(event.type);
      const side = event.appendMode === "side";
      let parent = explicit ? (event.parentId === null ? null : nonBlank(event.parentId)) : (canonical ? leaf : undefined);
      if (parent === undefined) return;
      if (canonical && !side) {
        if (!pastReset(parent)) parent = leaf;
        else if (parent !== null && !nodes.has(parent) && leaf !== null) parent = leaf;
        else if (explicit && parent === cursor && leaf !== cursor) parent = leaf;
      }
      nodes.set(id, {
        parent,
        compaction: event.type === "compaction" ? event : undefined,
        reset: event.type === "reset" ? event : undefined,
      });
      cursor = id;
      if (event.type === "reset") afterReset = new Set([id]);
      else if (afterReset !== null && parent !== null && afterReset.has(parent)) afterReset.add(id);
      if (canonical && !side) leaf = id;
    },
    /**
     * The newest boundary of OpenClaw's context on the active branch, or null: a compaction (with a summary
     * and a first kept entry), or a reset (its context starts again after it, from the tail before it that
     * its firstKeptEntryId keeps, when that is on the reset's branch). With the entries before it.
     * `resetsOnly`: the newest reset (for a service engine that owns compaction: OpenClaw's compaction
     * entries are its own, the reset is what it is told).
     */
    activeBoundary({ resetsOnly = false } = {}) {
      const seen = new Set();
      for (let id = leaf; id !== null && id !== undefined && !seen.has(id); id = nodes.get(id)?.parent) {
        seen.add(id);
        const node = nodes.get(id);
        if (node?.reset) {
          const before = this.ancestorsOf(id);
          const kept = nonBlank(node.reset.firstKeptEntryId);
          return { entry: node.reset, before, reset: true, kept: kept !== undefined && before.has(kept) ? kept : null };
        }
        const found = resetsOnly ? undefined : node?.compaction;
        if (found && typeof found.summary === "string" && typeof found.firstKeptEntryId === "string") {
          return { entry: found, before: this.ancestorsOf(id) };
        }
      }
      return null;
    },
    /** The ids of the entries before `id` on its branch (its parents up to the root). */
    ancestorsOf(id) {
      const before = new Set();
      for (let at = nodes.get(id)?.parent; at !== null && at !== undefined && !before.has(at); at = nodes.get(at)?.parent) {
        before.add(at);
      }
      return before;
    },
  };
}

function rememberScan(key, cursor) {
  compactionScans.delete(key);
  compactionScans.set(key, cursor);
  if (compactionScans.size > GROUP_MEMORY) compactionScans.delete(compactionScans.keys().next().value);
}

export async function createEngine(options) {
  const engineId = options.engine || "lossless";
  const client = createClient(options);
  const description = await describeEngine(client, engineId, { fresh: true });
  if (!description.durable) {
    throw new Error(`transcript-store engine "${engineId}" does not declare durable turn commits`);
  }
  const pageMessages = options.pageMessages || PAGE_MESSAGES;
  const pageBytes = options.pageBytes || PAGE_BYTES;
  // What the service takes (its description's `limits`; the defaults for a service older than them),
  // an explicit option first. Read again when the service refuses a body or an entry as too large (it
  // was restarted with other limits).
  let sizes = sizesOf(description.limits, options);
  const sizesKey = JSON.stringify([client.base, engineId]);
  rememberSizes(sizesKey, sizes);
  const ownsCompaction = description.info.owns_compaction === true;
  const hostRequirements = hostRequirementsOf(description.info.host_requirements);
  let sdkPromise = options.sdk ? Promise.resolve(options.sdk) : null;
  const sdk = () => (sdkPromise ??= defaultSdk());
  const ensured = new Set();
  const info = (message) => options.logger?.info?.(message);
  const warn = (message) => (options.logger?.warn ?? options.logger?.info)?.(message);
  // Where this process's imports of a session stopped (shared by every engine of one service, token
  // and engine id: OpenClaw builds an engine for each logical turn).
  const groupKey = (sessionId) => JSON.stringify([client.base, options.token, engineId, sessionId]);
  // Sessions this engine bootstrapped for the turn it serves (OpenClaw builds an engine for each logical
  // turn and reads under the turn's fence during bootstrap and assemble only). A compaction inside that
  // turn (overflow, budget or timeout recovery) is read without the fence: importing then took the
  // turn's own user message into the mirror, the retry's assemble sent it twice and its bootstrap failed
  // with a crossed fence. The fenced bootstrap imported everything before the turn already.
  const inTurn = new Set();
  // Sessions whose running turn's messages a compaction inside it imported (to make room): the turn's
  // fenced bootstrap then finds the mirror past its fence; that is no failure (nothing is missing).
  const aheadOfFence = new Set();

  async function relearnSizes(error) {
    if (!(error instanceof ServiceError && error.status === 413)) return false;
    let fresh;
    try {
      fresh = sizesOf((await describeEngine(client, engineId, { fresh: true })).limits, options);
    } catch {
      return false;
    }
    const changed = JSON.stringify(fresh) !== JSON.stringify(sizes);
    sizes = fresh;
    rememberSizes(sizesKey, fresh);
    if (changed) info(`transcript-store: the service's limits changed: ${JSON.stringify(fresh)}`);
    return changed;
  }

  const sessionPath = (sessionId) => `/v1/engines/${encodeURIComponent(engineId)}/sessions/${encodeURIComponent(sessionId)}`;

  async function ensureSession(sessionId, sessionKey) {
    if (!sessionId) throw new Error("transcript-store: the host gave no sessionId");
    if (ensured.has(sessionId)) return;
    try {
      await client.post("/v1/sessions", {
        session_id: sessionId,
        ...(sessionKey ? { session_key: sessionKey, rebind_key: true } : {}),
      });
    } catch (error) {
      // The session exists under another key binding: it is still the one to use.
      if (!(error instanceof ServiceError && error.code === "idempotency_conflict")) throw error;
    }
    ensured.add(sessionId);
  }

  // Run `call` in the session; a session the store no longer has (deleted, a database restored) is
  // created again once and the call retried, instead of every call answering 404 until a restart.
  async function inSession(sessionId, sessionKey, call) {
    await ensureSession(sessionId, sessionKey);
    try {
      return await call();
    } catch (error) {
      if (!(error instanceof ServiceError && error.status === 404 && error.code === "session_not_found")) throw error;
      ensured.delete(sessionId);
      info(`transcript-store: session ${sessionId} is gone from the store; creating it again`);
      await ensureSession(sessionId, sessionKey);
      return call();
    }
  }

  // Import the host's visible transcript into the service's mirror, page by page, from where the
  // last import stopped. `until`: stop after this host position (a commit catching up), else read on
  // to the end (under the host's read fence during bootstrap).
  async function importTranscript(target, until, abortSignal) {
    const read = (await sdk()).readSessionTranscriptVisibleMessageDelta;
    const path = sessionPath(target.sessionId);
    let imported = 0;
    let restarts = 0;
    let state = await client.get(`${path}/bootstrap`, abortSignal);
    let readCursor = state.cursor ?? undefined; // what the host is asked to read from
    let sentCursor = state.cursor ?? null; // what the service is told the page was read from
    let position = state.cursor ? state.position : 0;
    let maxBytes = pageBytes;
    let fewer; // a page too large to send: read again with at most this many messages
    const remembered = importGroups.get(groupKey(target.sessionId));
    let group = { bytes: remembered && sentCursor !== null && remembered.cursor === sentCursor ? remembered.bytes : 0 };
    for (let pages = 0; pages < MAX_PAGES; pages += 1) {
      const remaining = until === undefined ? pageMessages : until + 1 - position;
      if (remaining <= 0) return imported;
      const page = await read({
        agentId: target.agentId,
        sessionId: target.sessionId,
        sessionKey: target.sessionKey,
        storePath: target.storePath,
        ...(readCursor !== undefined ? { cursor: readCursor } : {}),
        maxMessages: Math.min(pageMessages, remaining, fewer ?? Infinity),
        maxBytes,
      });
      if (page.kind === "missing") return imported;
      if (page.kind === "unavailable") throw new Error(`host transcript is unavailable: ${page.reason}`);
      if (page.kind === "reset") {
        // The host transcript was replaced: read it again from its start; the mirror re-aligns.
        readCursor = page.cursor;
        sentCursor = null;
        position = 0;
        group = { bytes: 0 };
        continue;
      }
      if (page.entries.length === 0 && page.requiredBytes !== undefined && page.hasMore) {
        maxBytes = Math.max(maxBytes, page.requiredBytes); // one message larger than a page
        continue;
      }
      maxBytes = pageBytes;
      const fitted = storedInGroups(page.entries.map((entry) => entry.message), {
        maxEntryBytes: sizes.maxEntryBytes, turnLimit: sizes.turnLimit, state: group });
      const entries = page.entries.map((entry, i) => ({ entry_id: entry.entryId, message: fitted.stored[i] }));
      const body = { done: false, page: { cursor: sentCursor, next_cursor: page.cursor, entries } };
      if (entries.length > 1 && jsonBytes(body) > sizes.pageBodyBytes) {
        // Read the page again with as many messages as fit in the body (one at least).
        let size = jsonBytes({ ...body, page: { ...body.page, entries: [] } });
        let fit = 0;
        while (fit < entries.length - 1 && (size += jsonBytes(entries[fit]) + 1) <= sizes.pageBodyBytes) fit += 1;
        fewer = Math.max(1, fit);
        continue;
      }
      let answer;
      try {
        answer = await client.post(`${path}/bootstrap`, body, abortSignal);
      } catch (error) {
        if (error instanceof ServiceError && error.status === 413 && error.code === "request_too_large" && entries.length > 1) {
          fewer = Math.ceil(entries.length / 2); // a service with a smaller --max-body
          await relearnSizes(error);
          continue;
        }
        if (error instanceof ServiceError && error.status === 413 && (await relearnSizes(error)) && restarts < 3) {
          restarts += 1; // the service's limits changed: store the page again by them
          continue;
        }
        if (error instanceof ServiceError && error.reason === "cursor" && restarts < 3) {
          // Another importer moved the mirror's resume point: continue from the recorded one.
          restarts += 1;
          state = await client.get(`${path}/bootstrap`, abortSignal);
          readCursor = state.cursor ?? undefined;
          sentCursor = state.cursor ?? null;
          position = state.cursor ? state.position : 0;
          group = { bytes: 0 }; // as where an import run starts: not known
          continue;
        }
        throw error;
      }
      fewer = undefined;
      imported += answer.imported;
      position = answer.position;
      readCursor = page.cursor;
      sentCursor = page.cursor;
      group = fitted.state;
      rememberGroup(groupKey(target.sessionId), { cursor: page.cursor, bytes: group.bytes });
      if (!page.hasMore) return imported;
    }
    throw new Error("transcript-store: the host transcript import did not finish");
  }

  // The visible position of a host entry (none: null), read from the host transcript's start (-1 when not there), and
  // how many of the visible messages are among the ids of `before` (the entries before a compaction on
  // its branch, the active one: the messages the compaction was made after).
  async function hostPosition(target, entryId, before = new Set()) {
    const read = (await sdk()).readSessionTranscriptVisibleMessageDelta;
    let cursor;
    let position = 0;
    let maxBytes = pageBytes;
    let found = -1;
    let count = 0;
    for (let pages = 0; pages < MAX_PAGES; pages += 1) {
      const page = await read({
        agentId: target.agentId, sessionId: target.sessionId, sessionKey: target.sessionKey,
        storePath: target.storePath, ...(cursor !== undefined ? { cursor } : {}), maxMessages: pageMessages, maxBytes,
      });
      if (page.kind === "missing") return { position: -1, count: 0 };
      if (page.kind === "unavailable") throw new Error(`host transcript is unavailable: ${page.reason}`);
      if (page.kind === "reset") { cursor = page.cursor; position = 0; found = -1; count = 0; continue; }
      if (page.entries.length === 0 && page.requiredBytes !== undefined && page.hasMore) {
        maxBytes = Math.max(maxBytes, page.requiredBytes);
        continue;
      }
      maxBytes = pageBytes;
      for (const [i, entry] of page.entries.entries()) {
        if (entry.entryId === entryId && found < 0) found = position + i;
        if (before.has(entry.entryId)) count += 1;
      }
      position += page.entries.length;
      cursor = page.cursor;
      // (The messages a compaction was made after are a prefix of the visible ones: past the first
      // that is not among them, none is.)
      const done = before.size === 0 || page.entries.some((entry) => !before.has(entry.entryId));
      if (!page.hasMore || ((found >= 0 || entryId === null) && done)) return { position: found, count };
    }
    return { position: found, count };
  }

  // Tell the service engine about a compaction OpenClaw made (delegateCompactionToRuntime): its summary
  // goes in front of the first message it kept, as OpenClaw's own context shows it. One found in the host
  // transcript later goes with when it was made (`madeAt`, the host's clock) and the entries before it on
  // its branch (`before`): the service counts the visible ones among them (compacted_at_count) to keep
  // a compaction in force made further on, compared by that rather than across two machines' clocks.
  async function recordCompaction(target, details, madeAt, before) {
    const summary = details && typeof details.summary === "string" ? details.summary : "";
    const kept = details && typeof details.firstKeptEntryId === "string" ? details.firstKeptEntryId : "";
    if (!summary.trim() || !kept) return; // a provider's server-side compaction: nothing to show
    const { position, count } = await hostPosition(target, kept, before);
    if (position < 0) {
      warn(`transcript-store: the first message OpenClaw's compaction kept (${kept}) is not among the host's visible messages`);
      return;
    }
    await inSession(target.sessionId, target.sessionKey, () => client.post(`${sessionPath(target.sessionId)}/host_compaction`, {
      summary: wellFormed(summary), first_kept_position: position, first_kept_entry_id: wellFormed(kept),
      ...(Number.isSafeInteger(madeAt) && madeAt >= 0 ? { compacted_ms: madeAt } : {}),
      ...(before ? { compacted_at_count: count } : {}),
    }));
    info(`transcript-store: OpenClaw's compaction recorded (its summary before position ${position})`);
  }

  // Tell the service engine about a reset OpenClaw kept in its transcript (a `reset` entry: /new, /reset, an
  // idle or daily reset of the same session): OpenClaw's context starts again after it, from the tail
  // before it the reset kept (its firstKeptEntryId) when it kept one. The visible messages OpenClaw's
  // transcript reads (and the mirror imports) still hold everything before it: without this the assembly
  // kept them, and a compaction of them, in front of the new conversation. `before`: the entries before it
  // on its branch; the visible ones among them are where it was made (compacted_at_count), and, when it
  // kept none, its position (the host's next message, maybe not written yet, is not named).
  async function recordReset(target, boundary) {
    const { position, count } = await hostPosition(target, boundary.kept, boundary.before);
    if (count === 0) return; // nothing before it to leave out
    const at = boundary.kept === null ? count : position;
    if (at < 0) {
      warn(`transcript-store: the first message OpenClaw's reset kept (${boundary.kept}) is not among the host's visible messages`);
      return;
    }
    const madeAt = Date.parse(boundary.entry.timestamp);
    await inSession(target.sessionId, target.sessionKey, () => client.post(`${sessionPath(target.sessionId)}/host_compaction`, {
      summary: "", reset: true, first_kept_position: at,
      ...(boundary.kept !== null ? { first_kept_entry_id: wellFormed(boundary.kept) } : {}),
      ...(Number.isSafeInteger(madeAt) && madeAt >= 0 ? { compacted_ms: madeAt } : {}),
      compacted_at_count: count,
    }));
    info(`transcript-store: OpenClaw's reset recorded (its context starts again at position ${at})`);
  }

  // Read OpenClaw's raw host transcript (readSessionTranscriptRawDelta; under the running turn's fence
  // during bootstrap) from `cursor` (its start when undefined) to its end: each event to `take`; the cursor
  // after it. Null when the host has no raw reads (an OpenClaw older than them).
  async function readRaw(target, cursor, take) {
    const read = (await sdk()).readSessionTranscriptRawDelta;
    if (typeof read !== "function") return null;
    let maxBytes = RAW_PAGE_BYTES;
    for (let pages = 0; pages < MAX_PAGES; pages += 1) {
      const page = await read({
        agentId: target.agentId, sessionId: target.sessionId, sessionKey: target.sessionKey,
        storePath: target.storePath, ...(cursor !== undefined ? { cursor } : {}), maxEvents: RAW_PAGE_EVENTS, maxBytes,
      });
      if (!page || page.kind === "missing") return { cursor };
      if (page.kind === "reset") { cursor = page.cursor; take(null); continue; } // replaced: read it all again
      if (page.kind !== "page" || !Array.isArray(page.events)) throw new Error(`host transcript is unavailable: ${page.reason ?? page.kind}`);
      if (page.events.length === 0 && page.requiredBytes !== undefined && page.hasMore) {
        maxBytes = Math.max(maxBytes, page.requiredBytes); // one event larger than a page
        continue;
      }
      maxBytes = RAW_PAGE_BYTES;
      for (const { event } of page.events) take(event);
      cursor = page.cursor;
      if (!page.hasMore) return { cursor };
    }
    throw new Error("transcript-store: the host transcript's compactions were not read to the end");
  }

  // OpenClaw's newest boundary (a compaction or a reset) on the active branch of its raw host transcript,
  // when the transcript holds one (or a branch switch) past where this process last looked, and the cursor
  // after it.
  // Its in-run auto-compaction (compaction mode `default`, for an engine that does not own compaction)
  // calls no engine: its `compaction` entry (summary, firstKeptEntryId) is all there is of it. The raw
  // transcript holds every branch (a rewind, a retry, a branch switch leave entries off the active one): a
  // compaction seen there is looked for on the active branch, with the whole transcript read (only when
  // one was seen, or a branch switched). Null when the host has no raw reads (an OpenClaw older than them).
  async function newestHostCompaction(target) {
    const from = compactionScans.get(groupKey(target.sessionId));
    let tree = from === undefined ? transcriptTree() : null; // a read from the start builds the tree at once
    let changed = false;
    const read = await readRaw(target, from, (event) => {
      if (event === null) { tree = transcriptTree(); changed = false; return; } // read again from the start
      tree?.add(event);
      // (A compaction entry is not looked for when the service engine owns compaction: it made it.)
      if ((event?.type === "compaction" && !ownsCompaction) || event?.type === "leaf" || event?.type === "reset") changed = true;
    });
    if (read === null) return null;
    if (!changed) return { newest: null, cursor: read.cursor };
    if (tree === null) {
      tree = transcriptTree();
      const whole = await readRaw(target, undefined, (event) => { if (event === null) tree = transcriptTree(); else tree.add(event); });
      return { newest: tree.activeBoundary({ resetsOnly: ownsCompaction }), cursor: whole.cursor };
    }
    return { newest: tree.activeBoundary({ resetsOnly: ownsCompaction }), cursor: read.cursor };
  }

  // Record OpenClaw's newest compaction the plugin has not looked at yet (above). Recording one the
  // service has already (the delegated compaction, or a new process reading from the start) changes
  // nothing there. A failure is logged, never the turn's: the next bootstrap looks again.
  async function recordHostCompactions(target) {
    try {
      const found = await newestHostCompaction(target);
      if (!found) return;
      // With where (and when) OpenClaw made it: a compaction in force made further on (the service's own,
      // say) stays.
      if (found.newest?.reset) await recordReset(target, found.newest);
      else if (found.newest) {
        await recordCompaction(target, found.newest.entry, Date.parse(found.newest.entry.timestamp), found.newest.before);
      }
      if (found.cursor !== undefined) rememberScan(groupKey(target.sessionId), found.cursor);
    } catch (error) {
      compactionScans.delete(groupKey(target.sessionId)); // the next look reads from the start
      warn(`transcript-store: OpenClaw's compactions in the host transcript were not read (the next assemble may return what they compacted): ${error.message}`);
    }
  }

  // The memory plugin's prompt guidance (OpenClaw's buildMemorySystemPromptAddition), when the host has it.
  async function memoryHelper() {
    try {
      const helper = (await sdk()).buildMemorySystemPromptAddition;
      return typeof helper === "function" ? helper : null;
    } catch (error) {
      warn(`transcript-store: no memory prompt guidance (the OpenClaw SDK did not load): ${error.message}`);
      return null;
    }
  }

  async function memoryAddition(helper, params) {
    if (!helper) return undefined;
    try {
      // Forwarded as the host gave them, as the context-engine contract asks (awaited: a helper may be async).
      return await helper({
        availableTools: params.availableTools ?? new Set(),
        citationsMode: params.citationsMode,
        agentSessionKey: params.sessionKey,
      });
    } catch (error) {
      warn(`transcript-store: the memory prompt guidance failed; assembling without it: ${error.message}`);
      return undefined;
    }
  }

  function targetOf(params) {
    // A compaction's target can come in its runtimeContext only (as delegateCompactionToRuntime reads it).
    const t = params.sessionTarget || params.runtimeContext?.sessionTarget || {};
    const a = params.admission || {};
    return {
      agentId: t.agentId ?? a.agentId ?? params.agentId,
      sessionId: t.sessionId ?? params.sessionId ?? a.sessionId,
      sessionKey: t.sessionKey ?? params.sessionKey ?? a.sessionKey,
      storePath: t.storePath ?? a.storePath,
    };
  }

  const engine = {
    info: {
      id: PLUGIN_ID,
      name: `transcript-store (${engineId})`,
      version: VERSION,
      ownsCompaction,
      turnMaintenanceMode: description.info.turn_maintenance_mode === "background" ? "background" : "foreground",
      ...(hostRequirements ? { hostRequirements } : {}),
      transcriptSemantics: {
        currentTurnFence: CURRENT_TURN_FENCE,
        turnAdvancementIdempotency: TURN_ADVANCEMENT_IDEMPOTENCY,
      },
    },

    async bootstrap(params) {
      const target = targetOf(params);
      const [importedMessages, answer] = await inSession(target.sessionId, target.sessionKey, async () => {
        let imported = 0;
        try {
          imported = await importTranscript(target);
        } catch (error) {
          if (!aheadOfFence.has(target.sessionId) || !/crossed/i.test(String(error?.message ?? error))) throw error;
          info(`transcript-store: session ${target.sessionId} holds this turn's messages already (its compaction imported them)`);
        }
        // OpenClaw's own compactions that never reached the engine (its in-run auto-compaction), for a
        // service engine that assembles what OpenClaw compacts (one that owns compaction turns them off),
        // and its resets, for every service engine (its context starts again there, whoever compacts).
        await recordHostCompactions(target);
        return [imported, await client.post(`${sessionPath(target.sessionId)}/bootstrap`, { done: true })];
      });
      inTurn.add(target.sessionId);
      const result = answer.result || {};
      return {
        bootstrapped: result.bootstrapped !== false,
        importedMessages,
        ...(result.reason ? { reason: result.reason } : {}),
      };
    },

    async ingest() {
      // Turns reach the store through commitTurn (durable and idempotent), not message by message.
      return { ingested: false };
    },

    async afterTurn(params) {
      // Nothing else: the accepted turn arrives through commitTurn; upkeep runs in maintain.
      inTurn.delete(targetOf(params || {}).sessionId);
      aheadOfFence.delete(targetOf(params || {}).sessionId);
    },

    async assemble(params) {
      const budget = tokenBudgetOf(params.tokenBudget);
      if (budget !== null) rememberBudget(groupKey(params.sessionId), budget);
      const path = `${sessionPath(params.sessionId)}/assemble`;
      // The service takes at most 1000 tool names: the first 1000 the host lists are sent.
      const tools = params.availableTools ? [...params.availableTools].slice(0, MAX_TOOLS).map((name) => wellFormed(String(name))) : [];
      const prompt = typeof params.prompt === "string" ? wellFormed(params.prompt) : null;
      // The prompt goes in the body whole unless the body would be over the service's --max-body: a
      // long prompt (a pasted log) made every assemble of the turn 413. It is cut as a message's strings
      // are, with the marker, to what the rest of the body leaves (no prompt when not even the marker fits);
      // the service engines read the messages, not the prompt, for what they assemble.
      const bodyOf = (tokenBudget) => {
        const body = { token_budget: tokenBudget, available_tools: tools, prompt };
        if (prompt === null) return body;
        const room = sizes.bodyLimit - ASSEMBLE_MARGIN - jsonBytes({ ...body, prompt: "" }) + 2;
        body.prompt = cutToJsonBytes(prompt, room,
          `the prompt is over the ${sizes.bodyLimit} bytes the service takes in one request`);
        return body;
      };
      const ask = (tokenBudget) => inSession(params.sessionId, params.sessionKey, async () => {
        try {
          return await client.post(path, bodyOf(tokenBudget));
        } catch (error) {
          if (!(await relearnSizes(error))) throw error;
          return client.post(path, bodyOf(tokenBudget)); // the service was restarted with a lower --max-body
        }
      });
      // The service counts each message's OpenAI projection, where an image is a short placeholder and a
      // thinking block nothing; the model gets both. They are counted here (mediaTokens) and, when they
      // put the context over the budget, the service assembles again with a budget that leaves out the
      // oldest messages until the rest, with them, fits.
      let asked = budget;
      let answer;
      let messages;
      let estimated;
      let turn = [];
      for (let round = 0; ; round += 1) {
        answer = await ask(asked);
        // Replies kept across a compaction lose their signed thinking (its signature held for the prefix
        // the compaction replaced); the ones after it keep theirs, byte for byte.
        // What the service engine wrote itself (its summaries) is dated when it was written.
        const writtenAt = answer.compacted_at_ms ?? undefined;
        const all = answer.messages.map((stored) => fromStored(stored, { writtenAt }));
        // A message OpenClaw keeps out of the model's context (excludeFromContext) is mirrored where the
        // host has it, never assembled, and its share of the service's estimate is left out.
        const kept = all.map((message) => !excludedFromContext(message));
        const stored = answer.messages.filter((_, i) => kept[i]);
        const shown = estimateOf(answer.messages, kept, answer.estimated_tokens);
        messages = withoutStaleThinking(all.filter((_, i) => kept[i]), answer.compacted_at_ms);
        const media = messages.map(mediaTokens);
        // A retry's running turn (OpenClaw's own history holds it; the fence ends before it) follows.
        turn = runningTurnOf(params.messages, messages);
        const turnTokens = turn.reduce((sum, message) => sum + roughMessageTokens(toStored(message)) + mediaTokens(message), 0);
        estimated = shown + media.reduce((sum, tokens) => sum + tokens, 0) + turnTokens;
        if (budget === null || estimated <= budget || round + 1 >= ASSEMBLE_ROUNDS) break;
        const next = budgetWithout(stored, media, shown, budget - turnTokens);
        if (next === null || next < 1 || next >= asked) break;
        asked = next;
      }
      const additions = [await memoryAddition(await memoryHelper(), params), answer.system_prompt_addition]
        .filter((text) => typeof text === "string" && text.trim() !== "");
      return {
        messages: turn.length ? [...messages, ...turn] : messages,
        estimatedTokens: estimated,
        ...(additions.length ? { systemPromptAddition: additions.join("\n\n") } : {}),
        ...(answer.prompt_authority ? { promptAuthority: answer.prompt_authority } : {}),
      };
    },

    async commitTurn(params) {
      const target = targetOf(params);
      inTurn.delete(target.sessionId); // the turn is done: a compaction after it reads on to the end
      aheadOfFence.delete(target.sessionId);
      const body = {
        advancement_key: params.advancementKey,
        admission: { entry_id: params.admission.entryId, position: params.admission.activeMessagePosition },
        terminal: { entry_id: params.terminal.entryId, position: params.terminal.activeMessagePosition },
        messages: storedTurn(params.messages, sizes),
        is_heartbeat: params.isHeartbeat === true,
        session_target: {
          session_id: target.sessionId,
          ...(target.sessionKey ? { session_key: target.sessionKey } : {}),
          ...(target.agentId ? { agent_id: target.agentId } : {}),
        },
      };
      const path = `${sessionPath(target.sessionId)}/commit_turn`;
      const post = async () => {
        try {
          return await client.post(path, body);
        } catch (error) {
          if (!(await relearnSizes(error))) throw error;
          // The service was restarted with other limits: the turn stored by them.
          body.messages = storedTurn(params.messages, sizes);
          return client.post(path, body);
        }
      };
      // A replay of a turn the service committed while it had other limits (it was restarted since: a
      // lower entry cap, body limit or turn cap) is cut otherwise than its commit, and its payload's hash
      // collides with the receipt's. It is sent again cut by each limit this process has known the
      // service by, newest first, and by the service's defaults (a process started after the restart).
      // Only the service's "duplicate" is taken: the ledger compares the whole payload's hash (anchors
      // and every message), so the committed turn is exactly these host messages cut by those limits. A
      // replay that differs otherwise, or limits this process never knew, keep the collision.
      const replayedByEarlierLimits = async (collision) => {
        const tried = new Set([JSON.stringify(body.messages)]);
        for (const earlier of [...(seenSizes.get(sizesKey) ?? [])].reverse().concat([sizesOf(undefined, options)])) {
          const messages = storedTurn(params.messages, earlier);
          const text = JSON.stringify(messages);
          if (tried.has(text)) continue;
          tried.add(text);
          let answer;
          try {
            answer = await client.post(path, { ...body, messages });
          } catch (error) {
            if (error instanceof ServiceError && (error.status === 409 || error.status === 413)) continue;
            throw error;
          }
          // (Only "duplicate" while the receipt stands: the key is committed.)
          if (answer?.status === "duplicate") {
            info(`transcript-store: turn ${params.advancementKey} was committed under the service's earlier limits; its replay is a duplicate`);
          }
          return answer;
        }
        throw collision;
      };
      const answer = await inSession(target.sessionId, target.sessionKey, async () => {
        try {
          return await post();
        } catch (error) {
          if (error instanceof ServiceError && error.code === "advancement_key_collision") {
            return replayedByEarlierLimits(error);
          }
          if (!(error instanceof ServiceError && error.reason === "behind")) throw error;
          // Host messages before this turn never reached the mirror (a degraded turn, host-written
          // messages): import up to the turn's end, then commit.
          const imported = await importTranscript(target, params.terminal.activeMessagePosition);
          info(`transcript-store: imported ${imported} host messages before committing turn ${params.advancementKey}`);
          return post();
        }
      });
      return { status: answer.status };
    },

    async compact(params) {
      if (!ownsCompaction) {
        const result = await (await sdk()).delegateCompactionToRuntime(params);
        if (result && result.ok && result.compacted) {
          // OpenClaw's compaction adds a marker to its transcript (its summary and the first message it
          // kept) and leaves every message where it was: the visible messages the mirror imports do not
          // show it. The service engine (legacy) assembles from the mirror, so it is told: else the
          // assemble of the retry after an overflow recovery, and of every turn after /compact, still
          // returned everything that was compacted, and the retry overflowed again.
          const caller = targetOf(params);
          const target = successorOf(caller, result);
          const inside = inTurn.has(caller.sessionId);
          if (inside) inTurn.add(target.sessionId); // the turn's fenced reads stop at its admission
          try {
            if (!inside) {
              const imported = await inSession(target.sessionId, target.sessionKey, () => importTranscript(target));
              info(`transcript-store: imported ${imported} host messages after OpenClaw's compaction`);
            }
            if (target.sessionId === caller.sessionId) await recordCompaction(target, result.result);
            else warn(`transcript-store: OpenClaw's compaction moved the session to ${target.sessionId}; its summary is not recorded there`);
          } catch (error) {
            warn(`transcript-store: OpenClaw's compaction did not reach the mirror (the next assemble returns what it compacted): ${error.message}`);
          }
        }
        return result;
      }
      const target = targetOf(params);
      // The host transcript may hold messages the mirror never saw: a turn that timed out or was
      // aborted before its commit (its tool results can be what makes the host ask to compact). Import
      // them first, or the engine compacts a mirror without them, makes no progress, and the host's
      // pre-prompt compaction fails on every later turn of the session. An import that fails leaves the
      // compaction to what the mirror holds.
      // The service takes a focus of at most 10000 characters: longer instructions are cut there.
      const focus = typeof params.customInstructions === "string" ? cutText(params.customInstructions, MAX_FOCUS_CHARS) : null;
      const inside = inTurn.has(target.sessionId);
      const importFirst = async (why) => {
        try {
          const imported = await importTranscript(target, undefined, params.abortSignal);
          if (imported > 0) info(`transcript-store: imported ${imported} host messages ${why}`);
          return imported;
        } catch (error) {
          if (error instanceof ServiceError && (error.code === "session_not_found" || error.code === "aborted")) throw error;
          info(`transcript-store: compacting without importing the host transcript first: ${error.message}`);
          return 0;
        }
      };
      const request = () => client.post(`${sessionPath(target.sessionId)}/compact`, {
        force: params.force === true,
        token_budget: tokenBudgetOf(params.tokenBudget),
        focus,
      }, params.abortSignal);
      const answer = await inSession(target.sessionId, target.sessionKey, async () => {
        // (Inside a turn its fenced bootstrap imported what precedes it: reading on takes its message.)
        // (Between turns, or in a session's first turn, where OpenClaw runs no bootstrap and the plugin
        // cannot tell: an import that reached the running turn's messages leaves the mirror past its
        // fence, which that turn's next bootstrap is then told apart from a failure by.)
        if (!inside && (await importFirst("before compacting")) > 0) aheadOfFence.add(target.sessionId);
        const first = await request();
        // Only when OpenClaw says its context holds more than the mirror (an overflow recovery passes the
        // count it saw): a manual /compact, or a compaction with nothing to gain, leaves the turn's
        // message out of the mirror.
        const seen = [params.currentTokenCount, params.runtimeContext?.currentTokenCount].find(Number.isFinite);
        if (!inside || first.compacted || !(seen > (first.tokens_before ?? 0))) return first;
        // Inside a turn, what preceded it could not make room: the turn's own messages (its tool
        // results) are what overflows, and OpenClaw runs no compaction of its own for an engine that
        // owns it, so the turn failed. Import them too and compact again: the retry then gets the
        // compacted turn from assemble (its question may come twice, once in the mirror), and its
        // fenced bootstrap finds the mirror past the fence (below).
        if ((await importFirst("of the running turn, to make room")) === 0) return first;
        aheadOfFence.add(target.sessionId);
        return request();
      });
      return {
        ok: answer.ok,
        compacted: answer.compacted,
        ...(answer.reason ? { reason: answer.reason } : {}),
        result: {
          tokensBefore: answer.tokens_before ?? 0,
          ...(answer.tokens_after !== null && answer.tokens_after !== undefined ? { tokensAfter: answer.tokens_after } : {}),
        },
      };
    },

    async maintain(params) {
      const budget = tokenBudgetOf(params.tokenBudget) ?? assembleBudgets.get(groupKey(params.sessionId)) ?? null;
      const body = budget === null ? {} : { token_budget: budget };
      const answer = await inSession(params.sessionId, params.sessionKey,
        () => client.post(`${sessionPath(params.sessionId)}/maintain`, body, params.abortSignal));
      return {
        changed: answer.changed,
        bytesFreed: answer.bytes_freed,
        rewrittenEntries: answer.rewritten_entries,
        ...(answer.reason ? { reason: answer.reason } : {}),
      };
    },

    async dispose() {
      ensured.clear();
    },
  };

  // A compaction or maintenance that failed (the service unreachable or refusing, OpenClaw's own
  // compaction throwing) answers that it did nothing, with the reason, rather than throwing: OpenClaw
  // (2026.9.6) quarantines for the gateway process an engine it resolved for a /compact (or a CLI
  // backend's compaction) whose compact or maintain throws, and its later compactions then ran on
  // OpenClaw's legacy engine until a restart, the service long back. A turn's own compaction took a
  // throw as this answer already. An abort still rejects (OpenClaw tells it from a failure).
  const orNothingDone = (run, nothing) => async (params) => {
    try {
      return await run(params);
    } catch (error) {
      if (params?.abortSignal?.aborted || error?.name === "AbortError") throw error;
      const message = String(error?.message ?? error);
      const reason = message.startsWith("transcript-store") ? message : `transcript-store: ${message}`;
      warn(`${reason} (answered as nothing done)`);
      return { ...nothing, reason };
    }
  };
  engine.compact = orNothingDone(engine.compact, { ok: false, compacted: false });
  engine.maintain = orNothingDone(engine.maintain, { changed: false, bytesFreed: 0, rewrittenEntries: 0 });
  return engine;
}
