// Entry point: the top bar (language switch) and a hash router between the two views.
//   #/                 the workspace view
//   #/session/<id>     one session

import { api } from "./api.js";
import { h } from "./dom.js";
import { LANGUAGES, detectLanguage, language, onLanguageChange, setLanguage, t } from "./i18n.js";
import { mountSessionView } from "./session-view.js";
import { mountWorkspaceView } from "./workspace-view.js";

const main = document.getElementById("main");
let view = null;
let capabilities = null;

function getCapabilities() {
  capabilities ??= api.capabilities().catch((error) => {
    capabilities = null; // try again next time
    throw error;
  });
  return capabilities;
}

function navigate(hash) {
  if (location.hash === hash) route();
  else location.hash = hash;
}

function route({ initial = false } = {}) {
  if (view) view.destroy();
  view = null;
  main.replaceChildren();
  const match = /^#\/session\/([^/?#]+)/.exec(location.hash);
  if (match) {
    view = mountSessionView(main, { sessionId: decodeURIComponent(match[1]) });
  } else {
    document.title = t("app.title");
    view = mountWorkspaceView(main, { capabilities: getCapabilities(), navigate });
  }
  if (!initial) main.querySelector("h1")?.focus({ preventScroll: true }); // announce the new page
  window.scrollTo({ top: 0 });
}

function buildTopBar() {
  const brand = document.getElementById("brand");
  const label = document.getElementById("lang-label");
  const select = document.getElementById("lang-select");
  const render = () => {
    brand.replaceChildren(
      h("span", { class: "brand-mark", "aria-hidden": "true" }),
      h("span", { class: "brand-name" }, t("app.brand")),
      h("span", { class: "brand-product" }, t("app.product")),
    );
    label.textContent = t("lang.label");
    select.replaceChildren(
      ...LANGUAGES.map((code) => h("option", { value: code, lang: code, selected: code === language() }, t(`lang.${code}`))),
    );
    select.value = language();
  };
  select.addEventListener("change", () => setLanguage(select.value, { persist: true }));
  onLanguageChange(render);
  render();
}

setLanguage(detectLanguage());
buildTopBar();
onLanguageChange(() => {
  if (!/^#\/session\//.test(location.hash)) document.title = t("app.title");
});
window.addEventListener("hashchange", () => route());
route({ initial: true });
