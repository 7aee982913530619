"""``cvm-tune`` verifier commands: verify, publish, verify-quote, collateral (imported when used)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.cli import EXIT_REJECTED, _silence_stdout
from app.errors import ConfigError
from app.service.verify_page import browser_line
from attestation.io.safe_yaml import parse_json

if TYPE_CHECKING:
    from attestation import Verdict


def _verify(args: argparse.Namespace) -> int:
    from attestation import load_policy, read_collateral_file, verify_bundle

    if (args.bundle is None) == (args.chain is None):
        raise ConfigError("verify takes a BUNDLE or --chain EXPORTS_DIR (one of them)",
                          fix="cvm-tune verify exports/RUN_ID, or cvm-tune verify --chain exports/")
    if args.ops is not None and (args.chain is not None or args.parent is not None):
        raise ConfigError("--ops checks one training-API checkpoint", fix="drop --chain/--parent when passing --ops")
    if args.key_file is not None and not (args.replay and args.ops is None):
        raise ConfigError("--key-file is the dataset key for replaying a run", fix="cvm-tune verify BUNDLE --replay "
                          "--dataset DATASET.cvmds --key-file KEY (or drop --key-file)")
    if args.chain is not None and (args.parent or args.collateral or args.base_model or args.dataset):
        raise ConfigError("--chain verifies whole bundles: --parent, --collateral, --base-model and --dataset apply "
                          "to one BUNDLE", fix="drop them, or verify one bundle at a time")
    policy = load_policy(args.policy)
    now = args.now if args.now is not None else int(time.time())
    if args.chain is not None:
        return _verify_chain(args.chain, policy, now, as_json=args.json, hint=args.policy is None)
    _exports_dir_hint(args.bundle)
    coll = read_collateral_file(args.collateral) if args.collateral is not None else None
    from attestation.rounds.verify import is_round_bundle

    if is_round_bundle(args.bundle) and not (args.base_model or args.dataset):  # a federated round (docs/federated.md)
        if args.ops is not None:
            raise ConfigError("--ops checks a training-API checkpoint, not a federated round bundle",
                              fix="drop --ops, or pass the checkpoint's bundle")
        return _verify_round(args, policy, now, coll)
    from attestation.outputs.op_chain import OpsFileError

    from app.cli.adapter import identities

    try:
        verdict = verify_bundle(args.bundle, policy=policy, now=now, collateral=coll,
                                base_model_dir=args.base_model, dataset_file=args.dataset,
                                identities=identities(args.identity), ops_file=args.ops)
    except OpsFileError as exc:
        raise ConfigError(f"--ops: {exc}", fix="pass the JSONL of the ops as sent (docs/api.md)") from None
    if args.replay and args.ops is not None:  # the client's ops re-executed from the base model: its weights?
        from app.api.proof.replay import replay_check

        verdict = replay_check(verdict, args.bundle, args.ops, base_model_dir=args.base_model, progress=_stderr)
    elif args.replay:  # a nightly run re-executed from its configuration, base model and dataset
        from app.run.replay import replay_run

        verdict = replay_run(verdict, args.bundle, dataset=args.dataset, key_file=args.key_file,
                             base_model_dir=args.base_model, progress=_stderr)
    if args.parent is None:
        code = _print_verdict(verdict, as_json=args.json)  # op_chain.ops / op_chain.replay are checks of the verdict
        if not args.json:
            _print_ops(verdict)
        if not args.json and verdict.accepted:
            _print_objective(args.bundle)
        if not args.json and (line := browser_line(args.bundle, policy=verdict.test_root)):
            print(line)
        if args.policy is None:
            _simulator_hint([(args.bundle, verdict)])
        return code
    from attestation.bundle.lineage import check_link

    parent = verify_bundle(args.parent, policy=policy, now=now)
    code = _print_with_parent(verdict, parent, check_link(args.bundle, args.parent), as_json=args.json,
                              names=("bundle", "parent", f"parent {args.parent}", "lineage"),
                              linked="the bundle continued from this parent (manifest, adapter and base model hashes match)")
    if args.policy is None:
        _simulator_hint([(args.bundle, verdict), (args.parent, parent)])
    return code


def _print_ops(verdict: Verdict) -> None:
    """The op-chain and replay checks, one line each, whatever their result (why ``--ops``/``--replay`` were given)."""
    for c in verdict.checks:
        if c.name in ("op_chain.ops", "op_chain.replay", "training.replay"):
            label = "op chain" if c.name == "op_chain.ops" else "replay"
            print(f"{label}: {'pass' if c.status == 'pass' else 'FAIL'}: {c.detail}")


def _exports_dir_hint(path: Path) -> None:
    """BUNDLE names a directory of bundles (an output volume's exports/): say how to verify it, instead of "not a
    bundle".

    Raises:
        ConfigError: ``path`` holds no manifest.json but bundles that do (exit 2).
    """
    p = Path(path)
    if not p.is_dir() or (p / "manifest.json").exists() or (p / "round-manifest.json").exists():
        return
    try:
        runs = sorted(d.name for d in p.iterdir() if not d.name.startswith(".") and (d / "manifest.json").is_file())
    except OSError:
        return
    if runs:
        raise ConfigError(f"{p} is a directory of {len(runs)} export bundle(s), not one bundle",
                          fix=f"verify them all and their lineage: cvm-tune verify --chain {p} (or one: cvm-tune "
                          f"verify {p / runs[-1]})")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _manifest_block(bundle: Path, name: str) -> Any:
    """One top-level block of an accepted bundle's manifest.json (None when absent or unreadable)."""
    try:
        return parse_json((Path(bundle) / "manifest.json").read_bytes(), "manifest.json", ValueError).get(name)
    except (OSError, ValueError, AttributeError):
        return None  # an unreadable manifest is already a failed check


def _print_objective(bundle: Path) -> None:
    """The training objective the manifest records (bundles made before DPO record none: sft)."""
    training = _manifest_block(bundle, "training")
    if training is None:
        return
    dpo = training.get("dpo") if isinstance(training, dict) else None
    if isinstance(dpo, dict):
        print(f"objective: dpo (beta {dpo.get('beta')}, loss {dpo.get('loss_type')}, reference: {dpo.get('reference')})")
    else:
        print(f"objective: {training.get('objective', 'sft') if isinstance(training, dict) else 'sft'}")


def _print_with_parent(verdict: Verdict, parent: Verdict, problems: list[str], *, as_json: bool,
                       names: tuple[str, str, str, str], linked: str) -> int:
    """A verdict, its parent's and the link between them; ``names``: the two JSON keys, the parent's and the link's
    labels. Exit 0 only when both are accepted and the link holds."""
    ok = verdict.accepted and parent.accepted and not problems
    try:
        if as_json:
            print(json.dumps({"accepted": ok, names[0]: verdict.to_json(), names[1]: parent.to_json(),
                              "link_problems": problems}, indent=2))
        else:
            _write_verdict(verdict, as_json=False)
            print(f"{names[2]}: {parent.summary()}")
            for c in parent.failed:
                print(f"  FAIL {c.name}: {c.detail}")
            print(f"{names[3]}: " + (linked if not problems else "BROKEN: " + "; ".join(problems)))
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    return 0 if ok else EXIT_REJECTED


SIMULATOR_POLICY_FILE = "simulator-test-policy.yaml"  # app.export.stage writes it next to exports/ on a simulator run


def _simulator_hint(verdicts: list[tuple[Path, Verdict]]) -> None:
    """Under the default policy, a bundle whose quote chains to the cvm-tune simulator's TEST CA is rejected by
    design: say so on stderr (stdout keeps the verdict alone), with the ``--policy`` that verifies it."""
    for bundle, verdict in verdicts:
        quote = verdict.findings.quote
        if verdict.accepted or quote is None or not _simulator_chain(quote.pck_chain or b""):
            continue
        policy = bundle.resolve().parent.parent / SIMULATOR_POLICY_FILE
        where = (f"--policy {policy}" if policy.is_file() else f"--policy OUTPUT_DIR/{SIMULATOR_POLICY_FILE} (the run "
                 "that made it wrote it into its output directory; `cvm-tune simulator -o FILE` writes one)")
        print(f"hint: {bundle} was made by the cvm-tune simulator: its quote chains to the simulator's TEST CA, which "
              f"the default policy never trusts (expected). To check everything else, verify with {where}", file=sys.stderr)
        return


def _simulator_chain(pem: bytes) -> bool:
    """Is the last certificate of a quote's PCK chain one the cvm-tune simulator issued (``O=cvm-tune TEST ONLY``)?"""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from app.simulator.pki import TEST_ORG

    try:
        root = x509.load_pem_x509_certificates(pem.rstrip(b"\0"))[-1]
    except (ValueError, IndexError):
        return False
    return any(a.value == TEST_ORG for a in root.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME))


