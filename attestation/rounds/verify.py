"""Verify a federated round bundle (``attestation.rounds.manifest``) and, recursively, every client bundle in it.

Steps (after ``attestation.verify``'s quote steps on the aggregator's quote):
 R1 ``round.files``      exactly the expected files and directories, one ``clients/<name>/`` per admitted client;
                         no symlinks, no extra or empty directory
 R2 ``round.schema``     round-manifest.json parses against ``cvm-tune/round-manifest/v1``
 R3 ``quote.hex``, ``report_data`` (= SHA-512("cvm-tune-round-v1:" || round-manifest.json bytes))
 R4 ``round.file_hashes`` app-compose.json and the global adapter hash to the manifest; global_adapter_sha256 agrees
 R5 ``compose.hash``, ``tee.app_id``  the aggregator's compose and app id, as for a bundle (with ``mr-config.json``
                         when its MRCONFIGID is v3)
 R6 ``client.<name>``    the client bundle verifies under the same policy (every bundle check), and its manifest,
                         quote (by its signed region, ``quote_identity``) and adapter hash to what the round lists
 R7 ``round.terms``      every client manifest's ``federation`` block names this round, nonce, the round's input
                         global adapter and the strategy's ``proximal_mu``
 R8 ``round.weights``    trainable tokens = the client manifests'; weights = tokens / total; each client's DP
                         (epsilon, delta) = its manifest's ``privacy``
 R9 ``round.aggregate``  FedAvg/FedProx: the global adapter is recomputed from the client adapters (weighted mean);
                         FedYogi: skipped (server optimizer state is not in the bundle; the quote attests it)
 R10 ``round.confidential`` secure aggregation: updates encrypted to the aggregator, the global adapter to the admitted
                         clients' CVM keys; R9 then only with identities that decrypt them (``attestation.rounds.confidential``)
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from attestation.bundle import manifest as B
from attestation.rounds import manifest as R
from attestation.rounds import confidential as round_confidential
from attestation.bundle.verify import (
    _bundle_collateral,
    _compose_and_app_id,
    _events,
    _optional,
    _quote_bytes,
    _read,
    file_problems,
    verify_bundle,
)
from attestation.tdx.dcap import Collateral
from attestation.errors import AttestationError, BundleError
from attestation.io.hashing import sha256_file, sha256_hex
from attestation.outputs.confidential import naming_problems
from attestation.policy import Policy
from attestation.io.safe_yaml import parse_json
from attestation.verify import QuoteFindings, Verdict, verify_quote

_TOP = {R.ROUND_MANIFEST, B.QUOTE_BIN, B.QUOTE_HEX, B.EVENT_LOG, B.APP_COMPOSE}  # and the global adapter
_TOP_DIRS = {str(Path(R.GLOBAL_ADAPTER).parent), R.CLIENTS_DIR}
WEIGHT_TOLERANCE = 1e-9
# float32 weighted means summed in another order differ in the last bits; anything larger is another aggregate
AGGREGATE_RTOL, AGGREGATE_ATOL = 1e-5, 1e-7


def is_round_bundle(path: Path) -> bool:
    return (Path(path) / R.ROUND_MANIFEST).is_file()


def verify_round(round_dir: Path, *, policy: Policy, now: int, collateral: Collateral | None = None,
                 identities: list | None = None) -> Verdict:
    """Verify ``round_dir`` and the client bundles it holds under ``policy`` at unix time ``now``.

    One policy covers the aggregator and the clients: list both roles' compose-hashes in ``compose_hashes``.
    ``identities`` (age identities): with secure aggregation, recompute the aggregate if they decrypt every update.

    Raises:
        BundleError: the directory does not exist or holds no round-manifest.json.
    """
    root = Path(round_dir)
    if not is_round_bundle(root):
        raise BundleError(f"{root} has no {R.ROUND_MANIFEST}: not a cvm-tune round bundle")
    f = QuoteFindings()
    if _refused_special(f, root):
        return Verdict.of(f, policy, now)
    m = _attested_manifest(f, root, policy, now, collateral)
    _files(f, root, m)
    if m is not None:
        f.bundle = {"run_id": f"{m.federation_id}/round-{m.round}", "created_at": m.created_at}
        _file_hashes(f, root, m)
        clients = _clients(f, root, m, policy, now)
        _terms_and_weights(f, m, clients)
        round_confidential.check(f, m, clients)  # R10: secure aggregation
        _aggregate(f, root, m, identities)
    return Verdict.of(f, policy, now)


def verify_round_head(round_dir: Path, *, policy: Policy, now: int) -> tuple[Verdict, R.RoundManifest | None]:
    """Only the aggregator's attestation of a round: the round manifest bound by its quote, and its compose (what a
    client checks before it trains on the round's global adapter; no client bundles, no adapter file)."""
    f = QuoteFindings()
    m = None if _refused_special(f, Path(round_dir)) else _attested_manifest(f, Path(round_dir), policy, now, None)
    return Verdict.of(f, policy, now), m


