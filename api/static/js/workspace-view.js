// The workspace view: every session of a workspace, most urgent first, kept live by polling
// `GET /workspace/:id/sessions` every DEFAULT_INTERVAL_MS.

import { api } from "./api.js";
import { h, replaceChildren } from "./dom.js";
import { absoluteTime, onLanguageChange, relativeTime, t } from "./i18n.js";
import { sessionStatus, sortSessions, statusBadge } from "./status.js";

const WORKSPACE_KEY = "acp-shell.workspace";
const DEFAULT_INTERVAL_MS = 1000;

export function mountWorkspaceView(root, { capabilities, navigate }) {
  const view = new WorkspaceView(root, capabilities, navigate);
  view.start();
  return view;
}

class WorkspaceView {
  constructor(root, capabilities, navigate) {
    this.root = root;
    this.capabilities = capabilities; // a promise of GET /capabilities
    this.navigate = navigate;
    this.workspaces = [];
    this.workspaceId = null;
    this.rows = null; // null until the first listing arrives
    this.listError = null;
    this.intervalMs = DEFAULT_INTERVAL_MS;
    this.rowElements = new Map(); // sessionId -> {li, sig}
    this.timer = null;
    this.destroyed = false;
    this.build();
    this.unsubscribe = onLanguageChange(() => this.renderAll());
  }

  build() {
    this.titleEl = h("h1", { id: "ws-title", tabindex: "-1" });
    this.workspaceSlot = h("div", { class: "ws-path" });
    this.newButton = h("button", { type: "button", class: "btn btn-primary", onClick: () => this.createSession() });
    this.metaEl = h("p", { class: "ws-meta", "aria-live": "polite" });
    this.liveEl = h("span", { class: "ws-live" });
    this.alertEl = h("div", { class: "banner banner-error", role: "alert", hidden: true });
    this.listEl = h("ul", { class: "session-list" });
    this.emptyEl = h("p", { class: "empty", hidden: true });
    this.el = h(
      "section",
      { class: "view view-workspace", "aria-labelledby": "ws-title" },
      h("div", { class: "view-head" }, h("div", { class: "view-head-text" }, this.titleEl, this.workspaceSlot), this.newButton),
      h("div", { class: "ws-bar" }, this.metaEl, this.liveEl),
      this.alertEl,
      this.listEl,
      this.emptyEl,
    );
    this.root.append(this.el);
  }

  async start() {
    try {
      const caps = await this.capabilities;
      this.workspaces = Array.isArray(caps.workspaces) ? caps.workspaces : [];
      // The reference's capabilities: workspaces are `{id, cwd, primary, ...}`. The listing is
      // polled at the shell's own pace (a person is watching), not the live-state interval.
    } catch (error) {
      this.listError = error.message;
    }
    let stored = null;
    try {
      stored = localStorage.getItem(WORKSPACE_KEY);
    } catch {
      /* not remembered */
    }
    const known = this.workspaces.map((w) => w.id);
    this.workspaceId = known.includes(stored) ? stored : known[0] ?? null;
    this.renderAll();
    if (this.workspaceId) this.poll();
  }

  destroy() {
    this.destroyed = true;
    clearTimeout(this.timer);
    this.unsubscribe();
    this.el.remove();
  }

  get workspace() {
    return this.workspaces.find((w) => w.id === this.workspaceId) ?? null;
  }

  async poll() {
    clearTimeout(this.timer);
    const polled = this.workspaceId;
    try {
      const page = await api.listSessions(polled);
      if (this.destroyed || polled !== this.workspaceId) return;
      this.rows = sortSessions(Array.isArray(page.sessions) ? page.sessions : []);
      this.listError = null;
    } catch (error) {
      if (this.destroyed || polled !== this.workspaceId) return;
      this.listError = error.message;
    }
    this.renderList();
    this.renderMeta();
    this.timer = setTimeout(() => this.poll(), this.intervalMs);
  }

  async createSession() {
    const workspace = this.workspace;
    if (!workspace) return;
    this.newButton.disabled = true;
    this.newButton.textContent = t("ws.creating");
    this.showAlert(null);
    try {
      const created = await api.createSession(workspace.cwd);
      this.navigate(`#/session/${encodeURIComponent(created.sessionId)}`);
    } catch (error) {
      this.showAlert(t("ws.createError", { message: error.message }));
      this.newButton.disabled = false;
      this.renderHead();
    }
  }

  showAlert(text) {
    this.alertEl.hidden = !text;
    this.alertEl.textContent = text ?? "";
  }

  renderAll() {
    this.renderHead();
    this.renderMeta();
    for (const entry of this.rowElements.values()) entry.sig = null; // redraw in the new language
    this.renderList();
  }

