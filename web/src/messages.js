// What the page says when it cannot run a check that `cvm-tune verify` runs: never a pass, never an "accepted".
export const NOT_IMPLEMENTED = "not implemented in this page";

/** True for a check the page reported as not run (its reason starts with NOT_IMPLEMENTED). */
export const notImplemented = (c) => c.status === "skip" && c.reason.startsWith(NOT_IMPLEMENTED);
