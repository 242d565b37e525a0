// The session view: transcript (SSE + reload), pending interaction cards, composer.
//
// Loading: `POST /session/:id/load` gives the compacted replay (with the stored turn_error
// appended while the session is idle), `lastEventId` and `eventEpoch`. The event stream is
// opened after it with the epoch; events with ids <= the cursor are already rendered and
// skipped. If the stream's snapshot shows that events happened between the two calls, or
// the stream says history was truncated, the view loads again. EventSource resumes with
// Last-Event-ID by itself on reconnects.
//
// A session that is not live is never resumed by opening it: the view reads its status
// first, and shows a session that is not live read-only, with a Resume action (the same
// load route, which resumes a persisted session on a live worker). A session a draining
// worker is handing to another shows a "moving" notice until `session_moved` says it has
// arrived; the turn the drain stopped (`turn_error` `worker_draining`) is explained.

import { api, streamsNeedTickets } from "./api.js";
import { h, pretty, replaceChildren, uid } from "./dom.js";
import { hasMessage, language, onLanguageChange, t } from "./i18n.js";
import { optionButton, selectedOutcome } from "./options.js";
import { explainsResume, neverResumable, resumeErrorText } from "./resume.js";
import { isMoving, movingBadge, sessionStatus, statusBadge } from "./status.js";
import { Transcript, messageText, toolOutput } from "./transcript.js";

const HISTORY_PAGE_SIZE = 100;
const STREAM_EVENT_TYPES = [
  "session_update",
  "turn_complete",
  "turn_error",
  "permission_request",
  "permission_resolved",
  "permission_already_resolved",
  "pending_prompt_added",
  "pending_prompt_started",
  "pending_prompt_completed",
  "prompt_cancelled",
  "session_created",
  "session_closed",
  "session_died",
  "session_moved",
  "session_snapshot",
  "replay_complete",
  "history_truncated",
];
// Events after which the status (active prompt, pending interactions) is read again.
const STATUS_EVENTS = new Set([
  "turn_complete",
  "turn_error",
  "permission_request",
  "permission_resolved",
  "pending_prompt_added",
  "pending_prompt_started",
  "pending_prompt_completed",
  "prompt_cancelled",
  "session_moved",
]);
const ERROR_KINDS = { loop_detected: "loopDetected", model_stream_interrupted: "modelStreamInterrupted" };
// Turn errors the daemon itself gives (a `code`, no agent `errorKind`): the worker drained
// (the turn outlived the drain's grace) or died (its sweeper ended the turn).
const ERROR_CODES = { worker_draining: "workerDraining", worker_lost: "workerLost" };
const RETRYABLE = new Set(["model_stream_interrupted", "worker_draining"]);
const DRAINING = "worker_draining";
const REOPEN_DELAYS_MS = [1000, 2000, 5000, 10000];

export function mountSessionView(root, { sessionId }) {
  const view = new SessionView(root, sessionId);
  view.start();
  return view;
}

class SessionView {
  constructor(root, sessionId) {
    this.root = root;
    this.sid = sessionId;
    this.model = new Transcript();
    this.summary = null;
    this.cursor = 0; // the newest event id rendered
    this.epoch = null;
    this.loading = false;
    this.loaded = false; // the first load finished
    this.reloadQueued = false;
    this.buffer = []; // events that arrived while a load was in flight
    this.ended = false; // read-only once the session is gone
    this.resumeState = { busy: false, error: null }; // the Resume action of a session not live
    this.drainSeen = false; // a drain stopped a turn here: the session is about to move
    this.missing = false; // no such session at all: nothing to resume
    this.fallbackTitle = null; // a session not live: its first prompt, as the listing titles it
    this.connection = "connecting";
    this.es = null;
    this.streamEpoch = null;
    this.reopenAttempt = 0;
    this.reopenTimer = null;
    this.rendered = new Map(); // item key -> {el, sig}
    this.toolOpen = new Map(); // tool key -> {open, afterError}: the user's own toggles
    this.cards = new Map(); // requestId -> {el, sig}
    this.interactions = [];
    this.statusInFlight = false;
    this.statusAgain = false;
    this.destroyed = false;
    this.build();
    this.unsubscribe = onLanguageChange(() => this.renderAll());
  }

  // ---- skeleton -------------------------------------------------------------------------

