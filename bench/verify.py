"""Verifier speed: time per quote and per export bundle, collateral local, measured in one run.

    python bench/verify.py [--n 50] [--out bench/results/verify-cpu.json]

* per quote: ``cvm-tune verify-quote``'s work on the REAL dstack sample (dstack_nearmpc: read the
  quote, event log and collateral files, parse, dcap-qvl, chain checks, RTMR0-3 replay, names) at
  the sample's pinned ``now``;
* per bundle: ``verify_bundle`` on a fresh demo bundle (simulator quote under its test CA, the
  bundle's own collateral.json): the quote steps plus manifest, file hashes, compose-hash, audit
  chain and RTMR3 audit match;
* dcap-qvl alone (``dcap_qvl.verify``) on the sample, for scale;
* the whole ``cvm-tune verify-quote`` process (interpreter start and imports included), 5 runs.

The verifier's memo caches are cleared before every iteration, so each figure is a cold verify
(interpreter and imports excluded). Target: <= 50 ms per bundle.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import dcap_qvl

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from attestation import load_policy, read_collateral_file, read_event_log_file, read_quote_input, verify_bundle  # noqa: E402
from attestation.policy import Policy  # noqa: E402
from attestation.verify import quote_verdict  # noqa: E402
from timing import clear_dcap_caches, times_ms, write_json  # noqa: E402  (bench/timing.py: the script directory is on sys.path)

SAMPLES = REPO / "tests" / "data" / "attestation"
NOW = 1787894484
TARGET_BUNDLE_MS = 50.0


def _time(fn: Callable[[], object], n: int) -> dict[str, float]:
    times = times_ms(fn, n, clear_dcap_caches)
    times.sort()
    return {"median_ms": round(statistics.median(times), 2), "p90_ms": round(times[int(0.9 * (n - 1))], 2),
            "min_ms": round(times[0], 2), "n": n}


def verify_one_quote() -> None:
    raw, _ = read_quote_input(SAMPLES / "dstack_nearmpc_quote.bin")
    coll = read_collateral_file(SAMPLES / "dstack_nearmpc_collateral.json")
    events = read_event_log_file(SAMPLES / "dstack_nearmpc_event_log.json")
    verdict = quote_verdict(raw, policy=Policy(name="bench", allowed_app_events=("mpc-image-digest",)), now=NOW,
                            collateral=coll, events=events)
    if not verdict.accepted:
        raise SystemExit(f"bench sample rejected: {[c.name for c in verdict.failed]}")


def cli_process() -> None:
    cmd = [sys.executable, "-m", "app", "verify-quote", str(SAMPLES / "dstack_simulator_quote.bin"), "--now", str(NOW),
           "--collateral", str(SAMPLES / "dstack_nearmpc_collateral_nopckchain.json"),
           "--event-log", str(SAMPLES / "dstack_simulator_event_log.json")]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)


def make_bundle(tmp: Path) -> tuple[Path, Path]:
    from app.config import Config, OutputSettings, TrainingSettings
    from app.run.pipeline import run_once

    res = run_once(Config(output=OutputSettings(dir=tmp), training=TrainingSettings(max_steps=2, save_steps=2)))
    return res.bundle_dir, res.policy_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=50, help="iterations per figure")
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()
    raw = (SAMPLES / "dstack_nearmpc_quote.bin").read_bytes()
    qvl_coll = dcap_qvl.QuoteCollateralV3.from_json((SAMPLES / "dstack_nearmpc_collateral.json").read_text())
    with tempfile.TemporaryDirectory(prefix="cvm-tune-bench-verify-") as tmp:
        bundle, policy_file = make_bundle(Path(tmp))
        policy = load_policy(policy_file)

        def verify_one_bundle() -> None:
            verdict = verify_bundle(bundle, policy=policy, now=int(time.time()))
            if not verdict.accepted:
                raise SystemExit(f"bench bundle rejected: {[c.name for c in verdict.failed]}")

        result = {
            "per_quote": _time(verify_one_quote, args.n),
            "per_bundle": _time(verify_one_bundle, args.n),
            "dcap_qvl_verify_only": _time(lambda: dcap_qvl.verify(raw, qvl_coll, NOW), args.n),
            "cli_verify_quote_process": _time(cli_process, min(5, args.n)),
        }
    result["target_per_bundle_ms"] = TARGET_BUNDLE_MS
    result["meets_target"] = result["per_bundle"]["median_ms"] <= TARGET_BUNDLE_MS
    result["machine"] = {"python": platform.python_version(), "platform": platform.platform(),
                         "cpu": platform.processor() or platform.machine(), "dcap_qvl": dcap_qvl.__version__}
    result["measured"] = time.strftime("%Y-%m-%d", time.gmtime())
    for name in ("per_quote", "per_bundle", "dcap_qvl_verify_only", "cli_verify_quote_process"):
        r = result[name]
        print(f"{name:24} median {r['median_ms']:7.2f} ms   p90 {r['p90_ms']:7.2f} ms   min {r['min_ms']:7.2f} ms   (n={r['n']})")
    print(f"target <= {TARGET_BUNDLE_MS:.0f} ms per bundle: {'met' if result['meets_target'] else 'NOT met'}")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
