// Message catalogues and the current language. Every visible string goes through t();
// a key missing from the current catalogue falls back to English, then to the key itself.

import en from "./locales/en.js";
import zhCN from "./locales/zh-CN.js";

export const LANGUAGES = ["en", "zh-CN"];
const CATALOGUES = { en, "zh-CN": zhCN };
const STORAGE_KEY = "acp-shell.language";

let current = "en";
const listeners = new Set();

/** The supported language closest to a BCP 47 tag ("zh", "zh-Hans-CN" -> "zh-CN"). */
export function matchLanguage(tag) {
  if (typeof tag !== "string" || !tag) return null;
  const lower = tag.toLowerCase();
  if (lower.startsWith("zh")) return "zh-CN";
  if (lower.startsWith("en")) return "en";
  return null;
}

/** A stored choice first, then the browser's languages in order, then English. */
export function detectLanguage() {
  const stored = readStored();
  if (LANGUAGES.includes(stored)) return stored;
  const preferred = navigator.languages?.length ? navigator.languages : [navigator.language];
  for (const tag of preferred) {
    const match = matchLanguage(tag);
    if (match) return match;
  }
  return "en";
}

function readStored() {
  try {
    return localStorage.getItem(STORAGE_KEY);
  } catch {
    return null; // storage disabled: the choice simply is not remembered
  }
}

export function language() {
  return current;
}

/** Switch language; `persist` remembers an explicit choice for the next visit. */
export function setLanguage(lang, { persist = false } = {}) {
  if (!LANGUAGES.includes(lang)) lang = "en";
  if (persist) {
    try {
      localStorage.setItem(STORAGE_KEY, lang);
    } catch {
      /* not remembered */
    }
  }
  if (lang === current && document.documentElement.lang === lang) return;
  current = lang;
  document.documentElement.lang = lang;
  for (const listener of [...listeners]) listener(lang);
}

/** Call `listener(lang)` after every language change; returns the unsubscribe function. */
export function onLanguageChange(listener) {
  listeners.add(listener);
  return () => listeners.delete(listener);
}

function lookup(key) {
  const own = CATALOGUES[current];
  if (own && Object.hasOwn(own, key)) return own[key];
  if (Object.hasOwn(en, key)) return en[key];
  return undefined;
}

/** Whether a catalogue has `key` (for values that come from the agent, like a tool status). */
export function hasMessage(key) {
  return lookup(key) !== undefined;
}

/**
 * The message for `key` in the current language with `{name}` placeholders filled.
 * With a numeric `params.count`, the plural form `key.one` / `key.other` is chosen.
 */
export function t(key, params = {}) {
  let template;
  if (typeof params.count === "number") {
    const form = new Intl.PluralRules(current).select(params.count);
    template = lookup(`${key}.${form}`) ?? lookup(`${key}.other`);
  }
  template ??= lookup(key);
  if (template === undefined) return key;
  return template.replace(/\{(\w+)\}/g, (whole, name) => (name in params ? String(params[name]) : whole));
}

/** "3 minutes ago" in the current language, for an ISO timestamp. */
export function relativeTime(iso, now = Date.now()) {
  const then = Date.parse(iso);
  if (Number.isNaN(then)) return "";
  const seconds = Math.round((then - now) / 1000);
  if (Math.abs(seconds) < 45) return t("time.now");
  const format = new Intl.RelativeTimeFormat(current, { numeric: "auto" });
  const units = [
    ["day", 86400],
    ["hour", 3600],
    ["minute", 60],
  ];
  for (const [unit, size] of units) {
    if (Math.abs(seconds) >= size || unit === "minute") return format.format(Math.round(seconds / size), unit);
  }
  return "";
}

/** An absolute, localized timestamp (for tooltips). */
export function absoluteTime(iso) {
  const then = Date.parse(iso);
  if (Number.isNaN(then)) return "";
  return new Intl.DateTimeFormat(current, { dateStyle: "medium", timeStyle: "medium" }).format(then);
}