  build() {
    const inputId = uid("composer");
    const hintId = uid("hint");
    this.backLink = h("a", { href: "#/", class: "back-link" });
    this.titleEl = h("h1", { class: "session-title", id: "session-title", tabindex: "-1" });
    this.badgeSlot = h("span", { class: "session-badge" });
    this.connEl = h("span", { class: "conn", role: "status" });
    this.alertEl = h("div", { class: "banner banner-error", role: "alert", hidden: true });
    this.movingEl = h("div", { class: "banner banner-moving", role: "status", hidden: true });
    this.endedEl = h("div", { class: "banner banner-info banner-ended", hidden: true });
    this.emptyEl = h("p", { class: "empty", hidden: true });
    this.logEl = h("div", { class: "transcript", role: "log", "aria-live": "polite", "aria-relevant": "additions" });
    this.interactionsTitle = h("h2", { class: "section-title", id: uid("interactions") });
    this.interactionsEl = h("div", { class: "interaction-list" });
    this.interactionsSection = h(
      "section",
      { class: "interactions", "aria-live": "polite", "aria-labelledby": this.interactionsTitle.id, hidden: true },
      this.interactionsTitle,
      this.interactionsEl,
    );
    this.queuedEl = h("ul", { class: "queued", hidden: true });
    this.inputLabel = h("label", { for: inputId, class: "visually-hidden" });
    this.input = h("textarea", {
      id: inputId,
      class: "composer-input",
      rows: "2",
      "aria-describedby": hintId,
      onKeydown: (event) => this.onComposerKey(event),
      onInput: () => this.autosize(),
    });
    this.hintEl = h("span", { class: "composer-hint", id: hintId });
    this.stopButton = h("button", { type: "button", class: "btn btn-secondary", onClick: () => this.cancelTurn() });
    this.sendButton = h("button", { type: "submit", class: "btn btn-primary" });
    this.composerError = h("p", { class: "composer-error", role: "alert", hidden: true });
    this.composer = h(
      "form",
      { class: "composer", onSubmit: (event) => this.onSubmit(event) },
      this.inputLabel,
      this.input,
      h("div", { class: "composer-row" }, this.hintEl, h("div", { class: "composer-buttons" }, this.stopButton, this.sendButton)),
      this.composerError,
    );
    this.el = h(
      "section",
      { class: "view view-session", "aria-labelledby": "session-title" },
      h("nav", { class: "crumbs" }, this.backLink),
      h("div", { class: "session-head" }, h("div", { class: "session-head-main" }, this.titleEl, this.badgeSlot), this.connEl),
      this.alertEl,
      this.movingEl,
      this.endedEl,
      this.emptyEl,
      this.logEl,
      this.interactionsSection,
      this.queuedEl,
      this.composer,
    );
    this.root.append(this.el);
    this.renderAll();
  }

  async start() {
    // The load route resumes a session that is not live: only a person's Resume may do that.
    try {
      await api.status(this.sid);
    } catch (error) {
      if (this.destroyed) return;
      if (error.status === 404) return void (await this.showEnded());
      // Anything else: the load below says what is wrong.
    }
    if (this.destroyed) return;
    await this.reload();
    if (!this.ended && !this.destroyed) this.openStream();
  }

  destroy() {
    this.destroyed = true;
    this.closeStream();
    clearTimeout(this.reopenTimer);
    this.unsubscribe();
    this.el.remove();
  }

  // ---- loading and the event stream ------------------------------------------------------

  async reload() {
    if (this.loading) {
      this.reloadQueued = true;
      return;
    }
    this.loading = true;
    this.buffer = [];
    let body;
    try {
      body = await api.load(this.sid, HISTORY_PAGE_SIZE);
    } catch (error) {
      this.loading = false;
      if (this.destroyed) return;
      if (error.status === 404) await this.showEnded();
      else if (explainsResume(error)) this.showAlert(resumeErrorText(error)); // it died meanwhile
      else this.showAlert(t("session.loadError", { message: error.message }));
      return;
    }
    if (this.destroyed) return;
    this.applyLoad(body);
    this.loading = false;
    this.loaded = true;
    for (const envelope of this.buffer.splice(0)) this.applyEvent(envelope, { render: false });
    this.redrawTranscript({ scroll: true });
    this.refreshStatus();
    if (this.es && this.streamEpoch !== this.epoch) this.openStream(); // resume in the new epoch
    if (this.reloadQueued) {
      this.reloadQueued = false;
      this.reload();
    }
  }

