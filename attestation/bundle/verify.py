"""Verify an export bundle: the quote-level steps plus the bundle-level ones.

Bundle steps (after ``attestation.verify``'s quote steps):
 B1 ``bundle.files``     exactly the expected files; no symlinks, nothing unsigned added
 B2 ``manifest.schema``  manifest.json parses against ``cvm-tune/manifest/v1``
 B3 ``quote.hex``        quote.hex is the hex of quote.bin
 B4 ``report_data``      (quote step 8) = SHA-512("cvm-tune-manifest-v1:" || manifest.json bytes)
 B5 ``manifest.files``   every listed file hashes to its manifest value
 B6 ``compose.hash``     sha256(app-compose.json) = manifest = event-log compose-hash = MRCONFIGID (v3: with
                         mr-config.json, the MrConfigV3 document, whose fields equal the measured boot events)
 B6a ``compose.audit``   app-compose.json's dstack 0.6 findings (init_script, a weakened gpu_policy) each accepted by
                         name in the policy's ``allowed_compose_findings`` (``attestation.compose.dstack06``)
 B7 ``tee.app_id``       manifest app-id = event-log app-id
 B8 ``audit.chain``      audit.jsonl intact, linked, head and hashes agree with the manifest
 B9 ``audit.rtmr3``      the measured RTMR3 app events are the audit entries (when EmitEvent was used)
 B9a ``audit.anchors``   audit-anchors.jsonl: every checkpoint entry anchored by a quote of the same TD (dstack 0.6)
 B10 ``base_model.tree`` the base-model tree hash is recomputed (and compared with a local copy if given)
 B11 ``dataset.file``    the encrypted dataset hash (only when the file is given)
 B12 ``gpu.evidence``    gpu-evidence.json re-summarised = the manifest's ``gpu``, committed by the last
                         ``gpu.evidence`` audit entry, nonce = that entry's prev (``attestation.tdx.gpu.check``); plus
                         dstack's own measured GPU attestation when the OS made one (``attestation.tdx.gpu_dstack``)
 B12a ``gpu.boot_evidence`` gpu-boot-evidence.json (dstack 0.6 Attest's boot-time nvattest output) hashes to the
                         measured gpu-attestation event's evidence_sha256; the verdict's ``gpu`` says whether anything
                         cryptographic checked the GPU ("GPU not verified" otherwise)
 B13 ``dataset.owner``   owner key id = SHA-256(owner public key); with the file: its owner signature
                         verifies under that key and its statement, header and hashes match the manifest
 B14 ``build.image``     the manifest's image is the cvm-tune service's image in app-compose.json, pinned by digest
 B15 ``build.lock``      the run's environment matched the hash lock the image was built from
 B16 ``model.signature`` adapter/ (and merged/) verify with model-signing under the manifest's key (``attestation.bundle.model_sig``)
 B17 ``privacy.dp``      DP-SGD as run (``attestation.privacy.dp``): epsilon recomputed without torch (``attestation.privacy.epsilon``),
                         parameters = the bundle config, rows/steps/sample rate = the manifest's; policy ``max_epsilon``
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from attestation.bundle import manifest as B
from attestation.compose import app_compose as C
from attestation.compose.dstack06 import audit06, gpu_policy_hash
from attestation.bundle import confidential as confidential_verify
from attestation.bundle import anchors, input_checks
from attestation.outputs import op_chain
from attestation.privacy import dp as privacy
from attestation.bundle.audit import AuditEntry, AuditFormatError, chain_problems, parse_entry, parse_lines
from attestation.bundle.commitments import commitment_problems
from attestation.tdx.dcap import Collateral, parse_collateral
from attestation.errors import AttestationError, BundleError
from attestation.tdx.eventlog import Event, parse_event_log
from attestation.tdx.gpu import check as gpu_check
from attestation.tdx.gpu_dstack import boot_evidence_step, boot_gpu_attestation, gpu_status
from attestation.io.hashing import read_regular, sha256_file, sha256_hex
from attestation.policy import Policy
from attestation.tdx.quote import MAX_QUOTE_BYTES
from attestation.io.safe_yaml import MAX_DEPTH, depth
from attestation.verify import QuoteFindings, Verdict, verify_quote

MAX_FILE = 64 << 20
# The checks that depend only on the bundle's own bytes: not on trusted roots, TCB status, collateral dates
# or policy pins. Every honest export passes them under any policy; cvm-tune publishes a bundle only if it does.
INTEGRITY_CHECKS = frozenset({
    "bundle.files", "manifest.schema", "manifest.files", "quote.parse", "quote.hex", "quote.padding", "report_data",
    "event_log.parse", "event_log.replay", "event_log.boot", "compose.hash", "tee.app_id", "audit.chain",
    "audit.rtmr3", "audit.anchors", "base_model.tree", "gpu.evidence", "evaluation.decision", "model.signature", "privacy.dp",
    "confidential.outputs", "confidential.plaintext",
})


def verify_bundle(
    bundle_dir: Path,
    *,
    policy: Policy,
    now: int,
    collateral: Collateral | None = None,
    base_model_dir: Path | None = None,
    dataset_file: Path | None = None,
    identities: list | None = None,  # age identities (attestation.outputs.confidential.load_identities): decrypt the weights
    ops_file: Path | None = None,  # the client's record of a training-API model's ops (JSONL): op_chain.ops
) -> Verdict:
    """Verify ``bundle_dir`` under ``policy`` at unix time ``now``.

    ``collateral`` overrides the bundle's collateral.json (fresh collateral from a PCCS).

    Raises:
        BundleError: the directory does not exist or holds no manifest.json (not a bundle at all).
        OpsFileError: ``ops_file`` cannot be read (an input error; what it holds is checked as ``op_chain.ops``).
    """
    root = Path(bundle_dir)
    if not root.is_dir():
        raise BundleError(f"{root} is not a directory", fix="pass the exports/<run_id> directory of a bundle")
    if not (root / B.MANIFEST).is_file():
        raise BundleError(f"{root} has no {B.MANIFEST}: not a cvm-tune export bundle")
    if base_model_dir is not None and not Path(base_model_dir).is_dir():
        raise BundleError(f"base model directory {base_model_dir} is missing", fix="pass the local copy of the base model")
    if dataset_file is not None and not Path(dataset_file).is_file():
        raise BundleError(f"dataset file {dataset_file} is missing or not a file", fix="pass the encrypted dataset (.cvmds)")
    ops = None if ops_file is None else op_chain.read_record(ops_file)  # unreadable: an input error, first
    f = QuoteFindings()
    manifest_bytes = _read(root / B.MANIFEST)
    manifest = _files_and_manifest(f, root, manifest_bytes)
    raw = _quote_bytes(f, root)
    coll = collateral if collateral is not None else _bundle_collateral(f, root)
    events = _events(f, root)
    mr_config = _optional(root, B.MR_CONFIG)
    if raw is not None:
        verify_quote(raw, policy=policy, now=now, collateral=coll, events=events,
                     expected_report_data=B.manifest_report_data(manifest_bytes), findings=f, mr_config=mr_config)
    if manifest is not None:
        f.bundle = {"run_id": manifest.run_id, "created_at": manifest.created_at, "audit_head": manifest.audit.head,
                    "audit_last_seq": manifest.audit.first_seq + manifest.audit.entries - 1}
        _file_hashes(f, root, manifest)
        _compose_and_app_id(f, root, manifest)
        _compose_audit(f, root, policy)
        _build(f, root, manifest)
        entries = _audit_entries(root)  # parsed once: the audit and GPU steps both read them
        config_bytes = _config_bytes(root)  # read once: the audit, evaluation and privacy steps compare with it
        _audit(f, entries, config_bytes, manifest, policy)
        anchors.check(f, root, manifest, entries, policy=policy, now=now, collateral=coll, mr_config=mr_config)
        _gpu(f, root, manifest, events, entries)
        _gpu_06(f, root, manifest, events)
        input_checks.evaluation(f, manifest, config_bytes)
        confidential_verify.check(f, root, manifest, identities, dataset_file)  # B16 (+ C1, C2 when encrypted)
        privacy.check(f, manifest, policy, config_bytes)
        input_checks.inputs(f, manifest, base_model_dir, dataset_file)
    if ops is not None:
        op_chain.check(f, manifest.op_chain if manifest is not None else None, *ops)
    return Verdict.of(f, policy, now)


def _read(path: Path, limit: int = MAX_FILE) -> bytes:
    return read_regular(path, limit)  # a FIFO or device in a bundle is refused (OSError), never waited on


def _optional(root: Path, name: str) -> bytes | None:
    """An optional platform file's bytes (None when absent or unreadable: the check that needs it says so)."""
    try:
        return _read(root / name) if (root / name).exists() else None
    except OSError:
        return None


