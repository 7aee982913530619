#!/usr/bin/env python3
"""Hash locks: ``requirements/<name>.txt`` (pins, edited by people) -> ``requirements/<name>.lock`` (what pip installs).

Every installer of cvm-tune (the README's commands, ``.ci/run`` and the Dockerfile) runs
``requirements/install.sh``, which installs a ``.lock`` with ``pip --require-hashes``: pip refuses any file whose
SHA-256 is not listed, and any dependency that is not pinned. This script writes those hashes.

    .venv/bin/python requirements/lock.py                # rewrite every stale lock (verify, cpu, test, gpu)
    .venv/bin/python requirements/lock.py cpu test       # just these
    .venv/bin/python requirements/lock.py --resolve gpu  # re-resolve gpu.txt from pyproject's [gpu] extra, then lock
    .venv/bin/python requirements/lock.py --check-image /usr/bin/python3.12   # the image's install, without docker

After adding a package: add ``name==version`` to the ``.txt`` (and its new dependencies; ``--resolve NAME`` finds
them with pip's resolver, keeping every existing pin as a constraint), then run this script. ``tests/test_deploy.py``
fails while a ``.lock`` is older than its ``.txt`` (the lock records the SHA-256 of the pins it was made from).

Which hashes are listed, per pin ``name==version``:

* every file of exactly that version on PyPI (the simple JSON API, PEP 691) that installs on one of the targets:
  CPython 3.11 (CI, the demo) and 3.12 (the Docker base image's Python) on x86-64 Linux, plus pure-Python wheels;
  the sdist only when some target has no wheel;
* every such file in this machine's pip sources (``find-links`` directories and ``file://`` indexes from
  ``pip config``), matching the public version;
* for ``torch`` (LOCAL_ONLY) only the local builds: the ``2.13.0+cpu`` wheel in ``/opt/wheels`` that CI installs.
  Listing PyPI's hash too would make pip take PyPI's CUDA wheel: pip ranks a candidate whose index link carries a
  matching hash above a find-links file, which has none (``pip/_internal/index/package_finder.py``,
  ``CandidateEvaluator._sort_key``), and that wheel pulls ~3 GB of unpinned CUDA packages. The Docker image never
  downloads torch: its base image provides ``torch 2.13.0`` (pip sees the pin satisfied).

Packages marked "provided by the base image" in ``gpu.txt`` (torch's CUDA stack) are not in ``gpu.lock``: the image
takes them from its digest-pinned base. ``--check-image PYTHON`` replays the image's install step without docker:
a venv of that Python (3.12, as in the base) holding stand-ins for the base's torch stack (BASE_STUBS), then
``pip install --dry-run --require-hashes`` of each lock; pip fails if any dependency is unpinned there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NAMES = ("pip", "verify", "cpu", "test", "gpu")
INDEX = "https://pypi.org/simple"
PYTHONS = ((3, 11), (3, 12))
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(39, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
# What `--resolve NAME` asks pip for (the pins file is passed as constraints, so existing pins stay). verify: the
# verifier alone (pyproject's dependencies); the others add the training stack (the [train] extra).
RESOLVE = {"verify": ["."], "cpu": ["torch==2.13.0", ".[train]"], "test": ["torch==2.13.0", ".[train,test]"],
           "gpu": ["torch==2.13.0", ".[gpu]"]}
# torch's CUDA stack: the GPU image takes these from its base image (see the Dockerfile).
LOCAL_ONLY = {"torch"}
BASE_PROVIDED = re.compile(r"^(torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")
BASE_STUBS = {"torch": "2.13.0+cu126", "torchvision": "0.28.0+cu126", "triton": "3.7.1"}  # what the base image has
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#\\]+)\s*(?:#.*)?$")
INPUT_MARK = "# input-sha256: "


def target_tags() -> dict[str, set[Tag]]:
    """Interpreter tag sets, one per target Python."""
    out = {}
    for py in PYTHONS:
        tags = set(cpython_tags(py, platforms=PLATFORMS)) | set(compatible_tags(py, f"cp{py[0]}{py[1]}", PLATFORMS))
        out[f"cp{py[0]}{py[1]}"] = tags
    return out


def parse_pins(path: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """(``-r`` includes, [(name, version)]) of a pins file; anything else is an error."""
    includes, pins = [], []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            includes.append(line[3:].strip())
            continue
        m = PIN.match(line)
        if not m:
            raise SystemExit(f"{path.name}:{n}: expected `name==version` or `-r FILE`, got {raw!r}")
        pins.append((m.group(1), m.group(2)))
    return includes, pins


def _get(url: str, accept: str) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "cvm-tune-lock/1"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read()


def index_files(name: str) -> list[tuple[str, str]]:
    """[(filename, sha256)] of every file PyPI lists for a project."""
    data = json.loads(_get(f"{INDEX}/{canonicalize_name(name)}/", "application/vnd.pypi.simple.v1+json"))
    return [(f["filename"], f["hashes"]["sha256"]) for f in data["files"] if "sha256" in f.get("hashes", {})]


def pip_sources() -> tuple[list[Path], list[Path]]:
    """(find-links directories, file:// index roots) from this machine's pip configuration."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False).stdout
    links, indexes = [], []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        for item in shlex.split(value.strip().strip("'\"")) if value else []:
            if key.endswith("find-links") and Path(item).is_dir():
                links.append(Path(item))
            elif key.endswith("index-url") and item.startswith("file://"):
                root = Path(urllib.parse.unquote(urllib.parse.urlparse(item).path))
                if root.is_dir():
                    indexes.append(root)
    return list(dict.fromkeys(links)), list(dict.fromkeys(indexes))


def local_files(name: str, links: list[Path], indexes: list[Path]) -> list[tuple[str, str]]:
    """[(filename, sha256)] of a project's files in local find-links directories and file:// indexes."""
    out = []
    norm = canonicalize_name(name)
    for d in links:
        for p in sorted(d.iterdir()):
            if p.is_file() and _project_of(p.name) == norm:
                out.append((p.name, hashlib.sha256(p.read_bytes()).hexdigest()))
    for root in indexes:
        page = root / norm / "index.html"
        if page.is_file():
            for href, digest in re.findall(r'href="([^"#]+)#sha256=([0-9a-f]{64})"', page.read_text()):
                out.append((urllib.parse.unquote(href.rsplit("/", 1)[-1]), digest))
    return out


def _project_of(filename: str) -> str | None:
    try:
        return str(parse_wheel_filename(filename)[0]) if filename.endswith(".whl") else str(parse_sdist_filename(filename)[0])
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None


def select(name: str, version: str, files: Iterable[tuple[str, str]], targets: dict[str, set[Tag]], *,
           require_all: bool = True) -> list[str]:
    """Hashes of the files of ``name==version`` that pip may pick on a target (local versions match, as in pip).

    ``require_all``: every target must have a file (else: at least one).
    """
    want, norm = Version(version), canonicalize_name(name)
    wheels: dict[str, set[str]] = {}
    sdists: set[str] = set()
    covered: set[str] = set()
    for filename, digest in files:
        try:
            if filename.endswith(".whl"):
                proj, ver, _build, tags = parse_wheel_filename(filename)
            else:
                proj, ver = parse_sdist_filename(filename)
                tags = frozenset()
        except (InvalidWheelFilename, InvalidSdistFilename):
            continue
        if proj != norm or ver.public != str(want) and ver != want:
            continue
        if not filename.endswith(".whl"):
            sdists.add(digest)
            continue
        hit = [t for t, supported in targets.items() if tags & supported]
        if hit:
            wheels.setdefault(digest, set()).update(hit)
            covered.update(hit)
    chosen = set(wheels)
    if not require_all and chosen:
        return sorted(chosen)
    if covered != set(targets):
        if not sdists:
            raise SystemExit(f"{name}=={version}: no file installs on {sorted(set(targets) - covered)}")
        chosen |= sdists
    return sorted(chosen)


def write_lock(name: str, targets: dict[str, set[Tag]], sources: tuple[list[Path], list[Path]]) -> Path:
    src = HERE / f"{name}.txt"
    includes, pins = parse_pins(src)
    lines = [
        f"# GENERATED by requirements/lock.py from requirements/{src.name}: edit that file, then rerun the script.",
        f"# Targets: {', '.join(targets)} on x86_64 Linux; local pip sources: "
        f"{', '.join(str(p) for p in [*sources[0], *sources[1]]) or 'none'}.",
        f"{INPUT_MARK}{hashlib.sha256(src.read_bytes()).hexdigest()}",
    ]
    lines += [f"-r {inc.removesuffix('.txt')}.lock" for inc in includes]
    inherited = {canonicalize_name(p): v for inc in includes for p, v in parse_pins(HERE / inc)[1]}
    for pkg, version in sorted(pins, key=lambda p: canonicalize_name(p[0])):
        if canonicalize_name(pkg) in inherited:
            if inherited[canonicalize_name(pkg)] != version:
                raise SystemExit(f"{src.name}: {pkg}=={version} conflicts with {inherited[canonicalize_name(pkg)]} from {includes}")
            continue  # already locked by the included file
        if canonicalize_name(pkg) in LOCAL_ONLY:
            hashes = select(pkg, version, local_files(pkg, *sources), targets, require_all=False)
        else:
            hashes = select(pkg, version, index_files(pkg) + local_files(pkg, *sources), targets)
        lines.append(f"{pkg}=={version} \\")
        lines += [f"    --hash=sha256:{h}" + (" \\" if i < len(hashes) - 1 else "") for i, h in enumerate(hashes)]
    out = HERE / f"{name}.lock"
    out.write_text("\n".join(lines) + "\n")
    return out


def is_stale(name: str) -> bool:
    """True when ``name.lock`` is missing or was made from other pins."""
    lock = HERE / f"{name}.lock"
    if not lock.exists():
        return True
    mark = next((ln for ln in lock.read_text().splitlines() if ln.startswith(INPUT_MARK)), "")
    return mark.removeprefix(INPUT_MARK) != hashlib.sha256((HERE / f"{name}.txt").read_bytes()).hexdigest()


def resolve(name: str) -> None:
    """Rewrite ``name.txt`` with pip's resolution of RESOLVE[name], the current pins as constraints."""
    src = HERE / f"{name}.txt"
    header = [ln for ln in src.read_text().splitlines() if ln.startswith("#")]
    includes, _ = parse_pins(src)
    included = {canonicalize_name(p) for inc in includes for p, _ in parse_pins(HERE / inc)[1]}
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        pins = [f"{p}=={v}" for f in [src, *(HERE / i for i in includes)] for p, v in parse_pins(f)[1]]
        constraints.write_text("\n".join(pins) + "\n")
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--use-feature=fast-deps", "--report", str(report), "-c", str(constraints), *RESOLVE[name]],
                       cwd=ROOT, check=True)
        installed = json.loads(report.read_text())["install"]
    resolved = {}
    for item in installed:
        meta = item["metadata"]
        norm = canonicalize_name(meta["name"])
        if norm == "cvm-tune" or norm in included:
            continue
        if name == "gpu" and BASE_PROVIDED.match(norm):
            continue
        resolved[meta["name"]] = Version(meta["version"]).public
    body = [f"-r {inc}" for inc in includes] + [f"{p}=={v}" for p, v in sorted(resolved.items(), key=lambda kv: kv[0].lower())]
    src.write_text("\n".join(header + body) + "\n")
    print(f"resolved {src.relative_to(ROOT)}: {len(resolved)} pins")


