// The workspace view's rows: the listing (`GET /workspace/:id/sessions`, which has each
// session's displayName and createdAt) overlaid with the live feed's rows (which have the
// runtime flags only). Pure functions, so the page's tests can call them directly.

/**
 * The rows to show. `listed`: the listing's rows. `live`: the feed's rows by session id, or
 * null while the feed is not followed (then the listing's own runtime fields stand).
 * A listed session the feed does not have is not live: it is shown as ended. A feed row
 * the listing lacks is shown at once, untitled, until the listing is read again.
 */
export function mergeRows(listed, live) {
  if (!live) return listed;
  const rows = [];
  const seen = new Set();
  for (const row of listed) {
    seen.add(row.sessionId);
    const feed = live.get(row.sessionId);
    rows.push(feed ? overlay(row, feed) : endedRow(row));
  }
  for (const [sid, feed] of live) {
    if (!seen.has(sid)) rows.push(overlay({ sessionId: sid }, feed));
  }
  return rows;
}

/**
 * A listing row with a feed row's flags on top. The feed has no pendingInteractionCount: a
 * session waiting for nothing has none pending, else at least one per kind it waits for
 * (the listing's count, when higher, is kept until a status read corrects it). It has no
 * hasTurnError either: the listing's (or a status read's) stands, and a running turn
 * outranks it anyway.
 */
export function overlay(row, feed) {
  const waiting = (feed.isWaitingForPermission ? 1 : 0) + (feed.isWaitingForUserQuestion ? 1 : 0);
  const known = Number(row.pendingInteractionCount) || 0;
  const merged = {
    ...row,
    ...feed,
    updatedAt: later(row.updatedAt, feed.updatedAt),
    pendingInteractionCount: waiting === 0 ? 0 : Math.max(waiting, known),
    hasTurnError: Boolean(row.hasTurnError),
  };
  // `moving` is the feed's alone: a row without it has stopped moving (or never did).
  if (!feed.moving) delete merged.moving;
  return merged;
}

/** A session that is no longer live: its persisted fields only (status "ended"), and
 * whether it can be resumed (`resumable`, when the listing says). */
export function endedRow(row) {
  const { sessionId, displayName, createdAt, updatedAt, workspaceCwd, resumable } = row;
  const ended = { sessionId, createdAt, updatedAt };
  if (displayName) ended.displayName = displayName;
  if (workspaceCwd) ended.workspaceCwd = workspaceCwd;
  if (typeof resumable === "boolean") ended.resumable = resumable;
  return ended;
}

/** Apply a `live_state_changed` frame to the feed's rows (a Map, changed in place). */
export function applyChange(live, change) {
  for (const row of change.sessions ?? []) live.set(row.sessionId, row);
  for (const sid of change.removed ?? []) live.delete(sid);
}

function later(a, b) {
  if (!a) return b;
  if (!b) return a;
  return Date.parse(b) > Date.parse(a) ? b : a;
}