  /** Start over from a load's answer: the transcript, the event cursor and epoch. */
  applyLoad(body) {
    const model = new Transcript();
    model.applyAll(body.compactedReplay);
    this.model = model;
    this.rendered.clear(); // a new model: item keys may now name other items
    this.logEl.replaceChildren();
    this.cursor = Number(body.lastEventId) || 0;
    if (body.eventEpoch) this.epoch = body.eventEpoch;
    this.drainSeen = false; // a move still under way shows in the status read next
    this.showAlert(null);
  }

  async openStream() {
    this.closeStream();
    const opening = (this.opening = (this.opening || 0) + 1);
    const epoch = this.epoch;
    this.setConnection("connecting");
    let url;
    try {
      url = await api.eventsUrl(this.sid, epoch); // with a token: a fresh single-use ticket
    } catch {
      if (opening === this.opening && !this.destroyed && !this.ended) this.scheduleReopen();
      return;
    }
    if (opening !== this.opening || this.destroyed || this.ended) return; // replaced meanwhile
    // A ticket opens its stream once: the browser's reconnect would repeat it, so a break
    // reopens here, fresh (its snapshot tells whether a load is needed).
    const ticketed = streamsNeedTickets();
    const es = new EventSource(url);
    this.es = es;
    this.streamEpoch = epoch;
    for (const type of STREAM_EVENT_TYPES) es.addEventListener(type, (event) => this.onFrame(es, type, event));
    es.addEventListener("open", () => {
      if (es !== this.es) return;
      this.reopenAttempt = 0;
      this.setConnection("live");
    });
    es.addEventListener("error", () => {
      if (es !== this.es || this.ended) return;
      this.setConnection("reconnecting");
      if (ticketed || es.readyState === EventSource.CLOSED) this.scheduleReopen(); // the browser gave up
    });
  }

  closeStream() {
    this.opening = (this.opening || 0) + 1; // an open still waiting for its ticket is dropped
    if (this.es) this.es.close();
    this.es = null;
  }

  scheduleReopen() {
    this.closeStream();
    const delay = REOPEN_DELAYS_MS[Math.min(this.reopenAttempt, REOPEN_DELAYS_MS.length - 1)];
    this.reopenAttempt += 1;
    clearTimeout(this.reopenTimer);
    this.reopenTimer = setTimeout(async () => {
      if (this.destroyed || this.ended) return;
      try {
        await api.status(this.sid);
      } catch (error) {
        if (error.status === 404) return this.endSession();
        return this.scheduleReopen();
      }
      this.openStream(); // fresh: its snapshot tells whether a load is needed
    }, delay);
  }

  onFrame(es, type, event) {
    if (es !== this.es || this.destroyed) return;
    let envelope;
    try {
      envelope = JSON.parse(event.data);
    } catch {
      return;
    }
    if (envelope.id === undefined || envelope.id === null) {
      this.onControl(type, envelope.data || {});
    } else if (this.loading) {
      this.buffer.push(envelope);
    } else {
      this.applyEvent(envelope);
    }
  }

  onControl(type, data) {
    if (type === "session_snapshot") {
      const { lastEventId, eventEpoch, ...summary } = data;
      this.setSummary(summary);
      const missed = Number(lastEventId) > this.cursor;
      const otherEpoch = eventEpoch && this.epoch && eventEpoch !== this.epoch;
      if (missed || otherEpoch) this.reload(); // events fell between load and subscribe
    } else if (type === "history_truncated") {
      this.reload();
    }
  }

  applyEvent(envelope, { render = true } = {}) {
    const id = Number(envelope.id);
    if (!(id > this.cursor)) return; // already part of what was loaded or seen
    this.cursor = id;
    const changed = this.model.apply(envelope);
    if (changed && render) this.redrawTranscript();
    const update = envelope.data?.update;
    const startsTurn = envelope.type === "session_update" && update?.sessionUpdate === "user_message_chunk";
    if (envelope.type === "turn_error" && envelope.data?.code === DRAINING) {
      this.drainSeen = true; // the drain stopped the turn: the move comes next
      this.renderHead();
    } else if (envelope.type === "session_moved") {
      this.drainSeen = false; // arrived: the status read next says so too
      if (this.summary) this.summary = { ...this.summary, moving: false };
      this.renderHead();
    }
    if (STATUS_EVENTS.has(envelope.type) || startsTurn) this.refreshStatus();
    if (envelope.type === "session_closed" || envelope.type === "session_died") this.endSession();
  }

