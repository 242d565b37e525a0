// Resuming a session that is not live: `POST /session/:id/load` of a persisted session (its
// worker died or left) starts it again on a live worker, same id, same conversation. Shared
// by the workspace view's rows and the session view: whether a row can be resumed, and what
// a refusal means, in words (never only a status code).

import { t } from "./i18n.js";

// The refusals the load route explains with a code (docs/api.md); anything else is shown
// with the daemon's own message.
const EXPLAINED = new Set([
  "not_resumable",
  "no_worker_for_state_store",
  "no_worker_for_agent",
  "no_worker",
  "no_worker_capacity",
  "session_not_released",
  "restore_in_progress",
  "resume_failed",
  "session_not_found",
]);

/** A listing row's `resumable`: false when its agent cannot load sessions; absent (a row
 * written before the flag existed) counts as resumable. */
export function isResumable(row) {
  return row?.resumable !== false;
}

/** Whether a failed resume says the session can never be resumed (not just not now). */
export function neverResumable(error) {
  return error?.code === "not_resumable";
}

/** Whether `error` is one of the refusals a resume explains (a load of a session that
 * died meanwhile is a resume, and may get them). */
export function explainsResume(error) {
  return Boolean(error?.code && EXPLAINED.has(error.code) && error.code !== "session_not_found");
}

/** A failed resume (an ApiError) in plain language. */
export function resumeErrorText(error) {
  if (error?.status === 0) return t("resume.error.network");
  if (error?.code && EXPLAINED.has(error.code)) return t(`resume.error.${error.code}`);
  return t("resume.error.other", { message: error?.message || String(error) });
}
