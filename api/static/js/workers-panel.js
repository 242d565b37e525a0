// The deployment view's workers: `GET /workers` every REFRESH_MS (lease age and load change
// with every heartbeat, and nothing pushes them), one table row per live worker.

import { api } from "./api.js";
import { h, replaceChildren } from "./dom.js";
import { absoluteTime, language, relativeTime, t } from "./i18n.js";
import { statusBadge } from "./status.js";

const REFRESH_MS = 2000;
// A worker report's session states (acp_state/summary.py SESSION_STATES) as shell statuses.
const STATES = {
  waiting_permission: "needsApproval",
  waiting_question: "needsAnswer",
  running: "running",
  failed: "failed",
  idle: "idle",
};

export class WorkersPanel {
  constructor() {
    this.workers = null; // null until the first answer
    this.error = null;
    this.forbidden = false; // a workspace-scoped token: the deployment's workers are not its to see
    this.timer = null;
    this.destroyed = false;
    this.titleEl = h("h2", { id: "workers-title", class: "section-title" });
    this.metaEl = h("p", { class: "panel-meta", "aria-live": "polite" });
    this.body = h("div", { class: "panel-body" });
    this.el = h(
      "section",
      { class: "panel panel-workers", "aria-labelledby": "workers-title" },
      h("div", { class: "panel-head" }, this.titleEl, this.metaEl),
      this.body,
    );
  }

  start() {
    this.load();
    return this;
  }

  destroy() {
    this.destroyed = true;
    clearTimeout(this.timer);
  }

  async load() {
    clearTimeout(this.timer);
    try {
      const answer = await api.workers();
      this.workers = Array.isArray(answer?.workers) ? answer.workers : [];
      this.error = null;
    } catch (error) {
      if (error.status === 403) this.forbidden = true;
      else this.error = error.message;
    }
    if (this.destroyed) return;
    this.render();
    if (!this.forbidden) this.timer = setTimeout(() => this.load(), REFRESH_MS);
  }

  render() {
    this.titleEl.textContent = t("workers.heading");
    if (this.forbidden) {
      this.metaEl.textContent = "";
      replaceChildren(this.body, h("p", { class: "empty" }, t("workers.forbidden")));
      return;
    }
    this.metaEl.textContent = this.error
      ? t("workers.stale", { message: this.error })
      : t("workers.refresh", { seconds: REFRESH_MS / 1000 });
    this.metaEl.className = `panel-meta${this.error ? " panel-meta-stale" : ""}`;
    if (this.workers === null) {
      replaceChildren(this.body, h("p", { class: "empty" }, this.error ? "" : t("workers.loading")));
      return;
    }
    if (this.workers.length === 0) {
      replaceChildren(this.body, h("p", { class: "empty" }, t("workers.none")));
      return;
    }
    const columns = ["worker", "started", "lease", "sessions", "load", "states"];
    replaceChildren(
      this.body,
      h(
        "div",
        { class: "table-wrap" },
        h(
          "table",
          { class: "workers-table" },
          h("caption", { class: "visually-hidden" }, t("workers.caption")),
          h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col" }, t(`workers.col.${c}`))))),
          h("tbody", {}, this.workers.map((worker) => this.renderRow(worker))),
        ),
      ),
    );
  }

  renderRow(worker) {
    const number = new Intl.NumberFormat(language(), { maximumFractionDigits: 1 });
    const seconds = (ms) => number.format((Number(ms) || 0) / 1000);
    const load = typeof worker.load === "number" ? worker.load : null;
    const percent = load === null ? null : new Intl.NumberFormat(language(), { style: "percent" }).format(load);
    // The lease's age as a share of the lease: near the end, the worker is late renewing.
    const leaseShare = worker.leaseAgeMs != null && worker.leaseMs ? Math.min(1, worker.leaseAgeMs / worker.leaseMs) : null;
    const states = Object.entries(worker.states ?? {}).filter(([, count]) => count > 0);
    // A draining worker (SIGTERM, `acp-state drain`) takes no new session and is moving its
    // sessions to the others: it is still listed, marked, until its lease is released.
    const draining = worker.draining === true;
    return h(
      "tr",
      { class: draining ? "worker-draining" : null, dataset: { incarnation: worker.incarnation, draining: String(draining) } },
      h(
        "th",
        { scope: "row" },
        h(
          "div",
          { class: "worker-name" },
          h(
            "span",
            { class: "worker-host" },
            t("workers.hostPid", { host: worker.host ?? "?", pid: worker.pid ?? "?" }),
            draining
              ? h(
                  "span",
                  { class: "draining-badge", title: t("workers.drainingTitle") },
                  h("span", { class: "badge-icon", "aria-hidden": "true" }, "↘"),
                  h("span", { class: "badge-label" }, t("workers.draining")),
                )
              : null,
          ),
          h("code", { class: "row-id", title: worker.incarnation }, String(worker.incarnation).slice(0, 12)),
          worker.stateStore
            ? h("span", { class: "worker-store", title: worker.stateStore }, t("workers.stateStore", { store: worker.stateStore }))
            : null,
        ),
      ),
      h("td", {}, worker.startedAt ? h("time", { datetime: worker.startedAt, title: absoluteTime(worker.startedAt) }, relativeTime(worker.startedAt)) : "–"),
      h(
        "td",
        { class: "worker-lease" },
        worker.leaseAgeMs == null
          ? "–"
          : t("workers.leaseAge", { age: seconds(worker.leaseAgeMs), lease: seconds(worker.leaseMs) }),
        leaseShare === null ? null : h("meter", { class: "lease-meter", min: 0, max: 1, low: 0.5, high: 0.8, optimum: 0, value: leaseShare }),
      ),
      h(
        "td",
        { class: "worker-sessions num" },
        worker.maxSessions ? t("workers.sessionsOf", { count: worker.sessions, max: worker.maxSessions }) : String(worker.sessions ?? 0),
      ),
      h(
        "td",
        { class: "worker-load num" },
        percent ?? "–",
        load === null ? null : h("meter", { class: "load-meter", min: 0, max: 1, low: 0.7, high: 0.9, optimum: 0, value: load }),
      ),
      h(
        "td",
        {},
        states.length
          ? h(
              "div",
              { class: "worker-states" },
              states.map(([state, count]) => h("span", { class: "state-count" }, statusBadge(STATES[state] ?? "idle"), ` ${count}`)),
            )
          : "–",
      ),
    );
  }
}