def _files_and_manifest(f: QuoteFindings, root: Path, manifest_bytes: bytes) -> B.Manifest | None:
    present, odd, dirs = _walk(root)
    manifest = None
    try:
        doc = json.loads(manifest_bytes)
        if depth(doc) > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
        manifest = B.Manifest.model_validate(doc)
        if why := B.files_problem(manifest):
            raise ValueError(why)
        f.add("manifest.schema", "pass", B.MANIFEST_SCHEMA)
    except (ValueError, ValidationError, RecursionError) as exc:
        f.add("manifest.schema", "fail", f"manifest.json is not a valid {B.MANIFEST_SCHEMA} manifest: {str(exc).splitlines()[0]}")
        manifest = None
    expected = set(B.hashed_files(manifest)) | set(B.ATTESTATION_FILES)
    extra = sorted(present - expected - set(B.OPTIONAL_FILES))
    missing = sorted(expected - present)
    wanted_dirs = {str(Path(p).parent) for p in expected | set(B.OPTIONAL_FILES)} - {"."}
    problems = [*(f"unexpected file {p}" for p in extra), *(f"missing {p}" for p in missing),
                *(f"unexpected directory {d}/" for d in sorted(dirs - wanted_dirs)),
                *(f"{p} is a symlink or special file" for p in odd)]
    f.add("bundle.files", "fail" if problems else "pass", "; ".join(problems) or f"{len(present)} files, none unexpected")
    return manifest


