// OpenClaw AgentMessages <-> the store's OpenAI chat messages.
//
// The store keeps OpenAI chat-format messages and preserves unknown keys. A host message is stored as
// its OpenAI projection (what engines read, count and summarize) with the host's message itself under
// ORIGINAL, so reading it back gives the host exactly what it wrote. The projection is a function of
// the host message alone: the same host message always maps to the same stored message, which is how
// the service recognises a message it already holds.

export const ORIGINAL = "openclaw";

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

/** The stored (OpenAI chat) form of one AgentMessage, the AgentMessage itself kept under ORIGINAL. */
export function toStored(message) {
  const original = JSON.parse(JSON.stringify(message));
  if (message.role === "user") {
    return { role: "user", content: contentText(message.content), [ORIGINAL]: original };
  }
  if (message.role === "assistant") {
    const calls = toolCallsOf(message.content);
    const text = contentText(message.content);
    const stored = { role: "assistant", content: text || (calls.length ? null : ""), [ORIGINAL]: original };
    if (calls.length) stored.tool_calls = calls;
    return stored;
  }
  if (message.role === "toolResult") {
    return {
      role: "tool",
      tool_call_id: String(message.toolCallId || "unknown"),
      name: String(message.toolName || "tool"),
      content: contentText(message.content),
      [ORIGINAL]: original,
    };
  }
  // bashExecution, custom, branchSummary, compactionSummary, ...: text the model can read.
  return { role: "user", content: otherText(message), [ORIGINAL]: original };
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
