"""The browser verifier (web/dist/verify.html) against ``cvm-tune verify --json``, check by check, in headless Chromium.

The page is rebuilt from web/ in a scratch copy (``npm ci --prefer-offline``: the packages come from npm's cache,
which the README's test command fills through requirements/test-tools.sh) and must be byte-identical to the committed
file; the committed page is then served from a loopback server with each bundle as a .tar.gz and driven by Debian's
chromium through playwright-core (web/test/drive.mjs: one browser for the whole module).

Corpus covered here: the demo bundle (a dstack 0.6 simulator run with a model signature, GPU evidence and one
checkpoint, anchored in audit-anchors.jsonl) and a tampered copy for every file the manifest binds, every attestation
file and the bundle's layout, under the simulator's test policy; copies whose anchors break one rule of
verifier-spec section 4a each, re-quoted by the same simulator CVM so that only the anchors decide, and the policies
that require anchors or RTMR3; the demo bundle under the default policy; the committed sample bundle
(tests/data/bundle: a bundle from before model signatures, the second run of an audit chain); the committed
training-API checkpoint (tests/data/api-bundle) with its ops record, with changed records, without one, and with its op-chain head changed.
For each, the page's verdict and every check's name and status equal the Python verifier's, and the page asked for
nothing but the page and the files named in its URL.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

import pytest

from tests.loopback_http import Server, send
from tests.test_audit_anchors import reattest

REPO = Path(__file__).resolve().parent.parent
WEB = REPO / "web"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SAMPLE = REPO / "tests" / "data" / "bundle"
SAMPLE_POLICY = REPO / "tests" / "data" / "bundle-policy.yaml"
NOW = 1795853312  # inside the simulator collateral's window (2020..2099); both verifiers get the same time
PAGE_BUDGET_MS = 2000  # the demo bundle, verified in the page
API = REPO / "tests" / "data" / "api-bundle"  # a training-API checkpoint (same simulator root as the sample bundle)
API_OPS = REPO / "tests" / "data" / "api-bundle-ops.jsonl"  # the client's record of its four ops
CUSTOM = REPO / "tests" / "data" / "api-custom-bundle"  # a checkpoint trained with a server-side custom loss
CUSTOM_OPS = REPO / "tests" / "data" / "api-custom-bundle-ops.jsonl"
API_OPS_CASES: dict[str, Callable[[list[str]], list[str]]] = {
    "its ops": lambda ops: ops,
    "an op dropped": lambda ops: ops[:-1],
    "a token changed": lambda ops: [ops[0].replace("[1, 5, 9, 14, 3]", "[1, 5, 9, 14, 4]", 1), *ops[1:]],
    "a learning rate changed": lambda ops: [ops[0], ops[1].replace('"learning_rate": 0.01', '"learning_rate": 0.02'),
                                            *ops[2:]],
}

pytestmark = pytest.mark.skipif(shutil.which("node") is None or not Path(CHROMIUM).exists(),
                                reason="needs node and Debian's chromium (sh requirements/test-tools.sh installs both)")


# --- the page, rebuilt ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def web_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """web/'s tracked sources in a scratch directory, with its locked packages installed from npm's cache."""
    dst = tmp_path_factory.mktemp("web") / "web"
    tracked = subprocess.run(["git", "ls-files", "-z", "web"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        (dst.parent / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, dst.parent / rel)
    npm = subprocess.run(["npm", "ci", "--prefer-offline", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=dst,
                         capture_output=True, text=True)
    assert npm.returncode == 0, f"npm ci failed (fill npm's cache: sh requirements/test-tools.sh)\n{npm.stderr[-2000:]}"
    return dst


def test_a_fresh_build_reproduces_the_committed_page(web_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "verify.html"
    subprocess.run(["node", "build.mjs", str(out)], cwd=web_copy, check=True, capture_output=True)
    assert out.read_bytes() == (WEB / "dist" / "verify.html").read_bytes(), "rebuild it: cd web && npm run build"


def test_the_page_is_self_contained_and_allows_same_origin_fetches_only() -> None:
    html = (WEB / "dist" / "verify.html").read_text(encoding="utf-8")
    csp = html.split('http-equiv="Content-Security-Policy" content="', 1)[1].split('"', 1)[0]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'" and directives["connect-src"] == "'self'"
    assert directives["script-src"].startswith("'sha256-") and directives["style-src"].startswith("'sha256-")
    assert "http://" not in html.split("<script>", 1)[0] and "https://" not in html.split("<script>", 1)[0]
    assert html.count("<script") == 1 and "<link" not in html and " src=" not in html.split("<script>", 1)[0]


# --- serving and driving ----------------------------------------------------------------------------------------------


class Site:
    """A loopback HTTP server for one directory: the page and the corpus (archives, policies, ops files)."""

    def __init__(self, root: Path) -> None:
        self.root = root

        def route(h: Any, _stop: Any) -> None:
            path = (root / urlparse(h.path).path.lstrip("/")).resolve()
            if root in path.parents and path.is_file():
                kind = "text/html; charset=utf-8" if path.suffix == ".html" else "application/octet-stream"
                send(h, 200, path.read_bytes(), Content_Type=kind)
            else:
                send(h, 404)

        self.server = Server(route)

    def url(self, bundle: str, policy: str | None, ops: str | None = None) -> str:
        named = {"bundle": bundle, "policy": policy, "ops": ops}
        return f"{self.server.url}/verify.html?now={NOW}" + "".join(f"&{k}={quote(v)}" for k, v in named.items() if v)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("site").resolve()
    shutil.copyfile(WEB / "dist" / "verify.html", root / "verify.html")
    s = Site(root)
    yield s
    s.server.close()


def drive(web_copy: Path, pages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Open each page in one headless Chromium (web/test/drive.mjs) and return what each showed."""
    env = {**os.environ, "CHROMIUM": CHROMIUM}
    proc = subprocess.run(["node", str(web_copy / "test" / "drive.mjs")], capture_output=True, text=True, env=env,
                          input=json.dumps({"pages": pages, "timeout_ms": 60000}), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def python_verdict(bundle: Path, policy: Path | None, ops: Path | None = None) -> tuple[dict[str, Any], float]:
    """``cvm-tune verify BUNDLE [--policy P] [--ops OPS] --now NOW --json`` in this process: (verdict, seconds)."""
    from app.cli import main

    args = ["verify", str(bundle), "--now", str(NOW), "--json"] + (["--policy", str(policy)] if policy else []) \
        + (["--ops", str(ops)] if ops else [])
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(args)
    return json.loads(out.getvalue()), time.perf_counter() - start


def pack(src: Path, dst: Path) -> None:
    """``dst`` (.tar.gz) of the bundle directory ``src`` under one top folder, symlinks and empty folders kept."""
    with tarfile.open(dst, "w:gz") as tar:
        tar.add(src, arcname=src.name)


def packed_cases(cases: list[tuple[str, str, Callable[[Path], None] | None]], bundles: dict[str, tuple[Path, Path]],
                 site: Site, work: Path, prefix: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each case (kind, name, edit) on ``site``: ``bundles[kind]`` (bundle, policy), or a copy ``edit`` changed, as
    ``PREFIX-NN.tar.gz`` with its policy; (the pages to open, cvm-tune's verdict on each)."""
    pages, pythons = [], []
    for i, (kind, _name, edit) in enumerate(cases):
        bundle, policy = bundles[kind]
        if edit is not None:
            copy = work / f"{i:02d}" / bundle.name
            shutil.copytree(bundle, copy, symlinks=True)
            edit(copy)
            bundle = copy
        shutil.copyfile(policy, site.root / f"{prefix}-{i:02d}.yaml")
        pack(bundle, site.root / f"{prefix}-{i:02d}.tar.gz")
        pythons.append(python_verdict(bundle, policy)[0])
        pages.append({"url": site.url(f"{prefix}-{i:02d}.tar.gz", f"{prefix}-{i:02d}.yaml")})
    return pages, pythons


def same_checks(page: dict[str, Any], py: dict[str, Any], case: str) -> None:
    """The page agrees with ``cvm-tune verify --json``: verdict, and every check's name and status, in order."""
    assert page["errors"] == [], f"{case}: {page['errors']}"
    v = page["verdict"]
    assert v is not None, f"{case}: no verdict"
    want = [(c["name"], c["status"]) for c in py["checks"]]
    got = [(c["name"], c["status"]) for c in v["checks"]]
    assert got == want, f"{case}: page {got} != cvm-tune {want}\npage reasons: " + "; ".join(
        f"{c['name']}: {c['reason']}" for c in v["checks"] if c["status"] == "fail")
    assert v["verdict"] == py["verdict"] == page["body_verdict"], case
    assert "not_checked" not in v, f"{case}: the page could not run {v.get('not_checked')}"
    for key in ("schema", "policy", "test_root", "now", "tcb_status", "advisory_ids", "measurements", "replayed_rtmrs",
                "compose_hash", "app_id", "quote_hex", "bundle", "collateral", "tcb_date"):
        assert v[key] == py[key], f"{case}: {key}: page {v[key]!r} != cvm-tune {py[key]!r}"


def only_named_files(page: dict[str, Any]) -> None:
    """The page asked for itself and the files its URL names, nothing else."""
    url = urlparse(page["url"])
    query = dict(p.split("=", 1) for p in url.query.split("&"))
    named = {f"{url.scheme}://{url.netloc}{url.path}"} | {
        f"{url.scheme}://{url.netloc}/{query[k]}" for k in ("bundle", "policy", "ops") if k in query}
    asked = {r.split("?", 1)[0] for r in page["requests"]}
    assert asked <= named, f"unexpected requests: {asked - named}"


# --- the demo bundle and its tampered copies ------------------------------------------------------------------------


def _flip(rel: str, at: int = -1) -> Callable[[Path], None]:
    def edit(b: Path) -> None:
        data = bytearray((b / rel).read_bytes())
        data[at] ^= 0x01
        (b / rel).write_bytes(bytes(data))
    return edit


def _json_edit(rel: str, change: Callable[[Any], None]) -> Callable[[Path], None]:
    def edit(b: Path) -> None:
        doc = json.loads((b / rel).read_bytes())
        change(doc)
        (b / rel).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return edit


def _quote(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    """Change quote.bin and write quote.hex to match (so only the quote's own checks see the change)."""
    def apply(b: Path) -> None:
        raw = edit((b / "quote.bin").read_bytes())
        (b / "quote.bin").write_bytes(raw)
        (b / "quote.hex").write_text(raw.hex() + "\n")
    return apply


def _flipped(at: int) -> Callable[[bytes], bytes]:
    return lambda raw: raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:]


def _audit_edit(b: Path) -> None:
    lines = (b / "audit.jsonl").read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"seq":1', b'"seq":7')
    (b / "audit.jsonl").write_bytes(b"\n".join(lines))


def _event_payload(b: Path) -> None:
    log = json.loads((b / "event_log.json").read_text())
    # dstack 0.5 bundles: the cvm-tune.export audit event; dstack 0.6 (no EmitEvent): the last boot event with a payload
    rtmr3 = [e for e in log if e["imr"] == 3 and e["event_payload"]]
    ev = next((e for e in reversed(rtmr3) if e["event"] == "cvm-tune.export"), rtmr3[-1])
    ev["event_payload"] = ev["event_payload"][:-2] + ("00" if ev["event_payload"][-2:] != "00" else "01")
    (b / "event_log.json").write_text(json.dumps(log))


def _boot_digest(b: Path) -> None:
    log = json.loads((b / "event_log.json").read_text())
    ev = next(e for e in log if e["imr"] == 0 and e["digest"])
    ev["digest"] = ("00" if ev["digest"][:2] != "00" else "11") + ev["digest"][2:]
    (b / "event_log.json").write_text(json.dumps(log))


def _tcb_info(b: Path) -> None:
    c = json.loads((b / "collateral.json").read_text())
    c["tcb_info"] = c["tcb_info"].replace('"tcbEvaluationDataNumber":', '"tcbEvaluationDataNumber": ', 1)
    (b / "collateral.json").write_text(json.dumps(c))


def _manifest_field(b: Path) -> None:
    text = (b / "manifest.json").read_text()
    m = json.loads(text)
    rows = m["dataset"]["rows"]
    (b / "manifest.json").write_text(text.replace(f'"rows": {rows}', f'"rows": {rows + 1}', 1))


def _symlink(b: Path) -> None:
    (b / "README.md").unlink()
    (b / "README.md").symlink_to("config.json")


TAMPERS: dict[str, Callable[[Path], None]] = {
    "adapter weights": _flip("adapter/adapter_model.safetensors", 100),
    "adapter config": _flip("adapter/adapter_config.json", 5),
    "tokenizer": _flip("adapter/tokenizer.json", 10),
    "model signature": _json_edit("adapter/model.sig", lambda d: d["dsseEnvelope"]["signatures"][0].update(
        sig=base64.b64encode(base64.b64decode(d["dsseEnvelope"]["signatures"][0]["sig"])[:-1] + b"\x01").decode())),
    "config": _flip("config.json", 3),
    "app-compose": _flip("app-compose.json", 3),
    "model card": _flip("README.md", 3),
    "audit log": _audit_edit,
    "gpu evidence": _flip("gpu-evidence.json", 20),
    "run report": _flip("report/report.json", 30),
    "loss plot": _flip("report/loss.png", 200),
    "manifest field": _manifest_field,
    "quote report_data": _quote(_flipped(600)),
    "quote RTMR3": _quote(_flipped(530)),
    "quote signature": _quote(_flipped(650)),
    "quote PCK chain": _quote(lambda raw: raw.replace(b"CERTIFICATE-----\nMII", b"CERTIFICATE-----\nMIJ", 1)),
    "quote padding": _quote(lambda raw: raw + b"\x01"),
    "quote.hex": _flip("quote.hex", 8),
    "event payload": _event_payload,
    "boot digest": _boot_digest,
    "collateral tcb_info": _tcb_info,
    "collateral removed": lambda b: (b / "collateral.json").unlink(),
    "file added": lambda b: (b / "adapter" / "extra.bin").write_bytes(b"x"),
    "file removed": lambda b: (b / "report" / "loss.png").unlink(),
    "empty folder": lambda b: (b / "merged").mkdir(),
    "symlink": _symlink,
    "audit anchors": _flip("audit-anchors.jsonl", -3),  # "v":1 -> "v":0
    "audit anchors removed": lambda b: (b / "audit-anchors.jsonl").unlink(),
    "audit anchors count": _json_edit("manifest.json", lambda m: m["audit"].update(anchors=m["audit"]["anchors"] + 1)),
    "audit anchors true": _json_edit("manifest.json", lambda m: m["audit"].update(anchors=True)),  # not a JSON integer
    "audit first_seq a string": _json_edit("manifest.json",
                                           lambda m: m["audit"].update(first_seq=str(m["audit"]["first_seq"]))),
    "audit anchors unlisted": _json_edit("manifest.json", lambda m: (m["audit"].update(anchors=None),
                                                                     m["files"].pop("audit-anchors.jsonl"))),
}


# --- audit anchors (verifier-spec section 4a): the demo bundle's one checkpoint is anchored --------------------------
# Cases that change audit-anchors.jsonl and then make the manifest, quote and event log consistent again (re-signed by
# the embedded simulator, the CVM that made the demo bundle: same secret, same TD), so the anchors' own rules decide.

POLICIES = {"anchors-required.yaml": ("require_audit_anchors: false", "require_audit_anchors: true"),
            "rtmr3-required.yaml": ("require_rtmr3_audit: false", "require_rtmr3_audit: true")}


def _sim(**changes: Any) -> Any:
    from app.simulator import GuestAgentSimulator, SimulatorSettings

    return GuestAgentSimulator(SimulatorSettings(**changes))


def _entries(b: Path) -> list[Any]:
    from attestation.bundle.audit import parse_lines

    return parse_lines((b / "audit.jsonl").read_bytes())


def _entry(b: Path, kind: str) -> Any:
    return next(e for e in _entries(b) if e.type == kind)


def _anchor_lines(b: Path) -> list[bytes]:
    return (b / "audit-anchors.jsonl").read_bytes().split(b"\n")[:-1]


def _anchor(entry: Any, sim: Any = None, **override: Any) -> bytes:
    """The canonical anchor line of ``entry``, quoted by ``sim`` (the demo's simulator CVM), members overridden."""
    from attestation.bundle.anchors import report_data
    from attestation.io.hashing import canonical_json

    answer = (sim or _sim()).get_quote(report_data(entry.seq, entry.hash))
    return canonical_json({"v": 1, "seq": entry.seq, "head": entry.hash, "quote": answer["quote"],
                           "event_log": answer["event_log"], **override})


def _anchored(lines: Callable[[Path], list[bytes]], count: int | None = None) -> Callable[[Path], None]:
    return lambda b: reattest(b, b"".join(line + b"\n" for line in lines(b)), count)


OTHER_APP = json.dumps({"manifest_version": 2, "name": "another-app", "runner": "docker-compose",
                        "docker_compose_file": "services: {}\n"})

# name -> (edit of a copy of the demo bundle or None, policy, verdict, audit.anchors status)
ANCHOR_CASES: dict[str, tuple[Callable[[Path], None] | None, str, str, str]] = {
    "as made, require_audit_anchors": (None, "anchors-required.yaml", "accepted", "pass"),
    "as made, require_rtmr3_audit": (None, "rtmr3-required.yaml", "rejected", "pass"),
    "re-quoted as made": (_anchored(_anchor_lines), "simulator-policy.yaml", "accepted", "pass"),
    "unanchored": (lambda b: reattest(b, None), "simulator-policy.yaml", "accepted", "skip"),
    "unanchored, require_audit_anchors": (lambda b: reattest(b, None), "anchors-required.yaml", "rejected", "fail"),
    "measured into RTMR3 and anchored": (
        lambda b: reattest(b, (b / "audit-anchors.jsonl").read_bytes(),
                            change=lambda m: m["audit"].update(rtmr3="emit_event")),
        "simulator-policy.yaml", "rejected", "pass"),
    "measured into RTMR3, unanchored": (
        lambda b: reattest(b, None, change=lambda m: m["audit"].update(rtmr3="emit_event")),
        "anchors-required.yaml", "rejected", "skip"),
    "no anchor for the checkpoint": (_anchored(lambda b: []), "simulator-policy.yaml", "rejected", "fail"),
    "the checkpoint anchored twice": (_anchored(lambda b: _anchor_lines(b) * 2), "simulator-policy.yaml", "rejected",
                                      "fail"),
    "an anchor names another entry's hash": (
        _anchored(lambda b: [_anchor(_entry(b, "checkpoint"), head=_entry(b, "run.start").hash)]),
        "simulator-policy.yaml", "rejected", "fail"),
    "run.start anchored too": (_anchored(lambda b: [_anchor(_entry(b, "run.start")), *_anchor_lines(b)]),
                               "simulator-policy.yaml", "rejected", "fail"),
    "the quote of another entry": (
        _anchored(lambda b: [_anchor(_entry(b, "checkpoint"),
                                     quote=json.loads(_anchor(_entry(b, "run.start")))["quote"])]),
        "simulator-policy.yaml", "rejected", "fail"),
    "its event log emptied": (_anchored(lambda b: [_anchor(_entry(b, "checkpoint"), event_log="[]")]),
                              "simulator-policy.yaml", "rejected", "fail"),
    "its event log not JSON": (_anchored(lambda b: [_anchor(_entry(b, "checkpoint"), event_log="x")]),
                               "simulator-policy.yaml", "rejected", "fail"),
    "its event log with a BOM": (
        _anchored(lambda b: [_anchor(_entry(b, "checkpoint"),
                                     event_log="\ufeff" + json.loads(_anchor_lines(b)[0])["event_log"])]),
        "simulator-policy.yaml", "rejected", "fail"),
    "the quote of another deployment": (
        _anchored(lambda b: [_anchor(_entry(b, "checkpoint"), _sim(app_compose=OTHER_APP))]),
        "simulator-policy.yaml", "rejected", "fail"),
    "the quote of a reboot with a new app key epoch": (
        _anchored(lambda b: [_anchor(_entry(b, "checkpoint"), _sim(app_epoch=1))]),
        "simulator-policy.yaml", "accepted", "pass"),
    "the quote of a TD with a GPU": (_anchored(lambda b: [_anchor(_entry(b, "checkpoint"), _sim(gpu=True))]),
                                     "simulator-policy.yaml", "accepted", "pass"),
    "the quote of a dstack 0.5 TD": (_anchored(lambda b: [_anchor(_entry(b, "checkpoint"), _sim(dstack="0.5"))]),
                                     "simulator-policy.yaml", "rejected", "fail"),
    "a line not canonical": (_anchored(lambda b: [_anchor_lines(b)[0].replace(b'"v":1', b'"v": 1')]),
                             "simulator-policy.yaml", "rejected", "fail"),
    "a line with a BOM": (_anchored(lambda b: [b"\xef\xbb\xbf" + _anchor_lines(b)[0]]), "simulator-policy.yaml",
                          "rejected", "fail"),
    "a line with v 2": (_anchored(lambda b: [_anchor(_entry(b, "checkpoint"), v=2)]), "simulator-policy.yaml",
                        "rejected", "fail"),
    "an empty line": (_anchored(lambda b: [*_anchor_lines(b), b""]), "simulator-policy.yaml", "rejected", "fail"),
    "no final newline": (lambda b: reattest(b, (b / "audit-anchors.jsonl").read_bytes()[:-1], 1),
                         "simulator-policy.yaml", "rejected", "fail"),
    "the manifest counts two": (_anchored(_anchor_lines, count=2), "simulator-policy.yaml", "rejected", "fail"),
}


@pytest.fixture(scope="module")
def corpus(demo_bundle: tuple[Path, Path], site: Site, tmp_path_factory: pytest.TempPathFactory
           ) -> list[dict[str, Any]]:
    """Each case: its name, the page URL, and cvm-tune's verdict on the same bytes."""
    bundle, policy = demo_bundle
    work = tmp_path_factory.mktemp("corpus")
    shutil.copyfile(policy, site.root / "simulator-policy.yaml")
    shutil.copyfile(SAMPLE_POLICY, site.root / "sample-policy.yaml")
    for name, (was, now) in POLICIES.items():
        text = policy.read_text()
        assert text.count(was) == 1, f"{policy} has no single '{was}' line"
        (site.root / name).write_text(text.replace(was, now))
    cases = []

    def add(name: str, src: Path, policy_name: str | None, ops: str | None = None) -> None:
        arc = f"{len(cases):02d}.tar.gz"
        pack(src, site.root / arc)
        py, seconds = python_verdict(src, site.root / policy_name if policy_name else None, ops and site.root / ops)
        cases.append({"name": name, "url": site.url(arc, policy_name, ops), "python": py, "python_s": seconds})

    add("demo", bundle, "simulator-policy.yaml")
    add("demo, default policy", bundle, None)
    add("sample bundle", SAMPLE, "sample-policy.yaml")
    ops = API_OPS.read_text().splitlines(keepends=True)
    for name, lines in API_OPS_CASES.items():
        (site.root / f"ops-{len(cases):02d}.jsonl").write_text("".join(lines(ops)))
        add(f"api checkpoint, {name}", API, "sample-policy.yaml", f"ops-{len(cases):02d}.jsonl")
    add("api checkpoint, no ops", API, "sample-policy.yaml")
    changed = work / "api-head" / API.name
    shutil.copytree(API, changed)
    _json_edit("manifest.json", lambda m: m["op_chain"].update(head="0" * 64))(changed)
    add("api checkpoint, op chain head in the manifest", changed, "sample-policy.yaml")
    shutil.copyfile(CUSTOM_OPS, site.root / "custom-ops.jsonl")
    add("custom loss, its ops", CUSTOM, "sample-policy.yaml", "custom-ops.jsonl")
    other = work / "custom-doc" / CUSTOM.name
    shutil.copytree(CUSTOM, other)
    _json_edit("manifest.json", lambda m: next(iter(m["op_chain"]["custom_losses"].values())).update(name="x"))(other)
    add("custom loss, its document changed in the manifest", other, "sample-policy.yaml", "custom-ops.jsonl")
    sample_event = work / "sample-event" / SAMPLE.name  # a dstack 0.5 bundle: its cvm-tune.export event changed
    shutil.copytree(SAMPLE, sample_event)
    _event_payload(sample_event)
    add("sample bundle, export event payload", sample_event, "sample-policy.yaml")
    for name, edit in TAMPERS.items():
        copy = work / name.replace(" ", "-") / bundle.name
        shutil.copytree(bundle, copy, symlinks=True)
        edit(copy)
        add(f"tampered: {name}", copy, "simulator-policy.yaml")
    for name, (edit, policy_name, _verdict, _status) in ANCHOR_CASES.items():
        src = bundle
        if edit is not None:
            src = work / f"anchors-{len(cases):02d}" / bundle.name
            shutil.copytree(bundle, src, symlinks=True)
            edit(src)
        add(f"anchors: {name}", src, policy_name)
    return cases


@pytest.fixture(scope="module")
def shown(web_copy: Path, corpus: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pages = drive(web_copy, [{"url": c["url"]} for c in corpus])
    return {c["name"]: {**p, "python": c["python"], "python_s": c["python_s"]}
            for c, p in zip(corpus, pages, strict=True)}


def test_the_demo_bundle_is_accepted_with_the_simulator_warning(shown: dict[str, dict[str, Any]]) -> None:
    page = shown["demo"]
    same_checks(page, page["python"], "demo")
    assert page["verdict"]["verdict"] == "accepted" and page["verdict"]["test_root"] is True
    print(f"\ndemo bundle: verified in {page['ms']:.0f} ms in the page in headless Chromium ({page['loaded_ms']:.0f} ms "
          f"from opening the page), cvm-tune verify {page['python_s'] * 1000:.0f} ms in-process")
    assert page["loaded_ms"] <= PAGE_BUDGET_MS
    # its run wrote a checkpoint (save_steps = max_steps), which the dstack 0.6 simulator anchored
    anchors = _reason(page["verdict"], "audit.anchors")
    assert anchors == _reason(page["python"], "audit.anchors")
    assert anchors == ("pass", "1 checkpoint(s) anchored by quotes of this TD")


def _reason(verdict: dict[str, Any], name: str) -> tuple[str, str]:
    """(status, reason) of the check ``name`` in a verdict (the page's or cvm-tune's)."""
    return next((c["status"], c["reason"]) for c in verdict["checks"] if c["name"] == name)


@pytest.mark.parametrize("case", list(ANCHOR_CASES))
def test_audit_anchors_get_the_same_checks_and_reasons(shown: dict[str, dict[str, Any]], case: str) -> None:
    """Re-quoted bundles whose anchors break one rule of section 4a (or none), and the policies that require
    anchors or RTMR3: the same checks, and audit.anchors with the same status and reason."""
    page = shown[f"anchors: {case}"]
    same_checks(page, page["python"], case)
    _edit, _policy, verdict, status = ANCHOR_CASES[case]
    assert page["verdict"]["verdict"] == verdict
    assert _reason(page["verdict"], "audit.anchors") == _reason(page["python"], "audit.anchors")
    assert _reason(page["verdict"], "audit.anchors")[0] == status
    failed = {c["name"] for c in page["python"]["checks"] if c["status"] == "fail"}
    assert failed <= {"audit.anchors", "audit.rtmr3"}, f"{case}: the case is not about anchors alone: {failed}"


@pytest.mark.parametrize("case", ["demo, default policy", "sample bundle", "api checkpoint, no ops",
                                  *(f"api checkpoint, {name}" for name in API_OPS_CASES),
                                  "api checkpoint, op chain head in the manifest", "custom loss, its ops",
                                  "custom loss, its document changed in the manifest"])
def test_untampered_bundles_and_ops_files_agree(shown: dict[str, dict[str, Any]], case: str) -> None:
    same_checks(shown[case], shown[case]["python"], case)
    accepted = case in ("sample bundle", "api checkpoint, no ops", "api checkpoint, its ops", "custom loss, its ops")
    assert shown[case]["verdict"]["verdict"] == ("accepted" if accepted else "rejected")


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_every_tamper_is_rejected_by_the_same_checks(shown: dict[str, dict[str, Any]], case: str) -> None:
    page = shown[f"tampered: {case}"]
    same_checks(page, page["python"], case)
    assert page["verdict"]["verdict"] == "rejected"


def test_a_changed_audit_event_of_a_05_bundle_is_rejected_by_the_same_checks(shown: dict[str, dict[str, Any]]) -> None:
    """The demo bundle is dstack 0.6's (no app events in RTMR3); the sample bundle keeps 0.5's ``cvm-tune.export``."""
    page = shown["sample bundle, export event payload"]
    same_checks(page, page["python"], "sample bundle, export event payload")
    assert page["verdict"]["verdict"] == "rejected"
    assert {c["name"]: c["status"] for c in page["python"]["checks"]}["event_log.replay"] == "fail"


def _units(web: Path, *calls: tuple[str, list[Any]]) -> list[Any]:
    """The page's functions run by node on the modules it bundles (web/test/units.mjs): one result per call."""
    out = subprocess.run(["node", str(web / "test" / "units.mjs")], input=json.dumps(calls), capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout)


_H = "a" * 64
_GOOD = b'{"event_log":"[]","head":"' + _H.encode() + b'","quote":"00","seq":1,"v":1}'
ANCHOR_BODIES = [
    b"", _GOOD + b"\n", _GOOD + b"\n" + _GOOD.replace(b'"seq":1', b'"seq":2') + b"\n", _GOOD, b"\n", b"x\n" * 10_001,
    _GOOD.replace(b'"seq":1', b'"seq":1180591620717411303424') + b"\n",  # 2**70: Python's int, the page's BigInt
    *(line + b"\n" for line in [
        _GOOD.replace(b'"v":1}', b'"v":1,"x":0}'), _GOOD.replace(b'"event_log":', b'"event_log": '),
        _GOOD.replace(_H.encode(), _H.upper().encode()), _GOOD.replace(b'"00"', b'"0"'), _GOOD.replace(b'"00"', b'""'),
        _GOOD.replace(b'"00"', b'"0x00"'), _GOOD.replace(b'"seq":1', b'"seq":-1'),
        _GOOD.replace(b'"seq":1', b'"seq":true'), _GOOD.replace(b'"seq":1', b'"seq":1.0'),
        _GOOD.replace(b'"seq":1', b'"seq":1e0'), _GOOD.replace(b'"seq":1', b'"seq":"1"'),
        _GOOD.replace(b'"v":1', b'"v":1.0'), _GOOD.replace(b'"v":1', b'"v":true'), _GOOD.replace(b'"v":1', b'"v":2'),
        _GOOD.replace(b'"[]"', b"[]"), _GOOD.replace(b'{"event_log":"[]",', b'{"event_log":"[]","event_log":"[]",'),
        _GOOD.replace(b'"v":1}', b'"v":1} '), b"\xef\xbb\xbf" + _GOOD, b"\xff", b"[]", b"null",
        _GOOD.replace(b'"[]"', '"é"'.encode()), _GOOD.replace(b'"[]"', b'"\\u00e9"'),
        _GOOD.replace(b'"[]"', b'"\\u0001"'), _GOOD.replace(b'"[]"', '"\U0001f600"'.encode()),
        _GOOD.replace(b'"[]"', b'"\\ud83d\\ude00"'), _GOOD.replace(b'"[]"', b'"\\""'),
    ])]


def test_anchor_files_are_read_as_cvm_tune_reads_them(web_copy: Path) -> None:
    """audit-anchors.jsonl bodies (canonical lines, exact members and types, hex rules, the final newline, at most
    10,000 lines): the page reads the same anchors, or refuses with cvm-tune's reason."""
    from attestation.bundle.anchors import AnchorFormatError, parse_anchor_lines

    def python(body: bytes) -> Any:
        try:
            return [[str(a.seq), a.head, a.quote.hex(), a.event_log] for a in parse_anchor_lines(body)]
        except AnchorFormatError as exc:
            return {"error": str(exc)}

    got = _units(web_copy, *(("anchorLines", [base64.b64encode(b).decode()]) for b in ANCHOR_BODIES))
    for body, page in zip(ANCHOR_BODIES, got, strict=True):
        assert page == python(body), body[:200]


def _audit_line(seq: int, kind: str) -> bytes:
    from attestation.io.hashing import canonical_json

    return canonical_json({"data": {}, "prev": "0" * 64, "run_id": "r", "seq": seq, "time": "2026-12-06T12:00:00Z",
                           "type": kind, "v": 1})


def test_the_anchor_rules_are_cvm_tunes(web_copy: Path) -> None:
    """anchor_problems on a slice with checkpoint and promote entries, each anchor quote's check result given (what
    verify_quote found): the same problems in the same order, and the same quotes checked against the same
    report_data (SHA-512 of "cvm-tune-audit-anchor-v1:" seq ":" head)."""
    from attestation.bundle.anchors import anchor_problems, parse_anchor_lines
    from attestation.bundle.audit import parse_lines
    from attestation.io.hashing import canonical_json

    audit = b"".join(_audit_line(s, t) + b"\n" for s, t in
                     [(5, "run.start"), (6, "checkpoint"), (7, "promote"), (8, "checkpoint"), (9, "export")])
    hashes = {e.seq: e.hash for e in parse_lines(audit)}
    td = {k: "11" * 48 for k in ("mr_td", "mr_config_id", "mr_owner", "mr_owner_config", "td_attributes", "xfam",
                                 "rt_mr0", "rt_mr1", "rt_mr2")}
    boot = {"app-id": "22", "compose-hash": "33", "instance-id": "44", "os-image-hash": "55", "key-provider": None}
    ok = [[], td, boot]
    other = [["quote.signature", "report_data", "event_log.replay"], {**td, "mr_td": "00", "rt_mr2": None},
             {**boot, "instance-id": "45", "key-provider": "aa"}]

    def lines(*anchors: tuple[int, str, str]) -> bytes:
        return b"".join(canonical_json({"v": 1, "seq": seq, "head": head, "quote": quote, "event_log": "[]"}) + b"\n"
                        for seq, head, quote in anchors)

    cases = [
        (lines((6, hashes[6], "06"), (7, hashes[7], "07"), (8, hashes[8], "08")), {"06": ok, "07": ok, "08": ok}),
        (lines((6, hashes[6], "06"), (7, hashes[7], "07")), {"06": ok, "07": ok}),
        (lines((8, hashes[8], "08"), (6, hashes[6], "06")), {"06": ok, "08": ok}),
        (lines((6, hashes[6], "06"), (8, hashes[8], "08"), (9, hashes[9], "09")), {"06": ok, "08": ok}),
        (lines((6, hashes[5], "06"), (8, hashes[8], "08"), (2**70, hashes[8], "ff")), {"08": ok}),
        (lines((6, hashes[6], "06"), (6, hashes[6], "06"), (8, hashes[8], "08")), {"06": ok, "08": other}),
        (lines((5, hashes[5], "05"), (7, hashes[7], "07")), {"07": other}),
        (b"", {}),
    ]
    main = (["quote.signature", "collateral.chains"], td, boot)
    calls = [("anchorProblems", [base64.b64encode(body).decode(), base64.b64encode(audit).decode(), results, *main])
             for body, results in cases]
    for (body, results), page in zip(cases, _units(web_copy, *calls), strict=True):
        asked: list[list[str]] = []

        def check(raw: bytes, _log: str, expected: bytes, results: dict[str, Any] = results,
                  asked: list[list[str]] = asked) -> tuple[set[str], dict[str, Any], dict[str, Any]]:
            asked.append([raw.hex(), expected.hex()])
            failed, t, b = results[raw.hex()]
            return set(failed), t, b

        problems = anchor_problems(parse_anchor_lines(body), parse_lines(audit), check, main_failed=set(main[0]),
                                   main_td=main[1], main_boot=main[2])
        assert page == {"problems": problems, "asked": asked}, body


def test_the_page_asks_for_nothing_but_the_named_files(shown: dict[str, dict[str, Any]]) -> None:
    for page in shown.values():
        only_named_files(page)


def test_random_bit_flips_get_the_same_checks(web_copy: Path, demo_bundle: tuple[Path, Path], tmp_path: Path) -> None:
    """One flipped bit anywhere (mostly in the files with parsers of their own): the page's verifier, run by node on
    the modules it bundles, and cvm-tune verify give every check the same status (a fixed seed: reproducible)."""
    import random

    bundle, _policy = demo_bundle
    rnd = random.Random(36)
    parsed = ["quote.bin", "event_log.json", "collateral.json", "audit.jsonl", "manifest.json", "gpu-evidence.json",
              "adapter/model.sig", "quote.hex"]
    every = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
    flips = []
    for i in range(120):
        name = rnd.choice(parsed if i % 4 else every)
        flips.append((name, rnd.randrange((bundle / name).stat().st_size), 1 << rnd.randrange(8)))
    _flips_agree(web_copy, demo_bundle, flips, tmp_path)


def test_random_bit_flips_in_the_audit_anchors_get_the_same_checks(web_copy: Path, demo_bundle: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    """The same in audit-anchors.jsonl: a flipped bit in its JSON, its quote's hex or its event log."""
    import random

    rnd = random.Random(4)
    size = (demo_bundle[0] / "audit-anchors.jsonl").stat().st_size
    flips = [("audit-anchors.jsonl", rnd.randrange(size), 1 << rnd.randrange(8)) for _ in range(40)]
    _flips_agree(web_copy, demo_bundle, flips, tmp_path)


def _flips_agree(web_copy: Path, demo_bundle: tuple[Path, Path], flips: list[tuple[str, int, int]],
                 tmp_path: Path) -> None:
    bundle, policy = demo_bundle
    proc = subprocess.run(["node", str(web_copy / "test" / "mutate.mjs")], capture_output=True, text=True, timeout=300,
                          input=json.dumps({"bundle": str(bundle), "policy": policy.read_text(), "now": NOW,
                                            "flips": flips}), check=True)
    for (name, at, bit), page in zip(flips, json.loads(proc.stdout), strict=True):
        copy = tmp_path / f"{name.replace('/', '-')}-{at}-{bit}" / bundle.name
        shutil.copytree(bundle, copy)
        data = bytearray((copy / name).read_bytes())
        data[at] ^= bit
        (copy / name).write_bytes(bytes(data))
        py = [[c["name"], c["status"]] for c in python_verdict(copy, policy)[0]["checks"]]
        assert page == py, f"{name} byte {at} bit {bit}"
        shutil.rmtree(copy.parent)


def test_opened_from_disk_a_dropped_bundle_and_policy_are_verified(web_copy: Path, demo_bundle: tuple[Path, Path],
                                                                    tmp_path: Path) -> None:
    bundle, policy = demo_bundle
    pack(bundle, tmp_path / "bundle.tar.gz")
    shutil.copyfile(policy, tmp_path / "simulator-test-policy.yaml")
    shutil.copyfile(WEB / "dist" / "verify.html", tmp_path / "verify.html")
    dropped = [str(tmp_path / "bundle.tar.gz"), str(tmp_path / "simulator-test-policy.yaml")]
    [page] = drive(web_copy, [{"url": (tmp_path / "verify.html").as_uri(), "drop": dropped}])
    assert page["errors"] == [] and page["body_verdict"] == "accepted"
    assert page["verdict"]["policy"] == "cvm-tune-simulator-test-ca" and page["verdict"]["test_root"] is True
    assert [r for r in page["requests"] if not r.startswith("file://")] == []


def test_opened_from_disk_a_chosen_bundle_folder_is_verified(web_copy: Path, demo_bundle: tuple[Path, Path],
                                                             tmp_path: Path) -> None:
    """The other way in from disk: the policy and then the bundle folder chosen with the page's file inputs."""
    bundle, policy = demo_bundle
    shutil.copyfile(WEB / "dist" / "verify.html", tmp_path / "verify.html")
    [page] = drive(web_copy, [{"url": (tmp_path / "verify.html").as_uri(),
                               "pick": [["#pick-policy", [str(policy)]], ["#pick-folder", [str(bundle)]]]}])
    assert page["errors"] == [] and page["body_verdict"] == "accepted"
    assert [(c["name"], c["status"]) for c in page["verdict"]["checks"]] == [
        (c["name"], c["status"]) for c in python_verdict(bundle, policy)[0]["checks"]]


def test_a_round_bundle_without_its_files_is_rejected_as_cvm_tune_rejects_it(web_copy: Path, site: Site,
                                                                             tmp_path: Path) -> None:
    """A federated round bundle (round-manifest.json) is verified as one (tests/test_web_rounds.py has real rounds):
    one with nothing but a stub manifest fails the same checks in the page as in cvm-tune verify."""
    round_dir = tmp_path / "round-1"
    (round_dir / "adapter").mkdir(parents=True)
    (round_dir / "round-manifest.json").write_text(json.dumps({"schema": "cvm-tune/round-manifest/v1"}))
    pack(round_dir, site.root / "round.tar.gz")
    shutil.copyfile(SAMPLE_POLICY, site.root / "round-policy.yaml")
    [page] = drive(web_copy, [{"url": site.url("round.tar.gz", "round-policy.yaml")}])
    same_checks(page, python_verdict(round_dir, SAMPLE_POLICY)[0], "round stub")
    assert page["verdict"]["verdict"] == "rejected"
    assert [c["name"] for c in page["verdict"]["checks"]][:1] == ["round.schema"]


def test_a_url_load_names_the_policy_it_used_and_file_urls_say_what_to_do(web_copy: Path, corpus: list[dict[str, Any]],
                                                                          tmp_path: Path) -> None:
    """Loaded by URL, the inputs line names the policy the verdict was computed under (its file and its own name), not
    the built-in default; the built-in default is named as such. Opened from file://, a ?bundle= load cannot fetch:
    the page says to serve it over http(s) or drop the files, instead of the browser's bare "Failed to fetch"."""
    by_name = {c["name"]: c for c in corpus}
    shutil.copyfile(WEB / "dist" / "verify.html", tmp_path / "verify.html")
    local = (tmp_path / "verify.html").as_uri() + "?bundle=bundle.tar.gz&policy=policy.yaml"
    simulator, default, from_disk = drive(web_copy, [{"url": by_name["demo"]["url"], "text": "#in-policy"},
                                                     {"url": by_name["demo, default policy"]["url"], "text": "#in-policy"},
                                                     {"url": local}])
    name = simulator["verdict"]["policy"]
    assert name == by_name["demo"]["python"]["policy"] == "cvm-tune-simulator-test-ca"
    assert simulator["text"] == f"simulator-policy.yaml ('{name}')" and "built-in" not in simulator["text"]
    assert default["text"] == f"the built-in default (Intel's root only): '{default['verdict']['policy']}'"
    assert from_disk["body_verdict"] == "error" and from_disk["requests"] == [local]
    error = from_disk["verdict"]["error"]
    assert "opened from a file (file://)" in error and "serve the page over http(s)" in error and "drop the bundle" in error
