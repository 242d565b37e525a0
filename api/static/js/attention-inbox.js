// The deployment view's attention inbox: every session, in every workspace this token may
// see, that waits for a human, oldest wait first. It follows `GET /attention/events`
// (a snapshot, then additions and removals) and reads `GET /attention` every POLL_MS only
// while that stream is down.
//
// A permission is answered in place: its options come from the session's status
// (`pendingInteractions`), the vote goes to the permission route, and the item leaves when
// the stream says it was resolved. A question needs its form, so it links to the session
// view, which has one; a turn error shows its message and links there too.

import { api } from "./api.js";
import { h, replaceChildren } from "./dom.js";
import { absoluteTime, language, relativeTime, t } from "./i18n.js";
import { optionButton, selectedOutcome } from "./options.js";
import { statusBadge } from "./status.js";
import { FollowedStream } from "./stream.js";

const POLL_MS = 2000;
const PAGE_SIZE = 200; // while the stream is down: the oldest waits, the ones to see first
const CLOCK_MS = 30_000;
const KIND_STATUS = { permission: "needsApproval", user_question: "needsAnswer", turn_error: "failed" };

/** One wait's identity: its session, and its request (a turn error has none). */
export function itemKey(item) {
  return `${item.workspaceId}|${item.sessionId}|${item.requestId ?? item.kind}`;
}

/** Oldest wait first; ties in a stable order. */
export function compareItems(a, b) {
  return (Number(a.since) || 0) - (Number(b.since) || 0) || itemKey(a).localeCompare(itemKey(b));
}

export class AttentionInbox {
  constructor() {
    this.items = new Map(); // key -> item
    this.loaded = false;
    this.feed = "connecting"; // "connecting" | "live" | "down"
    this.error = null;
    this.polling = false;
    this.timer = null;
    this.details = new Map(); // key -> {state: "loading" | "ready" | "gone", interaction}
    this.votes = new Map(); // key -> {state: "sending" | "sent" | "error", message}
    this.rendered = new Map(); // key -> {li, sig}
    this.destroyed = false;
    this.titleEl = h("h2", { id: "inbox-title", class: "section-title" });
    this.metaEl = h("p", { class: "panel-meta", "aria-live": "polite" });
    this.listEl = h("ol", { class: "inbox-list" });
    this.emptyEl = h("p", { class: "empty" });
    this.el = h(
      "section",
      { class: "panel panel-inbox", "aria-labelledby": "inbox-title" },
      h("div", { class: "panel-head" }, this.titleEl, this.metaEl),
      this.listEl,
      this.emptyEl,
    );
  }

  start() {
    this.stream = new FollowedStream({
      // The browser's own reconnect resumes (Last-Event-ID) on the process it left; a reopen
      // here gets a snapshot.
      url: () => api.attentionEventsUrl(),
      events: {
        attention_snapshot: (data) => this.replace(data.items),
        attention_added: (item) => {
          this.items.set(itemKey(item), item);
          this.render();
        },
        attention_removed: (gone) => {
          this.items.delete(itemKey(gone));
          this.render();
        },
      },
      onUp: () => {
        this.feed = "live";
        this.stopPolling();
        this.render();
      },
      onDown: () => {
        this.feed = "down";
        this.startPolling();
        this.render();
      },
    }).start();
    this.clock = setInterval(() => this.redrawAll(), CLOCK_MS); // "waiting 3 minutes" moves on
    this.render();
    return this;
  }

  destroy() {
    this.destroyed = true;
    this.stream?.stop();
    this.stopPolling();
    clearInterval(this.clock);
  }

  replace(items) {
    this.items = new Map((Array.isArray(items) ? items : []).map((item) => [itemKey(item), item]));
    this.loaded = true;
    this.error = null;
    this.render();
  }

  startPolling() {
    if (this.polling) return;
    this.polling = true;
    this.poll();
  }

  stopPolling() {
    this.polling = false;
    clearTimeout(this.timer);
  }

  async poll() {
    clearTimeout(this.timer);
    try {
      const page = await api.attention(PAGE_SIZE);
      if (this.destroyed || !this.polling) return;
      this.replace(page.items);
    } catch (error) {
      if (this.destroyed) return;
      this.error = error.message;
      this.render();
    }
    if (this.polling && !this.destroyed) this.timer = setTimeout(() => this.poll(), POLL_MS);
  }

  // ---- a permission's options, and the vote ---------------------------------------------

  /** Read the session's status once for a waiting interaction (options, questions). */
  async loadDetails(item) {
    const key = itemKey(item);
    if (this.details.has(key)) return;
    this.details.set(key, { state: "loading" });
    let interaction = null;
    try {
      const summary = await api.status(item.sessionId);
      const pending = Array.isArray(summary.pendingInteractions) ? summary.pendingInteractions : [];
      interaction = pending.find((p) => p.requestId === item.requestId) ?? null;
    } catch {
      interaction = null; // the session went away: the stream removes the item
    }
    if (this.destroyed) return;
    this.details.set(key, interaction ? { state: "ready", interaction } : { state: "gone" });
    this.render();
  }

  async vote(item, option) {
    const key = itemKey(item);
    this.votes.set(key, { state: "sending" });
    this.render();
    try {
      await api.voteFromOutside(item.sessionId, item.requestId, selectedOutcome(option));
      this.votes.set(key, { state: "sent" }); // it leaves when the stream (or a poll) says so
    } catch (error) {
      this.votes.set(key, { state: "error", message: error.message });
    }
    if (!this.destroyed) this.render();
  }

