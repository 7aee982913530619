"""``cvm-tune`` deployment commands: compose-hash, app-compose, env, bundles (imported when used; docs/deploy.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from app.cli import EXIT_REJECTED
from app.errors import ConfigError


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

