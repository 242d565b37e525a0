// The deployment view (#/deployment), for an operator of many agents: the attention inbox
// across every workspace first (who waits for a human right now), then the live workers.

import { AttentionInbox } from "./attention-inbox.js";
import { h } from "./dom.js";
import { onLanguageChange, t } from "./i18n.js";
import { WorkersPanel } from "./workers-panel.js";

export function mountDeploymentView(root) {
  const view = new DeploymentView(root);
  view.start();
  return view;
}

class DeploymentView {
  constructor(root) {
    this.inbox = new AttentionInbox();
    this.workers = new WorkersPanel();
    this.titleEl = h("h1", { id: "dep-title", tabindex: "-1" });
    this.introEl = h("p", { class: "view-intro" });
    this.el = h(
      "section",
      { class: "view view-deployment", "aria-labelledby": "dep-title" },
      h("div", { class: "view-head" }, h("div", { class: "view-head-text" }, this.titleEl, this.introEl)),
      this.inbox.el,
      this.workers.el,
    );
    root.append(this.el);
    this.unsubscribe = onLanguageChange(() => this.render());
  }

  start() {
    this.render();
    this.inbox.start();
    this.workers.start();
  }

  render() {
    document.title = `${t("dep.heading")} · ${t("app.product")}`;
    this.titleEl.textContent = t("dep.heading");
    this.introEl.textContent = t("dep.intro");
    this.inbox.redrawAll();
    this.workers.render();
  }

  destroy() {
    this.inbox.destroy();
    this.workers.destroy();
    this.unsubscribe();
    this.el.remove();
  }
}
