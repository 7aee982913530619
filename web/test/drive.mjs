// Drives Debian's chromium (headless, through playwright-core: no browser download) for tests/test_web_verify.py.
// stdin: {"pages": [{"url": URL, "pick": [[SELECTOR, [PATH, ...]], ...], "drop": [PATH, ...], "screenshot": PATH}],
// "timeout_ms": N}: each page is opened (with "pick": files or a folder chosen in its file inputs, in order; with
// "drop": the files dropped onto it, as a user drags them from a file manager; with "text": the text of that element
// once verified); stdout: one JSON list, per page {url, verdict (the parsed <pre id="verdict-json">), body_verdict, ms
// (the page's own timing of the verification), loaded_ms (from opening the page to its verdict), text, requests: every
// URL the page asked for, errors}.
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { basename, join } from "node:path";
import { chromium } from "playwright-core";

const input = JSON.parse(readFileSync(0, "utf8"));
const profile = mkdtempSync(join(tmpdir(), "cvm-tune-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"],
});
const results = [];

/** Drop `paths` onto the page's drop zone in one DataTransfer, as a drag from a file manager does. */
async function dropFiles(page, paths) {
  const files = paths.map((p) => ({ name: basename(p), b64: readFileSync(p).toString("base64") }));
  const dt = await page.evaluateHandle((fs) => {
    const t = new DataTransfer();
    for (const f of fs) t.items.add(new File([Uint8Array.from(atob(f.b64), (c) => c.charCodeAt(0))], f.name));
    return t;
  }, files);
  await page.dispatchEvent("#drop", "drop", { dataTransfer: dt });
}
try {
  for (const { url, pick, drop, screenshot, text: selector } of input.pages) {
    const page = await context.newPage();
    const requests = [], errors = [];
    page.on("request", (r) => requests.push(r.url()));
    page.on("pageerror", (e) => errors.push(String(e)));
    page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
    let verdict = null, bodyVerdict = null, ms = null, loadedMs = null, text = null;
    try {
      await page.goto(url);
      for (const [selector, paths] of pick || []) await page.setInputFiles(selector, paths);
      if (drop) await dropFiles(page, drop);
      await page.waitForFunction(() => !["loading", "running", "waiting"].includes(document.body.dataset.verdict),
        null, { timeout: input.timeout_ms || 30000 });
      bodyVerdict = await page.evaluate(() => document.body.dataset.verdict);
      ms = await page.evaluate(() => Number(document.body.dataset.verifyMs || "NaN"));
      loadedMs = await page.evaluate(() => Number(document.body.dataset.loadedMs || "NaN"));
      verdict = JSON.parse(await page.textContent("#verdict-json"));
      if (selector) text = await page.textContent(selector);
    } catch (e) {
      errors.push(String(e));
    }
    if (screenshot) {
      await page.setViewportSize({ width: 1000, height: 760 });
      await page.screenshot({ path: screenshot });
    }
    results.push({ url, verdict, body_verdict: bodyVerdict, ms, loaded_ms: loadedMs, text, requests, errors });
    await page.close();
  }
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
process.stdout.write(JSON.stringify(results));
