// OpenClaw AgentMessages <-> the store's OpenAI chat messages.
//
// The store keeps OpenAI chat-format messages and preserves unknown keys. A host message is stored as
// its OpenAI projection (what engines read, count and summarize) with the host's message itself under
// ORIGINAL, so reading it back gives the host exactly what it wrote. The projection is a function of
// the host message alone: the same host message always maps to the same stored message, which is how
// the service recognises a message it already holds.

export const ORIGINAL = "openclaw";
// A message too large to be kept twice: the host's message without the text the projection already
// holds, under LEAN ({message, refs}); each ref names where in the projection a removed value is.
export const LEAN = "openclaw_lean";
/** The store's cap on one entry's JSON (its `max_payload_bytes`, 4 MiB unless the service lowered it). */
export const ENTRY_CAP_BYTES = 4 * 1024 * 1024;
/** The store's cap on one turn's closed range (its entries' JSON summed: MAX_TURN_BYTES). */
export const TURN_CAP_BYTES = 8 * 1024 * 1024;
const ENTRY_MARGIN = 4096;
// Room kept in a turn's budget for the rest of the commit's body (keys, ids, the session target) and
// for JSON the service writes a few bytes longer than JSON.stringify.
const TURN_MARGIN = 64 * 1024;
const MIN_SHARE = 16 * 1024; // a message cut for its turn keeps at least this much (a head and a marker)
// ... unless the turn holds so many messages that even so it is over (a head, a marker, its ids: toStored
// keeps ENTRY_MARGIN less than its cap).
const MIN_TURN_CUT = ENTRY_MARGIN + 2 * 1024;
const MIN_REF = 256; // shorter strings stay in the lean message
const MIN_CLIP = 1024; // shorter strings are never cut

/** A string without lone UTF-16 surrogates (each becomes U+FFFD): the service refuses them. */
export function wellFormed(text) {
  return typeof text === "string" ? text.toWellFormed() : text;
}

// The service refuses JSON nested past 64 levels, and a stored message holds the host's message one level
// (under ORIGINAL) or two (under LEAN) deeper than the host wrote it: an object or array this deep in the
// host's message, unless empty, is kept as its JSON text (so nothing is stored past level 64 either way).
// A tool result whose details nested about 64 levels (an MCP tool's structured content, a parsed
// document) failed its turn's commit and every import, for good.
const MAX_HOST_DEPTH = 62;

/** A JSON copy of a value with every string (keys too) well-formed, nested at most MAX_HOST_DEPTH levels. */
export function wellFormedCopy(value) {
  return clean(JSON.parse(JSON.stringify(value ?? null)), 0);
}

function clean(value, depth) {
  if (typeof value === "string") return value.toWellFormed();
  if (value && typeof value === "object" && depth >= MAX_HOST_DEPTH && Object.keys(value).length) {
    return JSON.stringify(value); // lone surrogates escaped
  }
  if (Array.isArray(value)) return value.map((item) => clean(item, depth + 1));
  if (value && typeof value === "object") {
    for (const key of Object.keys(value)) {
      const fixed = key.toWellFormed();
      const item = clean(value[key], depth + 1);
      if (fixed === key) {
        value[key] = item;
      } else {
        delete value[key];
        Object.defineProperty(value, fixed, { value: item, enumerable: true, writable: true, configurable: true });
      }
    }
  }
  return value;
}

export function jsonBytes(value) {
  return Buffer.byteLength(JSON.stringify(value));
}

const ZERO_USAGE = Object.freeze({
  input: 0,
  output: 0,
  cacheRead: 0,
  cacheWrite: 0,
  totalTokens: 0,
  cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0, total: 0 },
});

