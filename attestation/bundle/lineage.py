"""Lineage between export bundles: a warm-started bundle names its parent (run id, manifest SHA-256, adapter
weights SHA-256) in its manifest and commits to the parent's manifest hash in its ``run.start`` audit entry.

:func:`check_link` recomputes the link from the parent's files; :func:`verify_chain` verifies every bundle of an
exports directory once under a policy and checks every link, in lineage order (roots first), naming the first
broken one. Standard library + the bundle verifier only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attestation.bundle import manifest as B
from attestation.bundle.verify import verify_bundle
from attestation.outputs import confidential as C
from attestation.errors import BundleError
from attestation.policy import Policy
from attestation.io.safe_yaml import parse_json
from attestation.verify import Verdict

CHAIN_SCHEMA = "cvm-tune/chain/v1"
MAX_MANIFEST = 16 << 20


def _manifest(bundle: Path) -> tuple[bytes, dict[str, Any]]:
    path = Path(bundle) / B.MANIFEST
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_MANIFEST + 1)
    except OSError as exc:
        raise BundleError(f"cannot read {path}: {exc.strerror}", fix="pass an exports/<run_id> bundle directory") from exc
    doc = parse_json(raw, str(path), BundleError, max_bytes=MAX_MANIFEST)
    if not isinstance(doc, dict):
        raise BundleError(f"{path} is not a cvm-tune manifest (not a JSON object)")
    return raw, doc


def check_link(child: Path, parent: Path) -> list[str]:
    """Problems with the claim "``child`` was trained from ``parent``" (empty: the link holds).

    Recomputed, not trusted: the parent's manifest hash from its bytes, its run id, base model and adapter-weights
    hash from its manifest (whose file hashes :func:`verify_bundle` checks against the files). A manifest that
    cannot be read (damaged, oversized, nested too deeply) is a problem, not an error: damage inside a bundle
    rejects it.
    """
    try:
        _, c = _manifest(child)
        p_raw, p = _manifest(parent)
    except BundleError as exc:
        return [exc.message]
    lineage = c.get("lineage")
    if not isinstance(lineage, dict):
        return [f"{c.get('run_id')} names no parent (it was trained from the base model)"]
    problems = []
    if lineage.get("parent_manifest_sha256") != hashlib.sha256(p_raw).hexdigest():
        problems.append("parent manifest hash differs from the lineage")
    if lineage.get("parent_run_id") != p.get("run_id"):
        problems.append(f"lineage names run {lineage.get('parent_run_id')}, the parent bundle is {p.get('run_id')}")
    weights = C.stored_name(B.WEIGHTS, p.get("confidentiality") is not None)  # encrypted: the .age file's hash
    if lineage.get("parent_adapter_sha256") != _field(p, "files", weights):
        problems.append("parent adapter weights hash differs from the lineage")
    c_base, p_base = _field(c, "base_model", "tree_sha256"), _field(p, "base_model", "tree_sha256")
    if c_base != p_base:
        problems.append("parent was trained on another base model")
    return problems


def _field(doc: dict[str, Any], section: str, key: str) -> Any:
    """``doc[section][key]``, or None where the (untrusted) manifest has no such mapping."""
    inner = doc.get(section)
    return inner.get(key) if isinstance(inner, dict) else None


@dataclass
class ChainLink:
    run_id: str
    bundle: Path
    verdict: Verdict
    parent_run_id: str | None
    link_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verdict.accepted and not self.link_problems


@dataclass
class ChainReport:
    links: list[ChainLink]
    promoted: str | None  # run id named by exports/PROMOTED, if any

    @property
    def first_broken(self) -> ChainLink | None:
        return next((link for link in self.links if not link.ok), None)

    def to_json(self) -> dict[str, Any]:
        broken = self.first_broken
        return {"schema": CHAIN_SCHEMA, "accepted": broken is None, "promoted": self.promoted,
                "first_broken": broken.run_id if broken else None,
                "bundles": [{"run_id": link.run_id, "bundle": str(link.bundle), "accepted": link.verdict.accepted,
                             "failed": [f"{c.name}: {c.detail}" for c in link.verdict.failed],
                             "parent_run_id": link.parent_run_id, "link_problems": link.link_problems}
                            for link in self.links]}


def verify_chain(exports: Path, *, policy: Policy, now: int) -> ChainReport:
    """Verify every bundle under ``exports`` once and every lineage link between them, roots first.

    A bundle whose manifest cannot be read is verified too (and so rejected) and starts no link.

    Raises:
        BundleError: ``exports`` is not a directory or holds no bundle.
    """
    root = Path(exports)
    if not root.is_dir():
        raise BundleError(f"{root} is not a directory", fix="pass the exports/ directory of an output volume")
    bundles = sorted(p for p in root.iterdir() if not p.name.startswith(".") and (p / B.MANIFEST).is_file())
    if not bundles:
        raise BundleError(f"{root} holds no export bundle", fix="pass the exports/ directory of an output volume")
    by_hash: dict[str, Path] = {}
    info: dict[Path, dict[str, Any]] = {}
    damaged: dict[Path, str] = {}
    for b in bundles:
        try:
            raw, info[b] = _manifest(b)
        except BundleError as exc:
            info[b], damaged[b] = {}, exc.message
            continue
        by_hash[hashlib.sha256(raw).hexdigest()] = b
    links: list[ChainLink] = []
    for b in _lineage_order(bundles, info, by_hash):
        lineage = info[b].get("lineage") if isinstance(info[b].get("lineage"), dict) else None
        verdict = verify_bundle(b, policy=policy, now=now)
        problems: list[str] = [damaged[b]] if b in damaged else []
        parent_id = lineage.get("parent_run_id") if lineage else None
        if lineage:
            parent = by_hash.get(str(lineage.get("parent_manifest_sha256")))
            if parent is None:
                problems.append(f"its parent {parent_id} (manifest {str(lineage.get('parent_manifest_sha256'))[:16]}…) "
                                f"is not in {root}")
            else:
                problems += check_link(b, parent)
        links.append(ChainLink(str(info[b].get("run_id") or b.name), b, verdict, parent_id, problems))
    promoted = None
    try:
        promoted = (root / "PROMOTED").read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        pass
    return ChainReport(links, promoted)


def _lineage_order(bundles: list[Path], info: dict[Path, dict[str, Any]], by_hash: dict[str, Path]) -> list[Path]:
    """Parents before children; among siblings (and unrelated roots), by creation time then name."""
    def key(b: Path) -> tuple[str, str]:
        return (str(info[b].get("created_at") or ""), b.name)

    children: dict[Path | None, list[Path]] = {}
    for b in bundles:
        lineage = info[b].get("lineage")
        parent = by_hash.get(str(lineage.get("parent_manifest_sha256"))) if isinstance(lineage, dict) else None
        children.setdefault(parent, []).append(b)
    order: list[Path] = []
    stack = sorted(children.get(None, []), key=key, reverse=True)
    while stack:
        b = stack.pop()
        order.append(b)
        stack.extend(sorted(children.get(b, []), key=key, reverse=True))
    seen = set(order)
    order += sorted((b for b in bundles if b not in seen), key=key)  # a cycle (forged hashes): still verified
    return order
