// Builds dist/verify.html: src/verify.html with the stylesheet and the bundled script inlined, and a
// Content-Security-Policy that allows exactly those two (by hash) and same-origin fetches. Deterministic: the same
// sources and lockfile give the same bytes (tests/test_web_verify.py rebuilds it and compares).
import { createHash } from "node:crypto";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { build } from "esbuild";

const here = new URL(".", import.meta.url);
const read = (p) => readFileSync(new URL(p, here), "utf8");
const out = process.argv[2] || new URL("dist/verify.html", here).pathname;

const result = await build({
  entryPoints: [new URL("src/main.js", here).pathname], bundle: true, write: false, format: "iife", platform: "browser",
  target: "es2022", minify: true, legalComments: "eof", charset: "utf8", absWorkingDir: new URL(".", here).pathname,
  define: { global: "globalThis", "process.env.NODE_ENV": '"production"' }, logLevel: "warning",
});
const script = result.outputFiles[0].text.replace(/<\/(script)/gi, "<\\/$1");
const style = read("src/style.css");
const hash = (s) => "sha256-" + createHash("sha256").update(s, "utf8").digest("base64");
const html = read("src/verify.html")
  .replace("%SCRIPT_HASH%", hash(script)).replace("%STYLE_HASH%", hash(style))
  .replace("%STYLE%", () => style).replace("%SCRIPT%", () => script);
mkdirSync(new URL("dist/", here), { recursive: true });
writeFileSync(out, html);
console.log(`${out}: ${html.length} bytes`);