/** The text of an AgentMessage content (string or parts); images and other parts as placeholders. */
export function contentText(content) {
  if (typeof content === "string") return content;
  if (!Array.isArray(content)) return "";
  return content
    .map((part) => {
      if (!part || typeof part !== "object") return "";
      if (part.type === "text") return String(part.text ?? "");
      if (part.type === "image") return `[image${part.mimeType ? ` ${part.mimeType}` : ""}]`;
      return "";
    })
    .filter((text) => text !== "")
    .join("\n");
}

function toolCallsOf(content) {
  if (!Array.isArray(content)) return [];
  return content
    .filter((part) => part && part.type === "toolCall")
    .map((part, index) => ({
      id: String(part.id || `call_${index}`),
      type: "function",
      function: { name: String(part.name || "tool"), arguments: JSON.stringify(part.arguments ?? {}) },
    }));
}

function otherText(message) {
  if (typeof message.summary === "string") return message.summary;
  const text = contentText(message.content);
  if (text) return text;
  if (typeof message.command === "string") return `$ ${message.command}\n${message.output ?? ""}`;
  return `[${message.role || "event"}]`;
}

// The stored form of a (well-formed, JSON-clean) host message, `keep` the keys that carry the host's
// message, at ORIGINAL's place (the key order of the stored form is what the service compares).
function build(message, keep) {
  if (message.role === "user") {
    return { role: "user", content: contentText(message.content), ...keep };
  }
  if (message.role === "assistant") {
    const calls = toolCallsOf(message.content);
    const text = contentText(message.content);
    const stored = { role: "assistant", content: text || (calls.length ? null : ""), ...keep };
    if (calls.length) stored.tool_calls = calls;
    return stored;
  }
  if (message.role === "toolResult") {
    return {
      role: "tool",
      tool_call_id: String(message.toolCallId || "unknown"),
      name: String(message.toolName || "tool"),
      content: contentText(message.content),
      ...keep,
    };
  }
  // bashExecution, custom, branchSummary, compactionSummary, ...: text the model can read.
  return { role: "user", content: otherText(message), ...keep };
}

/**
 * The stored (OpenAI chat) form of one AgentMessage, the AgentMessage itself kept under ORIGINAL.
 *
 * Lone surrogates become U+FFFD. A message whose stored form would be over the store's entry cap
 * (`options.maxBytes`, ENTRY_CAP_BYTES by default) is kept once: the projection, and under LEAN the
 * host's message without what the projection already holds (fromStored puts it back). If even that is over the cap, its longest
 * strings are cut, each with a visible marker (an image's data: the image becomes a text note) that
 * gives `options.note` as the reason (by default the entry cap); a signature is dropped, never cut (a
 * thinking block cut loses its own, a redacted one becomes a note).
 * The result is a function of the message and the cap alone, so a replay maps to the same stored message.
 */
export function toStored(message, options) {
  const given = options && typeof options === "object" ? options : {}; // not map's index
  const maxBytes = given.maxBytes || ENTRY_CAP_BYTES;
  const note = given.note || `the message is over the store's entry cap of ${maxBytes} bytes`;
  const original = wellFormedCopy(message);
  const full = build(original, { [ORIGINAL]: original });
  const budget = maxBytes - ENTRY_MARGIN;
  if (jsonBytes(full) <= budget) return full;
  const cuts = new Map();
  let host = original;
  for (let round = 0; round < 32; round += 1) {
    const stored = leanStored(host);
    const size = jsonBytes(stored);
    if (size <= budget) return stored;
    if (!cut(host, original, cuts, size, budget, note)) break;
    host = clipped(original, cuts, note);
  }
  return leanStored(placeholder(original, note));
}

