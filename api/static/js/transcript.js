// The transcript model: folds event envelopes ({id?, type, promptId?, data}) into render
// items. No DOM here. Items are plain objects with a stable `key` and a `rev` that grows on
// every change, so the view redraws only what changed.
//
//   message  {role: "user" | "agent" | "thought", promptId, blocks: [{type, text?}]}
//   tool     {toolCallId, promptId, title, toolKind, status, input, content, collapsedByError}
//   error    {promptId, errorKind, message, code, loopType}
//   notice   {notice, noticeKey}: "closed" | "died" | "truncated" | "moved", and its message

const CHUNK_ROLES = {
  user_message_chunk: "user",
  agent_message_chunk: "agent",
  agent_thought_chunk: "thought",
};
// Session updates that are not turn content (spec §2.2): they never supersede a turn error.
const BOOKKEEPING_UPDATES = new Set(["available_commands_update", "current_mode_update", "session_info_update"]);

export class Transcript {
  constructor() {
    this.items = [];
    this.tools = new Map(); // toolCallId -> tool item
    this.queued = new Map(); // promptId -> text, prompts waiting behind the running one
    this.ended = null; // "closed" | "died" once the session is gone
    this.revision = 0; // grows on every change of anything above
    this._keys = 0;
  }

  /** Fold every envelope of a replay (oldest first). */
  applyAll(envelopes) {
    let changed = false;
    for (const envelope of envelopes || []) changed = this.apply(envelope) || changed;
    return changed;
  }

  /** Fold one envelope; true when something visible changed. */
  apply(envelope) {
    if (!envelope || typeof envelope.type !== "string") return false;
    const data = envelope.data && typeof envelope.data === "object" ? envelope.data : {};
    const promptId = envelope.promptId ?? data.promptId ?? null;
    let changed = false;
    switch (envelope.type) {
      case "session_update":
        changed = this._update(data.update, promptId);
        break;
      case "turn_error":
        changed = this._turnError(data, promptId);
        break;
      case "pending_prompt_added":
        if (promptId) this.queued.set(promptId, typeof data.text === "string" ? data.text : "");
        changed = true;
        break;
      case "pending_prompt_started":
        // A newer turn started: it supersedes a shown error (counts as turn content).
        this.queued.delete(promptId);
        this._supersedeErrors();
        changed = true;
        break;
      case "pending_prompt_completed":
        changed = this.queued.delete(promptId);
        break;
      case "session_closed":
      case "session_died":
        this.ended = envelope.type === "session_closed" ? "closed" : "died";
        this.queued.clear();
        this._push({ kind: "notice", notice: this.ended, noticeKey: this.ended === "closed" ? "session.closed" : "session.died" });
        changed = true;
        break;
      case "history_truncated":
        this._push({ kind: "notice", notice: "truncated", noticeKey: "session.truncated" });
        changed = true;
        break;
      case "session_moved":
        // A draining worker handed the session to another: same id, log and epoch, the
        // conversation goes on. Not turn content: it supersedes no error (the turn the
        // drain stopped keeps its explanation above this note).
        this._push({
          kind: "notice",
          notice: "moved",
          noticeKey: data.reason === "worker_draining" ? "session.movedDraining" : "session.moved",
        });
        changed = true;
        break;
      default:
        return false; // permission events, terminals, snapshots: shown elsewhere or not at all
    }
    if (changed) this.revision += 1;
    return changed;
  }

  /** The error item currently shown, if any (the last one). */
  get turnError() {
    for (let i = this.items.length - 1; i >= 0; i -= 1) if (this.items[i].kind === "error") return this.items[i];
    return null;
  }

  /** The text the user sent for `promptId` (or, without it, the last thing the user sent). */
  promptText(promptId) {
    const users = this.items.filter((item) => item.kind === "message" && item.role === "user");
    const own = promptId ? users.filter((item) => item.promptId === promptId) : [];
    const chosen = own.length ? own : users.slice(-1);
    return chosen.map(messageText).join("");
  }

  _push(item) {
    this._keys += 1;
    item.key ??= `${item.kind}:${this._keys}`;
    item.rev = 0;
    this.items.push(item);
    return item;
  }