def check_image(python: str, names: list[str]) -> None:
    """Dry-run each lock's install in a venv of ``python`` that holds the base image's torch stack (as stubs)."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        site = subprocess.run([str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        for dist, version in BASE_STUBS.items():
            info = Path(site) / f"{dist}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
            (info / "RECORD").write_text("")
        for name in names:
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--dry-run", "--require-hashes",
                            "--use-feature=fast-deps", "-r", str(HERE / f"{name}.lock")], check=True)
            print(f"requirements/{name}.lock installs on {python} beside the base image's torch stack")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"locks to (re)write: {', '.join(NAMES)} (default: all)")
    ap.add_argument("--resolve", action="store_true", help="first re-resolve the pins with pip (network)")
    ap.add_argument("--force", action="store_true", help="rewrite locks even when they are up to date")
    ap.add_argument("--check-image", metavar="PYTHON", help="only dry-run the image's install of the locks with this Python (3.12)")
    args = ap.parse_args(argv)
    names = args.names or list(NAMES)
    if unknown := sorted(set(names) - set(NAMES)):
        ap.error(f"unknown lock {unknown}: choose from {', '.join(NAMES)}")
    if args.check_image:
        check_image(args.check_image, [n for n in names if n != "test"])
        return 0
    if args.resolve:
        for name in names:
            resolve(name)
    targets, sources = target_tags(), pip_sources()
    for name in names:
        if args.force or args.resolve or is_stale(name):
            print(f"wrote {write_lock(name, targets, sources).relative_to(ROOT)}")
        else:
            print(f"requirements/{name}.lock is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