// ------------------------------------------------------------------------------------------ turns
//
// The service refuses a turn whose messages' JSON adds up to more than its turn cap (8 MiB), or whose
// commit body is over its --max-body: two tool results of 3.5 MiB each, each under the entry cap, and a
// pasted log made a turn no retry could commit. The messages of a turn are therefore stored under a
// budget (the smaller of the two caps, less TURN_MARGIN), group by group. A group opens at each message
// stored as a user message (a turn's admitted message is one) and takes the messages after it up to the
// next one. Within a group a message may take at most half of what the messages before it left of the
// budget: a message over that share is stored as toStored stores one over the entry cap (kept once, then
// its longest strings cut with a marker), the share as its cap. Each share depends on the group's earlier
// messages only, so an import that reads the turn (in pages, with what followed it) stores every message
// of it as its commit does, and the mirror finds the turn it already holds. Messages under their share
// are stored exactly as toStored stores them alone: a turn under the budget is stored as it always was.

/** Whether a host message opens a group (it is stored as a user message). */
function opensGroup(message) {
  return !(message && typeof message === "object" && (message.role === "assistant" || message.role === "toolResult"));
}

function turnNote(limit) {
  return `the turn is over the ${limit} bytes the store takes in one turn`;
}

/**
 * The stored forms of consecutive host messages, `state.bytes` the stored bytes of the open group's
 * messages before them (0: none). Returns the stored forms, each one's JSON bytes, and the state after them.
 * @param {object[]} messages
 * @param {{maxEntryBytes?: number, turnLimit?: number, state?: {bytes: number}}} [options]
 */
export function storedInGroups(messages, options = {}) {
  const maxEntryBytes = options.maxEntryBytes || ENTRY_CAP_BYTES;
  const limit = options.turnLimit || TURN_CAP_BYTES;
  const budget = Math.max(limit - TURN_MARGIN, MIN_SHARE);
  let bytes = options.state ? options.state.bytes : 0;
  const stored = [];
  const sizes = [];
  for (const message of messages) {
    if (opensGroup(message)) bytes = 0;
    let one = toStored(message, { maxBytes: maxEntryBytes });
    let size = jsonBytes(one);
    const share = Math.max(Math.floor((budget - bytes) / 2), MIN_SHARE);
    if (size > share && share < maxEntryBytes) {
      one = toStored(message, { maxBytes: share, note: turnNote(limit) });
      size = jsonBytes(one);
    }
    bytes += size;
    stored.push(one);
    sizes.push(size);
  }
  return { stored, sizes, state: { bytes } };
}

/**
 * The stored forms of one turn's messages (admission through terminal), within the budget: as
 * storedInGroups stores them; and when the turn holds several groups that still add up to more, each
 * message over an equal cap is cut to it (a commit only: such a turn's cut is not what an import stores).
 */
export function storedTurn(messages, options = {}) {
  const maxEntryBytes = options.maxEntryBytes || ENTRY_CAP_BYTES;
  const limit = options.turnLimit || TURN_CAP_BYTES;
  const budget = Math.max(limit - TURN_MARGIN, MIN_SHARE);
  const { stored, sizes } = storedInGroups(messages, { maxEntryBytes, turnLimit: limit });
  // What a message cut for its turn keeps at least: MIN_SHARE, then, for a turn of so many messages that
  // each under it still adds up to more (hundreds of tool results of a few KiB), MIN_TURN_CUT.
  let floor = MIN_SHARE;
  let step = 0; // rounds at this floor
  for (let round = 0; round < 10; round += 1, step += 1) {
    const total = sizes.reduce((sum, size) => sum + size, 0);
    if (total <= budget) break;
    // The largest cap c with sum(min(size, c)) within the budget.
    const sorted = [...sizes].sort((a, b) => a - b);
    let rest = budget;
    let cap = floor;
    for (let i = 0; i < sorted.length; i += 1) {
      const even = Math.floor(rest / (sorted.length - i));
      if (sorted[i] > even) { cap = even; break; }
      rest -= sorted[i];
    }
    cap = Math.max(cap, floor);
    let changed = false;
    sizes.forEach((size, i) => {
      if (size <= cap) return;
      stored[i] = toStored(messages[i], { maxBytes: Math.max(cap - step * MIN_SHARE, floor), note: turnNote(limit) });
      const now = jsonBytes(stored[i]);
      changed ||= now < size;
      sizes[i] = now;
    });
    if (changed) continue;
    if (floor === MIN_TURN_CUT) break; // nothing left to cut: the service says why
    floor = MIN_TURN_CUT;
    step = -1;
  }
  return stored;
}

