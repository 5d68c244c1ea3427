// Drive the plugin's commitTurn directly, as a host replay would: read {engineModule, serviceUrl, token,
// engine, calls: [params...]} as JSON on stdin, print one JSON array of results ({status} or {error}).
import { pathToFileURL } from "node:url";

let raw = "";
for await (const chunk of process.stdin) raw += chunk;
const input = JSON.parse(raw);
const { createEngine } = await import(pathToFileURL(input.engineModule).href);
const engine = await createEngine({ serviceUrl: input.serviceUrl, token: input.token, engine: input.engine, sdk: {} });
const results = [];
for (const params of input.calls) {
  try {
    results.push(await engine.commitTurn(params));
  } catch (error) {
    results.push({ error: error.code ?? String(error.message) });
  }
}
process.stdout.write(JSON.stringify(results) + "\n");
