// Drives Debian's chromium (headless, through playwright-core: no browser download) for tests/test_web_verify.py.
// stdin: {"pages": [{"url": URL}], "timeout_ms": N}; stdout: one JSON list, per page {url, verdict (the parsed
// <pre id="verdict-json">), body_verdict, ms (the page's own timing), requests: every URL the page asked for, errors}.
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
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
try {
  for (const { url } of input.pages) {
    const page = await context.newPage();
    const requests = [], errors = [];
    page.on("request", (r) => requests.push(r.url()));
    page.on("pageerror", (e) => errors.push(String(e)));
    page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
    let verdict = null, bodyVerdict = null, ms = null;
    try {
      await page.goto(url);
      await page.waitForFunction(() => !["loading", "running", "waiting"].includes(document.body.dataset.verdict),
        null, { timeout: input.timeout_ms || 30000 });
      bodyVerdict = await page.evaluate(() => document.body.dataset.verdict);
      ms = await page.evaluate(() => Number(document.body.dataset.verifyMs || "NaN"));
      verdict = JSON.parse(await page.textContent("#verdict-json"));
    } catch (e) {
      errors.push(String(e));
    }
    if (input.screenshot_dir && input.screenshot) {
      await page.setViewportSize({ width: 1100, height: 900 });
    }
    results.push({ url, verdict, body_verdict: bodyVerdict, ms, requests, errors });
    await page.close();
  }
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
process.stdout.write(JSON.stringify(results));