  renderHead() {
    this.titleEl.textContent = t("ws.heading");
    if (!this.newButton.disabled) {
      replaceChildren(this.newButton, h("span", { "aria-hidden": "true", class: "btn-icon" }, "+"), t("ws.new"));
    }
    this.newButton.hidden = !this.workspace;
    if (this.workspaces.length > 1) {
      const select = h(
        "select",
        {
          id: "ws-select",
          onChange: (event) => this.selectWorkspace(event.target.value),
        },
        this.workspaces.map((w) => h("option", { value: w.id, selected: w.id === this.workspaceId }, w.cwd)),
      );
      replaceChildren(this.workspaceSlot, h("label", { for: "ws-select", class: "ws-label" }, t("ws.workspace")), select);
    } else if (this.workspace) {
      replaceChildren(
        this.workspaceSlot,
        h("span", { class: "ws-label" }, t("ws.workspace")),
        h("code", { class: "ws-cwd", title: this.workspace.cwd }, this.workspace.cwd),
      );
    } else {
      replaceChildren(this.workspaceSlot, this.rows === null && !this.listError ? "" : t("ws.noWorkspace"));
    }
  }

  selectWorkspace(workspaceId) {
    this.workspaceId = workspaceId;
    try {
      localStorage.setItem(WORKSPACE_KEY, workspaceId);
    } catch {
      /* not remembered */
    }
    this.rows = null;
    this.listEl.replaceChildren();
    this.rowElements.clear();
    this.renderAll();
    this.poll();
  }

  renderMeta() {
    const rows = this.rows ?? [];
    const attention = rows.filter((r) => ["needsApproval", "needsAnswer"].includes(sessionStatus(r))).length;
    const parts = [];
    if (this.rows !== null) parts.push(t("ws.count", { count: rows.length }));
    if (attention) parts.push(t("ws.attention", { count: attention }));
    this.metaEl.textContent = parts.join(" · ");
    if (this.listError) {
      this.liveEl.textContent = t("ws.stale", { message: this.listError });
      this.liveEl.className = "ws-live ws-live-stale";
    } else {
      const seconds = Math.round(this.intervalMs / 100) / 10;
      this.liveEl.textContent = this.workspace ? t("ws.liveEvery", { seconds }) : "";
      this.liveEl.className = "ws-live";
    }
  }

  renderList() {
    if (this.rows === null) {
      this.emptyEl.hidden = !this.workspace;
      this.emptyEl.textContent = t("ws.loading");
      return;
    }
    this.emptyEl.hidden = this.rows.length > 0;
    this.emptyEl.textContent = t("ws.empty");
    this.listEl.setAttribute("aria-label", t("ws.listLabel"));
    const seen = new Set();
    let previous = null;
    for (const row of this.rows) {
      seen.add(row.sessionId);
      const updated = row.updatedAt ?? row.createdAt;
      const when = relativeTime(updated);
      const sig = JSON.stringify([sessionStatus(row), row.displayName, row.pendingInteractionCount, updated, when]);
      let entry = this.rowElements.get(row.sessionId);
      if (!entry) {
        entry = { li: h("li", { class: "session-item" }), sig: null };
        this.rowElements.set(row.sessionId, entry);
      }
      if (entry.sig !== sig) {
        replaceChildren(entry.li, this.renderRow(row, when));
        entry.sig = sig;
      }
      const expected = previous ? previous.nextSibling : this.listEl.firstChild;
      if (expected !== entry.li) move(this.listEl, entry.li, expected);
      previous = entry.li;
    }
    for (const [sid, entry] of this.rowElements) {
      if (!seen.has(sid)) {
        entry.li.remove();
        this.rowElements.delete(sid);
      }
    }
  }

  renderRow(row, when) {
    const status = sessionStatus(row);
    const count = Number(row.pendingInteractionCount) || 0;
    const name = row.displayName || t("ws.untitled");
    const updated = row.updatedAt ?? row.createdAt;
    return h(
      "a",
      {
        class: `session-row status-${status}`,
        href: `#/session/${encodeURIComponent(row.sessionId)}`,
        dataset: { sessionId: row.sessionId, status },
      },
      statusBadge(status),
      h(
        "span",
        { class: "row-main" },
        h("span", { class: `row-name${row.displayName ? "" : " row-name-untitled"}` }, name),
        h("span", { class: "row-id" }, row.sessionId.slice(0, 8)),
      ),
      h(
        "span",
        { class: `row-pending${count ? " row-pending-some" : ""}`, title: t("ws.pendingTitle"), dataset: { count: String(count) } },
        t("ws.pending", { count }),
      ),
      h("time", { class: "row-updated", datetime: updated, title: absoluteTime(updated) }, t("ws.updated", { time: when })),
    );
  }
}

/** Reorder without losing focus where the browser can (Element.moveBefore keeps state). */
function move(parent, node, before) {
  if (typeof parent.moveBefore === "function" && node.parentNode === parent) {
    try {
      parent.moveBefore(node, before);
      return;
    } catch {
      /* fall through */
    }
  }
  parent.insertBefore(node, before);
}