def _walk(root: Path) -> tuple[set[str], list[str], set[str]]:
    """Regular files, symlinks/special files and directories under ``root`` (relative posix paths); symlinks
    are never followed. One ``scandir`` per directory: the entry types come with the listing."""
    present: set[str] = set()
    odd: list[str] = []
    dirs: set[str] = set()
    stack = [(str(root), "")]
    while stack:
        path, prefix = stack.pop()
        with os.scandir(path) as it:
            for entry in it:
                rel = prefix + entry.name
                if entry.is_symlink():
                    odd.append(rel)
                elif entry.is_dir(follow_symlinks=False):
                    dirs.add(rel)
                    stack.append((entry.path, rel + "/"))
                elif entry.is_file(follow_symlinks=False):
                    present.add(rel)
                else:
                    odd.append(rel)
    return present, sorted(odd), dirs


def _quote_bytes(f: QuoteFindings, root: Path) -> bytes | None:
    try:
        raw = _read(root / B.QUOTE_BIN, MAX_QUOTE_BYTES + 1)
    except OSError:
        f.add("quote.parse", "fail", f"{B.QUOTE_BIN} missing or unreadable")
        return None
    if not raw or len(raw) > MAX_QUOTE_BYTES:
        f.add("quote.parse", "fail", f"{B.QUOTE_BIN} is " + ("empty" if not raw else f"larger than {MAX_QUOTE_BYTES} bytes")
              + ": not a TDX quote")
        return None
    try:
        hex_ok = _read(root / B.QUOTE_HEX, 2 * MAX_QUOTE_BYTES + 2).strip().decode("ascii").lower() == raw.hex()
    except (OSError, UnicodeDecodeError):
        hex_ok = False
    f.add("quote.hex", "pass" if hex_ok else "fail", "quote.hex = hex(quote.bin)" if hex_ok else "quote.hex differs from quote.bin")
    return raw


def _bundle_collateral(f: QuoteFindings, root: Path) -> Collateral | None:
    path = root / B.COLLATERAL
    if not path.exists():
        return None
    try:
        return parse_collateral(_read(path))
    except (OSError, AttestationError) as exc:
        f.add("collateral.parse", "fail", getattr(exc, "message", f"{B.COLLATERAL} unreadable or not a regular file"))
        return None


def _events(f: QuoteFindings, root: Path) -> tuple[Event, ...] | None:
    try:
        return parse_event_log(_read(root / B.EVENT_LOG))
    except (OSError, AttestationError) as exc:
        f.add("event_log.parse", "fail", getattr(exc, "message", f"{B.EVENT_LOG} missing or unreadable"))
        return None


def file_problems(root: Path, files: dict[str, str]) -> list[str]:
    """``"<file> changed"`` / ``"<file> unreadable"`` for each listed file that does not hash to its value."""
    bad = []
    for rel, want in sorted(files.items()):
        try:
            if sha256_file(root / rel) != want:
                bad.append(f"{rel} changed")
        except (OSError, ValueError):
            bad.append(f"{rel} unreadable")
    return bad


def _file_hashes(f: QuoteFindings, root: Path, m: B.Manifest) -> None:
    bad = file_problems(root, m.files)
    f.add("manifest.files", "fail" if bad else "pass", "; ".join(bad) or f"{len(m.files)} file hashes match")