// ------------------------------------------------------------------------------------------ tokens
//
// The service's engines count the OpenAI projection of each message, where an image is a short
// placeholder ("[image image/png]") and a thinking block is not at all; the model gets the host's message,
// both included. mediaTokens is what they add, counted as documented in the README: an image by its
// pixels (width x height / 750, after scaling it to fit 1568 pixels on its long side and 1.15
// megapixels: Anthropic's published estimate, about what OpenAI's tiles cost too; at least 85, and 1600
// when its size cannot be read from its data), a thinking block by its text (and a redacted one by its
// opaque data) with the service's rough rule (roughTokens).

/** Tokens of a text by the service's rough rule (its RoughEstimator.count_text). */
export function roughTokens(text) {
  if (typeof text !== "string" || text === "") return 0;
  let light = 0;
  let dense = 0;
  let wide = 0;
  let other = 0;
  for (const char of text) {
    const c = char.codePointAt(0);
    if (c < 0x80) {
      if ((c >= 0x21 && c <= 0x40) || (c >= 0x5b && c <= 0x60) || (c >= 0x7b && c <= 0x7e)) dense += 1;
      else light += 1;
    } else if (isWide(c)) {
      wide += 1;
    } else {
      other += 1;
    }
  }
  return Math.ceil(light / 4) + Math.ceil(dense / 2) + wide + Math.ceil(other / 2);
}

function isWide(c) {
  return (c >= 0x1100 && c <= 0x11ff) || (c >= 0x2e80 && c <= 0x2fdf) || (c >= 0x3000 && c <= 0x9fff)
    || (c >= 0xa960 && c <= 0xa97f) || (c >= 0xac00 && c <= 0xd7ff) || (c >= 0xf900 && c <= 0xfaff)
    || (c >= 0xfe30 && c <= 0xfe4f) || (c >= 0xff00 && c <= 0xffef) || (c >= 0x20000 && c <= 0x3ffff);
}

/** Tokens of one stored (OpenAI) message by the service's rough rule (its RoughEstimator, framing included). */
export function roughMessageTokens(message) {
  if (!message || typeof message !== "object") return 0;
  let total = 4;
  const content = message.content;
  if (typeof content === "string") total += roughTokens(content);
  else if (Array.isArray(content)) {
    for (const part of content) {
      if (typeof part === "string") total += roughTokens(part);
      else if (part && typeof part === "object") total += roughTokens(typeof part.text === "string" ? part.text : JSON.stringify(part));
    }
  }
  if (typeof message.name === "string") total += 1 + roughTokens(message.name);
  if (Array.isArray(message.tool_calls)) {
    for (const call of message.tool_calls) {
      total += 3 + roughTokens(call?.function?.name) + roughTokens(call?.function?.arguments);
    }
  }
  if (typeof message.tool_call_id === "string") total += roughTokens(message.tool_call_id);
  return total;
}

/** The tokens an AgentMessage's images and thinking blocks add to what the service counts of it. */
export function mediaTokens(message) {
  const content = message && typeof message === "object" ? message.content : null;
  if (!Array.isArray(content)) return 0;
  let total = 0;
  for (const part of content) {
    if (!part || typeof part !== "object") continue;
    if (part.type === "image") total += imageTokens(part);
    else if (part.type === "thinking") {
      total += roughTokens(part.thinking);
      if (part.redacted === true && typeof part.thinkingSignature === "string") total += Math.ceil(part.thinkingSignature.length / 4);
    }
  }
  return total;
}

