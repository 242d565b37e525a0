// The workspace view: every session of a workspace, most urgent first, kept live by the
// workspace's live feed (`GET /workspaces/:id/sessions/live-state/events`).
//
// The listing (`GET /workspace/:id/sessions`) is read once, and again only when the feed
// names a session it lacks or a session gets its title (at its first prompt); the feed's
// rows are laid over it (live-rows.js). While the feed is down the listing is polled every
// POLL_INTERVAL_MS, as before there was a feed; once it reopens the polling stops and the
// feed resumes from the last frame seen (its id names the revision and the generation).
//
// A session that is not live (its worker died or left) stays listed, "ended", with a Resume
// action when its agent can load sessions: it POSTs the load (which resumes it on a live
// worker) and opens the session; a refusal is said under the row. A session a draining
// worker is handing to another is marked "moving" beside its status.

import { api } from "./api.js";
import { h, replaceChildren } from "./dom.js";
import { absoluteTime, onLanguageChange, relativeTime, t } from "./i18n.js";
import { applyChange, mergeRows } from "./live-rows.js";
import { isResumable, neverResumable, resumeErrorText } from "./resume.js";
import { isMoving, movingBadge, sessionStatus, sortSessions, statusBadge } from "./status.js";
import { FollowedStream } from "./stream.js";