def _verify_chain(exports: Path, policy: Any, now: int, *, as_json: bool, hint: bool = False) -> int:
    from attestation.bundle.lineage import verify_chain

    report = verify_chain(exports, policy=policy, now=now)
    broken = report.first_broken
    try:
        if as_json:
            print(json.dumps(report.to_json(), indent=2))
        else:
            print(f"{len(report.links)} bundle(s) in {exports}, policy {policy.name}, roots first:")
            for link in report.links:
                where = f"<- {link.parent_run_id}" if link.parent_run_id else "root (from the base model)"
                mark = " (PROMOTED)" if link.run_id == report.promoted else ""
                print(f"  {'ok  ' if link.ok else 'FAIL'} {link.run_id}{mark}  {where}")
                for c in link.verdict.failed:
                    print(f"         {c.name}: {c.detail}")
                for problem in link.link_problems:
                    print(f"         lineage: {problem}")
            print("chain verified: every bundle accepted and every link holds" if broken is None
                  else f"first broken link: {broken.run_id}")
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    if hint:
        _simulator_hint([(link.bundle, link.verdict) for link in report.links])
    return 0 if broken is None else EXIT_REJECTED


def _publish(args: argparse.Namespace) -> int:
    import tempfile

    from attestation import load_policy, verify_bundle

    from app.export import hub

    repo = hub.check_repo_id(args.repo)
    policy = load_policy(args.policy)
    verdict = verify_bundle(args.bundle, policy=policy, now=args.now if args.now is not None else int(time.time()))
    if not verdict.accepted:
        _print_verdict(verdict, as_json=False)
        print(f"refused: the bundle is rejected under policy {policy.name}; nothing was uploaded", file=sys.stderr)
        return EXIT_REJECTED
    if args.stage_only is not None:
        print(f"staged {hub.stage_repo(args.bundle, args.stage_only)} (verified; not uploaded)")
        _ciphertext_note(args.bundle)
        return 0
    with tempfile.TemporaryDirectory(prefix="cvm-tune-publish-") as tmp:
        folder = hub.stage_repo(args.bundle, Path(tmp) / "repo")
        url = hub.upload(folder, repo, private=args.private, message=f"cvm-tune bundle {args.bundle.resolve().name}")
    print(f"published {args.bundle} (verified under {policy.name}) to {url}")
    _ciphertext_note(args.bundle)
    return 0


