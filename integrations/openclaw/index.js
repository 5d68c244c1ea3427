// OpenClaw plugin entry: registers the "transcript-store" context engine.
//
// Config (plugins.entries.transcript-store.config): serviceUrl, token, engine, timeoutMs; each falls
// back to TRANSCRIPT_STORE_SERVICE_URL / TRANSCRIPT_STORE_TOKEN / TRANSCRIPT_STORE_ENGINE /
// TRANSCRIPT_STORE_TIMEOUT_MS. Select it with plugins.slots.contextEngine = "transcript-store".

import { createEngine, PLUGIN_ID, resolveConfig } from "./src/engine.js";

export default {
  id: PLUGIN_ID,
  name: "transcript-store",
  description: "Context engine backed by a transcript-store service (durable, idempotent turn commits).",
  register(api) {
    const config = resolveConfig(api.pluginConfig ?? {});
    api.registerContextEngine(PLUGIN_ID, () => createEngine({ ...config, logger: api.logger }));
  },
};
