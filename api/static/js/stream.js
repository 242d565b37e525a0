// A followed event stream (EventSource) that says when it is up and when it is down, so a
// view can fall back to polling exactly while it is down.
//
// The browser reconnects by itself (after the stream's `retry:`), sending the last id it saw
// as `Last-Event-ID`: the push streams' ids carry all a resume needs (the live feed's
// `<revision>-<generation>`), so that reconnect resumes with what was missed. Only when the
// browser gives up (an HTTP error, or an answer that is not an event stream) is the stream
// reopened here, after a growing delay, with a fresh `url()`.
//
// With a token, a stream opens with a single-use ticket in its URL (api.js): the browser's
// reconnect would repeat a spent ticket, so a break closes the stream at once and it is
// reopened here with a fresh ticket; `url()` then names the last id seen (the live feed's
// `lastEventId`), which the browser's reconnect would have sent as `Last-Event-ID`.

import { streamsNeedTickets } from "./api.js";

const REOPEN_DELAYS_MS = [1000, 2000, 5000, 10000];

export class FollowedStream {
  /**
   * url():             the URL to open (or a promise of it), asked again at every (re)open
   * events:            {eventName: (data, messageEvent) => void}, data parsed from JSON
   * onUp(), onDown():  the stream opened; it broke (called once per outage)
   */
  constructor({ url, events, onUp = () => {}, onDown = () => {} }) {
    this.url = url;
    this.events = events;
    this.onUp = onUp;
    this.onDown = onDown;
    this.es = null;
    this.attempt = 0;
    this.timer = null;
    this.up = false;
    this.stopped = false;
    this.opening = 0; // which open() is the latest: an older one's URL, come late, is dropped
  }

  start() {
    this.open();
    return this;
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    this.close();
  }

  async open() {
    if (this.stopped) return;
    this.close();
    const opening = ++this.opening;
    let url;
    try {
      url = await this.url();
    } catch {
      if (opening === this.opening) this.broken(); // no ticket now (the API is down): later
      return;
    }
    if (this.stopped || opening !== this.opening) return;
    const ticketed = streamsNeedTickets();
    const es = new EventSource(url);
    this.es = es;
    for (const [name, handler] of Object.entries(this.events)) {
      es.addEventListener(name, (event) => {
        if (es !== this.es) return; // a frame of a stream already replaced
        let data;
        try {
          data = JSON.parse(event.data);
        } catch {
          return;
        }
        handler(data, event);
      });
    }
    es.addEventListener("open", () => {
      if (es !== this.es) return;
      this.attempt = 0;
      this.up = true;
      this.onUp();
    });
    es.addEventListener("error", () => {
      if (es !== this.es) return;
      if (!ticketed && es.readyState !== EventSource.CLOSED) {
        if (this.up || this.attempt === 0) this.onDown(); // once per outage
        this.up = false;
        this.attempt += 1; // the browser reconnects by itself, with Last-Event-ID
        return;
      }
      this.broken();
    });
  }

  /** The stream broke and will not come back by itself: reopen it later, with a fresh URL. */
  broken() {
    if (this.up || this.attempt === 0) this.onDown(); // once per outage
    this.up = false;
    this.close();
    const delay = REOPEN_DELAYS_MS[Math.min(this.attempt, REOPEN_DELAYS_MS.length - 1)];
    this.attempt += 1;
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.open(), delay);
  }

  close() {
    if (this.es) this.es.close();
    this.es = null;
  }
}
