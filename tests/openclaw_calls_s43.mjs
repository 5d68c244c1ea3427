// Drive the OpenClaw plugin's engine against a running `transcript-store serve`, as OpenClaw calls it:
// read {engineModule, serviceUrl, token, engine, transcript, calls: [{method, params}]} as JSON on stdin and
// print {results, logs}: each call's result ({result}) or error ({error: {name, code, message}}). The host's
// transcript is `transcript` (its visible messages, each {entryId, message}), read the way
// readSessionTranscriptVisibleMessageDelta reads it; the host has no raw reads, no memory helper and a
// delegated compaction that compacts nothing. An engine that cannot be built prints {built: its error}.
import { pathToFileURL } from "node:url";

let raw = "";
for await (const chunk of process.stdin) raw += chunk;
const input = JSON.parse(raw);
const { createEngine } = await import(pathToFileURL(input.engineModule).href);
const entries = input.transcript ?? [];
const sdk = {
  readSessionTranscriptVisibleMessageDelta: async ({ cursor, maxMessages }) => {
    const start = cursor === undefined ? 0 : Number(cursor);
    const page = entries.slice(start, start + maxMessages);
    const end = start + page.length;
    return { kind: "page", cursor: String(end), hasMore: end < entries.length, entries: page };
  },
  delegateCompactionToRuntime: async () => ({ ok: true, compacted: false, reason: "nothing to compact" }),
};
const logs = [];
const logger = { info: (m) => logs.push(m), warn: (m) => logs.push(m) };
let engine;
try {
  engine = await createEngine({ serviceUrl: input.serviceUrl, token: input.token, engine: input.engine, sdk, logger });
} catch (error) {
  process.stdout.write(JSON.stringify({ built: { name: error?.name, code: error?.code ?? null, message: String(error?.message ?? error) } }) + "\n");
  process.exit(0);
}
const results = [];
for (const { method, params } of input.calls) {
  try {
    results.push({ result: (await engine[method](params)) ?? null });
  } catch (error) {
    results.push({ error: { name: error?.name, code: error?.code ?? null, message: String(error?.message ?? error) } });
  }
}
process.stdout.write(JSON.stringify({ results, logs }) + "\n");