const WORKSPACE_KEY = "acp-shell.workspace";
const POLL_INTERVAL_MS = 1000;
const CLOCK_INTERVAL_MS = 30_000;

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
    this.listed = null; // the listing's rows; null until the first listing arrives
    this.live = null; // the feed's rows by session id; null until its first snapshot
    this.rows = null; // what is shown: the two merged, most urgent first
    this.listError = null;
    this.feed = "connecting"; // "connecting" | "live" | "down"
    this.stream = null;
    this.lastEventId = null; // the id of the last feed frame: where a reopened feed resumes
    this.listing = null; // the listing read in flight (a promise)
    this.listingAgain = false;
    this.asked = new Set(); // "reason:sessionId": the listing is re-read once per reason
    this.polling = false;
    this.rowElements = new Map(); // sessionId -> {li, sig}
    this.resuming = new Map(); // sessionId -> {busy, error}: a Resume clicked in this view
    this.timer = null;
    this.destroyed = false;
    this.build();
    this.unsubscribe = onLanguageChange(() => this.renderAll());
    // Nothing is polled while the feed is up, so "updated 2 minutes ago" is redrawn here.
    this.clock = setInterval(() => this.renderList(), CLOCK_INTERVAL_MS);
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
    if (this.workspaceId) this.follow();
  }

  destroy() {
    this.destroyed = true;
    clearInterval(this.clock);
    this.unfollow();
    this.unsubscribe();
    this.el.remove();
  }

  get workspace() {
    return this.workspaces.find((w) => w.id === this.workspaceId) ?? null;
  }

  // ---- the feed, and the listing under it --------------------------------------------------

  /** Read the listing and follow the workspace's feed (polling only while it is down). */
  follow() {
    const ws = this.workspaceId;
    this.readListing();
    this.stream = new FollowedStream({
      url: () => api.liveFeedUrl(ws, this.lastEventId),
      events: {
        live_state_snapshot: (data, event) => this.onFeed(data, event, { snapshot: true }),
        live_state_changed: (data, event) => this.onFeed(data, event, { snapshot: false }),
      },
      onUp: () => {
        this.feed = "live";
        this.stopPolling();
        this.refresh();
      },
      onDown: () => {
        this.feed = "down";
        this.startPolling();
        this.refresh();
      },
    }).start();
  }

  unfollow() {
    this.stream?.stop();
    this.stream = null;
    this.stopPolling();
  }

  onFeed(data, event, { snapshot }) {
    const previous = this.live ?? new Map();
    let next;
    if (snapshot) {
      next = new Map((data.sessions ?? []).map((row) => [row.sessionId, row]));
    } else {
      next = new Map(previous);
      applyChange(next, data);
    }
    this.live = next;
    if (event.lastEventId) this.lastEventId = event.lastEventId;
    const changed = snapshot ? [...next.values()] : data.sessions ?? [];
    for (const row of changed) this.noticed(previous.get(row.sessionId), row);
    this.refresh();
  }

  /** What the feed cannot say: a new session's title, a finished turn's error. */
  noticed(before, row) {
    const sid = row.sessionId;
    const listedRow = this.listed?.find((r) => r.sessionId === sid);
    // The feed reads a row once per batch of changes, so a quick turn may show only its end:
    // a turn ended when `updatedAt` moved, whether or not it was seen running.
    const turnEnded = Boolean(before && row.updatedAt && row.updatedAt !== before.updatedAt);
    const ranTurn = before && !before.hasActivePrompt && row.hasActivePrompt;
    if (this.listed && !listedRow) this.readListingOnce("unlisted", sid);
    // The title is the first prompt's text. Asked for even while a read that started before
    // the prompt is on its way (the session not listed yet): one more read follows it.
    if (!listedRow?.displayName && (ranTurn || turnEnded)) this.readListingOnce("titled", sid);
    if (turnEnded || (before?.hasActivePrompt && !row.hasActivePrompt)) this.readStatus(sid);
  }

  readListingOnce(reason, sid) {
    const key = `${reason}:${sid}`;
    if (this.asked.has(key)) return; // a session past the listing's page is not asked for forever
    this.asked.add(key);
    this.readListing();
  }

  /** Read the listing; one read at a time, and one more if asked for meanwhile. */
  readListing() {
    if (this.listing) {
      this.listingAgain = true;
      return this.listing;
    }
    const ws = this.workspaceId;
    this.listing = (async () => {
      try {
        const page = await api.listSessions(ws);
        if (this.destroyed || ws !== this.workspaceId) return;
        this.listed = Array.isArray(page.sessions) ? page.sessions : [];
        this.listError = null;
        // A session the feed announced while this read was on its way: read once more.
        const listedIds = new Set(this.listed.map((row) => row.sessionId));
        for (const sid of this.live?.keys() ?? []) if (!listedIds.has(sid)) this.readListingOnce("unlisted", sid);
      } catch (error) {
        if (this.destroyed || ws !== this.workspaceId) return;
        this.listError = error.message;
      } finally {
        this.listing = null;
      }
      this.refresh();
      if (this.listingAgain) {
        this.listingAgain = false;
        await this.readListing();
      }
    })();
    return this.listing;
  }

  /** A turn ended: whether it failed (and what is pending) is the status's to say. */
  async readStatus(sid) {
    const ws = this.workspaceId;
    let summary;
    try {
      summary = await api.status(sid);
    } catch {
      return; // gone meanwhile: the feed says so
    }
    if (this.destroyed || ws !== this.workspaceId) return;
    const listedRow = this.listed?.find((r) => r.sessionId === sid);
    // Not listed yet (its read started before this turn ended): a read from now has it all.
    if (!listedRow) return void this.readListingOnce("ended", sid);
    listedRow.hasTurnError = summary.hasTurnError;
    listedRow.pendingInteractionCount = summary.pendingInteractionCount;
    this.refresh();
  }

  startPolling() {
    if (this.polling) return;
    this.polling = true;
    this.pollOnce();
  }

  stopPolling() {
    this.polling = false;
    clearTimeout(this.timer);
  }

  async pollOnce() {
    clearTimeout(this.timer);
    await this.readListing();
    if (this.polling && !this.destroyed) this.timer = setTimeout(() => this.pollOnce(), POLL_INTERVAL_MS);
  }

  /** Merge what is known and draw it. */
  refresh() {
    if (this.destroyed) return;
    // While the feed is down the polled listing is newer than the feed's last rows.
    this.rows = this.listed === null ? null : sortSessions(mergeRows(this.listed, this.feed === "live" ? this.live : null));
    this.renderList();
    this.renderMeta();
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

  /** Resume a session that is not live, then open it; a refusal stays under its row. */
  async resumeSession(sid) {
    if (this.resuming.get(sid)?.busy) return;
    const ws = this.workspaceId;
    this.resuming.set(sid, { busy: true, error: null });
    this.renderList();
    try {
      await api.resume(sid);
    } catch (error) {
      if (this.destroyed || ws !== this.workspaceId) return;
      this.resuming.set(sid, { busy: false, error });
      this.renderList();
      return;
    }
    if (this.destroyed || ws !== this.workspaceId) return;
    this.resuming.delete(sid);
    this.navigate(`#/session/${encodeURIComponent(sid)}`);
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
    this.unfollow();
    Object.assign(this, { listed: null, live: null, rows: null, lastEventId: null, feed: "connecting", listError: null });
    this.asked.clear();
    this.resuming.clear();
    this.listEl.replaceChildren();
    this.rowElements.clear();
    this.renderAll();
    this.follow();
  }

  renderMeta() {
    const rows = this.rows ?? [];
    const attention = rows.filter((r) => ["needsApproval", "needsAnswer"].includes(sessionStatus(r))).length;
    const parts = [];
    if (this.rows !== null) parts.push(t("ws.count", { count: rows.length }));
    if (attention) parts.push(t("ws.attention", { count: attention }));
    this.metaEl.textContent = parts.join(" · ");
    this.liveEl.dataset.feed = this.feed;
    if (this.listError) {
      this.liveEl.textContent = t("ws.stale", { message: this.listError });
      this.liveEl.className = "ws-live ws-live-stale";
    } else if (this.feed === "live") {
      this.liveEl.textContent = this.workspace ? t("ws.livePushed") : "";
      this.liveEl.className = "ws-live";
    } else {
      const seconds = POLL_INTERVAL_MS / 1000;
      const text = this.feed === "down" ? t("ws.polling", { seconds }) : t("ws.connecting");
      this.liveEl.textContent = this.workspace ? text : "";
      this.liveEl.className = `ws-live ws-live-${this.feed}`;
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
      const status = sessionStatus(row);
      if (status !== "ended") this.resuming.delete(row.sessionId); // live again: nothing to resume
      const resume = this.resuming.get(row.sessionId);
      const updated = row.updatedAt ?? row.createdAt;
      const when = relativeTime(updated);
      const sig = JSON.stringify([
        status, row.displayName, row.pendingInteractionCount, updated, when, isMoving(row), isResumable(row),
        resume?.busy, resume?.error ? [resume.error.status, resume.error.code, resume.error.message] : null,
      ]);
      let entry = this.rowElements.get(row.sessionId);
      if (!entry) {
        entry = { li: h("li", { class: "session-item" }), sig: null };
        this.rowElements.set(row.sessionId, entry);
      }
      if (entry.sig !== sig) {
        // Redrawn from scratch: keep the keyboard where it was (the Resume button).
        const focused = entry.li.contains(document.activeElement) ? document.activeElement.dataset.focusKey : null;
        entry.li.className = `session-item${status === "ended" ? " session-item-ended" : ""}`;
        replaceChildren(entry.li, this.renderRow(row, when), status === "ended" ? this.renderResume(row, resume) : null);
        if (focused) entry.li.querySelector(`[data-focus-key="${focused}"]`)?.focus();
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
    const moving = isMoving(row);
    const count = Number(row.pendingInteractionCount) || 0;
    const name = row.displayName || t("ws.untitled");
    const updated = row.updatedAt ?? row.createdAt;
    return h(
      "a",
      {
        class: `session-row status-${status}${moving ? " session-row-moving" : ""}`,
        href: `#/session/${encodeURIComponent(row.sessionId)}`,
        dataset: moving ? { sessionId: row.sessionId, status, moving: "true" } : { sessionId: row.sessionId, status },
      },
      moving ? h("span", { class: "row-badges" }, statusBadge(status), movingBadge()) : statusBadge(status),
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
      updated
        ? h("time", { class: "row-updated", datetime: updated, title: absoluteTime(updated) }, t("ws.updated", { time: when }))
        : h("span", { class: "row-updated" }), // a session the listing has not caught up with yet
    );
  }

  /** An ended row's action: Resume (or why it cannot be), and the last refusal in words. */
  renderResume(row, resume) {
    const sid = row.sessionId;
    const error = resume?.error ?? null;
    if (!isResumable(row) || neverResumable(error)) {
      return [
        h(
          "div",
          { class: "row-actions" },
          h("span", { class: "row-cannot", title: t("resume.cannotTitle"), dataset: { resumable: "false" } }, t("resume.cannot")),
        ),
        // Told after a click (the listing had not said so): why, in words.
        error ? h("p", { class: "row-error", role: "alert" }, resumeErrorText(error)) : null,
      ];
    }
    const busy = Boolean(resume?.busy);
    const errorId = error ? `resume-error-${sid}` : null;
    return [
      h(
        "div",
        { class: "row-actions" },
        h(
          "button",
          {
            type: "button",
            class: "btn btn-secondary btn-small row-resume",
            title: t("resume.title"),
            // Not `disabled`: a disabled button drops the keyboard focus (a click meanwhile
            // is ignored by resumeSession).
            "aria-disabled": busy ? "true" : null,
            "aria-describedby": errorId,
            dataset: { focusKey: "resume", sessionId: sid },
            onClick: () => this.resumeSession(sid),
          },
          busy ? t("resume.busy") : [h("span", { class: "btn-icon", "aria-hidden": "true" }, "↻"), t("resume.action")],
        ),
      ),
      error ? h("p", { class: "row-error", id: errorId, role: "alert" }, resumeErrorText(error)) : null,
    ];
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
