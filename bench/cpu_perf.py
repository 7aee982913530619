"""CPU-side figures, each as project / bound / ratio measured in the same run (noise cancels out).

    python bench/cpu_perf.py [--n 15] [--hash-mib 256] [--decrypt-mib 512] [--skip-decrypt]
                             [--out bench/results/cpu-perf.json]

Rows (min / median of ``--n`` samples; processes: of ``max(5, n // 3)``):

* ``verify_bundle``: a fresh demo bundle (simulator quote, its test CA, the bundle's collateral),
  memo caches cleared before each call, vs bare ``dcap_qvl.verify_with_root_ca`` on its quote;
* ``bundle file hashing``: ``sha256_file`` over the bundle's manifest files vs ``hashlib.sha256``
  of the same bytes already in memory;
* ``large file hashing``: ``sha256_file`` on a ``--hash-mib`` file (page cache) vs ``hashlib.sha256``
  over the same bytes in memory (ratio = project throughput / raw throughput);
* ``cvm-tune verify BUNDLE`` as a process vs ``python -c 'import dcap_qvl'``;
* ``cvm-tune --help`` as a process vs ``python -c pass``;
* decrypt + verify (``open_encrypted`` over a ``--decrypt-mib`` owner-signed file) vs
  min(AES-256-GCM decrypt, SHA-256) measured in the same run (MB/s, ratio = project / bound).

The training rows (tokens/s vs a bare SFTTrainer, torch thread count) live in ``bench/overhead.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


def _clear_caches() -> None:
    from attestation import dcap

    for name in dir(dcap):
        obj = getattr(dcap, name)
        if callable(getattr(obj, "cache_clear", None)):
            obj.cache_clear()


def _stat(ms: list[float]) -> dict[str, float]:
    return {"min_ms": round(min(ms), 3), "median_ms": round(statistics.median(ms), 3), "n": len(ms)}


def _interleaved(a: Callable[[], object], b: Callable[[], object], n: int, cold: bool = False) -> tuple[list[float], list[float]]:
    """Alternate project and bound so both see the same machine load."""
    xs, ys = [], []
    a()
    b()
    for _ in range(n):
        xs += _samples_once(a, cold)
        ys += _samples_once(b, cold)
    return xs, ys


def _samples_once(fn: Callable[[], object], cold: bool) -> list[float]:
    if cold:
        _clear_caches()
    t = time.perf_counter()
    fn()
    return [(time.perf_counter() - t) * 1000]


def _proc(args: list[str]) -> Callable[[], None]:
    def run() -> None:
        subprocess.run(args, check=True, capture_output=True, cwd=REPO, env=ENV)
    return run


def make_bundle(tmp: Path) -> tuple[Path, Path]:
    from app.config import Config, OutputSettings, TrainingSettings
    from app.pipeline import run_once

    res = run_once(Config(output=OutputSettings(dir=tmp), training=TrainingSettings(max_steps=2, save_steps=2)))
    return res.bundle_dir, res.policy_file


def _row(rows: dict, name: str, project: list[float], bound: list[float], *, unit: str = "ms") -> None:
    p, b = _stat(project), _stat(bound)
    rows[name] = {"project": p, "bound": b, "ratio_median": round(p["median_ms"] / b["median_ms"], 3),
                  "ratio_min": round(p["min_ms"] / b["min_ms"], 3), "unit": unit}


def verify_rows(rows: dict, tmp: Path, n: int) -> None:
    import dcap_qvl

    from attestation import load_policy, verify_bundle
    from attestation.bundle import Manifest
    from attestation.hashing import sha256_file

    bundle, policy_file = make_bundle(tmp)
    policy = load_policy(policy_file)
    now = int(time.time())
    raw = (bundle / "quote.bin").read_bytes()
    coll = dcap_qvl.QuoteCollateralV3.from_json((bundle / "collateral.json").read_text())
    root = policy.trusted_root.der

    def project() -> None:
        if not verify_bundle(bundle, policy=policy, now=now).accepted:
            raise SystemExit("bench bundle rejected")

    _row(rows, "verify_bundle (cold caches) vs bare dcap_qvl.verify_with_root_ca",
         *_interleaved(project, lambda: dcap_qvl.verify_with_root_ca(raw, coll, root, now), n, cold=True))

    files = Manifest.model_validate_json((bundle / "manifest.json").read_bytes()).files
    paths = [bundle / rel for rel in sorted(files)]
    blobs = [p.read_bytes() for p in paths]
    _row(rows, f"hashing the bundle's {len(paths)} files vs hashlib.sha256 of the same bytes",
         *_interleaved(lambda: [sha256_file(p) for p in paths], lambda: [hashlib.sha256(b).hexdigest() for b in blobs], n))

    exe = sys.executable
    pv = _proc([exe, "-m", "app", "verify", str(bundle), "--policy", str(policy_file), "--now", str(now)])
    nproc = max(5, n // 3)
    _row(rows, "`cvm-tune verify BUNDLE` process vs python -c 'import dcap_qvl'",
         *_interleaved(pv, _proc([exe, "-c", "import dcap_qvl"]), nproc))
    _row(rows, "`cvm-tune --help` process vs python -c pass",
         *_interleaved(_proc([exe, "-m", "app", "--help"]), _proc([exe, "-c", "pass"]), nproc))


def hash_row(rows: dict, tmp: Path, mib: int, n: int) -> None:
    from attestation.hashing import sha256_file

    path = tmp / "big.bin"
    data = os.urandom(mib << 20)
    path.write_bytes(data)
    sha256_file(path)  # page cache
    xs, ys = _interleaved(lambda: sha256_file(path), lambda: hashlib.sha256(data).hexdigest(), max(5, n // 3))
    del data
    path.unlink()
    mb = (mib << 20) / 1e6
    p = {"best_mb_s": round(mb / (min(xs) / 1000)), "median_mb_s": round(mb / (statistics.median(xs) / 1000)), "n": len(xs)}
    b = {"best_mb_s": round(mb / (min(ys) / 1000)), "median_mb_s": round(mb / (statistics.median(ys) / 1000)), "n": len(ys)}
    rows[f"sha256_file on a {mib} MiB file vs hashlib.sha256 in memory"] = {
        "project": p, "bound": b, "ratio_median": round(p["median_mb_s"] / b["median_mb_s"], 3),
        "ratio_best": round(p["best_mb_s"] / b["best_mb_s"], 3), "unit": "MB/s"}


def decrypt_row(rows: dict, tmp: Path, mib: int, n: int) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from app.dataset import encrypt_stream, open_encrypted
    from bench.decrypt import CHUNK, KEY, _Rows

    owner = Ed25519PrivateKey.generate()
    path = tmp / "big.cvmds"
    with open(path, "wb") as out:
        encrypt_stream(_Rows(mib << 20), out, KEY, dataset_id="bench", owner_key=owner)  # type: ignore[arg-type]
    pub = owner.public_key().public_bytes_raw()
    size = path.stat().st_size

    def project() -> None:
        with open(path, "rb") as fh:
            for _ in open_encrypted(fh, KEY, owner_public_key=pub):
                pass

    aead, block = AESGCM(KEY), os.urandom(CHUNK)
    cts = [aead.encrypt(i.to_bytes(12, "big"), block, b"aad") for i in range(32)]
    reps = max(1, mib // 32)

    def aes() -> None:
        for _ in range(reps):
            for i, ct in enumerate(cts):
                aead.decrypt(i.to_bytes(12, "big"), ct, b"aad")

    def sha() -> None:
        h = hashlib.sha256()
        for _ in range(reps):
            for ct in cts:
                h.update(ct)

    k = max(3, n // 5)
    xs, ys, zs = [], [], []
    project()
    for _ in range(k):
        xs += _samples_once(project, False)
        ys += _samples_once(aes, False)
        zs += _samples_once(sha, False)
    path.unlink()

    def mbs(ms: list[float], nbytes: int) -> dict:
        return {"best_mb_s": round(nbytes / 1e6 / (min(ms) / 1000)), "median_mb_s": round(nbytes / 1e6 / (statistics.median(ms) / 1000)),
                "n": len(ms)}

    p, a, s = mbs(xs, size), mbs(ys, reps * 32 * CHUNK), mbs(zs, reps * 32 * (CHUNK + 16))
    bound = min(a, s, key=lambda d: d["median_mb_s"])
    rows[f"decrypt+verify a {mib} MiB signed dataset vs min(AES-GCM, SHA-256)"] = {
        "project": p, "bound": bound, "aes_gcm": a, "sha256": s, "unit": "MB/s",
        "ratio_median": round(p["median_mb_s"] / bound["median_mb_s"], 3),
        "ratio_best": round(p["best_mb_s"] / min(a["best_mb_s"], s["best_mb_s"]), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=15, help="samples per in-process figure")
    ap.add_argument("--hash-mib", type=int, default=256)
    ap.add_argument("--decrypt-mib", type=int, default=512)
    ap.add_argument("--skip-decrypt", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1")
    rows: dict = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="cvm-tune-bench-cpu-") as tmp:
        verify_rows(rows, Path(tmp), args.n)
        hash_row(rows, Path(tmp), args.hash_mib, args.n)
        if not args.skip_decrypt:
            decrypt_row(rows, Path(tmp), args.decrypt_mib, args.n)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    report = {"machine": f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)], "rows": rows}
    for name, r in rows.items():
        p, b = r["project"], r["bound"]
        if r["unit"] == "ms":
            print(f"{name}\n    project {p['min_ms']:8.2f} / {p['median_ms']:8.2f} ms   bound {b['min_ms']:8.2f} / "
                  f"{b['median_ms']:8.2f} ms   ratio (median) {r['ratio_median']:.2f}x")
        else:
            print(f"{name}\n    project {p['best_mb_s']:6d} / {p['median_mb_s']:6d} MB/s   bound {b['best_mb_s']:6d} / "
                  f"{b['median_mb_s']:6d} MB/s   ratio (median) {r['ratio_median']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