def _ciphertext_note(bundle: Path) -> None:
    """Say so when the published weights are age ciphertext: the Hub's loaders cannot read them as they are."""
    conf = _manifest_block(bundle, "confidentiality")
    if isinstance(conf, dict):
        n = len(conf.get("recipients") or ())
        print(f"note: the weight files are age ciphertext to {n} recipient(s), named NAME.age, not loadable as they "
              "are: a recipient decrypts each with `age -d -i KEY -o NAME NAME.age`, or runs `cvm-tune adapter "
              "decrypt` on the bundle")


def _print_verdict(verdict: Verdict, *, as_json: bool) -> int:
    """Print the verdict; its exit code stands even when the reader closes the pipe early (``| head -1``)."""
    try:
        _write_verdict(verdict, as_json=as_json)
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    return 0 if verdict.accepted else EXIT_REJECTED


def _write_verdict(verdict: Verdict, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(verdict.to_json(), indent=2))
    else:
        print(verdict.summary())
        for c in verdict.checks:
            if c.status != "pass":
                print(f"{c.status.upper():4} {c.name}: {c.detail}")
            elif c.name == "gpu.evidence":
                print(f"GPU: {c.detail}")  # shown even when intact: CC off / no GPU is for the reader to judge
            elif c.name == "privacy.dp":
                print(f"differential privacy: {c.detail}")  # the guarantee the adapter was trained under
        if verdict.accepted:
            passed = sum(c.status == "pass" for c in verdict.checks)
            print(f"{passed} checks passed; TCB {verdict.findings.tcb_status}")


