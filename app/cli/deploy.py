"""``cvm-tune`` deployment commands: compose-hash, app-compose, deploy-plan, env, bundles (imported when used; docs/deploy.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from app.cli import EXIT_REJECTED
from app.errors import ConfigError


def _compose_hash(args: argparse.Namespace) -> int:
    from attestation.compose import app_compose as C
    from attestation.compose.audit import audit as compose_audit
    from attestation.compose.dstack06 import audit06, gpu_policy_hash
    from attestation.tdx.inputs import read_bounded
    from attestation.io.safe_yaml import MAX_JSON_BYTES

    raw = read_bounded(args.app_compose, MAX_JSON_BYTES if args.from_info else C.MAX_APP_COMPOSE, C.ComposeError,
                       "Info document" if args.from_info else "app-compose.json")
    if args.save is not None and not args.from_info:
        raise ConfigError("-o/--out needs --from-info (the file itself is already the app-compose.json)")
    if args.from_info:
        raw = C.from_info(raw)
    doc = C.load(raw)
    digest = C.compose_hash(raw)
    app_id = C.app_id(doc, digest, pinned_app_id=args.app_id)
    form, mr_config_id = C.expected_mr_config_id(doc, digest, app_id)
    out = {"compose_hash": digest, "app_id": app_id, "mr_config_id": mr_config_id, "mr_config_id_form": form,
           "kms_enabled": bool(doc.get("kms_enabled")),
           "images": C.images(doc) if doc.get("runner") == "docker-compose" else {}, "problems": compose_audit(doc),
           "notes": audit06(doc)[2], "gpu_policy_hash": gpu_policy_hash(doc)}
    if args.save is not None:  # only an app-compose.json that could be read and audited is saved
        from app.fsutil import atomic_write_bytes

        atomic_write_bytes(args.save, raw)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"compose-hash  {digest}")
        print(f"app-id        {out['app_id'] or 'assigned by the KMS deployment (pass --app-id): not derivable from the file'}")
        print(f"mr_config_id  {form} {C.MR_CONFIG_V3 if form == 'v3' else mr_config_id or '(needs the app id: pass --app-id)'}")
        print(f"              ({C.MR_CONFIG_WHEN})")
        print(f"gpu-policy    {out['gpu_policy_hash']} (dstack 0.6 measures it as gpu-policy-hash)")
        for svc, ref in out["images"].items():
            print(f"image         {svc}: {ref}")
        for note in out["notes"]:
            print(f"NOTE          {note}")
        for problem in out["problems"]:
            print(f"PROBLEM       {problem}")
    return EXIT_REJECTED if out["problems"] else 0


def _app_compose(args: argparse.Namespace) -> int:
    from attestation.compose.app_compose import AppComposeSettings

    from app.deploy.app_compose import bundles_token_sha256, describe, render_deployment

    try:
        template = args.compose.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {args.compose}: {exc}") from exc
    settings = AppComposeSettings(name=args.name, kms_enabled=not args.no_kms, gateway_enabled=not args.no_gateway,
                                  local_key_provider_enabled=args.local_key_provider, key_provider_id=args.key_provider_id,
                                  allowed_envs=tuple(args.allowed_env))
    token_sha256 = bundles_token_sha256(args.bundles_token, args.bundles_token_sha256)
    dep = render_deployment(template, args.image, settings, bundles_token_sha256=token_sha256, style=args.format)
    summary = describe(dep, args.app_id)  # before writing: a bad --app-id writes nothing
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "docker-compose.yaml").write_text(dep.docker_compose)
    (args.out_dir / "app-compose.json").write_bytes(dep.app_compose)
    print(f"wrote {args.out_dir / 'docker-compose.yaml'} and {args.out_dir / 'app-compose.json'}")
    print("\n".join(summary))
    return 0


def _deploy_plan(args: argparse.Namespace) -> int:
    from app.deploy.plan import plan

    p = plan(args.target, model_gb=args.model_gb, output_gb=args.output_gb, gpus=args.gpus, vcpu=args.vcpu,
             memory=args.memory, disk=args.disk, name=args.name, deploy_dir=args.deploy_dir, env_file=args.env_file,
             instance_type=args.instance_type, os_image=args.os_image, kms_url=args.kms_url, vmm_url=args.vmm_url)
    print(f"needs: {p.needs.vcpu} vCPU, {p.needs.memory_gb} GB memory, {p.needs.disk_gb} GB disk")
    for note in p.notes:
        print(f"note: {note}")
    print(p.command)
    return 0


def _env(args: argparse.Namespace) -> int:
    from attestation.compose.app_compose import MAX_APP_COMPOSE, ComposeError, load
    from attestation.tdx.inputs import read_bounded

    from app.deploy.app_compose import check_env, encrypt_env, read_env_file, verify_public_key

    if args.env_file is not None:
        values = read_env_file(args.env_file)
    else:
        missing = [n for n in args.from_env if n not in os.environ]
        if missing:
            raise ConfigError(f"not set in the environment: {missing}")
        values = {n: os.environ[n] for n in args.from_env}
    allowed = None
    if args.app_compose is not None:
        raw = read_bounded(args.app_compose, MAX_APP_COMPOSE, ComposeError, "app-compose.json")
        names = load(raw).get("allowed_envs") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ComposeError(f"{args.app_compose}: allowed_envs is not a list of names")
        allowed = names
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

