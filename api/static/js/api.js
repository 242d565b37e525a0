// A small client for the daemon routes. URLs are relative to the page, so the shell works
// behind a path prefix and against any API process of a deployment.

import { t } from "./i18n.js";

const CLIENT_ID_KEY = "acp-shell.clientId";
const TOKEN_KEY = "acp-shell.token";

// The bearer token lives in this tab's sessionStorage, never in localStorage: it is gone
// when the tab closes (localStorage kept it on disk for good, for every page of the origin
// in every tab), yet survives a reload of the tab. It never goes into a URL: an event
// stream opens with a single-use ticket (`POST /stream-tickets`), see `streamUrl`.
let memoryToken = ""; // when the browser refuses sessionStorage: this page's life only

try {
  localStorage.removeItem(TOKEN_KEY); // a token an older shell kept there
} catch {
  /* storage disabled */
}

/** The bearer token this tab uses, when the daemon requires one. */
function token() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || memoryToken;
  } catch {
    return memoryToken;
  }
}

/** Ask once for a token after a 401; returns whether a new one was given. */
function askForToken() {
  const given = typeof window.prompt === "function" ? window.prompt(t("auth.prompt")) : null;
  if (!given) return false;
  memoryToken = given.trim();
  try {
    sessionStorage.setItem(TOKEN_KEY, memoryToken);
  } catch {
    /* kept in memory */
  }
  return true;
}

/** Whether the event streams open with tickets (a token is in use): a ticket opens its
 * stream once, so the browser's own reconnect, which repeats the URL, cannot resume it. */
export function streamsNeedTickets() {
  return Boolean(token());
}

/** A non-2xx answer: `status`, the daemon's `code`, and its message. */
export class ApiError extends Error {
  constructor(status, body, fallback) {
    super((body && typeof body.error === "string" && body.error) || fallback || `HTTP ${status}`);
    this.status = status;
    this.code = body && typeof body.code === "string" ? body.code : undefined;
    this.body = body;
  }
}

/** This browser's client id (X-Qwen-Client-Id): kept, so a reload does not add clients. */
export function clientId() {
  let id = null;
  try {
    id = localStorage.getItem(CLIENT_ID_KEY);
  } catch {
    /* storage disabled */
  }
  if (!id || !/^[A-Za-z0-9._:-]{1,128}$/.test(id)) {
    const bytes = crypto.getRandomValues(new Uint8Array(16)); // works outside secure contexts too
    id = "web-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
    try {
      localStorage.setItem(CLIENT_ID_KEY, id);
    } catch {
      /* a fresh id per page then */
    }
  }
  return id;
}

async function request(method, path, body, retried = false, { asClient = true } = {}) {
  const headers = asClient ? { "X-Qwen-Client-Id": clientId() } : {};
  if (token()) headers.Authorization = `Bearer ${token()}`;
  const init = { method, headers };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    throw new ApiError(0, null, error.message || "network error");
  }
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (response.status === 401 && !retried && askForToken()) return request(method, path, body, true, { asClient });
  if (!response.ok) throw new ApiError(response.status, data, text.slice(0, 200));
  return data;
}

const seg = encodeURIComponent;

export const api = {
  capabilities: () => request("GET", "capabilities"),
  listSessions: (workspaceId, size = 100) =>
    request("GET", `workspace/${seg(workspaceId)}/sessions?size=${size}`),
  createSession: (cwd) => request("POST", "session", { cwd, sessionScope: "thread" }),
  status: (sid) => request("GET", `session/${seg(sid)}/status`),
  load: (sid, historyPageSize = 100) => request("POST", `session/${seg(sid)}/load`, { historyPageSize }),
  // The same route: a session that is not live (its worker died or left) is resumed on a
  // live worker, under the same id, with its conversation (`attached: false`).
  resume: (sid) => request("POST", `session/${seg(sid)}/load`, {}),
  transcript: (sid, limit = 100) => request("GET", `session/${seg(sid)}/transcript?limit=${limit}`),
  prompt: (sid, text) => request("POST", `session/${seg(sid)}/prompt`, { prompt: [{ type: "text", text }] }),
  cancel: (sid) => request("POST", `session/${seg(sid)}/cancel`, {}),
  vote: (sid, requestId, body) => request("POST", `session/${seg(sid)}/permission/${seg(requestId)}`, body),
  // The deployment view answers from outside the session: this browser is not one of its
  // clients (a client id the session never registered is refused), so the vote carries none.
  voteFromOutside: (sid, requestId, body) =>
    request("POST", `session/${seg(sid)}/permission/${seg(requestId)}`, body, false, { asClient: false }),
  /** The SSE URL (a promise: it may need a ticket); `eventEpoch` lets the server say when a
   * resumed id is from an older epoch. */
  eventsUrl: (sid, eventEpoch) => streamUrl(`session/${seg(sid)}/events`, { eventEpoch }),
  /** The workspace's live feed; `lastEventId` (the last frame's id, which names its
   * generation) asks for what was missed since. */
  liveFeedUrl: (workspaceId, lastEventId) =>
    streamUrl(`workspaces/${seg(workspaceId)}/sessions/live-state/events`, { lastEventId }),
  attention: (size = 200) => request("GET", `attention?size=${size}`),
  attentionEventsUrl: () => streamUrl("attention/events"),
  workers: () => request("GET", "workers"),
};

/**
 * An event stream's URL with `params` (empty ones left out), as a promise. EventSource
 * cannot send headers, and a token in a URL would be kept in history and logs: with a token,
 * the URL carries a ticket asked for with the token in the header, which opens this stream
 * once, within a minute.
 */
async function streamUrl(path, params = {}) {
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") query.set(name, String(value));
  }
  if (token()) {
    const { ticket } = await request("POST", "stream-tickets", { path }, false, { asClient: false });
    query.set("ticket", ticket);
  }
  const text = query.toString();
  return path + (text ? `?${text}` : "");
}
