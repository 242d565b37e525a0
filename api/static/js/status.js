// Session status: one label per row, the urgency order of the workspace view, and badges.

import { h } from "./dom.js";
import { t } from "./i18n.js";

/** Most urgent first: needs approval, waiting for an answer, running, failed, idle, ended. */
export const STATUS_ORDER = ["needsApproval", "needsAnswer", "running", "failed", "idle", "ended"];

const ICONS = {
  needsApproval: "!",
  needsAnswer: "?",
  running: "▸",
  failed: "×",
  idle: "•",
  ended: "–",
};

/**
 * The status of a listing row or a status summary. Rows of sessions that are not live carry
 * no runtime fields (spec §1.3): they are "ended".
 */
export function sessionStatus(row) {
  if (!row || row.pendingInteractionCount === undefined) return "ended";
  if (row.isWaitingForPermission) return "needsApproval";
  if (row.isWaitingForUserQuestion) return "needsAnswer";
  if (row.hasActivePrompt) return "running";
  if (row.hasTurnError) return "failed";
  return "idle";
}

/** Urgency first, then the most recently updated, then the id (a stable order). */
export function compareSessions(a, b) {
  const rank = STATUS_ORDER.indexOf(sessionStatus(a)) - STATUS_ORDER.indexOf(sessionStatus(b));
  if (rank !== 0) return rank;
  // `updatedAt` appears once a turn has ended; a session without one sorts by its creation.
  const when = (row) => Date.parse(row.updatedAt ?? row.createdAt) || 0;
  const recency = when(b) - when(a);
  if (recency !== 0) return recency;
  return String(a.sessionId).localeCompare(String(b.sessionId));
}

export function sortSessions(rows) {
  return [...rows].sort(compareSessions);
}

/**
 * A session a draining worker is handing to another (`moving: true` on its status and its
 * live-state row). Shown beside its status, which it does not change: a moving session
 * may still wait for a vote, and prompts sent meanwhile run once it has moved.
 */
export function isMoving(row) {
  return row?.moving === true;
}

/** The "moving" mark, worded like a badge (but not one: a row has one status badge). */
export function movingBadge() {
  return h(
    "span",
    { class: "moving-badge", title: t("moving.title") },
    h("span", { class: "badge-icon", "aria-hidden": "true" }, "⇄"),
    h("span", { class: "badge-label" }, t("status.moving")),
  );
}

/** A badge that says its status in words; the colour and the glyph only repeat it. */
export function statusBadge(status) {
  return h(
    "span",
    { class: `badge badge-${status}`, dataset: { status } },
    h("span", { class: "badge-icon", "aria-hidden": "true" }, ICONS[status] ?? "·"),
    h("span", { class: "badge-label" }, t(`status.${status}`)),
  );
}