def _verify_quote(args: argparse.Namespace) -> int:
    from attestation import load_policy, parse_report_data_hex, read_collateral_file, read_event_log_file
    from attestation.errors import QuoteParseError
    from attestation.tdx.inputs import (MAX_QUOTE_INPUT_BYTES, attest_answer, decode_quote_input_with_log, event_log_from_json,
                                        getquote_mr_config, read_bounded)
    from attestation.verify import attest_verdict, quote_verdict

    policy = load_policy(args.policy)
    data = read_bounded(args.quote, MAX_QUOTE_INPUT_BYTES, QuoteParseError, "quote")
    coll = read_collateral_file(args.collateral) if args.collateral is not None else None
    events = read_event_log_file(args.event_log) if args.event_log is not None else None
    expected = parse_report_data_hex(args.report_data) if args.report_data is not None else None
    mr_config = _mr_config_file(args.mr_config) if args.mr_config is not None else None
    now = args.now if args.now is not None else int(time.time())
    answer = attest_answer(data)
    if answer is not None:  # an Attest answer: {"attestation": hex(VersionedAttestation)}
        verdict = attest_verdict(answer, source=str(args.quote), policy=policy, now=now, collateral=coll, events=events,
                                 expected_report_data=expected, mr_config=mr_config)
        return _print_verdict(verdict, as_json=args.json)
    raw, embedded_log = decode_quote_input_with_log(data, source=str(args.quote))
    if events is None and embedded_log is not None:
        events = event_log_from_json({"event_log": embedded_log}, source=f"{args.quote} event_log")
    verdict = quote_verdict(raw, policy=policy, now=now, collateral=coll, events=events, expected_report_data=expected,
                            mr_config=mr_config if mr_config is not None else getquote_mr_config(data))
    return _print_verdict(verdict, as_json=args.json)


def _mr_config_file(path: Path) -> bytes:
    """The exact bytes of a MrConfigV3 document file (hashed as they are; at most 64 KiB)."""
    from attestation.compose.app_compose import ComposeError
    from attestation.compose.mr_config import MAX_DOCUMENT
    from attestation.tdx.inputs import read_bounded

    return read_bounded(path, MAX_DOCUMENT, ComposeError, "MrConfigV3 document")


def _collateral(args: argparse.Namespace) -> int:
    from attestation import read_quote_file
    from attestation.tdx.pccs import PHALA_PCCS_URL, fetch_collateral, save_collateral

    raw = read_quote_file(args.quote)
    url = args.pccs or PHALA_PCCS_URL
    text = fetch_collateral(raw, pccs_url=url, timeout=args.timeout, retries=args.retries)
    save_collateral(args.output, text)
    obj = json.loads(text)
    tcb = json.loads(obj["tcb_info"])
    print(f"wrote {args.output}: collateral from {url} for FMSPC {tcb.get('fmspc')}, TCB info issued "
          f"{tcb.get('issueDate')}, next update {tcb.get('nextUpdate')}, tcbEvaluationDataNumber "
          f"{tcb.get('tcbEvaluationDataNumber')}")
    return 0


def _verify_round(args: argparse.Namespace, policy: Any, now: int, collateral: Any) -> int:
    """Verify ``args.bundle`` (and with ``--parent``, the previous round and the link); 0 accepted, 1 rejected."""
    from attestation.rounds.verify import check_round_link, verify_round

    from app.cli.adapter import identities

    verdict = verify_round(args.bundle, policy=policy, now=now, collateral=collateral,
                           identities=identities(args.identity))  # secure aggregation: recompute if they decrypt
    if args.parent is None:
        code = _print_verdict(verdict, as_json=args.json)
        if not args.json:  # who was admitted or rejected, and the aggregate (what the checks were about)
            from app.cli.federated import round_summary

            for line in round_summary(args.bundle):
                print(line)
        return code
    parent = verify_round(args.parent, policy=policy, now=now)
    return _print_with_parent(verdict, parent, check_round_link(args.bundle, args.parent), as_json=args.json,
                              names=("round", "previous", f"previous round {args.parent}", "link"),
                              linked="this round continued the previous one (manifest hash, round number, global "
                              "adapter)")