  refreshStatus() {
    if (this.ended || this.destroyed) return;
    if (this.statusInFlight) {
      this.statusAgain = true;
      return;
    }
    this.statusInFlight = true;
    api
      .status(this.sid)
      .then((summary) => this.setSummary(summary))
      .catch((error) => {
        if (error.status === 404) this.endSession();
      })
      .finally(() => {
        this.statusInFlight = false;
        if (this.statusAgain) {
          this.statusAgain = false;
          this.refreshStatus();
        }
      });
  }

  setSummary(summary) {
    if (this.destroyed) return;
    // The status carries no title (the reference's does not): keep the one the snapshot gave.
    this.summary = { ...summary, displayName: summary.displayName ?? this.summary?.displayName };
    this.interactions = Array.isArray(summary.pendingInteractions) ? summary.pendingInteractions : [];
    this.renderHead();
    this.renderInteractions();
    this.renderComposer();
  }

  endSession() {
    if (this.ended) return;
    this.ended = true;
    this.drainSeen = false;
    this.closeStream();
    clearTimeout(this.reopenTimer);
    this.interactions = [];
    this.renderAll();
  }

  /** A session that is not live: its persisted transcript, read-only (until resumed). */
  async showEnded() {
    this.ended = true;
    this.loaded = true;
    this.closeStream();
    try {
      const page = await api.transcript(this.sid, HISTORY_PAGE_SIZE);
      const model = new Transcript();
      model.applyAll(page.events);
      this.model = model;
      this.rendered.clear();
      this.logEl.replaceChildren();
      // Neither the status nor the transcript route has the title: the whole transcript
      // does (the listing's title is the first prompt's text).
      const first = page.hasMore ? null : model.items.find((item) => item.kind === "message" && item.role === "user");
      this.fallbackTitle = first ? messageText(first).trim().slice(0, 120) || null : null;
    } catch (error) {
      this.missing = error.status === 404;
      this.showAlert(this.missing ? t("session.notFound") : t("session.loadError", { message: error.message }));
    }
    this.renderAll();
  }

  // ---- actions ----------------------------------------------------------------------------

  /** Resume a session that is not live (the load route), then follow it as a live one. */
  async resumeSession() {
    if (this.resumeState.busy || !this.ended) return;
    this.resumeState = { busy: true, error: null };
    this.renderEnded();
    let body;
    try {
      body = await api.resume(this.sid);
    } catch (error) {
      if (this.destroyed) return;
      this.resumeState = { busy: false, error };
      this.renderEnded();
      return;
    }
    if (this.destroyed) return;
    this.resumeState = { busy: false, error: null };
    this.ended = false;
    this.summary = null;
    this.applyLoad(body);
    this.renderAll();
    scrollToEnd();
    this.refreshStatus();
    this.openStream();
    this.input.focus();
  }

