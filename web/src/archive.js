// A bundle as the page sees it: { files: Map(path -> bytes), dirs: Set(path), odd: [path] }, read from a .tar or
// .tar.gz (ustar, GNU long names, pax path records) or from a dropped folder. Paths are relative to the bundle: a
// single top-level folder holding the bundle is taken off.

const td = new TextDecoder();

async function gunzip(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

const str = (b, at, n) => { const s = b.subarray(at, at + n); const z = s.indexOf(0); return td.decode(z < 0 ? s : s.subarray(0, z)); };
const octal = (b, at, n) => parseInt(str(b, at, n).trim() || "0", 8);

export class ArchiveError extends Error {}

function untar(b) {
  const entries = [];
  let at = 0, longName = null, paxPath = null;
  while (at + 512 <= b.length) {
    const h = b.subarray(at, at + 512);
    if (h.every((x) => x === 0)) break;
    let sum = 0;
    for (let i = 0; i < 512; i++) sum += i >= 148 && i < 156 ? 32 : h[i];
    if (sum !== octal(h, 148, 8)) throw new ArchiveError("not a tar archive (header checksum)");
    const size = octal(h, 124, 12), type = String.fromCharCode(h[156] || 48);
    const body = b.subarray(at + 512, at + 512 + size);
    at += 512 + Math.ceil(size / 512) * 512;
    if (type === "L") { longName = str(body, 0, body.length); continue; }
    if (type === "x") {
      for (const rec of td.decode(body).split("\n")) { const m = /^\d+ path=(.*)$/.exec(rec); if (m) paxPath = m[1]; }
      continue;
    }
    if (type === "g") continue;
    const prefix = str(h, 345, 155);
    let name = paxPath || longName || (prefix ? `${prefix}/${str(h, 0, 100)}` : str(h, 0, 100));
    longName = paxPath = null;
    name = name.replace(/^\.\//, "").replace(/\/+$/, "");
    if (!name || name === ".") continue;
    entries.push({ name, type, body });
  }
  return entries;
}

/** Entries [{ name, type: "0" file | "5" dir | other, body }] -> a bundle. */
export function toBundle(entries) {
  let names = entries.map((e) => e.name);
  if (names.some((n) => n.split("/").includes("..") || n.startsWith("/"))) throw new ArchiveError("an archive path leaves the bundle");
  const tops = new Set(names.map((n) => n.split("/")[0]));
  const strip = tops.size === 1 && !names.includes("manifest.json") && !names.includes("round-manifest.json")
    && entries.some((e) => e.name.includes("/"));
  const files = new Map(), dirs = new Set(), odd = [];
  for (const e of entries) {
    const name = strip ? e.name.split("/").slice(1).join("/") : e.name;
    if (!name) continue;
    const parts = name.split("/");
    for (let i = 1; i < parts.length; i++) dirs.add(parts.slice(0, i).join("/"));
    if (e.type === "5") dirs.add(name);
    else if (e.type === "0" || e.type === "\0" || e.type === "7") files.set(name, e.body);
    else odd.push(name);
  }
  return { files, dirs, odd };
}

/** A bundle from archive bytes (.tar, or gzip-compressed). */
export async function fromArchive(bytes) {
  const raw = bytes[0] === 0x1f && bytes[1] === 0x8b ? await gunzip(bytes) : bytes;
  return toBundle(untar(raw));
}

/** A bundle from a dropped directory entry (webkitGetAsEntry). */
export async function fromDirectoryEntry(root) {
  const entries = [];
  async function walk(dir, prefix) {
    const reader = dir.createReader();
    for (;;) {
      const batch = await new Promise((ok, bad) => reader.readEntries(ok, bad));
      if (!batch.length) break;
      for (const e of batch) {
        const name = prefix + e.name;
        if (e.isDirectory) { entries.push({ name, type: "5" }); await walk(e, name + "/"); }
        else {
          const file = await new Promise((ok, bad) => e.file(ok, bad));
          entries.push({ name, type: "0", body: new Uint8Array(await file.arrayBuffer()) });
        }
      }
    }
  }
  await walk(root, "");
  return toBundle(entries);
}

/** A bundle from an <input webkitdirectory> FileList (paths start with the chosen folder's name). */
export async function fromFileList(list) {
  const entries = [];
  for (const file of list) entries.push({ name: file.webkitRelativePath || file.name, type: "0", body: new Uint8Array(await file.arrayBuffer()) });
  return toBundle(entries);
}