def _attested_manifest(f: QuoteFindings, root: Path, policy: Policy, now: int,
                       collateral: Collateral | None) -> R.RoundManifest | None:
    """round-manifest.json, the aggregator's quote binding it, and the aggregator's compose-hash and app id."""
    raw_manifest = _read(root / R.ROUND_MANIFEST)
    m = _schema(f, raw_manifest)
    quote = _quote_bytes(f, root)
    events = _events(f, root)
    if quote is not None:
        verify_quote(quote, policy=policy, now=now, collateral=collateral or _bundle_collateral(f, root),
                     events=events, expected_report_data=R.round_report_data(raw_manifest), findings=f,
                     mr_config=_optional(root, B.MR_CONFIG))
    if m is not None:
        _compose_and_app_id(f, root, m)  # type: ignore[arg-type]  # reads only .tee
    return m


def _schema(f: QuoteFindings, raw: bytes) -> R.RoundManifest | None:
    try:
        m = R.RoundManifest.model_validate(parse_json(raw, R.ROUND_MANIFEST, ValueError))
        names = [a.client for a in m.admitted]
        if len(set(names)) != len(names):
            raise ValueError("a client is admitted twice")
        if len(names) < m.min_clients:  # the aggregator fails such a round (app.federated.strategy)
            raise ValueError(f"{len(names)} client(s) admitted, fewer than min_clients {m.min_clients}")
        if bad := naming_problems(m.files, m.confidentiality is not None):  # a round made before .age names
            raise ValueError("; ".join(bad))
        f.add("round.schema", "pass", f"{R.ROUND_SCHEMA}, round {m.round}, {len(m.admitted)} admitted, "
              f"{len(m.rejected)} rejected")
        return m
    except (ValueError, ValidationError, RecursionError) as exc:
        f.add("round.schema", "fail", f"{R.ROUND_MANIFEST} is not a valid {R.ROUND_SCHEMA} manifest: "
              f"{str(exc).splitlines()[0]}")
        return None


