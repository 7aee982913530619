"""``cvm-tune`` command line. The only module that prints (with ``app.cli_owner``, the data owner's commands).

Exit codes (also in docs/exit-codes.md):
  0  success / bundle or quote accepted
  1  verification rejected (one line per failed check)
  2  usage, config, policy or input error (missing file, unreadable bundle or quote)
  3  dataset error   4  key error   5  guest agent / attestation error
  6  training error  7  state / export error   70  internal error (bug: rerun with --debug)
  130 interrupted     141 stdout closed by its reader (verify/verify-quote keep the verdict's code)
``--debug`` adds the traceback and keeps the code. ``run``/``serve`` when another process holds the output volume's lock: "skipped: locked", exit 0.
A SIGTERM during ``run``/``serve`` checkpoints at the next step boundary and exits 0.
``status --health``: 0 healthy, 1 unhealthy (one line saying why).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from attestation import AttestationError, Verdict

import app
from app import cli_owner
from app.errors import ConfigError, CvmTuneError, InputsUnchanged

EXIT_REJECTED = 1
EXIT_INTERNAL = 70
EXIT_BROKEN_PIPE = 141  # as a shell reports a process killed by SIGPIPE
MAX_UNIX_SECONDS = 253402300799  # 9999-12-31T23:59:59Z: the latest time a certificate or collateral date can name


def _bounded_int(lo: int, hi: int):
    """argparse type: an integer in [lo, hi] (out of range is a usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside {lo}..{hi}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cvm-tune",
        description="Attested LoRA fine-tuning for dstack confidential VMs: train on an encrypted dataset, "
        "export the adapter with a TDX quote, verify it offline.",
        epilog="Exit codes: 0 ok, 1 rejected, 2 usage/input, 3 data, 4 key, 5 attestation, 6 training, 7 state, 70 bug.",
    )
    p.add_argument("--version", action="version", version=f"cvm-tune {app.__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run one attested training run now",
                       description="Decrypt the dataset, train a LoRA adapter, export it with a TDX quote and verify it. "
                       "Without --config: the embedded demo (simulator, bundled sample data, tiny local model).")
    r.add_argument("--config", type=Path, metavar="FILE", help="YAML configuration (see `cvm-tune schema`)")
    r.add_argument("--run-id", metavar="ID", help="name the run (resumes it if unfinished); default: a new timestamped id "
                   "or the newest unfinished run with the same inputs")

    sv = sub.add_parser("serve", help="the nightly service: run each scheduled slot once (what the container runs)",
                        description="Run one attested training per calendar day at schedule.time in schedule.timezone: "
                        "one catch-up run after downtime, retries with backoff, overrun slots skipped, SIGTERM = "
                        "checkpoint and exit 0. A second process on the same output volume logs 'skipped: locked', exits 0.")
    sv.add_argument("--config", type=Path, metavar="FILE", help="YAML configuration (see `cvm-tune schema`)")
    sv.add_argument("--once", action="store_true", help="run the due slot (if any) and exit, for cron-like use")

    st = sub.add_parser("status", help="show the last runs and the next slot of the service",
                        description="Print the run database (last runs, status, reasons, bundles) and the next slot. "
                        "--health: exit 0 only when the heartbeat is fresh and the newest slot is not finally failed.")
    st.add_argument("--config", type=Path, metavar="FILE", help="YAML configuration (see `cvm-tune schema`)")
    st.add_argument("--health", action="store_true", help="health check for Docker HEALTHCHECK: exit 0 healthy, 1 not")
    st.add_argument("--json", action="store_true", help="machine-readable status (schema cvm-tune/status/v1)")
    st.add_argument("-n", type=_bounded_int(1, 10_000), default=10, metavar="N", help="rows to show (default 10)")

    v = sub.add_parser("verify", help="verify an export bundle (or a federated round bundle, recursively)",
                       description="Check a bundle's quote (dcap-qvl), report_data binding, file hashes, RTMR0-3 replay "
                       "and audit chain under a policy. Exit 0 accepted, 1 rejected, 2 input error.")
    v.add_argument("bundle", type=Path, nargs="?", metavar="BUNDLE", help="the exports/<run_id> directory")
    v.add_argument("--parent", type=Path, metavar="PARENT_BUNDLE", help="also verify the bundle BUNDLE continued from "
                   "(for a federated round: the previous round) and the link between them")
    v.add_argument("--chain", type=Path, metavar="EXPORTS_DIR", help="instead of BUNDLE: verify every bundle in an "
                   "exports/ directory and every lineage link, roots first; names the first broken link")
    v.add_argument("--policy", type=Path, metavar="FILE", help="YAML policy (default: built-in, Intel root, UpToDate only)")
    v.add_argument("--now", type=_bounded_int(0, MAX_UNIX_SECONDS), metavar="UNIX_SECONDS", help="verification time (default: now); pins time for tests")
    v.add_argument("--json", action="store_true", help="print the machine-readable verdict (schema cvm-tune/verdict/v1)")
    v.add_argument("--collateral", type=Path, metavar="FILE", help="use this collateral JSON instead of the bundle's")
    v.add_argument("--base-model", type=Path, metavar="DIR", help="also check a local copy of the base model against the manifest")
    v.add_argument("--dataset", type=Path, metavar="FILE", help="also check the encrypted dataset file against the manifest")

    pu = sub.add_parser("publish", help="upload a verified bundle to the Hugging Face Hub (network)",
                        description="Verify BUNDLE under the policy, then upload it as a Hub model repository: the PEFT "
                        "adapter (with tokenizer and model.sig) at the root, the model card as README.md, every other "
                        "bundle file under attestation/. Token: HF_TOKEN or `hf auth login`. A rejected bundle is never "
                        "uploaded. Exit 0 published, 1 rejected, 2 input error, 7 upload error.")
    pu.add_argument("bundle", type=Path, metavar="BUNDLE", help="the exports/<run_id> directory")
    pu.add_argument("--repo", required=True, metavar="OWNER/NAME", help="Hub model repository (created if missing)")
    pu.add_argument("--policy", type=Path, metavar="FILE", help="YAML policy (default: built-in, Intel root, UpToDate only)")
    pu.add_argument("--now", type=int, metavar="UNIX_SECONDS", help="verification time (default: now)")
    pu.add_argument("--private", action="store_true", help="create the repository private")
    pu.add_argument("--stage-only", type=Path, metavar="DIR", help="write the folder that would be uploaded to DIR "
                    "(new or empty) and stop: no network, no token")

    q = sub.add_parser("verify-quote", help="verify a TDX quote (raw, hex or GetQuote JSON) under a policy",
                       description="Check one quote: dcap-qvl signature chain and TCB, collateral window, TD attributes, "
                       "report_data (when given), RTMR0-3 replayed from the event log, boot events and event names, and the "
                       "policy's measurement pins. Offline: pass collateral fetched with `cvm-tune collateral`. "
                       "Exit 0 accepted, 1 rejected, 2 input error.")
    q.add_argument("quote", type=Path, metavar="QUOTE", help="raw quote bytes, hex text (0x/whitespace ok) or a dstack "
                   "GetQuote JSON response (its event_log is used unless --event-log is given)")
    q.add_argument("--collateral", type=Path, metavar="FILE", help="collateral JSON (dcap-qvl QuoteCollateralV3)")
    q.add_argument("--event-log", type=Path, metavar="FILE", help="dstack event log: a JSON list, or JSON with an event_log member")
    q.add_argument("--report-data", metavar="HEX", help="expected report_data (at most 64 bytes; shorter is zero-padded)")
    q.add_argument("--policy", type=Path, metavar="FILE", help="YAML policy (default: built-in, Intel root, UpToDate only)")
    q.add_argument("--now", type=_bounded_int(0, MAX_UNIX_SECONDS), metavar="UNIX_SECONDS", help="verification time (default: now); pins time for tests")
    q.add_argument("--json", action="store_true", help="print the machine-readable verdict (schema cvm-tune/verdict/v1)")

    co = sub.add_parser("collateral", help="fetch a quote's collateral from a PCCS (network)",
                        description="Fetch the Intel collateral for QUOTE from a PCCS, as dcap-qvl's get_collateral does, "
                        "and write it as JSON for `verify-quote --collateral` / `verify --collateral`. The only command "
                        "that uses the network. Exit 0 written, 2 error.")
    co.add_argument("quote", type=Path, metavar="QUOTE", help="raw quote bytes, hex text or a GetQuote JSON response")
    co.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="where to write the collateral JSON")
    co.add_argument("--pccs", metavar="URL", help="PCCS base URL (default: https://pccs.phala.network, dcap-qvl's default)")
    co.add_argument("--timeout", type=float, default=15.0, metavar="SECONDS", help="per-request timeout (default 15)")
    co.add_argument("--retries", type=int, default=3, metavar="N", help="retries per request on network errors and "
                    "HTTP 429/5xx, with backoff (default 3)")

    s = sub.add_parser("simulator", help="serve the simulated dstack guest agent (TEST CA, not a TEE)",
                       description="Serve the dstack guest-agent protocol (Info, GetQuote, GetKey, EmitEvent, Version, ...) "
                       "with quotes signed by a deterministic TEST CA. Point the app at it with DSTACK_SIMULATOR_ENDPOINT.")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--socket", type=Path, metavar="PATH", help="unix socket path (default: ./dstack.sock)")
    where.add_argument("--port", type=int, metavar="N", help="serve on 127.0.0.1:N instead of a socket")
    s.add_argument("--emit-event", choices=("accept", "noop", "reject"), default="accept",
                   help="EmitEvent behaviour: accept (dstack OS 0.5.x), noop (simulator 0.5.3-0.5.8), reject (>= 0.5.9)")
    s.add_argument("--write-policy", type=Path, metavar="FILE", help="write a policy trusting this simulator's TEST CA and exit")

    s.add_argument("--app-compose", type=Path, metavar="FILE", help="serve this app-compose.json (its SHA-256 becomes the compose-hash)")

    _deploy_parsers(sub)
    sub.add_parser("schema", help="print the configuration JSON schema")
    c = sub.add_parser("validate-config", help="check a configuration file and print the resolved config")
    c.add_argument("config", type=Path, metavar="FILE")
    cli_owner.add_parsers(sub)
    return p


