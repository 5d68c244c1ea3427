// `transcript-store serve` for the plugin's Node tests: a child process on a loopback port (0: a free one),
// SQLite in a temporary directory. The service's Python is TRANSCRIPT_STORE_PYTHON, else the repository's
// .venv, else python3.
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const ROOT = fileURLToPath(new URL("../../..", import.meta.url));
const PYTHON = process.env.TRANSCRIPT_STORE_PYTHON
  || (existsSync(join(ROOT, ".venv/bin/python")) ? join(ROOT, ".venv/bin/python") : "python3");

/** Start the service, its one bearer `token` for scope-openclaw; resolves once it prints the URL it listens on. */
export async function startService({ token, env = {}, args = [], dir = mkdtempSync(join(tmpdir(), "ts-openclaw-")), port = 0 }) {
  const child = spawn(PYTHON, ["-m", "transcript_store", "serve", "--db", `sqlite:///${join(dir, "store.db")}`,
    "--port", String(port), ...args], {
    cwd: dir,
    env: { ...process.env, PYTHONPATH: ROOT, TRANSCRIPT_STORE_TOKENS: `${token}=scope-openclaw`, ...env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let log = "";
  child.stderr.on("data", (chunk) => { log += chunk; });
  const url = await new Promise((resolve, reject) => {
    let out = "";
    const timer = setTimeout(() => reject(new Error(`serve did not start:\n${log.slice(-3000)}`)), 60000);
    child.stdout.on("data", (chunk) => {
      out += chunk;
      const found = /listening on (http:\/\/\S+)/.exec(out);
      if (found) { clearTimeout(timer); resolve(found[1]); }
    });
    child.on("exit", (code) => { clearTimeout(timer); reject(new Error(`serve exited (${code}):\n${log.slice(-3000)}`)); });
  });
  const call = async (method, path, body) => (await fetch(url + path, {
    method, headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
    ...(body ? { body: JSON.stringify(body) } : {}),
  })).json();
  return {
    url,
    dir,
    port: Number(new URL(url).port),
    log: () => log,
    get: (path) => call("GET", path),
    post: (path, body) => call("POST", path, body),
    async stop({ keep = false } = {}) {
      if (child.exitCode === null) {
        const exited = new Promise((resolve) => child.once("exit", resolve));
        child.kill("SIGTERM");
        await exited;
      }
      if (!keep) rmSync(dir, { recursive: true, force: true });
    },
  };
}
