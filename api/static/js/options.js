// A permission's options as buttons: shared by the session view's cards and the deployment
// view's attention inbox, so an option looks (and votes) the same in both.

import { h } from "./dom.js";

/** The button style of an offered option: allow is primary, reject is a danger. */
export function optionClass(option) {
  const kind = String(option.kind || "");
  if (kind.startsWith("allow")) return "btn-primary";
  if (kind.startsWith("reject")) return "btn-danger";
  return "btn-secondary";
}

/** The vote body that selects `option` (`POST /session/:id/permission/:requestId`). */
export function selectedOutcome(option) {
  return { outcome: { outcome: "selected", optionId: option.optionId } };
}

/** One button per option; `onVote(option)` is called with the one clicked. */
export function optionButton(option, onVote, { disabled = false } = {}) {
  return h(
    "button",
    {
      type: "button",
      class: `btn ${optionClass(option)}`,
      dataset: { optionId: option.optionId },
      disabled,
      onClick: () => onVote(option),
    },
    option.label || option.optionId,
  );
}
