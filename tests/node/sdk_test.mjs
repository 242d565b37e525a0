// Drives two acp-state API processes with the reference's official SDK, @qwen-code/sdk
// (DaemonClient), unchanged. Run by tests/test_sdk.py; runnable by hand too.
//
// Environment:
//   ACP_SDK_API_A, ACP_SDK_API_B  base URLs of two API processes of one cluster
//   ACP_SDK_CWD                   the workspace cwd both serve
//   ACP_SDK_TIMEOUT_MS            bound on each awaited event (default 90000)
//   ACP_SDK_FAILOVER=none         no kill: for one daemon given as both A and B (the
//                                 reference `qwen serve`, to check this script against it)
//
// Output: one JSON line per step, {"step", "ok", "api", "via", "call", "result" | "error",
// "http"}; `http` lists the requests the step made (method, path, status). `via` is "sdk"
// for a DaemonClient method and "http" for a route that SDK 0.1.14 has no method for (turn
// status, the batch catalog): those go out as plain fetch, with the SDK's headers.
//
// Failover: after the QUESTION prompt's request arrives on API A's event stream the
// script prints {"control":"kill-api-a"} and waits for a line `killed` on stdin; the
// caller SIGKILLs API A and answers. The stream on A must then break, the answer goes
// through API B, and the stream resumes on B from the last event id seen on A.
//
// A failing step is recorded and the script goes on where it can; it exits 1 at the end
// when any step failed (at once when nothing after it can run), 0 when all passed.

import { createInterface } from 'node:readline';
import { DaemonClient, DaemonHttpError } from '@qwen-code/sdk';

const API_A = required('ACP_SDK_API_A');
const API_B = required('ACP_SDK_API_B');
const CWD = required('ACP_SDK_CWD');
const TIMEOUT_MS = Number(process.env.ACP_SDK_TIMEOUT_MS ?? 90000);
const FAILOVER = process.env.ACP_SDK_FAILOVER !== 'none';
const PROCEED_ONCE = { outcome: { outcome: 'selected', optionId: 'proceed_once' } };
const REFERENCE_FEATURES = [
  'session_status',
  'session_events',
  'session_permission_vote',
  'session_turn_status',
  'session_catalog_batch',
  'workspace_session_live_state',
];

function required(name) {
  const value = process.env[name];
  if (!value) {
    console.error(`sdk_test: ${name} is not set`);
    process.exit(2);
  }
  return value;
}

// ---- output -------------------------------------------------------------------------

const failures = [];
let currentHttp = [];

function emit(line) {
  process.stdout.write(JSON.stringify(line) + '\n');
}

class StepFailure extends Error {}

function check(condition, message) {
  if (!condition) throw new StepFailure(message);
}

function describe(error) {
  if (error instanceof DaemonHttpError) {
    return { message: error.message, status: error.status, body: error.body };
  }
  if (error instanceof StepFailure) return { message: error.message };
  const cause = error?.cause ? ` (cause: ${error.cause.code ?? error.cause.message ?? error.cause})` : '';
  return { message: `${error?.name ?? 'Error'}: ${error?.message ?? error}${cause}` };
}

/** Runs one step; records its outcome as a line. Returns the step's value, or undefined
 * when it failed (`fatal` steps end the run: nothing after them can work). */
async function step(name, meta, body, { fatal = false } = {}) {
  currentHttp = [];
  try {
    const result = await body();
    emit({ step: name, ok: true, ...meta, result: summarize(result), http: currentHttp });
    return result ?? true;
  } catch (error) {
    const line = { step: name, ok: false, ...meta, error: describe(error), http: currentHttp };
    emit(line);
    failures.push(line);
    if (fatal) finish();
    return undefined;
  }
}

function summarize(value) {
  const text = JSON.stringify(value);
  if (text === undefined || text.length <= 1500) return value;
  return `${text.slice(0, 1500)}… (${text.length} chars)`;
}

function finish() {
  emit({ summary: { failed: failures.map((f) => f.step), failedCount: failures.length } });
  process.exit(failures.length ? 1 : 0);
}

// ---- the SDK clients, with a fetch that notes each request's outcome ------------------