def _walk(root: Path) -> Iterator[tuple[str, int]]:
    """(relative posix path, lstat mode) of everything under ``root``; symlinks are never followed."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            yield full.relative_to(root).as_posix(), os.lstat(full).st_mode


def _refused_special(f: QuoteFindings, root: Path) -> bool:
    """R1 before anything is opened: a symlink, FIFO or device anywhere in the round bundle fails ``round.files``
    and nothing else is read (opening a FIFO blocks, a device never ends); True when it did."""
    odd = [rel for rel, mode in _walk(root) if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode))]
    if odd:
        f.add("round.files", "fail", "; ".join(f"{rel} is not a plain file or directory" for rel in odd[:5])
              + " (not opened: no other check ran)")
    return bool(odd)


def _files(f: QuoteFindings, root: Path, m: R.RoundManifest | None) -> None:
    """Exactly the expected files and directories (as for an export bundle: no empty or extra directory either);
    what is inside ``clients/<name>/`` is the client bundle's own check. (Symlinks and special files were refused
    before anything was read: ``_refused_special``.)"""
    problems, present, dirs = [], set(), set()
    for rel, mode in _walk(root):
        if not rel.startswith(R.CLIENTS_DIR + "/"):
            (present if stat.S_ISREG(mode) else dirs).add(rel)
    adapters = {R.GLOBAL_ADAPTER, R.GLOBAL_ADAPTER_AGE}  # which one: the manifest says (unparsed: the one present)
    top = _TOP | ({R.global_adapter(m.confidentiality is not None)} if m is not None else (present & adapters) or
                  {R.GLOBAL_ADAPTER})
    problems += [f"missing {p}" for p in sorted(top - present)]
    problems += [f"unexpected file {p}" for p in sorted(present - top - {B.COLLATERAL, B.MR_CONFIG})]
    problems += [f"unexpected directory {d}/" for d in sorted(dirs - _TOP_DIRS)]
    if m is not None:
        want = {a.client for a in m.admitted}
        clients = root / R.CLIENTS_DIR
        have = {p.name for p in clients.iterdir()} if clients.is_dir() else set()
        problems += [f"missing {R.CLIENTS_DIR}/{c}/" for c in sorted(want - have)]
        problems += [f"unexpected {R.CLIENTS_DIR}/{c}" for c in sorted(have - want)]
    f.add("round.files", "fail" if problems else "pass", "; ".join(problems[:5]) or "expected files only")


def _file_hashes(f: QuoteFindings, root: Path, m: R.RoundManifest) -> None:
    bad = file_problems(root, m.files)
    if set(m.files) != {B.APP_COMPOSE, R.global_adapter(m.confidentiality is not None)}:
        bad.append("the manifest's files are not app-compose.json and the global adapter")
    if m.confidentiality is not None:  # secure aggregation: the file is ciphertext, the hash names the plaintext
        bad += round_confidential.global_problems(root, m)
    elif m.files.get(R.GLOBAL_ADAPTER) != m.global_adapter_sha256:
        bad.append("global_adapter_sha256 is not the global adapter file's hash")
    f.add("round.file_hashes", "fail" if bad else "pass", "; ".join(bad) or f"{len(m.files)} file hashes match")


def _clients(f: QuoteFindings, root: Path, m: R.RoundManifest, policy: Policy, now: int) -> dict[str, B.Manifest]:
    """Verify each admitted client bundle; returns the manifests of those that passed."""
    out: dict[str, B.Manifest] = {}
    for a in m.admitted:
        d = root / R.CLIENTS_DIR / a.client
        if not d.is_dir():
            f.add(f"client.{a.client}", "fail", "bundle missing")
            continue
        try:
            verdict = verify_bundle(d, policy=policy, now=now)
        except BundleError as exc:
            f.add(f"client.{a.client}", "fail", exc.message)
            continue
        problems = [f"{c.name}: {c.detail}" for c in verdict.failed]
        raw = _read(d / B.MANIFEST)
        for what, digest, want in (("manifest.json", lambda: sha256_file(d / B.MANIFEST), a.manifest_sha256),
                                   ("quote.bin", lambda: R.quote_identity(_read(d / B.QUOTE_BIN)), a.quote_sha256),
                                   ("adapter", lambda: sha256_file(d / _weights(raw)), a.adapter_sha256)):
            try:
                if digest() != want:  # a quote by its signed region (verifier.md, "Quote padding")
                    problems.append(f"{what} does not hash to the round manifest's value")
            except (OSError, ValueError, AttestationError):  # ValueError: the client's manifest does not parse
                problems.append(f"{what} unreadable")
        if not problems:
            out[a.client] = B.Manifest.model_validate_json(raw)
        f.add(f"client.{a.client}", "fail" if problems else "pass", "; ".join(problems[:3]) or
              f"bundle {a.run_id} accepted ({len(verdict.checks)} checks); hashes match the round manifest")
    return out


def _weights(raw_manifest: bytes) -> str:
    """A client bundle's adapter weights file (its ``.age`` name when encrypted); its manifest has verified."""
    return B.weights_file(B.Manifest.model_validate_json(raw_manifest))