/** The tokens of one image part ({type: "image", data: base64, mimeType}). */
export function imageTokens(part) {
  const size = imageSize(part && part.data);
  if (!size) return 1600;
  const { width, height } = size;
  const scale = Math.min(1, 1568 / Math.max(width, height), Math.sqrt(1150000 / (width * height)));
  return Math.min(1600, Math.max(85, Math.ceil((width * scale) * (height * scale) / 750)));
}

/** The pixel size of a PNG, GIF, JPEG or WebP image from its base64 data (its first 256 KiB), or null. */
export function imageSize(data) {
  if (typeof data !== "string" || data.length < 40) return null;
  let bytes;
  try {
    bytes = Buffer.from(data.slice(0, 349528 - (349528 % 4)), "base64");
  } catch {
    return null;
  }
  const ok = (width, height) => (width > 0 && height > 0 ? { width, height } : null);
  if (bytes.length >= 24 && bytes.readUInt32BE(0) === 0x89504e47 && bytes.toString("latin1", 12, 16) === "IHDR") {
    return ok(bytes.readUInt32BE(16), bytes.readUInt32BE(20));
  }
  if (bytes.length >= 10 && bytes.toString("latin1", 0, 4) === "GIF8") return ok(bytes.readUInt16LE(6), bytes.readUInt16LE(8));
  if (bytes.length >= 30 && bytes.toString("latin1", 0, 4) === "RIFF" && bytes.toString("latin1", 8, 12) === "WEBP") {
    const kind = bytes.toString("latin1", 12, 16);
    if (kind === "VP8X") return ok(1 + bytes.readUIntLE(24, 3), 1 + bytes.readUIntLE(27, 3));
    if (kind === "VP8 ") return ok(bytes.readUInt16LE(26) & 0x3fff, bytes.readUInt16LE(28) & 0x3fff);
    if (kind === "VP8L" && bytes[20] === 0x2f) {
      const bits = bytes.readUInt32LE(21);
      return ok((bits & 0x3fff) + 1, ((bits >> 14) & 0x3fff) + 1);
    }
    return null;
  }
  if (bytes.length >= 4 && bytes[0] === 0xff && bytes[1] === 0xd8) {
    let at = 2;
    while (at + 9 < bytes.length) {
      if (bytes[at] !== 0xff) return null;
      const marker = bytes[at + 1];
      if (marker === 0xff) { at += 1; continue; }
      const length = bytes.readUInt16BE(at + 2);
      // Start of frame (every SOFn but the DHT, JPG and DAC markers among C0..CF): its height, then width.
      if (marker >= 0xc0 && marker <= 0xcf && marker !== 0xc4 && marker !== 0xc8 && marker !== 0xcc) {
        return ok(bytes.readUInt16BE(at + 7), bytes.readUInt16BE(at + 5));
      }
      at += 2 + length;
    }
  }
  return null;
}

function leanStored(host) {
  const projection = build(host, {});
  const lean = JSON.parse(JSON.stringify(host));
  const refs = [];
  const text = typeof projection.content === "string" ? projection.content : "";
  if (projection.tool_calls && Array.isArray(lean.content)) {
    let call = 0;
    lean.content.forEach((part, index) => {
      if (!part || part.type !== "toolCall") return;
      if (part.arguments && typeof part.arguments === "object" && projection.tool_calls[call].function.arguments.length >= MIN_REF) {
        part.arguments = null;
        refs.push({ path: ["content", index, "arguments"], call });
      }
      call += 1;
    });
  }
  if (text.length >= MIN_REF) {
    walk(lean, [], (value, path, parent, key) => {
      if (value.length < MIN_REF) return;
      const start = text.indexOf(value);
      if (start < 0) return;
      parent[key] = null;
      refs.push({ path, start, end: start + value.length });
    });
  }
  return build(host, { [LEAN]: { message: lean, refs } });
}