def _compose_and_app_id(f: QuoteFindings, root: Path, m: B.Manifest) -> None:
    try:
        actual = sha256_hex(_read(root / B.APP_COMPOSE))
    except OSError:
        actual = None
    measured = f.boot.hex("compose-hash") if f.boot else None
    td = f.quote.td if f.quote else None
    config_id = td.mr_config_id if td else b""
    problems = []
    if actual != m.tee.compose_hash:
        problems.append("app-compose.json does not hash to the manifest's compose_hash")
    if measured != m.tee.compose_hash:
        problems.append(f"event-log compose-hash {measured or '(absent)'} differs from the manifest")
    mr_config = _optional(root, B.MR_CONFIG)
    bound, how = C.check_mr_config_id(config_id, m.tee.compose_hash, f.boot.hex("app-id") if f.boot else None,
                                      f.boot.values.get("key-provider") if f.boot else None, boot=f.boot,
                                      mr_config=mr_config) if td else (True, "no quote")
    if not bound:
        problems.append(how)
    if mr_config is not None and config_id[:1] != b"\x03":
        problems.append(f"{B.MR_CONFIG} is in the bundle but MRCONFIGID is not v3: nothing binds it")
    f.add("compose.hash", "fail" if problems else "pass", "; ".join(problems) or f"compose-hash {m.tee.compose_hash[:16]}… consistent; {how}")
    app_id = f.boot.hex("app-id") if f.boot else None
    ok = app_id == m.tee.app_id
    f.add("tee.app_id", "pass" if ok else "fail", f"app-id {app_id or '(absent)'}" + ("" if ok else f" != manifest {m.tee.app_id}"))


def _compose_audit(f: QuoteFindings, root: Path, policy: Policy) -> None:
    """B6a: the dstack 0.6 app-compose findings, each accepted only when the policy names it."""
    try:
        doc = C.load(_read(root / B.APP_COMPOSE))
    except (OSError, AttestationError):
        f.add("compose.audit", "fail", "app-compose.json missing or not a JSON object")
        return
    findings, problems, notes = audit06(doc)
    measured = f.boot.hex("gpu-policy-hash") if f.boot else None
    if measured is not None and measured != gpu_policy_hash(doc):
        problems = [*problems, "the measured gpu-policy-hash is not the hash of app-compose.json's requirements.gpu_policy"]
    refused = [msg for name, msg in findings if name not in policy.allowed_compose_findings] + problems
    accepted = [name for name, _ in findings if name in policy.allowed_compose_findings]
    said = [*(f"accepted by the policy: {n}" for n in accepted), *notes]
    if refused:
        f.add("compose.audit", "fail", "; ".join(refused) + (" (a policy may accept a finding by name: "
              "allowed_compose_findings)" if findings else "") + "".join(f"; {x}" for x in said))
    else:
        f.add("compose.audit", "pass", "; ".join(said) or "no init_script, GPU policy not weakened")


def _build(f: QuoteFindings, root: Path, m: B.Manifest) -> None:
    try:
        image = C.images(C.load(_read(root / B.APP_COMPOSE))).get(C.SERVICE)
    except (OSError, AttestationError):
        image = None  # compose.hash already reports an unreadable app-compose.json
    b = m.build
    if b is None or b.image is None:
        if image is not None:
            f.add("build.image", "fail", f"the manifest omits the measured {C.SERVICE} image {image}")
        else:
            f.add("build.image", "skip", f"no {C.SERVICE} image in app-compose.json and none recorded")
    elif b.image != image or b.image_digest is None or b.image_digest != C.image_digest(image):
        f.add("build.image", "fail", f"manifest image {b.image} is not the app-compose's {C.SERVICE} image {image}")
    else:
        f.add("build.image", "pass", f"{b.image_digest} (measured through the compose-hash)")
    if b is None or b.lock_file is None:
        f.add("build.lock", "skip", "no dependency lock recorded (not a container build)")
    elif b.lock_mismatches:
        f.add("build.lock", "fail", f"the environment differed from {b.lock_file}: " + "; ".join(b.lock_mismatches[:5]))
    else:
        f.add("build.lock", "pass", f"{b.lock_file} sha256 {b.lock_sha256}; every pin installed")


def _audit_entries(root: Path) -> list[AuditEntry] | Exception:
    """The entries of audit.jsonl, or why they cannot be read."""
    try:
        return parse_lines(_read(root / B.AUDIT))
    except (OSError, AuditFormatError) as exc:
        return exc


