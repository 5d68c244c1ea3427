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
const ENTRY_MARGIN = 4096;
const MIN_REF = 256; // shorter strings stay in the lean message
const MIN_CLIP = 1024; // shorter strings are never cut

/** A string without lone UTF-16 surrogates (each becomes U+FFFD): the service refuses them. */
export function wellFormed(text) {
  return typeof text === "string" ? text.toWellFormed() : text;
}

/** A JSON copy of a value with every string (keys too) well-formed. */
export function wellFormedCopy(value) {
  return clean(JSON.parse(JSON.stringify(value ?? null)));
}

function clean(value) {
  if (typeof value === "string") return value.toWellFormed();
  if (Array.isArray(value)) return value.map(clean);
  if (value && typeof value === "object") {
    for (const key of Object.keys(value)) {
      const fixed = key.toWellFormed();
      const item = clean(value[key]);
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
 * strings are cut, each with a visible marker (an image's data: the image becomes a text note).
 * The result is a function of the message alone, so a replay maps to the same stored message.
 */
export function toStored(message, options) {
  const maxBytes = (options && typeof options === "object" && options.maxBytes) || ENTRY_CAP_BYTES; // not map's index
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
    if (!cut(host, original, cuts, size, budget, maxBytes)) break;
    host = clipped(original, cuts, maxBytes);
  }
  return leanStored(placeholder(original, maxBytes));
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

function cutMarker(count, maxBytes) {
  return `\n[... ${count} characters cut by transcript-store: the message is over the store's entry cap of ${maxBytes} bytes]`;
}

// The host message with its strings cut as `cuts` says (path -> characters kept; -1: an image dropped).
function clipped(original, cuts, maxBytes) {
  const host = JSON.parse(JSON.stringify(original));
  for (const [key, keep] of cuts) {
    const path = JSON.parse(key);
    const parent = path.slice(0, -1).reduce((node, step) => node[step], host);
    const last = path[path.length - 1];
    if (keep < 0) {
      const part = parent[last];
      parent[last] = { type: "text", text: `[image${part.mimeType ? ` ${part.mimeType}` : ""} of ${String(part.data).length} characters dropped by transcript-store: the message is over the store's entry cap of ${maxBytes} bytes]` };
    } else {
      const text = parent[last];
      parent[last] = text.slice(0, keep) + cutMarker(text.length - keep, maxBytes);
    }
  }
  return host;
}

// Cut the longest string still long enough, by what its characters weigh in the stored form, so the
// stored form comes under `budget` (or cut it all and go on with the next); false when none is left.
function cut(host, original, cuts, size, budget, maxBytes) {
  let best = null;
  walk(host, [], (value, path, parent) => {
    if (value.length >= MIN_CLIP && (!best || value.length > best.value.length)) best = { value, path, parent };
  });
  if (!best) return false;
  const key = JSON.stringify(best.path);
  if (best.path[best.path.length - 1] === "data" && best.parent.type === "image") {
    cuts.set(JSON.stringify(best.path.slice(0, -1)), -1);
    return true;
  }
  const source = best.path.reduce((node, step) => node[step], original);
  const kept = cuts.has(key) ? cuts.get(key) : source.length;
  const without = jsonBytes(leanStored(clipped(original, new Map(cuts).set(key, 0), maxBytes)));
  const perChar = (size - without) / Math.max(kept, 1);
  let keep = without >= budget || perChar <= 0 ? 0 : Math.floor(kept - (size - budget + 512) / perChar);
  keep = Math.max(0, Math.min(keep, kept - 1));
  const code = source.charCodeAt(keep - 1);
  if (keep > 0 && code >= 0xd800 && code <= 0xdbff) keep -= 1; // never split a surrogate pair
  cuts.set(key, keep);
  return true;
}

// Last resort (a message made of many short strings): its role and ids, and a note.
function placeholder(original, maxBytes) {
  const short = (value) => (typeof value === "string" ? value.slice(0, 256).toWellFormed() : value);
  const size = jsonBytes(original);
  const note = { type: "text", text: `[a message of ${size} bytes dropped by transcript-store: over the store's entry cap of ${maxBytes} bytes]` };
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

/** The AgentMessage of a stored message: the host's own when it wrote it, else a faithful rendering. */
export function fromStored(message) {
  const original = message && message[ORIGINAL];
  if (original && typeof original === "object" && typeof original.role === "string") return original;
  const rebuilt = fromLean(message);
  if (rebuilt) return rebuilt;
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
      timestamp: 0,
    };
  }
  if (message.role === "tool") {
    return {
      role: "toolResult",
      toolCallId: message.tool_call_id,
      toolName: message.name || "tool",
      content: [{ type: "text", text }],
      isError: false,
      timestamp: 0,
    };
  }
  // user, system, developer (summaries an engine wrote): the model reads them as user context.
  return { role: "user", content: [{ type: "text", text }], timestamp: 0 };
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