// Calls visit(string, path, parent, key) for every string below value (not the keys).
function walk(value, path, visit) {
  if (Array.isArray(value)) {
    value.forEach((item, index) => {
      if (typeof item === "string") visit(item, [...path, index], value, index);
      else walk(item, [...path, index], visit);
    });
  } else if (value && typeof value === "object") {
    for (const key of Object.keys(value)) {
      if (typeof value[key] === "string") visit(value[key], [...path, key], value, key);
      else walk(value[key], [...path, key], visit);
    }
  }
}

function cutMarker(count, note) {
  return `\n[... ${count} characters cut by transcript-store: ${note}]`;
}

// What one UTF-16 unit weighs in a JSON string as JSON.stringify writes it, in UTF-8 bytes (a pair: 4
// for both units; a lone surrogate, escaped: 6).
function jsonUnitBytes(code) {
  if (code === 0x22 || code === 0x5c) return 2;
  if (code < 0x20) return code === 0x08 || code === 0x09 || code === 0x0a || code === 0x0c || code === 0x0d ? 2 : 6;
  if (code < 0x80) return 1;
  if (code < 0x800) return 2;
  if (code >= 0xd800 && code <= 0xdfff) return 6;
  return 3;
}

/**
 * `text` whose JSON string (its quotes included) weighs at most `maxBytes`: whole when it does, else its
 * head and the cut marker, as a message's strings are cut (a pair never split); null when not even the
 * marker fits.
 */
export function cutToJsonBytes(text, maxBytes, note) {
  if (jsonBytes(text) <= maxBytes) return text;
  const room = maxBytes - jsonBytes(cutMarker(text.length, note)); // the longest marker it can take
  if (room < 0) return null;
  let used = 0;
  let end = 0;
  while (end < text.length) {
    const code = text.charCodeAt(end);
    const next = end + 1 < text.length ? text.charCodeAt(end + 1) : 0;
    const pair = code >= 0xd800 && code <= 0xdbff && next >= 0xdc00 && next <= 0xdfff;
    const bytes = pair ? 4 : jsonUnitBytes(code);
    if (used + bytes > room) break;
    used += bytes;
    end += pair ? 2 : 1;
  }
  return text.slice(0, end) + cutMarker(text.length - end, note);
}

// A provider's signature over a block (Anthropic's thinkingSignature, Gemini's thoughtSignature, ...):
// valid only whole and beside the text it signs, so never cut, only dropped.
const SIGNATURE_KEY = /signature$/i;
const DROP_KEY = -2;

function dropSignatures(block) {
  for (const key of Object.keys(block)) if (SIGNATURE_KEY.test(key)) delete block[key];
}

// The host message with its strings cut as `cuts` says (path -> characters kept; -1: an image or a
// redacted thinking block dropped for a note; DROP_KEY: the key removed).
function clipped(original, cuts, note) {
  const host = JSON.parse(JSON.stringify(original));
  for (const [key, keep] of cuts) {
    const path = JSON.parse(key);
    const parent = path.slice(0, -1).reduce((node, step) => node[step], host);
    const last = path[path.length - 1];
    if (keep === DROP_KEY) {
      delete parent[last];
    } else if (keep < 0 && parent[last].type === "thinking") {
      // Redacted thinking: its opaque data is all it holds, and a provider refuses it cut.
      parent[last] = { type: "thinking", thinking: `[redacted thinking of ${String(parent[last].thinkingSignature).length} characters dropped by transcript-store: ${note}]` };
    } else if (keep < 0) {
      const part = parent[last];
      parent[last] = { type: "text", text: `[image${part.mimeType ? ` ${part.mimeType}` : ""} of ${String(part.data).length} characters dropped by transcript-store: ${note}]` };
    } else {
      const text = parent[last];
      parent[last] = text.slice(0, keep) + cutMarker(text.length - keep, note);
      // A signature signs the whole text: kept beside a cut one, the provider refused the replayed
      // history (Anthropic's "invalid signature in thinking block"); without it the text is sent unsigned.
      if (parent.type === "thinking") dropSignatures(parent);
    }
  }
  return host;
}