  // ---- rendering --------------------------------------------------------------------------

  redrawAll() {
    for (const entry of this.rendered.values()) entry.sig = null;
    this.render();
  }

  render() {
    if (this.destroyed) return;
    const items = [...this.items.values()].sort(compareItems);
    this.titleEl.textContent = t("inbox.heading");
    this.renderMeta(items);
    this.listEl.setAttribute("aria-label", t("inbox.listLabel"));
    this.emptyEl.hidden = items.length > 0;
    this.emptyEl.textContent = this.loaded ? t("inbox.empty") : t("inbox.loading");
    const lang = language();
    const seen = new Set();
    let previous = null;
    for (const item of items) {
      const key = itemKey(item);
      seen.add(key);
      if (item.requestId) this.loadDetails(item); // a permission's options, a question's questions
      const sig = JSON.stringify([lang, item, this.details.get(key), this.votes.get(key)]);
      let entry = this.rendered.get(key);
      if (!entry) {
        entry = { li: h("li", { class: "inbox-entry" }), sig: null };
        this.rendered.set(key, entry);
      }
      if (entry.sig !== sig) {
        replaceChildren(entry.li, this.renderItem(item));
        entry.sig = sig;
      }
      const expected = previous ? previous.nextSibling : this.listEl.firstChild;
      if (expected !== entry.li) this.listEl.insertBefore(entry.li, expected);
      previous = entry.li;
    }
    for (const [key, entry] of this.rendered) {
      if (!seen.has(key)) {
        entry.li.remove();
        this.rendered.delete(key);
        this.details.delete(key);
        this.votes.delete(key);
      }
    }
  }

  renderMeta(items) {
    const parts = [];
    if (this.loaded) parts.push(t("inbox.count", { count: items.length }));
    let live;
    if (this.error) live = t("inbox.stale", { message: this.error });
    else if (this.feed === "live") live = t("inbox.live");
    else if (this.feed === "down") live = t("inbox.polling", { seconds: POLL_MS / 1000 });
    else live = t("ws.connecting");
    replaceChildren(
      this.metaEl,
      parts.length ? h("span", { class: "panel-count" }, parts.join(" · ")) : null,
      h("span", { class: `ws-live ws-live-${this.error ? "stale" : this.feed}`, dataset: { feed: this.feed } }, live),
    );
  }

  renderItem(item) {
    const status = KIND_STATUS[item.kind] ?? "idle";
    const since = Number(item.since) ? new Date(Number(item.since)).toISOString() : null;
    const sessionHref = `#/session/${encodeURIComponent(item.sessionId)}`;
    return h(
      "article",
      {
        class: `card inbox-item inbox-${item.kind}`,
        dataset: { kind: item.kind, sessionId: item.sessionId, requestId: item.requestId ?? "" },
      },
      h(
        "header",
        { class: "card-head" },
        statusBadge(status),
        h("h3", { class: "inbox-title" }, item.title || t(`inbox.untitled.${item.kind}`)),
      ),
      h(
        "p",
        { class: "inbox-meta" },
        h("span", { class: "ws-label" }, t("ws.workspace")),
        h("code", { class: "ws-cwd", title: item.workspaceCwd }, item.workspaceCwd || item.workspaceId),
        h("a", { class: "inbox-session", href: sessionHref }, t("inbox.session", { id: item.sessionId.slice(0, 8) })),
        since ? h("time", { datetime: since, title: absoluteTime(since) }, t("inbox.since", { time: relativeTime(since) })) : null,
      ),
      this.renderActions(item, sessionHref),
    );
  }

  renderActions(item, sessionHref) {
    if (item.kind === "user_question") {
      const questions = this.details.get(itemKey(item))?.interaction?.questions;
      return [
        Array.isArray(questions) && questions.length
          ? h("ul", { class: "inbox-questions" }, questions.map((q) => h("li", {}, String(q?.question ?? q?.header ?? ""))))
          : null,
        h("div", { class: "card-actions" }, h("a", { class: "btn btn-primary", href: sessionHref }, t("inbox.answer"))),
      ];
    }
    if (item.kind !== "permission") {
      return h("div", { class: "card-actions" }, h("a", { class: "btn btn-secondary", href: sessionHref }, t("inbox.open")));
    }
    const key = itemKey(item);
    const detail = this.details.get(key);
    const vote = this.votes.get(key);
    const busy = vote?.state === "sending" || vote?.state === "sent";
    const options = detail?.state === "ready" && Array.isArray(detail.interaction.options) ? detail.interaction.options : [];
    const action = detail?.interaction?.action ?? {};
    let note = "";
    if (!detail || detail.state === "loading") note = t("inbox.loadingOptions");
    else if (vote?.state === "sending") note = t("vote.sending");
    else if (vote?.state === "sent") note = t("inbox.sent");
    return h(
      "div",
      { class: "inbox-permission" },
      action.type ? h("p", { class: "action-meta" }, t("permission.kind"), " ", h("code", {}, action.type)) : null,
      h(
        "div",
        { class: "card-actions" },
        options.map((option) => optionButton(option, () => this.vote(item, option), { disabled: busy })),
        h("a", { class: "btn btn-secondary", href: sessionHref }, t("inbox.open")),
        h("span", { class: "card-status", role: "status" }, note),
      ),
      vote?.state === "error" ? h("p", { class: "card-error", role: "alert" }, t("vote.error", { message: vote.message })) : null,
    );
  }
}
