// Entry point: the top bar (views, language switch) and a hash router between the views.
//   #/                 the workspace view
//   #/session/<id>     one session
//   #/deployment       the deployment view: attention inbox and workers

import { api } from "./api.js";
import { h } from "./dom.js";
import { LANGUAGES, detectLanguage, language, onLanguageChange, setLanguage, t } from "./i18n.js";
import { mountDeploymentView } from "./deployment-view.js";
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
  } else if (isDeployment()) {
    view = mountDeploymentView(main);
  } else {
    document.title = t("app.title");
    view = mountWorkspaceView(main, { capabilities: getCapabilities(), navigate });
  }
  if (!initial) main.querySelector("h1")?.focus({ preventScroll: true }); // announce the new page
  window.scrollTo({ top: 0 });
  renderNav();
}

function isDeployment() {
  return /^#\/deployment\/?$/.test(location.hash);
}

/** The views' links; the current one is marked for assistive technology too. */
function renderNav() {
  const nav = document.getElementById("topnav");
  nav.setAttribute("aria-label", t("nav.label"));
  const link = (href, key, current) =>
    h("a", { class: "topnav-link", href, "aria-current": current ? "page" : null }, t(key));
  nav.replaceChildren(
    link("#/", "nav.sessions", !isDeployment() && !/^#\/session\//.test(location.hash)),
    link("#/deployment", "nav.deployment", isDeployment()),
  );
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
  onLanguageChange(renderNav);
  render();
}

setLanguage(detectLanguage());
buildTopBar();
onLanguageChange(() => {
  if (!/^#\/session\//.test(location.hash) && !isDeployment()) document.title = t("app.title");
});
window.addEventListener("hashchange", () => route());
route({ initial: true });