// Cut the longest string still long enough, by what its characters weigh in the stored form, so the
// stored form comes under `budget` (or cut it all and go on with the next); false when none is left.
function cut(host, original, cuts, size, budget, note) {
  let best = null;
  walk(host, [], (value, path, parent) => {
    if (value.length >= MIN_CLIP && (!best || value.length > best.value.length)) best = { value, path, parent };
  });
  if (!best) return false;
  const key = JSON.stringify(best.path);
  const last = best.path[best.path.length - 1];
  if ((last === "data" && best.parent.type === "image")
    || (last === "thinkingSignature" && best.parent.type === "thinking" && best.parent.redacted === true)) {
    cuts.set(JSON.stringify(best.path.slice(0, -1)), -1);
    return true;
  }
  if (SIGNATURE_KEY.test(String(last))) {
    cuts.set(key, DROP_KEY); // a signature cut is no signature: dropped whole
    return true;
  }
  const source = best.path.reduce((node, step) => node[step], original);
  const kept = cuts.has(key) ? cuts.get(key) : source.length;
  const without = jsonBytes(leanStored(clipped(original, new Map(cuts).set(key, 0), note)));
  const perChar = (size - without) / Math.max(kept, 1);
  let keep = without >= budget || perChar <= 0 ? 0 : Math.floor(kept - (size - budget + 512) / perChar);
  keep = Math.max(0, Math.min(keep, kept - 1));
  const code = source.charCodeAt(keep - 1);
  if (keep > 0 && code >= 0xd800 && code <= 0xdbff) keep -= 1; // never split a surrogate pair
  cuts.set(key, keep);
  return true;
}

// Last resort (a message made of many short strings): its role and ids, and a note.
function placeholder(original, why) {
  const short = (value) => (typeof value === "string" ? value.slice(0, 256).toWellFormed() : value);
  const size = jsonBytes(original);
  const note = { type: "text", text: `[a message of ${size} bytes dropped by transcript-store: ${why}]` };
  const host = { role: short(original.role) };
  for (const key of ["toolCallId", "toolName", "isError", "api", "provider", "model", "stopReason", "timestamp"]) {
    if (original[key] !== undefined && (typeof original[key] !== "object" || original[key] === null)) host[key] = short(original[key]);
  }
  const calls = Array.isArray(original.content)
    ? original.content.filter((part) => part && part.type === "toolCall").map((part) => ({ type: "toolCall", id: short(part.id), name: short(part.name), arguments: {} }))
    : [];
  host.content = [note, ...calls];
  return host;
}

function parseArguments(text) {
  try {
    const value = JSON.parse(text || "{}");
    return value && typeof value === "object" && !Array.isArray(value) ? value : {};
  } catch {
    return {};
  }
}

/**
 * The AgentMessage of a stored message: the host's own when it wrote it, else a faithful rendering, dated
 * `options.writtenAt` (milliseconds) when given: OpenClaw shows a user message's date to the model, and a
 * summary dated 0 read "[Thu 1970-01-01 00:00 UTC]".
 */
export function fromStored(message, options) {
  const original = message && message[ORIGINAL];
  if (original && typeof original === "object" && typeof original.role === "string") return original;
  const rebuilt = fromLean(message);
  if (rebuilt) return rebuilt;
  const given = options && typeof options === "object" ? options.writtenAt : undefined; // not map's index
  const timestamp = Number.isFinite(given) && given > 0 ? given : 0;
  const text = typeof message.content === "string" ? message.content : contentText(message.content);
  if (message.role === "assistant") {
    const calls = (message.tool_calls || []).map((call) => ({
      type: "toolCall",
      id: call.id,
      name: call.function?.name ?? "tool",
      arguments: parseArguments(call.function?.arguments),
    }));
    return {
      role: "assistant",
      content: [...(text ? [{ type: "text", text }] : []), ...calls],
      api: "openai-completions",
      provider: "transcript-store",
      model: "transcript-store",
      usage: ZERO_USAGE,
      stopReason: calls.length ? "toolUse" : "stop",
      timestamp,
    };
  }
  if (message.role === "tool") {
    return {
      role: "toolResult",
      toolCallId: message.tool_call_id,
      toolName: message.name || "tool",
      content: [{ type: "text", text }],
      isError: false,
      timestamp,
    };
  }
  // user, system, developer (summaries an engine wrote): the model reads them as user context.
  return { role: "user", content: [{ type: "text", text }], timestamp };
}