function recordingFetch(label) {
  return async (input, init = {}) => {
    const url = new URL(typeof input === 'string' ? input : input.url);
    const entry = { api: label, method: init.method ?? 'GET', path: url.pathname + url.search };
    currentHttp.push(entry);
    try {
      const response = await fetch(input, init);
      entry.status = response.status;
      for (const header of ['content-type', 'x-qwen-event-epoch', 'x-qwen-sse-stream-id']) {
        const value = response.headers.get(header);
        if (value !== null) (entry.headers ??= {})[header] = value;
      }
      return response;
    } catch (error) {
      entry.error = describe(error).message;
      throw error;
    }
  };
}

const A = new DaemonClient({ baseUrl: API_A, fetch: recordingFetch('A') });
const B = new DaemonClient({ baseUrl: API_B, fetch: recordingFetch('B') });

/** For routes DaemonClient 0.1.14 has no method for: plain HTTP, the SDK's headers. */
async function rawJson(label, base, method, path, body, clientId) {
  const headers = { Accept: 'application/json' };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  if (clientId) headers['X-Qwen-Client-Id'] = clientId;
  const response = await recordingFetch(label)(`${base}${path}`, {
    method,
    headers,
    ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
  });
  const text = await response.text();
  let json;
  try {
    json = JSON.parse(text);
  } catch {
    json = text;
  }
  return { status: response.status, body: json };
}

// ---- event streams --------------------------------------------------------------------

