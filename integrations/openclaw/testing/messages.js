// Messages in OpenClaw's form and test payloads, shared by the plugin's tests (outside test/, where
// `node --test test/` would run it as a test file).

export const MiB = 1024 * 1024;

export const userMessage = (text, timestamp = 1) => ({ role: "user", content: text, timestamp });
export const assistantMessage = (content, timestamp = 2) => ({
  role: "assistant", content: typeof content === "string" ? [{ type: "text", text: content }] : content,
  api: "openai-completions", provider: "fake", model: "m", usage: {}, stopReason: "stop", timestamp,
});
export const toolCall = (id, name, args) => assistantMessage([{ type: "toolCall", id, name, arguments: args }]);
export const toolResult = (id, text) => ({
  role: "toolResult", toolCallId: id, toolName: "read", content: [{ type: "text", text }], isError: false, timestamp: 3,
});
/** About `mib` MiB of text: `seed` repeated. */
export const logOf = (seed, mib) => `${seed} `.repeat(Math.floor(mib * MiB / (seed.length + 1)));

/** A PNG's first bytes (signature and IHDR chunk) for an image of width x height, padded, as base64. */
export function pngOf(width, height, padding = 2000) {
  const bytes = Buffer.alloc(33 + padding);
  Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]).copy(bytes, 0);
  bytes.writeUInt32BE(13, 8);
  bytes.write("IHDR", 12, "latin1");
  bytes.writeUInt32BE(width, 16);
  bytes.writeUInt32BE(height, 20);
  return bytes.toString("base64");
}