// The host's message of a LEAN stored message: its removed values taken back from the projection.
function fromLean(message) {
  const lean = message && message[LEAN];
  if (!lean || typeof lean !== "object" || !lean.message || typeof lean.message.role !== "string") return null;
  try {
    const host = JSON.parse(JSON.stringify(lean.message));
    for (const ref of Array.isArray(lean.refs) ? lean.refs : []) {
      const path = ref.path;
      let parent = host;
      for (const step of path.slice(0, -1)) {
        if (!Object.hasOwn(parent, step)) throw new Error("bad ref");
        parent = parent[step];
      }
      const last = path[path.length - 1];
      if (!parent || typeof parent !== "object" || !Object.hasOwn(parent, last)) throw new Error("bad ref");
      parent[last] = ref.call !== undefined
        ? JSON.parse(message.tool_calls[ref.call].function.arguments)
        : message.content.slice(ref.start, ref.end);
    }
    return host;
  } catch {
    return null; // not one this plugin wrote: rendered from the projection
  }
}

// ------------------------------------------------------------------------------- stale signatures
//
// A provider signs a reply's reasoning together with the prefix it was generated after (Anthropic's
// signed thinking). A compaction replaces that prefix with a summary, so the replies it kept carry
// signatures the provider no longer verifies: Anthropic refused the history ("Invalid signature in
// thinking block"), or drops the blocks ("prefix_binding_mismatch") on every request. OpenClaw removes
// them from its own history after its compactions (stripStaleThinkingSignaturesForCompactionReplay, then
// stripInvalidThinkingSignatures: a reply older than the latest compaction summary loses its signed
// thinking), but what a context engine assembles reaches the model as it is.

export const OMITTED_REASONING = "[assistant reasoning omitted]";

function timeOf(value) {
  if (typeof value === "number") return Number.isFinite(value) ? value : undefined;
  if (typeof value !== "string") return undefined;
  const parsed = Date.parse(value);
  return Number.isFinite(parsed) ? parsed : undefined;
}

/**
 * The assembled messages with the thinking blocks of every reply generated before the latest compaction
 * removed: the latest of OpenClaw's compaction summaries among them and `compactedAt` (when the service
 * engine last summarised what they follow, milliseconds). A reply left empty says its reasoning was
 * omitted, as OpenClaw's own replay does. Replies after the compaction are returned untouched.
 */
export function withoutStaleThinking(messages, compactedAt) {
  let latest = Number.isFinite(compactedAt) ? compactedAt : undefined;
  for (const message of messages) {
    if (message?.role !== "compactionSummary") continue;
    const at = timeOf(message.timestamp);
    if (at !== undefined && (latest === undefined || at > latest)) latest = at;
  }
  if (latest === undefined) return messages;
  return messages.map((message) => {
    if (!message || message.role !== "assistant" || !Array.isArray(message.content)) return message;
    const at = timeOf(message.timestamp);
    if (at === undefined || at >= latest) return message;
    const kept = message.content.filter((part) => !(part && (part.type === "thinking" || part.type === "redacted_thinking")));
    if (kept.length === message.content.length) return message;
    return { ...message, content: kept.length ? kept : [{ type: "text", text: OMITTED_REASONING }] };
  });
}
