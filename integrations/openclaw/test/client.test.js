// The client against a real local HTTP server (node:http) and the real fetch: `node --test test/`.
import assert from "node:assert/strict";
import { once } from "node:events";
import { createServer } from "node:http";
import { test } from "node:test";

import { createClient, ServiceError } from "../src/client.js";

async function serving(handler) {
  const sockets = new Set();
  const server = createServer(handler);
  server.on("connection", (socket) => { sockets.add(socket); socket.on("close", () => sockets.delete(socket)); });
  server.listen(0, "127.0.0.1");
  await once(server, "listening");
  const { port } = server.address();
  return {
    url: `http://127.0.0.1:${port}`,
    close: () => { for (const socket of sockets) socket.destroy(); server.close(); },
  };
}

test("a service that sends its headers and then stalls times out as unreachable", async () => {
  const svc = await serving((req, res) => {
    res.writeHead(200, { "content-type": "application/json", "content-length": "100" });
    res.write('{"partial": ');  // and never the rest
  });
  try {
    const client = createClient({ serviceUrl: svc.url, token: "tok", timeoutMs: 300 });
    const started = Date.now();
    await assert.rejects(client.get("/v1/engines"), (error) =>
      error instanceof ServiceError && error.code === "service_unreachable" && /no answer within 300 ms/.test(error.message));
    assert.ok(Date.now() - started < 5000);
  } finally {
    svc.close();
  }
});

test("a connection cut in the middle of the body is a typed error", async () => {
  const svc = await serving((req, res) => {
    res.writeHead(200, { "content-type": "application/json", "content-length": "100" });
    res.write('{"partial": ', () => req.socket.destroy());
  });
  try {
    const client = createClient({ serviceUrl: svc.url, token: "tok", timeoutMs: 5000 });
    await assert.rejects(client.post("/v1/sessions", {}), (error) =>
      error instanceof ServiceError && error.code === "service_unreachable" && error.status === 0);
  } finally {
    svc.close();
  }
});

test("the service's error body becomes the error's code and reason", async () => {
  const svc = await serving((req, res) => {
    res.writeHead(409, { "content-type": "application/json" });
    res.end(JSON.stringify({ error: { code: "read_fence", message: "moved", reason: "generation" } }));
  });
  try {
    const client = createClient({ serviceUrl: svc.url, token: "tok" });
    await assert.rejects(client.get("/v1/x"), (error) =>
      error.status === 409 && error.code === "read_fence" && error.reason === "generation");
  } finally {
    svc.close();
  }
});

test("a timeout from the environment is checked like the config's", async () => {
  const { resolveConfig } = await import("../src/engine.js");
  assert.equal(resolveConfig({}, { TRANSCRIPT_STORE_TIMEOUT_MS: "2500" }).timeoutMs, 2500);
  assert.equal(resolveConfig({ timeoutMs: 300 }, { TRANSCRIPT_STORE_TIMEOUT_MS: "nope" }).timeoutMs, 300);
  assert.equal(resolveConfig({}, {}).timeoutMs, 15000);
  for (const bad of ["15s", "99", "600001", "1.5", "-1"]) {
    assert.throws(() => resolveConfig({}, { TRANSCRIPT_STORE_TIMEOUT_MS: bad }), /100\.\.600000/);
  }
});

test("a token or URL fetch would refuse is a config error that never quotes it", async () => {
  for (const token of ["secret-token-abc\nsecond-line", "\u201csecret-token-abc\u201d", "secret token-abc"]) {
    assert.throws(() => createClient({ serviceUrl: "http://127.0.0.1:9", token }), (error) =>
      /token .*printable ASCII/.test(error.message) && !error.message.includes("secret"));
  }
  for (const serviceUrl of ["https://svc:proxy-password-xyz@127.0.0.1:8765", "http://user@h:1", "not a url proxy-password-xyz", "ftp://h/x"]) {
    assert.throws(() => createClient({ serviceUrl, token: "tok" }), (error) =>
      /serviceUrl/.test(error.message) && !error.message.includes("proxy-password-xyz") && !error.message.includes("user@"));
  }
  assert.equal(createClient({ serviceUrl: "http://127.0.0.1:8765/prefix/", token: "tok" }).base, "http://127.0.0.1:8765/prefix");
  // An error building the request is never passed on verbatim (undici's quote the header value).
  const fetchImpl = async (url, init) => { throw new TypeError(`Headers.append: "${init.headers.authorization}" is an invalid header value.`); };
  const client = createClient({ serviceUrl: "http://127.0.0.1:9", token: "secret-token-abc", fetchImpl });
  await assert.rejects(client.get("/v1/engines"), (error) =>
    error.code === "service_unreachable" && !error.message.includes("secret-token-abc"));
});
