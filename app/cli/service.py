"""``cvm-tune`` service commands: run, serve, status, bundles, simulator, schema, validate-config (imported when
used)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from app.cli import EXIT_REJECTED
from app.errors import ConfigError, InputsUnchanged


def _stop_on_sigterm() -> list[str]:
    """SIGTERM/SIGINT set a flag the trainer polls at every step boundary (checkpoint, then stop)."""
    import signal

    flag: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: flag.append(signal.Signals(signum).name))
    return flag


def _exit_0_on_sigterm() -> None:
    """A server in the foreground (``bundles serve``, ``simulator``): SIGTERM stops it like Ctrl-C would, through
    every ``finally`` (the socket closed, the command's private cache directory removed), and exits 0."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(0))


def _run(args: argparse.Namespace) -> int:
    import contextlib

    from app.config import load_config
    from app.run.pipeline import RunHooks, run_once
    from app.state import claim_volume
    from app.training import TrainingStopped

    overrides = [*args.overrides, *([f"training.max_steps={args.max_steps}"] if args.max_steps is not None else [])]
    cfg = load_config(args.config, overrides)
    flag = _stop_on_sigterm()
    hooks = RunHooks(should_stop=lambda: f"{flag[0]} received" if flag else None)
    try:
        with contextlib.ExitStack() as volume:
            claim_volume(volume, cfg.output.dir)  # another process on the volume: StateError, exit 7, nothing written
            res = run_once(cfg, progress=lambda m: print(m, flush=True), run_id=args.run_id, hooks=hooks)
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
    from app.service.scheduler import serve

    cfg = load_config(args.config)
    outcome = serve(cfg, once=args.once, progress=lambda m: print(m, flush=True))
    print(f"service: {outcome}", flush=True)
    return 0


def _status(args: argparse.Namespace) -> int:
    from app.config import load_config
    from app.service.status import render_status

    cfg = load_config(args.config)
    if args.health:
        from app.service.scheduler import health

        ok, why = health(cfg)
        print(why)
        return 0 if ok else EXIT_REJECTED
    print(render_status(cfg, limit=args.n, as_json=args.json))
    return 0



def _bundles(args: argparse.Namespace) -> int:
    from app.service import bundles

    if args.bundles_command == "token":
        digest = bundles.new_token(args.file)
        print(f"wrote {args.file} (mode 0600); its SHA-256 (= sha256sum {args.file}) is {digest}")
        print(f"pin it in the measured compose: cvm-tune app-compose --image IMAGE@sha256:DIGEST --bundles-token {args.file}")
        return 0
    if args.bundles_command == "serve":
        from app.netaddr import require_free_address

        digest = bundles.serve_token_sha256(args.token_file, os.environ.get(bundles.TOKEN_ENV))
        if not args.output.is_dir():
            raise ConfigError(f"the output volume {args.output} is not a directory",
                              fix="pass the directory `cvm-tune run` / `serve` write to: --output DIR")
        require_free_address(args.host, args.port, "--host/--port")
        server = bundles.BundleServer(args.output, digest, host=args.host, port=args.port)
        _exit_0_on_sigterm()  # before the line that says it serves
        where = " (every interface of this machine: --host 127.0.0.1 for this machine only)" if args.host in (
            "0.0.0.0", "::", "") else ""
        print(f"cvm-tune bundle server (read-only) on {server.url}{where} for {args.output}; verify its bundles in a "
              f"browser at {server.url}/verify/runs (the token as the password)", flush=True)
        try:
            server.serve_forever()
        finally:
            server.server_close()
        return 0
    token = bundles.read_token(args.token_file)
    if args.bundles_command == "list":
        print(bundles_table(bundles.list_runs(args.url, token)))
        return 0
    out = bundles.fetch(args.url, args.run_id, args.out_dir, token)
    print(f"fetched {out}")
    print(f"what it says: cvm-tune show {out}")
    print(f"verify it: cvm-tune verify {out} --policy YOUR_POLICY.yaml")
    return 0


def bundles_table(runs: list[dict]) -> str:
    """``bundles list``: a header, then one line per run or API save (run id, kind, status, start time, whether its
    bundle can be fetched and whether it is the promoted one)."""
    from app.service.status import columns

    lines = columns([("RUN ID", "KIND", "STATUS", "STARTED (UTC)", "BUNDLE")] + [
        (r["run_id"], r["kind"], r["status"] or "", (r["started_at"] or "").replace("T", " ").rstrip("Z"),
         ("yes" if r["exported"] else "no") + (" (promoted)" if r["promoted"] else "")) for r in runs])
    return "\n".join(lines if runs else [*lines, "no runs yet"])


def _simulator(args: argparse.Namespace) -> int:
    from attestation.policy import policy_file_text, simulator_policy

    from app.simulator import GuestAgentSimulator, SimulatorServer, SimulatorSettings

    app_compose = None
    if args.app_compose is not None:
        try:
            app_compose = args.app_compose.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {args.app_compose}: {exc}") from exc
    try:
        settings = SimulatorSettings(emit_event=args.emit_event, app_compose=app_compose, dstack=args.dstack,
                                     root_epoch=args.root_epoch, app_epoch=args.app_epoch, gpu=args.gpu)
    except ValueError as exc:
        raise ConfigError(str(exc), fix="--root-epoch and --app-epoch take integers from 0 to 2^32-1") from exc
    try:
        sim = GuestAgentSimulator(settings)
    except ValueError as exc:  # an app-compose the simulator (like dstack's guest) cannot boot with
        raise ConfigError(f"{args.app_compose}: {exc}", fix="pass an app-compose.json dstack would boot") from exc
    if args.write_policy:
        args.write_policy.write_text(policy_file_text(simulator_policy(sim.test_root_ca_der)))
        print(f"wrote {args.write_policy}")
        return 0
    if args.port is not None:
        server = SimulatorServer(sim, port=args.port)
    else:
        server = SimulatorServer(sim, socket_path=args.socket or Path("dstack.sock"))
    _exit_0_on_sigterm()  # before the lines that say where it listens
    server.start()
    print(f"cvm-tune dstack {args.dstack} simulator (TEST CA — NOT a TEE) listening on {server.endpoint}"
          + (f" (key epochs: root {args.root_epoch}, app {args.app_epoch})" if args.dstack == "0.6" else ""), flush=True)
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