  _update(update, promptId) {
    if (!update || typeof update !== "object") return false;
    const kind = update.sessionUpdate;
    if (BOOKKEEPING_UPDATES.has(kind)) return false;
    const userShell = update._meta && typeof update._meta === "object" && update._meta.source === "user-shell";
    const superseded = !userShell && this._supersedeErrors();
    if (kind in CHUNK_ROLES) {
      this._chunk(CHUNK_ROLES[kind], update.content, promptId);
      return true;
    }
    if (kind === "tool_call" || kind === "tool_call_update") {
      this._tool(update, promptId);
      return true;
    }
    return superseded; // plans, notices and other variants are not drawn
  }

  _chunk(role, content, promptId) {
    const block = content && typeof content === "object" ? content : { type: "text", text: String(content ?? "") };
    const last = this.items[this.items.length - 1];
    // Consecutive chunks of one kind within one prompt form one message. Replayed history
    // has no prompt ids: there agent chunks still merge, user chunks do not (two prompts
    // in a row without an answer must stay two messages).
    const samePrompt = last && last.promptId === promptId && (promptId !== null || role !== "user");
    if (last && last.kind === "message" && last.role === role && samePrompt) {
      const tail = last.blocks[last.blocks.length - 1];
      if (block.type === "text" && tail && tail.type === "text") tail.text += block.text ?? "";
      else last.blocks.push({ ...block });
      last.rev += 1;
      return;
    }
    this._push({ kind: "message", role, promptId, blocks: [{ ...block }] });
  }

  _tool(update, promptId) {
    const id = typeof update.toolCallId === "string" ? update.toolCallId : "";
    let item = this.tools.get(id);
    if (!item) {
      item = this._push({
        kind: "tool",
        key: `tool:${id}`, // stable across reloads: the user's open/closed choice survives
        toolCallId: id,
        promptId,
        title: "",
        toolKind: null,
        status: "pending",
        input: undefined,
        content: [],
        collapsedByError: false,
      });
      this.tools.set(id, item);
    }
    if (typeof update.title === "string") item.title = update.title;
    if (typeof update.kind === "string") item.toolKind = update.kind;
    if (typeof update.status === "string") item.status = update.status;
    if (update.rawInput !== undefined && update.rawInput !== null) item.input = update.rawInput;
    if (Array.isArray(update.content)) item.content = update.content;
    item.rev += 1;
  }

  _turnError(data, promptId) {
    // Tool cards of the failed turn stay, collapsed: they are what led up to the error.
    for (let i = this.items.length - 1; i >= 0; i -= 1) {
      const item = this.items[i];
      if (item.kind === "message" && item.role === "user") break;
      if (item.kind === "tool" && !item.collapsedByError) {
        item.collapsedByError = true;
        item.rev += 1;
      }
    }
    this._supersedeErrors(); // one error at a time: the newest
    this._push({
      kind: "error",
      promptId,
      errorKind: typeof data.errorKind === "string" ? data.errorKind : null,
      message: typeof data.message === "string" ? data.message : "",
      code: typeof data.code === "string" ? data.code : null,
      loopType: typeof data.loopType === "string" ? data.loopType : null,
    });
    return true;
  }

  _supersedeErrors() {
    const kept = this.items.filter((item) => item.kind !== "error");
    if (kept.length === this.items.length) return false;
    this.items = kept;
    return true;
  }
}

export function messageText(item) {
  return item.blocks.filter((b) => b.type === "text").map((b) => b.text ?? "").join("");
}

/** The readable text of a tool call's content list (text blocks; other kinds as JSON). */
export function toolOutput(content) {
  const parts = [];
  for (const entry of content || []) {
    if (entry && entry.type === "content" && entry.content && entry.content.type === "text") parts.push(entry.content.text ?? "");
    else if (entry && entry.type === "diff") parts.push(`${entry.path ?? ""}\n${entry.newText ?? ""}`);
    else parts.push(JSON.stringify(entry, null, 2));
  }
  return parts.join("\n");
}