  onComposerKey(event) {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      this.composer.requestSubmit();
    }
  }

  autosize() {
    this.input.style.height = "auto";
    this.input.style.height = `${Math.min(this.input.scrollHeight, 240)}px`;
  }

  async onSubmit(event) {
    event.preventDefault();
    const text = this.input.value;
    if (!text.trim() || this.ended) return;
    if (await this.send(text)) {
      this.input.value = "";
      this.autosize();
    }
    this.input.focus();
  }

  async send(text) {
    this.sendButton.disabled = true;
    this.showComposerError(null);
    try {
      await api.prompt(this.sid, text);
      this.refreshStatus();
      return true;
    } catch (error) {
      this.showComposerError(t("session.sendError", { message: error.message }));
      return false;
    } finally {
      this.sendButton.disabled = this.ended;
    }
  }

  async cancelTurn() {
    this.stopButton.disabled = true;
    try {
      await api.cancel(this.sid);
    } catch (error) {
      this.showComposerError(t("session.cancelError", { message: error.message }));
    }
    this.refreshStatus();
  }

  retry(item) {
    const text = this.model.promptText(item.promptId);
    if (text.trim()) this.send(text);
  }

  async vote(card, requestId, body) {
    const buttons = card.querySelectorAll("button, input, textarea");
    buttons.forEach((el) => (el.disabled = true));
    const errorEl = card.querySelector(".card-error");
    const statusEl = card.querySelector(".card-status");
    statusEl.textContent = t("vote.sending");
    errorEl.hidden = true;
    try {
      await api.vote(this.sid, requestId, body);
    } catch (error) {
      statusEl.textContent = "";
      errorEl.textContent = t("vote.error", { message: error.message });
      errorEl.hidden = false;
      buttons.forEach((el) => (el.disabled = false));
    }
    this.refreshStatus();
  }

  // ---- rendering --------------------------------------------------------------------------

  renderAll() {
    document.title = `${this.title} · ${t("app.product")}`;
    this.backLink.replaceChildren(h("span", { "aria-hidden": "true" }, "← "), t("session.back"));
    this.logEl.setAttribute("aria-label", t("session.transcript"));
    this.interactionsTitle.textContent = t("interactions.heading");
    this.inputLabel.textContent = t("session.composerLabel");
    this.input.placeholder = t("session.placeholder");
    this.hintEl.textContent = t("session.hint");
    this.sendButton.textContent = t("session.send");
    this.stopButton.textContent = t("session.stop");
    this.renderEnded();
    this.setConnection(this.ended ? "ended" : this.connection);
    this.renderHead();
    this.cards.forEach((entry) => (entry.sig = null));
    this.renderInteractions();
    this.redrawTranscript();
    this.renderComposer();
  }

  renderHead() {
    const name = this.title;
    this.titleEl.textContent = name;
    document.title = `${name} · ${t("app.product")}`;
    const status = this.ended ? "ended" : this.summary ? sessionStatus(this.summary) : null;
    replaceChildren(this.badgeSlot, status ? statusBadge(status) : null, this.moving ? movingBadge() : null);
    this.renderMoving();
  }

  get title() {
    return this.summary?.displayName || this.fallbackTitle || t("ws.untitled");
  }

  /** A draining worker is handing the session over (its status says so, or the drain
   * already stopped a turn here and `session_moved` has not come yet). */
  get moving() {
    return !this.ended && (this.drainSeen || isMoving(this.summary));
  }

  renderMoving() {
    const moving = this.moving;
    const sig = `${moving}|${language()}`;
    if (sig === this.movingSig) return; // unchanged: not announced again
    this.movingSig = sig;
    this.movingEl.hidden = !moving;
    this.movingEl.dataset.moving = String(moving);
    replaceChildren(
      this.movingEl,
      moving
        ? [
            h("span", { class: "banner-icon", "aria-hidden": "true" }, "⇄"),
            h("span", {}, h("strong", {}, t("session.moving.title")), " ", t("session.moving")),
          ]
        : null,
    );
  }

  /** Read-only: why, and the Resume action unless it is known that it cannot be. */
  renderEnded() {
    this.endedEl.hidden = !this.ended || this.missing;
    if (this.endedEl.hidden) return void this.endedEl.replaceChildren();
    const { busy, error } = this.resumeState;
    const never = neverResumable(error);
    const focused = this.endedEl.contains(document.activeElement);
    const button = never
      ? null
      : h(
          "button",
          {
            type: "button",
            class: "btn btn-primary btn-small ended-resume",
            "aria-disabled": busy ? "true" : null, // keeps the focus, unlike `disabled`
            onClick: () => this.resumeSession(),
          },
          busy ? t("resume.busy") : [h("span", { class: "btn-icon", "aria-hidden": "true" }, "↻"), t("resume.action")],
        );
    replaceChildren(
      this.endedEl,
      h(
        "div",
        { class: "ended-main" },
        h("p", { class: "ended-text" }, t(never ? "session.endedCannot" : "session.endedResume")),
        button,
      ),
      error && !never ? h("p", { class: "ended-error", role: "alert" }, resumeErrorText(error)) : null,
    );
    if (focused && button) button.focus();
  }

  setConnection(state) {
    if (state !== "ended") this.connection = state;
    const shown = this.ended ? "ended" : state;
    this.connEl.dataset.state = shown;
    this.connEl.replaceChildren(h("span", { class: "conn-dot", "aria-hidden": "true" }), t(`session.conn.${shown}`));
  }

  renderComposer() {
    this.composer.hidden = this.ended;
    this.sendButton.disabled = this.ended;
    // The composer stays usable whatever happened to the last turn; Stop only while one runs.
    this.stopButton.disabled = this.ended || !this.summary?.hasActivePrompt;
    const queued = [...this.model.queued.values()];
    this.queuedEl.hidden = queued.length === 0 || this.ended;
    replaceChildren(this.queuedEl, queued.map((text) => h("li", {}, t("session.queued", { text }))));
  }

  showAlert(text) {
    this.alertEl.hidden = !text;
    this.alertEl.textContent = text ?? "";
  }

  showComposerError(text) {
    this.composerError.hidden = !text;
    this.composerError.textContent = text ?? "";
  }

  redrawTranscript({ scroll = false } = {}) {
    const stick = scroll || nearBottom();
    const lang = language();
    const seen = new Set();
    let previous = null;
    for (const item of this.model.items) {
      seen.add(item.key);
      const sig = `${item.rev}|${lang}|${this.ended}`; // an error's Retry goes when the session ends
      let entry = this.rendered.get(item.key);
      if (!entry || entry.sig !== sig) {
        const el = this.renderItem(item);
        if (entry) entry.el.replaceWith(el);
        entry = { el, sig };
        this.rendered.set(item.key, entry);
      }
      const expected = previous ? previous.nextSibling : this.logEl.firstChild;
      if (expected !== entry.el) this.logEl.insertBefore(entry.el, expected);
      previous = entry.el;
    }
    for (const [key, entry] of this.rendered) {
      if (!seen.has(key)) {
        entry.el.remove();
        this.rendered.delete(key);
      }
    }
    this.renderEmpty();
    this.renderComposer();
    if (stick) scrollToEnd();
  }

  renderEmpty() {
    this.emptyEl.hidden = this.model.items.length > 0 || this.ended;
    this.emptyEl.textContent = this.loaded ? t("session.empty") : t("session.loading");
  }

  renderItem(item) {
    switch (item.kind) {
      case "message":
        return this.renderMessage(item);
      case "tool":
        return this.renderTool(item);
      case "error":
        return this.renderError(item);
      default:
        return h("p", { class: `notice notice-${item.notice}`, dataset: { notice: item.notice } }, t(item.noticeKey));
    }
  }

  renderMessage(item) {
    const who = { user: "session.you", agent: "session.agent", thought: "session.thought" }[item.role];
    const body = item.blocks.map((block) =>
      block.type === "text" ? block.text : h("span", { class: "non-text" }, t("session.nonText", { type: block.type })),
    );
    return h(
      "article",
      { class: `msg msg-${item.role}`, dataset: { role: item.role } },
      h("div", { class: "msg-who" }, t(who)),
      h("div", { class: "msg-body" }, body),
    );
  }

  renderTool(item) {
    const override = this.toolOpen.get(item.key);
    // Collapsed unless it failed (a pending call's input is on its permission card), and
    // collapsed once a turn error follows: the error explains the turn.
    const defaultOpen = !item.collapsedByError && item.status === "failed";
    const usable = override && (!item.collapsedByError || override.afterError);
    const open = usable ? override.open : defaultOpen;
    const output = toolOutput(item.content);
    const hasBody = item.input !== undefined || Boolean(output);
    const details = h(
      "details",
      {
        class: `tool tool-${item.status}${hasBody ? "" : " tool-empty"}`,
        dataset: { toolCallId: item.toolCallId, status: item.status },
        open: open && hasBody,
      },
      h(
        "summary",
        { class: "tool-summary" },
        h(
          "span",
          { class: `tool-status tool-status-${item.status}` },
          hasMessage(`tool.status.${item.status}`) ? t(`tool.status.${item.status}`) : item.status,
        ),
        h("span", { class: "tool-title" }, item.title || t("tool.untitled")),
        item.toolKind ? h("span", { class: "tool-kind" }, t("tool.kind", { kind: item.toolKind })) : null,
      ),
      hasBody
        ? h(
            "div",
            { class: "tool-body" },
            item.input !== undefined
              ? h("div", { class: "tool-section" }, h("h3", {}, t("tool.input")), h("pre", {}, pretty(item.input)))
              : null,
            output ? h("div", { class: "tool-section" }, h("h3", {}, t("tool.output")), h("pre", {}, output)) : null,
          )
        : null,
    );
    details.addEventListener("toggle", () => {
      if (details.open === defaultOpen && !this.toolOpen.has(item.key)) return; // our own initial state
      this.toolOpen.set(item.key, { open: details.open, afterError: item.collapsedByError });
    });
    return details;
  }

  renderError(item) {
    const key = ERROR_KINDS[item.errorKind] ?? (item.errorKind ? undefined : ERROR_CODES[item.code]);
    const title = t(key ? `error.${key}.title` : "error.unknown.title");
    const text = key ? t(`error.${key}`) : item.message || t("error.unknown");
    // Retry sends the prompt again: not once the session has ended (it would be refused).
    const retryable = RETRYABLE.has(item.errorKind) || (!item.errorKind && RETRYABLE.has(item.code));
    const retry = retryable && !this.ended
      ? h("button", { type: "button", class: "btn btn-primary btn-small", onClick: () => this.retry(item) }, t("error.retry"))
      : null;
    return h(
      "div",
      {
        class: `turn-error turn-error-${item.errorKind || item.code || "unknown"}`,
        role: "alert",
        dataset: { errorKind: item.errorKind || "", errorCode: item.code || "" },
      },
      h("div", { class: "turn-error-icon", "aria-hidden": "true" }, "!"),
      h(
        "div",
        { class: "turn-error-main" },
        h("h2", { class: "turn-error-title" }, title),
        h("p", { class: "turn-error-text" }, text),
        !key && item.code ? h("p", { class: "turn-error-code" }, t("error.code", { code: item.code })) : null,
        retry ? h("div", { class: "turn-error-actions" }, retry) : null,
      ),
    );
  }

  renderInteractions() {
    const list = this.ended ? [] : this.interactions;
    const stick = nearBottom();
    const added = list.some((interaction) => !this.cards.has(interaction.requestId));
    this.interactionsSection.hidden = list.length === 0;
    const lang = language();
    const seen = new Set();
    let previous = null;
    for (const interaction of list) {
      const rid = interaction.requestId;
      seen.add(rid);
      let entry = this.cards.get(rid);
      const sig = `${lang}|${JSON.stringify(interaction)}`;
      if (!entry || entry.sig !== sig) {
        const el = interaction.kind === "user_question" ? this.renderQuestion(interaction) : this.renderPermission(interaction);
        if (entry) entry.el.replaceWith(el);
        entry = { el, sig };
        this.cards.set(rid, entry);
      }
      const expected = previous ? previous.nextSibling : this.interactionsEl.firstChild;
      if (expected !== entry.el) this.interactionsEl.insertBefore(entry.el, expected);
      previous = entry.el;
    }
    for (const [rid, entry] of this.cards) {
      if (!seen.has(rid)) {
        entry.el.remove();
        this.cards.delete(rid);
      }
    }
    if (added && stick) scrollToEnd(); // a new question for the user: bring it into view
  }

  /** One button per offered option: selecting it votes for that option. */
  optionButton(card, interaction, option) {
    return optionButton(option, () => this.vote(card, interaction.requestId, selectedOutcome(option)));
  }

  renderPermission(interaction) {
    const action = interaction.action || {};
    const titleId = uid("perm");
    const card = h("article", {
      class: "card interaction interaction-permission",
      dataset: { requestId: interaction.requestId },
      "aria-labelledby": titleId,
    });
    const options = Array.isArray(interaction.options) ? interaction.options : [];
    const buttons = options.map((option) => this.optionButton(card, interaction, option));
    const details = [];
    if (action.type) details.push(h("dt", {}, t("permission.kind")), h("dd", {}, h("code", {}, action.type)));
    replaceChildren(
      card,
      h("header", { class: "card-head" }, statusBadge("needsApproval"), h("h3", { id: titleId }, t("permission.heading"))),
      h("p", { class: "action-title" }, action.title || t("permission.untitled")),
      details.length ? h("dl", { class: "action-meta" }, details) : null,
      action.input !== undefined
        ? h("div", { class: "action-input" }, h("h4", {}, t("permission.input")), h("pre", {}, pretty(action.input)))
        : null,
      h("div", { class: "card-actions" }, buttons, h("span", { class: "card-status", role: "status" })),
      h("p", { class: "card-error", role: "alert", hidden: true }),
    );
    return card;
  }

  renderQuestion(interaction) {
    const titleId = uid("question");
    const card = h("article", {
      class: "card interaction interaction-question",
      dataset: { requestId: interaction.requestId },
      "aria-labelledby": titleId,
    });
    const options = Array.isArray(interaction.options) ? interaction.options : [];
    const submit = options.find((o) => String(o.kind || "").startsWith("allow")) ?? options[0];
    const others = options.filter((o) => o !== submit);
    const questions = Array.isArray(interaction.questions) ? interaction.questions : [];
    const fields = questions.map((question, index) => this.renderQuestionField(interaction, question, index));
    const form = h(
      "form",
      {
        class: "question-form",
        onSubmit: (event) => {
          event.preventDefault();
          if (!submit) return;
          const answers = {};
          for (const field of fields) {
            const value = field.answer();
            if (!value) {
              const errorEl = card.querySelector(".card-error");
              errorEl.textContent = t("question.required");
              errorEl.hidden = false;
              field.focus();
              return;
            }
            answers[field.answerKey] = value;
          }
          this.vote(card, interaction.requestId, { outcome: { outcome: "selected", optionId: submit.optionId }, answers });
        },
      },
      fields.map((field) => field.el),
      h(
        "div",
        { class: "card-actions" },
        submit
          ? h("button", { type: "submit", class: "btn btn-primary", dataset: { optionId: submit.optionId } }, submit.label || t("question.submit"))
          : null,
        others.map((option) => this.optionButton(card, interaction, option)),
        h("span", { class: "card-status", role: "status" }),
      ),
      h("p", { class: "card-error", role: "alert", hidden: true }),
    );
    replaceChildren(
      card,
      h("header", { class: "card-head" }, statusBadge("needsAnswer"), h("h3", { id: titleId }, t("question.heading"))),
      form,
    );
    return card;
  }

  /** One question: radios (or checkboxes for multiSelect) and a free-text answer. */
  renderQuestionField(interaction, question, index) {
    const answerKey = String(question.answerKey ?? index);
    const multi = question.multiSelect === true;
    const name = `q-${interaction.requestId}-${answerKey}`;
    const choices = (Array.isArray(question.options) ? question.options : []).map((option) => {
      const inputId = uid("choice");
      const descId = option.description ? uid("desc") : null;
      const input = h("input", {
        type: multi ? "checkbox" : "radio",
        id: inputId,
        name,
        value: String(option.label ?? ""),
        "aria-describedby": descId,
      });
      return {
        input,
        el: h(
          "div",
          { class: "choice" },
          input,
          h("label", { for: inputId, class: "choice-label" }, String(option.label ?? "")),
          descId ? h("span", { class: "choice-desc", id: descId }, String(option.description)) : null,
        ),
      };
    });
    const otherId = uid("other");
    const other = h("input", { type: "text", id: otherId, class: "other-input", placeholder: t("question.otherPlaceholder") });
    const el = h(
      "fieldset",
      { class: "question" },
      h(
        "legend",
        {},
        question.header ? h("span", { class: "question-header" }, String(question.header)) : null,
        h("span", { class: "question-text" }, String(question.question ?? "")),
      ),
      h("div", { class: `choices${multi ? " choices-multi" : ""}` }, choices.map((c) => c.el)),
      h("div", { class: "other" }, h("label", { for: otherId }, t("question.other")), other),
    );
    return {
      el,
      answerKey,
      focus: () => (choices[0]?.input ?? other).focus(),
      answer: () => {
        const picked = choices.filter((c) => c.input.checked).map((c) => c.input.value);
        const typed = other.value.trim();
        if (multi) return [...picked, ...(typed ? [typed] : [])].join(", ");
        return typed || picked[0] || "";
      },
    };
  }
}

function scrollToEnd() {
  requestAnimationFrame(() => window.scrollTo({ top: document.documentElement.scrollHeight }));
}

function nearBottom() {
  const doc = document.documentElement;
  return window.innerHeight + window.scrollY >= doc.scrollHeight - 160;
}