def _deploy_parsers(sub: argparse._SubParsersAction) -> None:
    """compose-hash, app-compose, env encrypt, bundles (the dstack deployment tools; docs/deploy.md)."""
    h = sub.add_parser("compose-hash", help="dstack's compose-hash and app-id of an app-compose.json, and its audit",
                       description="SHA-256 of the exact file bytes (what the CVM measures into RTMR3 and MRCONFIGID), the "
                       "app-id it implies, and what must change before it can be trusted. Exit 1 if the audit finds anything.")
    h.add_argument("app_compose", type=Path, nargs="?", default=Path("app-compose.json"), metavar="APP_COMPOSE_JSON")
    h.add_argument("--app-id", metavar="HEX", help="the app id your KMS deployment pinned (kms_enabled: the file alone cannot say)")
    h.add_argument("--json", action="store_true", help="print JSON")

    a = sub.add_parser("app-compose", help="write the deployable docker-compose.yaml and app-compose.json for an image",
                       description="Put the pushed image's digest into docker-compose.yaml and write app-compose.json as "
                       "dstack's vmm-cli does (or the normalized form Phala Cloud shows); print compose-hash and app-id.")
    a.add_argument("--image", required=True, metavar="REF@sha256:DIGEST", help="the pushed image, pinned by digest")
    a.add_argument("--bundles-token-sha256", metavar="HEX", help="SHA-256 of the bundle server's token (cvm-tune bundles token FILE)")
    a.add_argument("--compose", type=Path, default=Path("docker-compose.yaml"), metavar="FILE", help="template (default: %(default)s)")
    a.add_argument("--out-dir", type=Path, default=Path("deploy"), metavar="DIR", help="output directory (default: %(default)s)")
    a.add_argument("--name", default="cvm-tune", help="app name in app-compose.json")
    a.add_argument("--format", choices=("vmm-cli", "normalized"), default="vmm-cli",
                   help="vmm-cli: indent 4, dstack's vmm-cli.py; normalized: sorted compact JSON (dstack-sdk get_compose_hash)")
    a.add_argument("--no-kms", action="store_true", help="kms_enabled false (keys then die with the CVM unless a local key provider is on)")
    a.add_argument("--no-gateway", action="store_true", help="gateway_enabled false (no way to reach the bundle server)")
    a.add_argument("--local-key-provider", action="store_true", help="local_key_provider_enabled true (SGX local key provider)")
    a.add_argument("--key-provider-id", default="", metavar="HEX")
    a.add_argument("--allowed-env", action="append", default=[], metavar="NAME", help="extra allowed_envs name (repeatable)")

    e = sub.add_parser("env", help="dstack encrypted environment variables").add_subparsers(dest="env_command", required=True, metavar="ACTION")
    ee = e.add_parser("encrypt", help="encrypt variables to a CVM's env public key (dstack-sdk)",
                      description="Values come from a file or this process's environment, never the command line. Encrypted env "
                      "is confidential but forgeable by the host: see docs/deploy.md, 'Secrets and encrypted env'.")
    ee.add_argument("--public-key", required=True, metavar="HEX", help="the app's env encryption public key (X25519)")
    src = ee.add_mutually_exclusive_group(required=True)
    src.add_argument("--env-file", type=Path, metavar="FILE", help="NAME=value lines")
    src.add_argument("--from-env", nargs="+", metavar="NAME", help="take these variables from the environment")
    ee.add_argument("--app-compose", type=Path, metavar="FILE", help="refuse names missing from its allowed_envs")
    ee.add_argument("--kms-signature", metavar="HEX", help="signature_v1 from the KMS (verified before encrypting)")
    ee.add_argument("--app-id", metavar="HEX", help="with --kms-signature")
    ee.add_argument("--timestamp", type=int, metavar="UNIX_SECONDS", help="with --kms-signature")
    ee.add_argument("--kms-signer", metavar="HEX", help="the KMS signer's compressed secp256k1 key you trust")
    ee.add_argument("-o", "--output", type=Path, metavar="FILE", help="write the hex blob here (default: stdout)")

    b = sub.add_parser("bundles", help="serve or fetch export bundles (the way out of a CVM)").add_subparsers(
        dest="bundles_command", required=True, metavar="ACTION")
    bt = b.add_parser("token", help="write a new bearer token file and print the SHA-256 to pin in docker-compose.yaml")
    bt.add_argument("file", type=Path, metavar="FILE")
    bs = b.add_parser("serve", help="read-only HTTP server over the output volume (the compose's bundles service)")
    bs.add_argument("--output", type=Path, default=Path("/data/output"), metavar="DIR", help="output volume (default: %(default)s)")
    bs.add_argument("--port", type=int, default=8000)
    bs.add_argument("--host", default="0.0.0.0")
    for name, what in (("list", "list the server's runs"), ("fetch", "download a bundle (then: cvm-tune verify DIR/RUN_ID)")):
        bc = b.add_parser(name, help=what)
        bc.add_argument("url", metavar="URL", help="the bundle server, e.g. https://<app-id>-8000.<gateway domain>")
        bc.add_argument("--token-file", type=Path, required=True, metavar="FILE")
        if name == "fetch":
            bc.add_argument("run_id", metavar="RUN_ID")
            bc.add_argument("-o", "--out-dir", type=Path, default=Path("."), metavar="DIR")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except (CvmTuneError, AttestationError) as exc:
        if args.debug:  # the traceback, and still the documented exit code
            traceback.print_exc()
        print(f"error: {exc.message}", file=sys.stderr)
        print(f"fix: {exc.fix}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`cvm-tune verify … | head -1`): its verdict was already decided
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # a bug: one line, no traceback unless --debug
        if args.debug:
            traceback.print_exc()
        print(f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        print("fix: rerun with --debug and report the traceback", file=sys.stderr)
        return EXIT_INTERNAL


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _stop_on_sigterm() -> list[str]:
    """SIGTERM/SIGINT set a flag the trainer polls at every step boundary (checkpoint, then stop)."""
    import signal

    flag: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: flag.append(signal.Signals(signum).name))
    return flag


def _run(args: argparse.Namespace) -> int:
    from app.config import load_config
    from app.pipeline import RunHooks, run_once
    from app.state import Locked, run_lock
    from app.training import TrainingStopped

    cfg = load_config(args.config)
    flag = _stop_on_sigterm()
    hooks = RunHooks(should_stop=lambda: f"{flag[0]} received" if flag else None)
    try:
        with run_lock(cfg.output.dir):
            res = run_once(cfg, progress=lambda m: print(m, flush=True), run_id=args.run_id, hooks=hooks)
    except Locked as exc:
        print(f"skipped: locked ({exc} is held by another cvm-tune process)", flush=True)
        return 0
    except TrainingStopped as exc:
        print(f"stopped: {exc.message}; run again to resume", flush=True)
        return 0
    except InputsUnchanged as exc:
        print(f"skipped: {exc.message} (nothing new to train on)", flush=True)
        return 0
    print()
    print(f"Export bundle: {res.bundle_dir}" + ("" if res.promoted else f" (not promoted: {res.promotion_refused})"))
    for name, verdict in res.verdicts:
        failed = ", ".join(c.name for c in verdict.failed)
        note = " (expected: the simulator's test CA is not trusted by the default policy)" if (
            failed and res.policy_file and name == "default") else ""
        print(f"Verdict ({name}): {verdict.summary()}" + (f" — failed: {failed}" if failed else "") + note)
    cmd = f"cvm-tune verify {res.bundle_dir}" + (f" --policy {res.policy_file}" if res.policy_file else "")
    print(f"Verify again: {cmd}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from app.config import load_config
    from app.scheduler import serve

    cfg = load_config(args.config)
    outcome = serve(cfg, once=args.once, progress=lambda m: print(m, flush=True))
    print(f"service: {outcome}", flush=True)
    return 0


def _status(args: argparse.Namespace) -> int:
    from app.config import load_config
    from app.status import render_status

    cfg = load_config(args.config)
    if args.health:
        from app.scheduler import health

        ok, why = health(cfg)
        print(why)
        return 0 if ok else EXIT_REJECTED
    print(render_status(cfg, limit=args.n, as_json=args.json))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from attestation import load_policy, read_collateral_file, verify_bundle

    if (args.bundle is None) == (args.chain is None):
        raise ConfigError("verify takes a BUNDLE or --chain EXPORTS_DIR (one of them)",
                          fix="cvm-tune verify exports/RUN_ID, or cvm-tune verify --chain exports/")
    if args.chain is not None and (args.parent or args.collateral or args.base_model or args.dataset):
        raise ConfigError("--chain verifies whole bundles: --parent, --collateral, --base-model and --dataset apply "
                          "to one BUNDLE", fix="drop them, or verify one bundle at a time")
    policy = load_policy(args.policy)
    now = args.now if args.now is not None else int(time.time())
    if args.chain is not None:
        return _verify_chain(args.chain, policy, now, as_json=args.json)
    coll = read_collateral_file(args.collateral) if args.collateral is not None else None
    from attestation.round_verify import is_round_bundle

    if is_round_bundle(args.bundle) and not (args.base_model or args.dataset):  # a federated round (docs/federated.md)
        from app.federated.verify_cli import verify_round_cli

        return verify_round_cli(args, policy, now, coll)
    verdict = verify_bundle(args.bundle, policy=policy, now=now, collateral=coll,
                            base_model_dir=args.base_model, dataset_file=args.dataset)
    if args.parent is None:
        return _print_verdict(verdict, as_json=args.json)
    from attestation.lineage import check_link

    parent = verify_bundle(args.parent, policy=policy, now=now)
    return _print_with_parent(verdict, parent, check_link(args.bundle, args.parent), as_json=args.json,
                              names=("bundle", "parent", f"parent {args.parent}", "lineage"),
                              linked="the bundle continued from this parent (manifest, adapter and base model hashes match)")


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


def _verify_chain(exports: Path, policy: Any, now: int, *, as_json: bool) -> int:
    from attestation.lineage import verify_chain

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
    return 0 if broken is None else EXIT_REJECTED


def _publish(args: argparse.Namespace) -> int:
    import tempfile

    from attestation import load_policy, verify_bundle

    from app import hub

    repo = hub.check_repo_id(args.repo)
    policy = load_policy(args.policy)
    verdict = verify_bundle(args.bundle, policy=policy, now=args.now if args.now is not None else int(time.time()))
    if not verdict.accepted:
        _print_verdict(verdict, as_json=False)
        print(f"refused: the bundle is rejected under policy {policy.name}; nothing was uploaded", file=sys.stderr)
        return EXIT_REJECTED
    if args.stage_only is not None:
        print(f"staged {hub.stage_repo(args.bundle, args.stage_only)} (verified; not uploaded)")
        return 0
    with tempfile.TemporaryDirectory(prefix="cvm-tune-publish-") as tmp:
        folder = hub.stage_repo(args.bundle, Path(tmp) / "repo")
        url = hub.upload(folder, repo, private=args.private, message=f"cvm-tune bundle {args.bundle.resolve().name}")
    print(f"published {args.bundle} (verified under {policy.name}) to {url}")
    return 0


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
        if verdict.accepted:
            passed = sum(c.status == "pass" for c in verdict.checks)
            print(f"{passed} checks passed; TCB {verdict.findings.tcb_status}")


def _verify_quote(args: argparse.Namespace) -> int:
    from attestation import load_policy, parse_report_data_hex, read_collateral_file, read_event_log_file, read_quote_input
    from attestation.inputs import event_log_from_json
    from attestation.verify import quote_verdict

    policy = load_policy(args.policy)
    raw, embedded_log = read_quote_input(args.quote)
    coll = read_collateral_file(args.collateral) if args.collateral is not None else None
    if args.event_log is not None:
        events = read_event_log_file(args.event_log)
    elif embedded_log is not None:
        events = event_log_from_json({"event_log": embedded_log}, source=f"{args.quote} event_log")
    else:
        events = None
    expected = parse_report_data_hex(args.report_data) if args.report_data is not None else None
    now = args.now if args.now is not None else int(time.time())
    verdict = quote_verdict(raw, policy=policy, now=now, collateral=coll, events=events, expected_report_data=expected)
    return _print_verdict(verdict, as_json=args.json)


def _collateral(args: argparse.Namespace) -> int:
    from attestation import read_quote_file
    from attestation.pccs import PHALA_PCCS_URL, fetch_collateral, save_collateral

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


def _simulator(args: argparse.Namespace) -> int:
    from attestation.policy import policy_file_text, simulator_policy

    from app.simulator import GuestAgentSimulator, SimulatorServer, SimulatorSettings

    app_compose = None
    if args.app_compose is not None:
        try:
            app_compose = args.app_compose.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {args.app_compose}: {exc}") from exc
    sim = GuestAgentSimulator(SimulatorSettings(emit_event=args.emit_event, app_compose=app_compose))
    if args.write_policy:
        args.write_policy.write_text(policy_file_text(simulator_policy(sim.test_root_ca_der)))
        print(f"wrote {args.write_policy}")
        return 0
    if args.port is not None:
        server = SimulatorServer(sim, port=args.port)
    else:
        server = SimulatorServer(sim, socket_path=args.socket or Path("dstack.sock"))
    server.start()
    print(f"cvm-tune dstack simulator (TEST CA — NOT a TEE) listening on {server.endpoint}", flush=True)
    print(f"use it with: export DSTACK_SIMULATOR_ENDPOINT={os.path.abspath(server.endpoint) if args.port is None else server.endpoint}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.stop()
    return 0


def _schema(_args: argparse.Namespace) -> int:
    from app.config import Config

    print(json.dumps(Config.model_json_schema(), indent=2))
    return 0


def _validate_config(args: argparse.Namespace) -> int:
    from app.config import load_config

    print(json.dumps(load_config(args.config).model_dump(mode="json"), indent=2))
    return 0


def _compose_hash(args: argparse.Namespace) -> int:
    from attestation import compose as C

    try:
        raw = args.app_compose.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {args.app_compose}: {exc.strerror}", fix="pass the app-compose.json to hash") from exc
    doc = C.load(raw)
    digest = C.compose_hash(raw)
    out = {"compose_hash": digest, "app_id": C.app_id(doc, digest, pinned_app_id=args.app_id),
           "mr_config_id": C.mr_config_id_v1(digest), "kms_enabled": bool(doc.get("kms_enabled")),
           "images": C.images(doc) if doc.get("runner") == "docker-compose" else {}, "problems": C.audit(doc)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"compose-hash  {digest}")
        print(f"app-id        {out['app_id'] or 'assigned by the KMS deployment (pass --app-id): not derivable from the file'}")
        print(f"mr_config_id  {out['mr_config_id']}")
        for svc, ref in out["images"].items():
            print(f"image         {svc}: {ref}")
        for problem in out["problems"]:
            print(f"PROBLEM       {problem}")
    return EXIT_REJECTED if out["problems"] else 0


def _app_compose(args: argparse.Namespace) -> int:
    from attestation.compose import AppComposeSettings

    from app.deploy import render_deployment

    try:
        template = args.compose.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {args.compose}: {exc}") from exc
    settings = AppComposeSettings(name=args.name, kms_enabled=not args.no_kms, gateway_enabled=not args.no_gateway,
                                  local_key_provider_enabled=args.local_key_provider, key_provider_id=args.key_provider_id,
                                  allowed_envs=tuple(args.allowed_env))
    dep = render_deployment(template, args.image, settings, bundles_token_sha256=args.bundles_token_sha256, style=args.format)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "docker-compose.yaml").write_text(dep.docker_compose)
    (args.out_dir / "app-compose.json").write_bytes(dep.app_compose)
    print(f"wrote {args.out_dir / 'docker-compose.yaml'} and {args.out_dir / 'app-compose.json'}")
    print(f"compose-hash  {dep.compose_hash}")
    print(f"app-id        {dep.app_id} (unless your KMS deployment pins another: then the KMS's)")
    return 0


def _env(args: argparse.Namespace) -> int:
    from attestation.compose import load

    from app.deploy import check_env, encrypt_env, read_env_file, verify_public_key

    if args.env_file is not None:
        values = read_env_file(args.env_file)
    else:
        missing = [n for n in args.from_env if n not in os.environ]
        if missing:
            raise ConfigError(f"not set in the environment: {missing}")
        values = {n: os.environ[n] for n in args.from_env}
    allowed = None
    if args.app_compose is not None:
        try:
            allowed = list(load(args.app_compose.read_bytes()).get("allowed_envs") or [])
        except OSError as exc:
            raise ConfigError(f"cannot read {args.app_compose}: {exc.strerror}") from exc
    check_env(values, allowed)
    if args.kms_signature:
        if not (args.app_id and args.timestamp is not None and args.kms_signer):
            raise ConfigError("--kms-signature needs --app-id, --timestamp and --kms-signer")
        verify_public_key(args.public_key, args.kms_signature, args.app_id, args.timestamp, args.kms_signer)
    else:
        print("warning: the env public key is not authenticated (no --kms-signature): make sure it comes from your KMS",
              file=sys.stderr)
    blob = encrypt_env(values, args.public_key)
    if args.output is not None:
        args.output.write_text(blob + "\n")
        print(f"encrypted {len(values)} variables ({', '.join(sorted(values))}) to {args.output}", file=sys.stderr)
    else:
        print(blob)
    return 0


def _bundles(args: argparse.Namespace) -> int:
    from app import bundles

    if args.bundles_command == "token":
        digest = bundles.new_token(args.file)
        print(f"wrote {args.file} (mode 0600). Pin its hash in docker-compose.yaml:")
        print(f"  {bundles.TOKEN_ENV}={digest}")
        return 0
    if args.bundles_command == "serve":
        server = bundles.BundleServer(args.output, os.environ.get(bundles.TOKEN_ENV, ""), host=args.host, port=args.port)
        print(f"cvm-tune bundle server (read-only) on {server.url} for {args.output}", flush=True)
        try:
            server.serve_forever()
        finally:
            server.server_close()
        return 0
    token = bundles.read_token(args.token_file)
    if args.bundles_command == "list":
        for r in bundles.list_runs(args.url, token):
            print(f"{r['run_id']:40} {str(r['status']):10} {str(r['started_at']):22} {'exported' if r['exported'] else ''}")
        return 0
    out = bundles.fetch(args.url, args.run_id, args.out_dir, token)
    print(f"fetched {out}")
    print(f"verify it: cvm-tune verify {out} --policy YOUR_POLICY.yaml")
    return 0


_COMMANDS = {"run": _run, "serve": _serve, "status": _status, "verify": _verify, "publish": _publish, "verify-quote": _verify_quote,
             "collateral": _collateral, "simulator": _simulator, "schema": _schema, "validate-config": _validate_config,
             "compose-hash": _compose_hash, "app-compose": _app_compose, "env": _env, "bundles": _bundles,
             **cli_owner.COMMANDS}