def _audit(f: QuoteFindings, entries: list[AuditEntry] | Exception, config_bytes: bytes | None, m: B.Manifest,
           policy: Policy) -> None:
    if isinstance(entries, Exception):
        f.add("audit.chain", "fail", f"audit.jsonl unreadable: {entries}")
        return
    problems = chain_problems(entries)
    if not entries:
        problems.append("audit.jsonl is empty")
    else:
        first, last = entries[0], entries[-1]
        if first.type != "run.start" or last.type != "export":
            problems.append("the slice must run from a run.start entry to an export entry")
        if first.prev != m.audit.start_prev or first.seq != m.audit.first_seq or len(entries) != m.audit.entries:
            problems.append("slice start/length differ from the manifest")
        if last.hash != m.audit.head:
            problems.append("chain head differs from the manifest")
        if any(e.run_id != m.run_id for e in entries):
            problems.append("an entry belongs to another run")
        problems += commitment_problems(entries, m, config_bytes)
    f.add("audit.chain", "fail" if problems else "pass", "; ".join(problems) or f"{len(entries)} entries, head {m.audit.head[:16]}…")
    _audit_rtmr3(f, entries, m, policy)


def _config_bytes(root: Path) -> bytes | None:
    try:
        return _read(root / B.CONFIG)
    except OSError:
        return None


def _audit_rtmr3(f: QuoteFindings, entries: list[AuditEntry], m: B.Manifest, policy: Policy) -> None:
    if m.audit.rtmr3 == "unsupported":
        status = "fail" if policy.require_rtmr3_audit else "skip"
        f.add("audit.rtmr3", status, "the guest agent did not support EmitEvent: audit chain is bound by report_data only")
        return
    if f.boot is None:
        f.add("audit.rtmr3", "fail", "no usable event log to match the audit entries against")
        return
    measured: list[AuditEntry] = []
    for ev in f.boot.app_events:
        try:
            entry = parse_entry(ev.payload)
        except AuditFormatError:
            entry = None
        if entry is None or ev.event != entry.event_name:
            f.add("audit.rtmr3", "fail", f"RTMR3 app event {ev.event!r} (index {ev.index}) is not a cvm-tune audit entry")
            return
        measured.append(entry)
    problems = chain_problems(measured)
    lines = [e.line for e in entries]
    seen = [e.line for e in measured]
    # The run's entries from its last boot onward must be the tail of this boot's measured events;
    # earlier entries may have been measured in a previous boot (a resumed run starts with run.resume).
    start = next((i for i in range(len(lines)) if len(lines) - i <= len(seen) and seen[i - len(lines):] == lines[i:]), None)
    if start is None or (start > 0 and entries[start].type != "run.resume"):
        problems.append("the audit entries of this run are not the last events measured into RTMR3")
    f.add("audit.rtmr3", "fail" if problems else "pass",
          "; ".join(problems) or f"{len(lines) - (start or 0)} audit entries measured into RTMR3 and replayed")


def _gpu(f: QuoteFindings, root: Path, m: B.Manifest, events: tuple[Event, ...] | None = None,
         entries: list[AuditEntry] | Exception | None = None) -> None:
    dstack = boot_gpu_attestation(events)  # dstack's own boot-time GPU attestation, when the OS made one
    if m.gpu is None:
        if dstack is None:
            f.add("gpu.evidence", "skip", "the manifest records no GPU evidence (bundle from before cvm-tune collected it)")
        else:
            f.add("gpu.evidence", "pass" if dstack[0] else "fail", dstack[1])
        return
    try:
        data: bytes | None = _read(root / B.GPU_EVIDENCE)
    except OSError:
        data = None
    if entries is None:
        entries = _audit_entries(root)
    status, detail = gpu_check(data, m.gpu, entries if isinstance(entries, list) else [])
    if dstack is not None:
        status, detail = ("fail" if not dstack[0] else status), f"{detail}; {dstack[1]}"
    f.add("gpu.evidence", status, detail)


def _gpu_06(f: QuoteFindings, root: Path, m: B.Manifest, events: tuple[Event, ...] | None) -> None:
    """B12a: dstack 0.6's boot-time GPU evidence against the measured gpu-attestation event; then the verdict's GPU
    status (verified only when dstack's measured boot gate attested the GPUs)."""
    f.add("gpu.boot_evidence", *boot_evidence_step(events, _optional(root, B.GPU_BOOT_EVIDENCE)))
    f.gpu = gpu_status(events, m.gpu is not None and m.gpu.present, f.checks)
