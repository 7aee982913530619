"""CPU-side performance: each project figure next to its bound, measured in the same run, and their ratio.

    python bench/cpu_perf.py [--tree DIR] [--n 30] [--dataset-mib 1024] [--out bench/results/cpu-perf.json]

Rows (project / bound / ratio; times as min and median of the samples, throughput as median):

* ``verify_bundle`` with cold caches on a fresh demo bundle / bare ``dcap_qvl.verify_with_root_ca`` on the same
  quote and collateral (the one call a verifier cannot skip);
* hashing every file of that bundle with ``attestation.io.hashing.sha256_file`` / ``hashlib.sha256`` over the same
  bytes already in memory; the same for one 256 MiB file (read from the page cache);
* the whole ``cvm-tune verify BUNDLE`` process / ``python -c 'import dcap_qvl'``;
* ``cvm-tune --help`` / ``python -c pass``;
* ``open_encrypted`` streaming an owner-signed dataset of ``--dataset-mib`` (key check, header MAC, owner signature,
  every GCM tag, SHA-256 of ciphertext and plaintext) / min(AES-256-GCM decrypt, SHA-256), both measured on 1 MiB
  chunks in memory in this run;
* the training rows of ``bench/train_perf.py`` (``--train-steps 0`` skips them): tokens/s of a run's training step
  / a bare ``SFTTrainer`` with the same saves; dataset preparation (token policy + TRL on its ids / TRL alone);
  ms per optimizer step at ``training.cpu_threads: auto`` / 1 thread.

``--tree`` measures another checkout of cvm-tune (say, the previous release) with this same script, for a before/after
comparison on one machine (the training rows need the tree to have ``bench/train_perf.py``). A run's phases are
measured by ``bench/overhead.py`` (CPU), GPU training by ``bench/gpu_train.py``. Shared machines are noisy: the
load average before and after is recorded, and only same-run ratios compare.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import clear_dcap_caches, times_ms, write_json  # bench/timing.py: the script directory is on sys.path

HERE = Path(__file__).resolve().parents[1]
KEY = bytes(range(32))
MiB = 1 << 20


def _stats(samples: list[float]) -> dict[str, float]:
    return {"min": round(min(samples), 3), "median": round(statistics.median(samples), 3), "n": len(samples)}


def _row(name: str, project: dict, bound: dict, *, unit: str) -> dict:
    """Ratio = project median / bound median (times: x slower than the bound)."""
    return {"row": name, "unit": unit, "project": project, "bound": bound,
            "ratio": round(project["median"] / bound["median"], 3)}


def _make_bundle(tmp: Path) -> tuple[Path, Path]:
    from app.config import Config, OutputSettings, TrainingSettings
    from app.run.pipeline import run_once

    res = run_once(Config(output=OutputSettings(dir=tmp), training=TrainingSettings(max_steps=2, save_steps=2)))
    return res.bundle_dir, res.policy_file


def verify_rows(tmp: Path, n: int) -> list[dict]:
    import dcap_qvl

    from attestation import load_policy, verify_bundle
    from attestation.tdx.dcap import parse_collateral
    from attestation.io.hashing import sha256_file

    bundle, policy_file = _make_bundle(tmp)
    policy = load_policy(policy_file)
    now = int(time.time())

    def project() -> None:
        if not verify_bundle(bundle, policy=policy, now=now).accepted:
            raise SystemExit("bench bundle rejected")

    raw = (bundle / "quote.bin").read_bytes()
    coll = parse_collateral((bundle / "collateral.json").read_bytes()).qvl
    root = policy.trusted_root.der  # the demo bundle's policy trusts the simulator's TEST root
    mine, bare = [], []
    for _ in range(3):  # interleaved, so a load change hits both
        mine += times_ms(project, n // 3 or 1, clear_dcap_caches)
        bare += times_ms(lambda: dcap_qvl.verify_with_root_ca(raw, coll, root, now), n // 3 or 1)
    files = sorted(p for p in bundle.rglob("*") if p.is_file())
    blobs = [p.read_bytes() for p in files]
    hashed = times_ms(lambda: [sha256_file(p) for p in files], n)
    in_memory = times_ms(lambda: [hashlib.sha256(b).hexdigest() for b in blobs], n)
    rows = [_row("verify_bundle, cold caches", _stats(mine), _stats(bare), unit="ms"),
            _row(f"hashing the bundle's {len(files)} files", _stats(hashed), _stats(in_memory), unit="ms")]
    # raw SHA-256 in memory over file-based: >= 0.9 means the file path reaches 90% of raw hashlib
    rows[-1]["raw_share"] = round(statistics.median(in_memory) / statistics.median(hashed), 3)
    big = tmp / "big.bin"
    with open(big, "wb") as fh:
        for _ in range(256):
            fh.write(os.urandom(MiB))
    data = big.read_bytes()
    file_ms, raw_ms = [], []
    for _ in range(5):
        file_ms += times_ms(lambda: sha256_file(big), 1)
        raw_ms += times_ms(lambda: hashlib.sha256(data).hexdigest(), 1)
    del data
    rows.append(_row("sha256_file, 256 MiB file", _stats(file_ms), _stats(raw_ms), unit="ms"))
    rows[-1]["raw_share"] = round(statistics.median(raw_ms) / statistics.median(file_ms), 3)
    rows += cli_rows(bundle, policy_file, n)
    return rows


def _process_ms(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=False, capture_output=True, env=env, cwd=TREE)  # -c puts the cwd first on sys.path
    return (time.perf_counter() - t) * 1000


def cli_rows(bundle: Path, policy: Path, n: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(TREE)}
    cli = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())"]  # what the console script runs
    pairs = {
        "cvm-tune verify BUNDLE (process)": (cli + ["verify", str(bundle), "--policy", str(policy)],
                                             [sys.executable, "-c", "import dcap_qvl"]),
        "cvm-tune --help (process)": (cli + ["--help"], [sys.executable, "-c", "pass"]),
    }
    rows = []
    for name, (cmd, bound) in pairs.items():
        mine, base = [], []
        for _ in range(max(5, n // 4)):
            mine.append(_process_ms(cmd, env))
            base.append(_process_ms(bound, env))
        rows.append(_row(name, _stats(mine), _stats(base), unit="ms"))
    return rows


def decrypt_row(tmp: Path, size_mib: int, repeat: int) -> dict:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from app.dataset import encrypt_stream, open_encrypted

    owner = Ed25519PrivateKey.from_private_bytes(b"\x42" * 32)
    block = os.urandom(MiB)

    class Source:
        left = size_mib * MiB

        def read(self, n: int = -1) -> bytes:
            n = min(n, self.left)
            self.left -= n
            return block[:n]

    path = tmp / "dataset.cvmds"
    with open(path, "wb") as out:
        encrypt_stream(Source(), out, KEY, dataset_id="bench", owner_key=owner)  # type: ignore[arg-type]
    size = path.stat().st_size
    pub = owner.public_key().public_bytes_raw()

    def stream() -> None:
        with open(path, "rb") as fh:
            for _ in open_encrypted(fh, KEY, owner_public_key=pub):
                pass

    aead = AESGCM(KEY)
    cts = [aead.encrypt(i.to_bytes(12, "big"), block, b"aad") for i in range(64)]

    def aes() -> None:
        for i, ct in enumerate(cts):
            aead.decrypt(i.to_bytes(12, "big"), ct, b"aad")

    def sha() -> None:
        h = hashlib.sha256()
        for ct in cts:
            h.update(ct)

    mbs: dict[str, list[float]] = {"stream": [], "aes": [], "sha": []}
    for _ in range(repeat):  # interleaved
        mbs["stream"].append(size / times_ms(stream, 1)[0] / 1e3)
        mbs["aes"].append(64 * MiB / min(times_ms(aes, 3)) / 1e3)
        mbs["sha"].append(64 * (MiB + 16) / min(times_ms(sha, 3)) / 1e3)
    med = {k: statistics.median(v) for k, v in mbs.items()}
    bound = min(med["aes"], med["sha"])
    return {"row": f"decrypt + verify a {size_mib} MiB signed dataset", "unit": "MB/s",
            "project": {"median": round(med["stream"]), "max": round(max(mbs["stream"])), "n": repeat},
            "bound": {"median": round(bound), "aes_gcm": round(med["aes"]), "sha256": round(med["sha"])},
            "ratio": round(med["stream"] / bound, 3)}


def main() -> None:
    global TREE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=HERE, help="the cvm-tune checkout to measure (default: this one)")
    ap.add_argument("--n", type=int, default=30, help="samples per in-process figure (default 30)")
    ap.add_argument("--dataset-mib", type=int, default=1024, help="signed dataset size for the decrypt row (default 1024)")
    ap.add_argument("--repeat", type=int, default=5, help="decrypt passes (default 5)")
    ap.add_argument("--train-steps", type=int, default=30, help="optimizer steps of the training rows (0: skip them)")
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()
    TREE = args.tree.resolve()
    sys.path.insert(0, str(TREE))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="cvm-tune-bench-cpu-") as tmp:
        rows = verify_rows(Path(tmp) / "v", args.n)
        rows.append(decrypt_row(Path(tmp), args.dataset_mib, args.repeat))
    if args.train_steps:
        sys.path.insert(0, str(TREE / "bench"))
        from train_perf import train_rows

        rows += train_rows(args.train_steps)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    report = {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tree": str(TREE),
              "machine": f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)], "rows": rows}
    print(f"{'row':66} {'project':>22} {'bound':>22} {'ratio':>7}")
    for r in rows:
        p, b = r["project"], r["bound"]
        fmt = (lambda d: f"{d['median']:.0f} {r['unit']}") if r["unit"] == "MB/s" else (
            lambda d: f"{d['min']:.2f} / {d['median']:.2f} {r['unit']}")
        extra = f"  (raw share {r['raw_share']:.2f})" if "raw_share" in r else ""
        if "previous_revision" in r:
            extra = f"  (previous revision {fmt(r['previous_revision'])})"
        print(f"{r['row']:66} {fmt(p):>22} {fmt(b):>22} {r['ratio']:>7.3f}{extra}")
    print(f"machine: {report['machine']}; load average before/after {report['load_average_before_after']}")
    write_json(report, args.out)


TREE = HERE

if __name__ == "__main__":
    main()