function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new StepFailure(`timed out after ${ms} ms waiting for ${what}`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

/** One `subscribeEvents` iteration, read in the background; events are awaited by
 * predicate. Notes what the handshake told (epoch, stream id) and how the stream ended. */
class EventStream {
  constructor(client, label, sessionId, opts = {}) {
    this.label = label;
    this.events = [];
    this.epoch = undefined;
    this.streamId = undefined;
    this.accepted = false;
    this.ended = false;
    this.error = undefined;
    this.controller = new AbortController();
    this.waiters = new Set();
    this.iterator = client.subscribeEvents(sessionId, {
      ...opts,
      signal: this.controller.signal,
      onEpoch: (epoch) => {
        this.epoch = epoch;
      },
      onSseStreamAccepted: (id) => {
        this.accepted = true;
        this.streamId = id;
      },
    });
    this.done = this.pump();
  }

  async pump() {
    try {
      for await (const event of this.iterator) {
        this.events.push(event);
        this.notify();
      }
    } catch (error) {
      if (!this.controller.signal.aborted) this.error = error;
    } finally {
      this.ended = true;
      this.notify();
    }
  }

  notify() {
    for (const check of [...this.waiters]) check();
  }

  waitFor(predicate, what, ms = TIMEOUT_MS) {
    const found = new Promise((resolve, reject) => {
      const check = () => {
        const event = this.events.find(predicate);
        if (event) {
          this.waiters.delete(check);
          resolve(event);
        } else if (this.ended) {
          this.waiters.delete(check);
          const why = this.error ? describe(this.error).message : 'the stream ended';
          reject(new StepFailure(`${what} never came on API ${this.label}'s stream: ${why}`));
        }
      };
      this.waiters.add(check);
      check();
    });
    return withTimeout(found, ms, `${what} on API ${this.label}'s stream`);
  }

  waitEnd(ms = TIMEOUT_MS) {
    return withTimeout(this.done, ms, `API ${this.label}'s stream to end`);
  }

  get maxId() {
    return this.events.reduce((max, e) => (typeof e.id === 'number' && e.id > max ? e.id : max), 0);
  }

  ids() {
    return this.events.filter((e) => typeof e.id === 'number').map((e) => e.id);
  }

  close() {
    this.controller.abort();
    return this.done;
  }
}

const isTurnEnd = (promptId) => (e) =>
  (e.type === 'turn_complete' || e.type === 'turn_error') && e.data?.promptId === promptId;
const isRequest = (promptId) => (e) =>
  e.type === 'permission_request' && (e.promptId === promptId || e.data?.promptId === promptId);
const text = (t) => ({ prompt: [{ type: 'text', text: t }] });

function acceptedEnvelope(accepted) {
  check(
    accepted && typeof accepted.promptId === 'string' && Number.isSafeInteger(accepted.lastEventId),
    `expected a 202 acceptance {promptId, lastEventId, eventEpoch}, got ${JSON.stringify(accepted)}`,
  );
  return accepted;
}

/** What `prompt()` runs for a 202 daemon: the SDK's own temporary SSE wait for the turn's
 * `turn_complete`/`turn_error` (TypeScript-private, JavaScript-reachable). */
function awaitTurnComplete(client, sessionId, accepted, clientId) {
  return client._awaitTurnComplete(
    sessionId, accepted.promptId, accepted.lastEventId, undefined, clientId, accepted.eventEpoch,
  );
}

// ---- the run --------------------------------------------------------------------------

const stdinLines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();

async function main() {
  await step('health', { api: 'A+B', via: 'sdk', call: 'health()' }, async () => {
    const [a, b] = await Promise.all([A.health(), B.health()]);
    check(a.status === 'ok' && b.status === 'ok', `expected {status:"ok"} twice, got ${JSON.stringify([a, b])}`);
    return [a, b];
  }, { fatal: true });

  await step('capabilities', { api: 'A', via: 'sdk', call: 'capabilities()' }, async () => {
    const caps = await A.capabilities();
    const problems = [];
    if (caps.v !== 1) problems.push(`v is ${JSON.stringify(caps.v)}, not 1`);
    if (caps.protocolVersions?.current !== 'v1') {
      problems.push(`protocolVersions is ${JSON.stringify(caps.protocolVersions)}, not {current:"v1",supported:["v1"]}`);
    }
    if (typeof caps.mode !== 'string') problems.push('no `mode` (the reference: "http-bridge")');
    if (!Array.isArray(caps.modelServices)) problems.push('no `modelServices` array');
    const features = Array.isArray(caps.features) ? caps.features : [];
    const missing = REFERENCE_FEATURES.filter((f) => !features.includes(f));
    if (missing.length) problems.push(`features lack ${missing.join(', ')}`);
    // The reference names its primary workspace in `workspaceCwd`, and lists `workspaces[]`
    // ({id, cwd, primary, trusted}) when it has more than one.
    const listed = (caps.workspaces ?? []).find((w) => w.cwd === CWD);
    if (caps.workspaceCwd !== CWD && !listed) problems.push(`neither workspaceCwd nor a workspaces[] entry is ${CWD}`);
    if (listed && (typeof listed.id !== 'string' || typeof listed.primary !== 'boolean' || typeof listed.trusted !== 'boolean')) {
      problems.push(`workspaces[] entry is ${JSON.stringify(listed)}, not {id, cwd, primary, trusted}`);
    }
    if (typeof caps.limits?.maxPendingPromptsPerSession !== 'number') {
      problems.push('no limits.maxPendingPromptsPerSession');
    }
    check(problems.length === 0, `not the reference's shape: ${problems.join('; ')}`);
    return { features: caps.features };
  });

  const created = await step('createOrAttachSession (create)', { api: 'A', via: 'sdk', call: 'createOrAttachSession({workspaceCwd, sessionScope:"single"})' }, async () => {
    const session = await A.createOrAttachSession({ workspaceCwd: CWD, sessionScope: 'single' });
    check(typeof session.sessionId === 'string', `no sessionId in ${JSON.stringify(session)}`);
    check(session.attached === false, `attached is ${session.attached} on a fresh workspace`);
    check(session.workspaceCwd === CWD, `workspaceCwd is ${session.workspaceCwd}, not ${CWD}`);
    check(typeof session.clientId === 'string', `no clientId in ${JSON.stringify(session)}`);
    return session;
  }, { fatal: true });
  const sid = created.sessionId;
  const clientA = created.clientId;

  const attached = await step('createOrAttachSession (attach)', { api: 'B', via: 'sdk', call: 'createOrAttachSession({workspaceCwd, sessionScope:"single"})' }, async () => {
    const session = await B.createOrAttachSession({ workspaceCwd: CWD, sessionScope: 'single' });
    check(session.sessionId === sid, `attached to ${session.sessionId}, not the workspace's session ${sid}`);
    check(session.attached === true, `attached is ${session.attached}`);
    return session;
  });
  const clientB = attached?.clientId;

  // prompt(): a 202 daemon makes the SDK await the turn's end over a temporary SSE stream;
  // a 200 answer is taken as a blocking daemon's final result.
  let firstPromptId;
  await step('prompt', { api: 'B', via: 'sdk', call: 'prompt(sid, {prompt:[text "hello"]})' }, async () => {
    const result = await B.prompt(sid, text('hello'), undefined, clientB);
    if (typeof result?.promptId === 'string') {
      firstPromptId = result.promptId;
      // The turn goes on: wait for it so the steps after see an idle session.
      await withTimeout(awaitTurnComplete(B, sid, result, clientB), TIMEOUT_MS, 'the hello turn');
    }
    check(
      result?.stopReason === 'end_turn',
      `prompt() resolved with ${JSON.stringify(result)}, not {stopReason:"end_turn"}: the SDK awaits the turn only on a 202 answer; a 200 is read as a blocking daemon's final result`,
    );
    return result;
  });

  await step('sessionStatus', { api: 'A', via: 'sdk', call: 'sessionStatus(sid)' }, async () => {
    const status = await A.sessionStatus(sid, clientA);
    check(status.sessionId === sid, `sessionId is ${status.sessionId}`);
    check(status.workspaceCwd === CWD, `workspaceCwd is ${status.workspaceCwd}`);
    check(status.hasActivePrompt === false && status.pendingInteractionCount === 0, `not idle: ${JSON.stringify(status)}`);
    return status;
  });

  await step('listWorkspaceSessions', { api: 'B', via: 'sdk', call: 'listWorkspaceSessions(cwd)' }, async () => {
    const sessions = await B.listWorkspaceSessions(CWD);
    check(Array.isArray(sessions), `expected an array, got ${JSON.stringify(sessions)}`);
    check(sessions.some((s) => s.sessionId === sid), `session ${sid} not listed: ${JSON.stringify(sessions)}`);
    return sessions.map((s) => s.sessionId);
  });

  await step('getWorkspaceSessionLiveState', { api: 'A', via: 'sdk', call: 'getWorkspaceSessionLiveState(cwd)' }, async () => {
    const live = await A.getWorkspaceSessionLiveState(CWD);
    check(live.v === 1, `v is ${live.v}`);
    check(
      typeof live.catalogVersion?.generation === 'string' && Number.isInteger(live.catalogVersion?.revision),
      `catalogVersion is ${JSON.stringify(live.catalogVersion)}`,
    );
    const mine = (live.sessions ?? []).find((s) => s.sessionId === sid);
    check(mine, `session ${sid} not in ${JSON.stringify(live.sessions)}`);
    check(
      typeof mine.clientCount === 'number' && mine.hasActivePrompt === false
        && mine.isWaitingForPermission === false && mine.isWaitingForUserQuestion === false,
      `entry is ${JSON.stringify(mine)}`,
    );
    return live;
  });

  await step('turn status: current', { api: 'B', via: 'http', call: 'GET /session/:id/turns/current' }, async () => {
    const { status, body } = await rawJson('B', API_B, 'GET', `/session/${sid}/turns/current`);
    check(status === 200, `HTTP ${status} ${JSON.stringify(body)}`);
    check(body.sessionId === sid, `sessionId is ${body.sessionId}`);
    check(body.state === 'completed' && body.stopReason === 'end_turn' && body.promptText === 'hello'
      && (firstPromptId === undefined || body.promptId === firstPromptId),
      `expected the hello turn${firstPromptId ? ` (${firstPromptId})` : ''} completed with end_turn, got ${JSON.stringify(body)}`);
    firstPromptId ??= body.promptId; // prompt() on a 202 daemon returns no promptId
    return body;
  });

  await step('turn status: by promptId', { api: 'A', via: 'http', call: 'GET /session/:id/turns/:promptId' }, async () => {
    check(firstPromptId, 'no promptId (neither prompt() nor turns/current gave one)');
    const { status, body } = await rawJson('A', API_A, 'GET', `/session/${sid}/turns/${firstPromptId}`);
    check(status === 200, `HTTP ${status} ${JSON.stringify(body)}`);
    check(body.promptId === firstPromptId && body.state === 'completed' && body.promptText === 'hello',
      `got ${JSON.stringify(body)}`);
    const unknown = await rawJson('A', API_A, 'GET', `/session/${sid}/turns/nope`);
    check(unknown.status === 404 && unknown.body?.code === 'prompt_not_found',
      `unknown promptId: HTTP ${unknown.status} ${JSON.stringify(unknown.body)}, not 404 prompt_not_found`);
    return body;
  });

  await step('session catalog (batch)', { api: 'B', via: 'http', call: 'POST /sessions/catalog' }, async () => {
    const { status, body } = await rawJson('B', API_B, 'POST', '/sessions/catalog', { workspaces: [{ workspace: CWD }] });
    check(status === 200, `HTTP ${status} ${JSON.stringify(body)}`);
    const [member] = body.workspaces ?? [];
    check(member && member.workspace === CWD && member.cwd === CWD && !member.error, `member is ${JSON.stringify(member)}`);
    check((member.sessions ?? []).some((s) => s.sessionId === sid), `session ${sid} not in ${JSON.stringify(member.sessions)}`);
    return body;
  });

  // ---- PERM: a shell command waits for a permission vote --------------------------------
  let perm;
  await step('permission: prompt', { api: 'A', via: 'sdk', call: 'promptNonBlocking(sid, "PERM please run")' }, async () => {
    perm = acceptedEnvelope(await A.promptNonBlocking(sid, text('PERM please run'), undefined, clientA));
    return perm;
  });
  if (perm) {
    const turnEnd = awaitTurnComplete(B, sid, perm, clientB); // the SDK's own wait, on B
    turnEnd.catch(() => {}); // awaited below; a rejection before then is not unhandled
    const watch = new EventStream(B, 'B', sid, { lastEventId: perm.lastEventId, epoch: perm.eventEpoch, clientId: clientB });
    let requestId;
    await step('permission: request on the event stream', { api: 'B', via: 'sdk', call: 'subscribeEvents(sid, {lastEventId})' }, async () => {
      const request = await watch.waitFor(isRequest(perm.promptId), 'permission_request');
      requestId = request.data?.requestId;
      check(typeof requestId === 'string', `no data.requestId in ${JSON.stringify(request)}`);
      return request;
    });
    await step('permission: sessionStatus while waiting', { api: 'A', via: 'sdk', call: 'sessionStatus(sid)' }, async () => {
      const status = await A.sessionStatus(sid);
      check(status.isWaitingForPermission === true && status.isWaitingForUserQuestion === false, `status is ${JSON.stringify(status)}`);
      const [pending] = status.pendingInteractions ?? [];
      check(pending?.requestId === requestId && pending.kind === 'permission', `pendingInteractions is ${JSON.stringify(status.pendingInteractions)}`);
      check(pending.options.some((o) => o.optionId === 'proceed_once'), `no proceed_once in ${JSON.stringify(pending.options)}`);
      return status;
    });
    await step('permission: turn status while running', { api: 'B', via: 'http', call: 'GET /session/:id/turns/current' }, async () => {
      const { status, body } = await rawJson('B', API_B, 'GET', `/session/${sid}/turns/current`);
      check(status === 200, `HTTP ${status} ${JSON.stringify(body)}`);
      check(body.state === 'running' && body.promptId === perm.promptId && body.promptText === 'PERM please run',
        `expected the PERM turn running, got ${JSON.stringify(body)}`);
      return body;
    });
    await step('permission: live state while waiting', { api: 'B', via: 'sdk', call: 'getWorkspaceSessionLiveState(cwd)' }, async () => {
      const live = await B.getWorkspaceSessionLiveState(CWD);
      const mine = (live.sessions ?? []).find((s) => s.sessionId === sid);
      check(mine?.isWaitingForPermission === true && mine.hasActivePrompt === true, `entry is ${JSON.stringify(mine)}`);
      return mine;
    });
    await step('permission: vote', { api: 'B', via: 'sdk', call: 'respondToSessionPermission(sid, requestId, proceed_once)' }, async () => {
      check(requestId, 'no requestId to vote on');
      const accepted = await B.respondToSessionPermission(sid, requestId, PROCEED_ONCE, clientB);
      check(accepted === true, `the vote was not accepted (${accepted}: the daemon answered 404)`);
      return accepted;
    });
    await step('permission: awaitTurnComplete', { api: 'B', via: 'sdk', call: '_awaitTurnComplete(sid, promptId, lastEventId, …, eventEpoch)' }, async () => {
      const result = await withTimeout(turnEnd, TIMEOUT_MS, 'the PERM turn');
      check(result.stopReason === 'end_turn', `turn ended with ${JSON.stringify(result)}`);
      return result;
    });
    await step('permission: a second vote loses', { api: 'A', via: 'sdk', call: 'respondToPermission(requestId, proceed_once)' }, async () => {
      check(requestId, 'no requestId');
      const accepted = await A.respondToPermission(requestId, PROCEED_ONCE);
      check(accepted === false, `a vote on a resolved request was accepted (${accepted}); the SDK expects 404 -> false`);
      return accepted;
    });
    await watch.close();
  }

  // ---- QUESTION: the answer travels with the vote; API A dies mid-turn ------------------
  let asked;
  await step('question: prompt', { api: 'B', via: 'sdk', call: 'promptNonBlocking(sid, "QUESTION ask me")' }, async () => {
    asked = acceptedEnvelope(await B.promptNonBlocking(sid, text('QUESTION ask me'), undefined, clientB));
    return asked;
  });
  if (!asked) finish();
  const onA = new EventStream(A, 'A', sid, { lastEventId: asked.lastEventId, epoch: asked.eventEpoch, clientId: clientA });
  let question;
  await step('question: request on the event stream', { api: 'A', via: 'sdk', call: 'subscribeEvents(sid, {lastEventId, epoch})' }, async () => {
    question = await onA.waitFor(isRequest(asked.promptId), 'permission_request (ask_user_question)');
    check(typeof question.data?.requestId === 'string', `no data.requestId in ${JSON.stringify(question)}`);
    return question;
  });
  if (!question) finish();

  await step('event stream headers', { api: 'A', via: 'sdk', call: 'subscribeEvents(sid, {onEpoch, onSseStreamAccepted})' }, async () => {
    const problems = [];
    if (onA.epoch === undefined) problems.push('no X-Qwen-Event-Epoch response header (onEpoch never called)');
    else if (asked.eventEpoch !== undefined && onA.epoch !== asked.eventEpoch) {
      problems.push(`X-Qwen-Event-Epoch ${onA.epoch} differs from the prompt's eventEpoch ${asked.eventEpoch}`);
    }
    if (onA.streamId === undefined) problems.push('no X-Qwen-SSE-Stream-Id response header holding a UUID (onSseStreamAccepted got undefined)');
    check(problems.length === 0, problems.join('; '));
    return { epoch: onA.epoch, streamId: onA.streamId };
  });

  let answerKey = '0';
  await step('question: sessionStatus while waiting', { api: 'B', via: 'sdk', call: 'sessionStatus(sid)' }, async () => {
    const status = await B.sessionStatus(sid);
    check(status.isWaitingForUserQuestion === true && status.isWaitingForPermission === false, `status is ${JSON.stringify(status)}`);
    const [pending] = status.pendingInteractions ?? [];
    check(pending?.requestId === question.data.requestId && pending.kind === 'user_question', `pendingInteractions is ${JSON.stringify(status.pendingInteractions)}`);
    const [first] = pending.questions ?? [];
    check(first?.question === 'Which color?' && typeof first.answerKey === 'string', `questions is ${JSON.stringify(pending.questions)}`);
    answerKey = first.answerKey;
    return status;
  });

  const lastSeenOnA = onA.maxId;
  await step('failover: API A killed, its stream breaks', { api: 'A', via: 'sdk', call: 'subscribeEvents iteration' }, async () => {
    if (!FAILOVER) {
      await onA.close();
      return { skipped: 'ACP_SDK_FAILOVER=none: the stream on A was closed, not broken', lastSeenEventId: lastSeenOnA };
    }
    emit({ control: 'kill-api-a', lastSeenEventId: lastSeenOnA });
    const reply = await withTimeout(stdinLines.next(), TIMEOUT_MS, 'the caller to kill API A');
    check(!reply.done && reply.value.trim() === 'killed', `expected "killed" on stdin, got ${JSON.stringify(reply.value)}`);
    await onA.waitEnd();
    check(onA.error !== undefined, 'the stream on A ended cleanly, not broken');
    return { lastSeenEventId: lastSeenOnA, error: describe(onA.error).message };
  });
  const lastSeen = onA.maxId;

  await step('question: answer', { api: 'B', via: 'sdk', call: 'respondToSessionPermission(sid, requestId, {proceed_once, answers})' }, async () => {
    const accepted = await B.respondToSessionPermission(
      sid, question.data.requestId, { ...PROCEED_ONCE, answers: { [answerKey]: 'Blue' } }, clientB,
    );
    check(accepted === true, `the answer was not accepted (${accepted}: the daemon answered 404)`);
    return accepted;
  });

  const onB = new EventStream(B, 'B', sid, { lastEventId: lastSeen, epoch: onA.epoch ?? asked.eventEpoch, clientId: clientB });
  await step('event stream resumed on API B', { api: 'B', via: 'sdk', call: 'subscribeEvents(sid, {lastEventId, epoch})' }, async () => {
    const end = await onB.waitFor(isTurnEnd(asked.promptId), 'the QUESTION turn_complete');
    check(end.type === 'turn_complete' && end.data.stopReason === 'end_turn', `turn ended with ${JSON.stringify(end)}`);
    const ids = onB.ids();
    check(ids[0] === lastSeen + 1, `resumed at id ${ids[0]}, not ${lastSeen + 1} (Last-Event-ID ${lastSeen})`);
    check(ids.every((id, i) => i === 0 || id === ids[i - 1] + 1), `ids not contiguous: ${ids.join(',')}`);
    const resolved = onB.events.find((e) => e.type === 'permission_resolved' && e.data?.requestId === question.data.requestId);
    check(resolved, `no permission_resolved for ${question.data.requestId} in ${onB.events.map((e) => e.type).join(',')}`);
    return { from: ids[0], to: ids[ids.length - 1], types: onB.events.map((e) => e.type) };
  });
  await onB.close();

  // A resume cursor from another epoch (the reference: its bus restarted) must not be
  // replayed as if it were this one's: the reference answers `state_resync_required`
  // {reason: "epoch_reset", detail: "epoch_mismatch"} first, read from the request header
  // X-Qwen-Event-Epoch the SDK sends with Last-Event-ID.
  await step('event stream: resume with a stale epoch', { api: 'B', via: 'sdk', call: 'subscribeEvents(sid, {lastEventId, epoch: "stale-epoch"})' }, async () => {
    const stale = new EventStream(B, 'B', sid, { lastEventId: onB.maxId, epoch: 'stale-epoch' });
    try {
      const first = await stale.waitFor(
        (e) => ['state_resync_required', 'history_truncated', 'replay_complete'].includes(e.type),
        'the first stream-control event',
      );
      check(
        first.type === 'state_resync_required' && first.data?.reason === 'epoch_reset',
        `first control event is ${JSON.stringify(first)}, not state_resync_required {reason:"epoch_reset"}`,
      );
      return first;
    } finally {
      await stale.close();
    }
  });

  await step('question: turn status by promptId', { api: 'B', via: 'http', call: 'GET /session/:id/turns/:promptId' }, async () => {
    const { status, body } = await rawJson('B', API_B, 'GET', `/session/${sid}/turns/${asked.promptId}`);
    check(status === 200, `HTTP ${status} ${JSON.stringify(body)}`);
    check(body.state === 'completed' && body.stopReason === 'end_turn', `got ${JSON.stringify(body)}`);
    return body;
  });

  // ---- after the failover: a whole turn through B alone -------------------------------
  await step('awaitTurnComplete after failover', { api: 'B', via: 'sdk', call: 'promptNonBlocking + _awaitTurnComplete' }, async () => {
    const accepted = acceptedEnvelope(await B.promptNonBlocking(sid, text('hello again'), undefined, clientB));
    const result = await withTimeout(awaitTurnComplete(B, sid, accepted, clientB), TIMEOUT_MS, 'the last turn');
    check(result.stopReason === 'end_turn', `turn ended with ${JSON.stringify(result)}`);
    return result;
  });

  await step('sessionStatus after failover', { api: 'B', via: 'sdk', call: 'sessionStatus(sid)' }, async () => {
    const status = await B.sessionStatus(sid);
    check(status.hasActivePrompt === false && status.pendingInteractionCount === 0 && status.isWaitingForUserQuestion === false,
      `not idle: ${JSON.stringify(status)}`);
    return status;
  });

  finish();
}

main().catch((error) => {
  emit({ step: 'script', ok: false, error: describe(error) });
  failures.push({ step: 'script' });
  finish();
});
