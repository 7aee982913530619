"""``cvm-tune`` command line. The only module that prints (with ``app.cli.owner``, the data owner's commands, and
``app.cli.federated``, the federated simulation).

Exit codes (also in docs/exit-codes.md):
  0  success / bundle or quote accepted
  1  verification rejected (one line per failed check)
  2  usage, config, policy or input error (missing file, unreadable bundle or quote)
  3  dataset error   4  key error   5  guest agent / attestation error
  6  training error  7  state / export error   70  internal error (bug: rerun with --debug)
  130 interrupted     141 stdout closed by its reader (verify/verify-quote keep the verdict's code)
``--debug`` adds the traceback and keeps the code. ``run`` when another process holds the output volume's lock: exit 7
(the holder's pid; nothing written); ``serve``: "service: skipped: locked", exit 0 (the service already runs).
A SIGTERM during ``run``/``serve`` checkpoints at the next step boundary and exits 0.
``status --health``: 0 healthy, 1 unhealthy (one line saying why).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import app
from app.cli import adapter as cli_adapter
from app.cli import api as cli_api
from app.cli import federated as cli_federated
from app.cli import owner as cli_owner
from app.cli.args import Parser, bounded_int, out_option
from app.errors import CvmTuneError

EXIT_REJECTED = 1
EXIT_INTERNAL = 70
EXIT_BROKEN_PIPE = 141  # as a shell reports a process killed by SIGPIPE
# Import names of pyproject's [train] and [gpu] extras: requirements/verify.lock installs none of them.
TRAINING_STACK = frozenset({"dstack_sdk", "eth_keys", "torch", "transformers", "peft", "trl", "datasets", "accelerate",
                            "opacus", "schedule", "pytz", "matplotlib", "huggingface_hub", "flwr", "pyarrow", "tinker",
                            "fastapi", "uvicorn", "unsloth",
                            "unsloth_zoo"})
MAX_UNIX_SECONDS = 253402300799  # 9999-12-31T23:59:59Z: the latest time a certificate or collateral date can name


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="cvm-tune",
        description="Attested LoRA fine-tuning for dstack confidential VMs: train on an encrypted dataset, "
        "export the adapter with a TDX quote, verify it offline.",
        epilog="Exit codes: 0 ok, 1 rejected, 2 usage/input, 3 data, 4 key, 5 attestation, 6 training, 7 state, 70 bug.",
    )
    p.add_argument("--version", action="version", version=f"cvm-tune {app.__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks, debug logs, and the warnings and progress bars "
                   "of the libraries underneath (hidden otherwise)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run one attested training run now",
                       description="Decrypt the dataset, train a LoRA adapter, export it with a TDX quote and verify it. "
                       "Without --config: the embedded demo (simulator, bundled sample data, tiny local model).")
    r.add_argument("--config", type=Path, metavar="FILE", help="YAML configuration (see `cvm-tune schema`)")
    r.add_argument("--run-id", metavar="ID", help="name the run (resumes it if unfinished); default: a new timestamped id "
                   "or the newest unfinished run with the same inputs")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one configuration value (a dotted key, a YAML value), e.g. --set "
                   "training.learning_rate=1e-4; repeatable; recorded in the manifest like the file's own values")
    r.add_argument("--max-steps", type=bounded_int(1, 10**9), metavar="N",
                   help="train at most N optimizer steps (= --set training.max_steps=N)")

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
    st.add_argument("-n", type=bounded_int(1, 10_000), default=10, metavar="N", help="rows to show (default 10)")

    v = sub.add_parser("verify", help="verify an export bundle (or a federated round bundle, recursively)",
                       description="Check a bundle's quote (dcap-qvl), report_data binding, file hashes, RTMR0-3 replay "
                       "and audit chain under a policy. Exit 0 accepted, 1 rejected, 2 input error.")
    v.add_argument("bundle", type=Path, nargs="?", metavar="BUNDLE", help="the exports/<run_id> directory")
    v.add_argument("--parent", type=Path, metavar="PARENT_BUNDLE", help="also verify the bundle BUNDLE continued from "
                   "(for a federated round: the previous round) and the link between them")
    v.add_argument("--chain", type=Path, metavar="EXPORTS_DIR", help="instead of BUNDLE: verify every bundle in an "
                   "exports/ directory and every lineage link, roots first; names the first broken link")
    v.add_argument("--policy", type=Path, metavar="FILE", help="YAML policy (default: built-in, Intel root, UpToDate only)")
    v.add_argument("--now", type=bounded_int(0, MAX_UNIX_SECONDS), metavar="UNIX_SECONDS", help="verification time (default: now); pins time for tests")
    v.add_argument("--json", action="store_true", help="print the machine-readable verdict (schema cvm-tune/verdict/v1)")
    v.add_argument("--collateral", type=Path, metavar="FILE", help="use this collateral JSON instead of the bundle's")
    v.add_argument("--base-model", type=Path, metavar="DIR", help="also check a local copy of the base model against the manifest")
    v.add_argument("--dataset", type=Path, metavar="FILE", help="also check the encrypted dataset file against the manifest")
    v.add_argument("--ops", type=Path, metavar="OPS.jsonl", help="also recompute a training-API checkpoint's op chain "
                   "from the client's record of its ops (one JSON op a line; docs/api.md); a mismatch rejects (exit 1)")
    v.add_argument("--replay", action="store_true", help="re-execute the training on this machine's CPU and compare "
                   "the weights with the bundle's: with --ops, a training-API checkpoint's ops (check op_chain.replay); "
                   "without, a nightly run from its config, with --dataset FILE --key-file KEY unless it trained on "
                   "the bundled sample (check training.replay); --base-model DIR unless the base is the built-in tiny "
                   "model")
    v.add_argument("--key-file", type=Path, metavar="KEY", help="with --replay: the dataset key (32 bytes or 64 hex "
                   "characters) of the --dataset file")

    sh = sub.add_parser("show", help="summarize a bundle: run, model, dataset, training, recipients (verifies nothing)",
                        description="Print what an export bundle (a run or a training-API checkpoint) or a federated "
                        "round bundle says about itself, read from its manifest, and the `cvm-tune verify` command that "
                        "checks it. Nothing is verified here. Exit 0 shown, 2 not a bundle (no or a damaged manifest).")
    sh.add_argument("bundle", type=Path, metavar="BUNDLE", help="an exports/<run_id> or rounds/<federation>/round-N directory")
    sh.add_argument("--json", action="store_true", help="machine-readable summary (schema cvm-tune/show/v1)")

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
    q.add_argument("quote", type=Path, metavar="QUOTE", help="raw quote bytes, hex text (0x/whitespace ok), a dstack "
                   "GetQuote JSON response or an Attest answer ({\"attestation\": hex}, SCALE V0 or MessagePack V1); "
                   "the event log it carries is used unless --event-log is given")
    q.add_argument("--collateral", type=Path, metavar="FILE", help="collateral JSON (dcap-qvl QuoteCollateralV3)")
    q.add_argument("--event-log", type=Path, metavar="FILE", help="dstack event log: a JSON list, or JSON with an event_log member")
    q.add_argument("--report-data", metavar="HEX", help="expected report_data (at most 64 bytes; shorter is zero-padded)")
    q.add_argument("--mr-config", type=Path, metavar="FILE", help="the MrConfigV3 document a v3 MRCONFIGID was computed "
                   "from (exact bytes; default: the mr_config of the vm_config an Attest or GetQuote answer carries)")
    q.add_argument("--policy", type=Path, metavar="FILE", help="YAML policy (default: built-in, Intel root, UpToDate only)")
    q.add_argument("--now", type=bounded_int(0, MAX_UNIX_SECONDS), metavar="UNIX_SECONDS", help="verification time (default: now); pins time for tests")
    q.add_argument("--json", action="store_true", help="print the machine-readable verdict (schema cvm-tune/verdict/v1)")

    co = sub.add_parser("collateral", help="fetch a quote's collateral from a PCCS (network)",
                        description="Fetch the Intel collateral for QUOTE from a PCCS, as dcap-qvl's get_collateral does, "
                        "and write it as JSON for `verify-quote --collateral` / `verify --collateral`. The only command "
                        "that uses the network. Exit 0 written, 2 error.")
    co.add_argument("quote", type=Path, metavar="QUOTE", help="raw quote bytes, hex text or a GetQuote JSON response")
    out_option(co, "--output", dest="output", required=True, metavar="FILE", help="where to write the collateral JSON")
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
    s.add_argument("--dstack", choices=("0.5", "0.6"), default="0.6",
                   help="agent line to imitate: 0.6 (dstack 0.6.7: /v0 and /v1 routes, Attest, EmitEvent refused, "
                   "KMS key epochs; default) or 0.5 (dstack 0.5.11)")
    s.add_argument("--root-epoch", type=int, default=0, metavar="N",
                   help="KMS root key epoch of the simulated CVM (default 0; restart with a higher one to simulate a "
                   "KMS root-key rotation)")
    s.add_argument("--app-epoch", type=int, default=0, metavar="N",
                   help="app key epoch of the simulated CVM (default 0; a higher one simulates an app-key rotation)")
    s.add_argument("--gpu", action="store_true",
                   help="--dstack 0.6 only: simulate one H100 that dstack's boot gate attested (RTMR3 gpu-attestation, "
                   "boot-time evidence from Attest, AttestGpu evidence with TEST bytes)")
    s.add_argument("--emit-event", choices=("accept", "noop", "reject"), default="accept",
                   help="--dstack 0.5 only: EmitEvent behaviour: accept (dstack OS 0.5.x), noop (simulator "
                   "0.5.3-0.5.8), reject (>= 0.5.9). A 0.6 agent always refuses EmitEvent")
    out_option(s, "--write-policy", dest="write_policy", metavar="FILE",
               help="write a policy trusting this simulator's TEST CA to FILE and exit (serves nothing)")

    s.add_argument("--app-compose", type=Path, metavar="FILE", help="serve this app-compose.json (its SHA-256 becomes the compose-hash)")

    _deploy_parsers(sub)
    sub.add_parser("schema", help="print the configuration JSON schema")
    c = sub.add_parser("validate-config", help="check a configuration file and print the resolved config")
    c.add_argument("config", type=Path, metavar="FILE")
    cli_owner.add_parsers(sub)
    cli_federated.add_parsers(sub)
    cli_api.add_parsers(sub)
    cli_adapter.add_parsers(sub)  # adapter decrypt; verify --identity
    return p


def _deploy_parsers(sub: argparse._SubParsersAction) -> None:
    """compose-hash, app-compose, env encrypt, bundles (the dstack deployment tools; docs/deploy.md)."""
    h = sub.add_parser("compose-hash", help="dstack's compose-hash and app-id of an app-compose.json, and its audit",
                       description="SHA-256 of the exact file bytes (what the CVM measures into RTMR3 and MRCONFIGID), the "
                       "app-id it implies, and what must change before it can be trusted. Exit 1 if the audit finds anything.")
    h.add_argument("app_compose", type=Path, nargs="?", default=Path("app-compose.json"), metavar="APP_COMPOSE_JSON")
    h.add_argument("--app-id", metavar="HEX", help="the app id your KMS deployment pinned (kms_enabled: the file alone cannot say)")
    h.add_argument("--from-info", action="store_true", help="the file is an Info answer or `phala cvms attestation --json` "
                   "output: use its tcb_info.app_compose (the exact bytes the CVM measured)")
    out_option(h, "--save", dest="save", metavar="FILE", help="with --from-info: also write those bytes to FILE")
    h.add_argument("--json", action="store_true", help="print JSON")

    a = sub.add_parser("app-compose", help="write the deployable docker-compose.yaml and app-compose.json for an image",
                       description="Put the pushed image's digest into docker-compose.yaml and write app-compose.json as "
                       "dstack's vmm-cli does (or the normalized form Phala Cloud shows); print compose-hash and app-id.")
    a.add_argument("--image", required=True, metavar="REF@sha256:DIGEST", help="the pushed image, pinned by digest")
    a.add_argument("--bundles-token", type=Path, metavar="FILE", help="the bundle server's token file (cvm-tune bundles token FILE)")
    a.add_argument("--bundles-token-sha256", metavar="HEX", help="its SHA-256 instead (refused if it is not the file's)")
    a.add_argument("--app-id", metavar="HEX", help="the app id your KMS deployment assigned (to print MRCONFIGID v2)")
    a.add_argument("--compose", type=Path, default=Path("docker-compose.yaml"), metavar="FILE", help="template (default: %(default)s)")
    out_option(a, "--out-dir", dest="out_dir", default=Path("deploy"), metavar="DIR", help="output directory (default: %(default)s)")
    a.add_argument("--name", default="cvm-tune", help="app name in app-compose.json")
    a.add_argument("--format", choices=("vmm-cli", "normalized"), default="vmm-cli",
                   help="vmm-cli: indent 4, dstack's vmm-cli.py; normalized: sorted compact JSON (dstack-sdk get_compose_hash)")
    a.add_argument("--no-kms", action="store_true", help="kms_enabled false (keys then die with the CVM unless a local key provider is on)")
    a.add_argument("--no-gateway", action="store_true", help="gateway_enabled false (no way to reach the bundle server)")
    a.add_argument("--local-key-provider", action="store_true", help="local_key_provider_enabled true (SGX local key provider)")
    a.add_argument("--key-provider-id", default="", metavar="HEX")
    a.add_argument("--allowed-env", action="append", default=[], metavar="NAME", help="extra allowed_envs name (repeatable)")

    dp = sub.add_parser("deploy-plan", help="size the CVM and print the exact deploy command (phala CLI 1.1.x or vmm-cli.py)",
                        description="Refuses resources below what the image, the base model and the output need, an "
                        "app-compose that fails its audit, and an env file without the alert webhook (values are never printed).")
    dp.add_argument("--target", choices=("phala", "vmm"), required=True)
    dp.add_argument("--model-gb", type=float, required=True, metavar="GB", help="size of the base model directory")
    dp.add_argument("--output-gb", type=float, default=50.0, metavar="GB", help="runs, checkpoints, bundles (default: %(default)s)")
    dp.add_argument("--gpus", type=int, default=1)
    dp.add_argument("--vcpu", type=int, help="vCPUs (vmm: default the plan's; phala: the instance type's, to check)")
    dp.add_argument("--memory", metavar="SIZE", help="e.g. 128G (vmm: default the plan's; phala: the instance type's, to check)")
    dp.add_argument("--disk", metavar="SIZE", help="e.g. 400G (default: the plan's)")
    dp.add_argument("--name", default="cvm-tune-nightly", help="the CVM's name (default: %(default)s)")
    dp.add_argument("--deploy-dir", type=Path, default=Path("deploy"), metavar="DIR", help="cvm-tune app-compose's output (default: %(default)s)")
    dp.add_argument("--env-file", type=Path, default=Path("deploy/secrets.env"), metavar="FILE", help="default: %(default)s")
    dp.add_argument("--instance-type", metavar="TYPE", help="phala: a GPU instance type, e.g. h200.small")
    dp.add_argument("--os-image", metavar="NAME", help="vmm: a production dstack OS image (e.g. dstack-nvidia-0.5.11)")
    dp.add_argument("--kms-url", metavar="URL", help="vmm: your KMS")
    dp.add_argument("--vmm-url", metavar="URL", help="vmm: dstack-vmm's API (else vmm-cli's own default)")

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
    out_option(ee, "--output", dest="output", metavar="FILE", help="write the hex blob here (default: stdout)")

    b = sub.add_parser("bundles", help="serve or fetch export bundles (the way out of a CVM)").add_subparsers(
        dest="bundles_command", required=True, metavar="ACTION")
    bt = b.add_parser("token", help="write a new bearer token file and print its SHA-256 (pinned by cvm-tune app-compose)")
    bt.add_argument("file", type=Path, metavar="FILE")
    bs = b.add_parser("serve", help="read-only HTTP server over the output volume (the compose's bundles service)",
                      description="Serve the runs and bundles of an output volume (runs and the training API's saves) "
                      "to clients with the bearer token. The token's SHA-256 comes from --token-file, or from "
                      "CVM_TUNE_BUNDLES_TOKEN_SHA256, which the measured compose sets; given both, they must agree.")
    bs.add_argument("--output", type=Path, default=Path("/data/output"), metavar="DIR", help="output volume (default: %(default)s)")
    bs.add_argument("--token-file", type=Path, metavar="FILE", help="the token file `cvm-tune bundles token FILE` wrote")
    bs.add_argument("--port", type=bounded_int(0, 65535), default=8000, help="port to listen on (default: %(default)s)")
    bs.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s; 127.0.0.1: this "
                    "machine only)")
    for name, what in (("list", "list the server's runs and API saves"),
                       ("fetch", "download a bundle (then: cvm-tune verify DIR/RUN_ID)")):
        bc = b.add_parser(name, help=what)
        bc.add_argument("url", metavar="URL", help="the bundle server, e.g. https://<app-id>-8000.<gateway domain>")
        bc.add_argument("--token-file", type=Path, required=True, metavar="FILE")
        if name == "fetch":
            bc.add_argument("run_id", metavar="RUN_ID")
            out_option(bc, "--out-dir", dest="out_dir", default=Path("."), metavar="DIR",
                       help="directory to download into (default: the current one)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import logging  # after parsing: ``--help`` and usage errors exit before any of this is loaded

    from app.cli import quiet

    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        with quiet.session(debug=args.debug):  # no third-party warnings or bars; nothing left in $HOME or $TMPDIR
            return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`cvm-tune verify … | head -1`): its verdict was already decided
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if args.debug:  # the traceback, and still the documented exit code
            import traceback

            traceback.print_exc()
        if _training_stack_missing(exc):
            print(f"error: `cvm-tune {args.command}` needs the training stack, which this environment lacks "
                  f"(no module {exc.name!r}): it has the verifier alone", file=sys.stderr)
            print("fix: install the training stack: sh requirements/install.sh VENV requirements/cpu.lock", file=sys.stderr)
            return 2
        if _is_expected(exc):
            print(f"error: {exc.message}", file=sys.stderr)  # type: ignore[attr-defined]
            print(f"fix: {exc.fix}", file=sys.stderr)  # type: ignore[attr-defined]
            return exc.exit_code  # type: ignore[attr-defined, no-any-return]
        # a bug: one line, no traceback unless --debug
        print(f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        print("fix: rerun with --debug and report the traceback", file=sys.stderr)
        return EXIT_INTERNAL


def _training_stack_missing(exc: Exception) -> bool:
    """A module of the training stack (or one it brings, such as httpx) is missing: a verifier-only install."""
    if not isinstance(exc, ModuleNotFoundError):
        return False
    import importlib.util

    return (exc.name or "").partition(".")[0] in TRAINING_STACK or importlib.util.find_spec("torch") is None


def _is_expected(exc: Exception) -> bool:
    """A cvm-tune or verifier error (message + fix + exit code), not a bug. ``attestation`` is loaded only by
    the commands that use it; a process that never loaded it cannot have raised its errors."""
    if isinstance(exc, CvmTuneError):
        return True
    errors = sys.modules.get("attestation.errors")
    return errors is not None and isinstance(exc, errors.AttestationError)


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The handler ``module.name``, imported on first call: each command loads only what it uses."""

    def handler(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), name)(args)  # type: ignore[no-any-return]

    handler.__qualname__ = f"{module}.{name}"
    return handler


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    **{name: _lazy("app.cli.service", fn) for name, fn in (
        ("run", "_run"), ("serve", "_serve"), ("status", "_status"), ("simulator", "_simulator"), ("schema", "_schema"),
        ("validate-config", "_validate_config"), ("bundles", "_bundles"))},
    "show": _lazy("app.cli.show", "_show"),
    **{name: _lazy("app.cli.verify", fn) for name, fn in (
        ("verify", "_verify"), ("publish", "_publish"), ("verify-quote", "_verify_quote"), ("collateral", "_collateral"))},
    **{name: _lazy("app.cli.deploy", fn) for name, fn in (
        ("compose-hash", "_compose_hash"), ("app-compose", "_app_compose"), ("deploy-plan", "_deploy_plan"), ("env", "_env"))},
    **cli_owner.COMMANDS,
    **cli_federated.COMMANDS,
    **cli_api.COMMANDS,
    **cli_adapter.COMMANDS,
}
