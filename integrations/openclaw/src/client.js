// A small JSON client for `transcript-store serve`: bearer token, timeout, typed errors.
//
// Every failure throws a ServiceError: an unreachable service or a timeout (`status` 0,
// code "service_unreachable"), or the service's own error body ({"error": {"code", "message"}}).
// Nothing is retried here: the host retries whole operations (a commit stays in its outbox and is
// replayed with the same advancement key, which the service answers "duplicate").

export class ServiceError extends Error {
  /**
   * @param {number} status HTTP status (0 when no answer arrived)
   * @param {string} code the service's stable error code
   * @param {string} message
   * @param {string | undefined} reason extra reason for some codes (read_fence, transcript_mirror)
   * @param {{cause?: unknown}} [options]
   */
  constructor(status, code, message, reason, options) {
    super(message, options);
    this.name = "ServiceError";
    this.status = status;
    this.code = code;
    this.reason = reason;
  }
}

// A request the host's abortSignal ended. OpenClaw (2026.9.6, its context-engine registry) tells a
// lifecycle call the host aborted from an engine failure by the error alone: the signal's reason, an
// error named AbortError, or one whose cause is the reason. Anything else is taken as the engine
// failing, and an engine OpenClaw resolved for a /compact is quarantined for the gateway process (its
// later compactions ran on OpenClaw's legacy engine until a restart). So the error is named AbortError
// and caused by the reason, and keeps its code ("aborted") for the plugin's own checks.
function abortedBy(abortSignal, method, path) {
  const error = new ServiceError(0, "aborted", `transcript-store ${method} ${path}: aborted by the host`, undefined,
    { cause: abortSignal.reason });
  error.name = "AbortError";
  return error;
}

/**
 * @param {{serviceUrl: string, token: string, timeoutMs?: number, fetchImpl?: typeof fetch}} options
 */
export function createClient({ serviceUrl, token, timeoutMs = 15000, fetchImpl = globalThis.fetch }) {
  if (!serviceUrl) throw new Error("transcript-store: serviceUrl is not configured");
  if (!token) throw new Error("transcript-store: token is not configured");
  // Checked here, never quoted: fetch's own errors for a bad header or a URL with credentials quote
  // the whole value, and OpenClaw logs the message.
  if (typeof token !== "string" || !/^[\x21-\x7e]+$/.test(token)) {
    throw new Error(`transcript-store: the token (${typeof token === "string" ? token.length : 0} characters, not shown) must be printable ASCII without spaces or line breaks`);
  }
  let url;
  try {
    url = new URL(String(serviceUrl));
  } catch {
    throw new Error("transcript-store: serviceUrl is not a valid URL (not shown)");
  }
  if (url.username || url.password) {
    throw new Error("transcript-store: serviceUrl must not contain credentials (user:password@); the value is not shown");
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    throw new Error("transcript-store: serviceUrl must be an http:// or https:// URL");
  }
  // Each API path is appended to the base: after a query or a fragment it became part of them, and every
  // request went to the service's "/" (a 404 read as an unknown engine). Not quoted: a query can hold a secret.
  if (url.search || url.hash) {
    throw new Error("transcript-store: serviceUrl must not have a query (?...) or a fragment (#...); the value is not shown");
  }
  const base = (url.origin + url.pathname).replace(/\/+$/, "");

  async function request(method, path, body, abortSignal) {
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), timeoutMs);
    // The host's own abort (a compaction it gave up on) ends the request too.
    const stop = () => controller.abort();
    if (abortSignal?.aborted) {
      clearTimeout(timer);
      throw abortedBy(abortSignal, method, path);
    }
    abortSignal?.addEventListener?.("abort", stop, { once: true });
    let response;
    let text;
    // The timeout covers the whole answer, its body too: a service that sent its headers and then
    // stalled held the host's turn for ever, and a connection cut mid-body threw an untyped error.
    try {
      response = await fetchImpl(base + path, {
        method,
        headers: {
          authorization: `Bearer ${token}`,
          accept: "application/json",
          ...(body === undefined ? {} : { "content-type": "application/json" }),
        },
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: controller.signal,
      });
      text = await response.text();
    } catch (error) {
      if (abortSignal?.aborted) throw abortedBy(abortSignal, method, path);
      const why = controller.signal.aborted ? `no answer within ${timeoutMs} ms` : describe(error, token);
      throw new ServiceError(0, "service_unreachable", `transcript-store service at ${base} is unreachable: ${why}`);
    } finally {
      clearTimeout(timer);
      abortSignal?.removeEventListener?.("abort", stop);
    }
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch {
      data = null;
    }
    if (!response.ok) {
      const error = (data && data.error) || {};
      throw new ServiceError(
        response.status,
        error.code || "http_error",
        `transcript-store ${method} ${path}: ${error.message || `HTTP ${response.status}`}`,
        error.reason || undefined,
      );
    }
    return data;
  }

  return {
    base,
    get: (path, abortSignal) => request("GET", path, undefined, abortSignal),
    post: (path, body, abortSignal) => request("POST", path, body ?? {}, abortSignal),
  };
}

// A network failure's cause; never the message of an error building the request (it quotes the
// header or URL it refused), and never the token.
function describe(error, token) {
  const cause = error && error.cause;
  const text = cause && (cause.code || cause.message);
  if (!text) return `the request could not be made (${(error && error.name) || "error"}; its message is not shown, as it can quote the headers)`;
  return String(text).split(token).join("[token]");
}