def _terms_and_weights(f: QuoteFindings, m: R.RoundManifest, clients: dict[str, B.Manifest]) -> None:
    terms, weights = [], []
    mu = m.strategy.params.get("proximal_mu", 0.0)
    total = sum(a.trainable_tokens for a in m.admitted)
    for a in m.admitted:
        cm = clients.get(a.client)
        if cm is None:
            continue  # its client.* check already failed
        fed = cm.federation
        if fed is None or (fed.round, fed.nonce, fed.global_adapter_sha256, fed.proximal_mu) != (
                m.round, m.nonce, m.global_adapter_in_sha256, mu):
            terms.append(f"{a.client} was not trained for this round (round, nonce, global adapter or mu differ)")
        if R.client_privacy(cm) != (a.privacy_epsilon, a.privacy_delta):
            weights.append(f"{a.client}: privacy (epsilon, delta) listed {(a.privacy_epsilon, a.privacy_delta)}, its "
                           f"manifest says {R.client_privacy(cm)}")
        tokens = (cm.dataset.validation or {}).get("trainable_tokens")
        if tokens != a.trainable_tokens:
            weights.append(f"{a.client}: {a.trainable_tokens} trainable tokens listed, its manifest says {tokens}")
        if abs(a.weight - a.trainable_tokens / total) > WEIGHT_TOLERANCE:
            weights.append(f"{a.client}: weight {a.weight} != {a.trainable_tokens}/{total}")
    f.add("round.terms", "fail" if terms else "pass", "; ".join(terms[:3]) or
          f"every client trained for round {m.round} (nonce {m.nonce[:16]}…) from the same global adapter")
    f.add("round.weights", "fail" if weights else "pass", "; ".join(weights[:3]) or
          f"weights = trainable tokens / {total}")


def _aggregate(f: QuoteFindings, root: Path, m: R.RoundManifest, identities: list | None = None) -> None:
    if m.strategy.name not in R.RECOMPUTABLE:
        f.add("round.aggregate", "skip", f"{m.strategy.name} keeps server-side optimizer state: the aggregate is "
              "attested by the aggregator's quote, not recomputed")
        return
    import numpy as np

    try:
        loaded = round_confidential.load_plain(root, m, identities)  # decrypted in memory when the round is secure
        if isinstance(loaded, str):
            f.add("round.aggregate", "skip", loaded)
            return
        total = None
        for a, tensors in zip(m.admitted, loaded[0]):  # the aggregator's order and float32 arithmetic
            scaled = {k: v * a.weight for k, v in tensors.items()}
            total = scaled if total is None else {k: total[k] + scaled[k] for k in total}
        result = loaded[1]
    except Exception as exc:  # noqa: BLE001 - SafetensorError, KeyError, a shape or dtype mismatch: not recomputable
        f.add("round.aggregate", "fail", f"cannot recompute the aggregate: {type(exc).__name__}: {str(exc)[:100]}")
        return
    assert total is not None  # admitted has at least one client (schema)
    bad = sorted(set(total) ^ set(result)) or [
        k for k in sorted(total) if total[k].shape != result[k].shape
        or not np.allclose(total[k], result[k], rtol=AGGREGATE_RTOL, atol=AGGREGATE_ATOL)]
    f.add("round.aggregate", "fail" if bad else "pass",
          f"{len(bad)} tensor(s) differ from the weighted mean of the client adapters, e.g. {bad[0]}" if bad else
          f"global adapter = weighted mean of {len(m.admitted)} client adapters ({len(total)} tensors recomputed)")


def round_digest(raw_manifest: bytes) -> str:
    """SHA-256 of a round-manifest.json (the next round's ``previous_round_sha256``)."""
    return sha256_hex(raw_manifest)


def check_round_link(round_dir: Path, previous_dir: Path) -> list[str]:
    """Problems with ``round_dir`` continuing ``previous_dir`` (empty: it does): the previous round-manifest's hash,
    the round numbers, the federation, and the global adapter the round started from."""
    try:
        raw_prev = _read(Path(previous_dir) / R.ROUND_MANIFEST)
        cur = R.RoundManifest.model_validate(parse_json(_read(Path(round_dir) / R.ROUND_MANIFEST), "round", ValueError))
        prev = R.RoundManifest.model_validate(parse_json(raw_prev, "previous round", ValueError))
    except (OSError, ValueError, ValidationError) as exc:
        return [f"a round manifest is unreadable or invalid: {type(exc).__name__}"]
    problems = []
    if cur.previous_round_sha256 != round_digest(raw_prev):
        problems.append("previous_round_sha256 is not the hash of the previous round's manifest")
    if (cur.federation_id, cur.round) != (prev.federation_id, prev.round + 1):
        problems.append(f"round {cur.federation_id}/{cur.round} does not follow {prev.federation_id}/{prev.round}")
    if cur.global_adapter_in_sha256 != prev.global_adapter_sha256:
        problems.append("the round did not start from the previous round's global adapter")
    return problems
