"""``cvm-tune api serve``: the attested Tinker-compatible training API (docs/api.md).

Registered by :mod:`app.cli` (which catches errors and maps exit codes). The work is in :mod:`app.api`, imported
when the command runs (torch, transformers and FastAPI are heavy).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from app.cli.args import out_option


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``api`` (with its action ``serve``) to the top-level subparsers."""
    a = sub.add_parser("api", help="the Tinker-compatible training API: serve it",
                       description="An attested training API that the official tinker SDK drives (docs/api.md).")
    asub = a.add_subparsers(dest="api_command", required=True, metavar="ACTION")
    s = asub.add_parser("serve", help="serve the training API (prints 'listening on' when ready)",
                        description="Load the configured base model once and serve the Tinker REST API on HOST:PORT "
                        "over TLS, with a key derived inside the CVM (the simulator's, locally) that `cvm-tune api "
                        "attest` checks against the quote; --plain-http serves plain HTTP instead (loopback with the "
                        "simulator only). Accepted keys: env CVM_TUNE_API_KEYS (comma-separated) and api.key_sha256 in "
                        "the config. Every saved state is also an export bundle under exports/.")
    s.add_argument("--listen", default="127.0.0.1:8443", metavar="HOST:PORT",
                   help="address and port (default 127.0.0.1:8443; port 0 picks a free one)")
    s.add_argument("--config", type=Path, metavar="FILE", help="YAML configuration (see `cvm-tune schema`)")
    s.add_argument("--plain-http", action="store_true",
                   help="serve plain HTTP instead of TLS: loopback with the simulator only (local tests)")
    t = asub.add_parser("attest", help="check a training API's attestation and write the certificate to trust",
                        description="Ask the server at URL for a quote over a fresh nonce and its TLS key, check the "
                        "quote under POLICY, the app-compose against the measured compose-hash, and that the "
                        "certificate this connection presented is the one the quote binds; then write it to --out "
                        "(what the SDK's HTTP client trusts: SSL_CERT_FILE). Exit 0 trusted, 1 rejected, 2 input "
                        "error.")
    t.add_argument("url", metavar="URL", help="the API's base URL, e.g. https://127.0.0.1:8443")
    t.add_argument("--policy", type=Path, metavar="FILE", help="YAML policy (default: built-in, Intel root)")
    out_option(t, required=True, metavar="PEM", help="where to write the trusted certificate")


def _api(args: argparse.Namespace) -> int:
    if args.api_command == "attest":
        from app.api.http.attest import attest

        return attest(args.url, policy_file=args.policy, out=args.out)
    from app.api import check_listen, serve
    from app.config import load_config
    from app.netaddr import require_free_address

    cfg = load_config(args.config)
    host, port, _loopback = check_listen(args.listen)
    require_free_address(host, port, "--listen")  # before the base model loads
    serve(cfg, args.listen, progress=lambda m: print(m, flush=True), plain_http=args.plain_http)
    return 0


COMMANDS = {"api": _api}


