"""Cost of exporting weights as age ciphertext (confidential outputs) against the machine's AEAD bound.

    python bench/encrypt.py [--adapter-mib 16] [--merged-mib 512] [--repeat 3] [--out bench/results/encrypt-cpu.json]

Two payloads of random bytes (incompressible, like trained weights): an adapter-sized file (``--adapter-mib``; a
rank-16 LoRA on a 0.5-1.5B model is 8-35 MB) and a merged export (``--merged-mib``, written as 4 shards). Measured in
one run on the same machine, median of ``--repeat``:

* ``export``: what the confidential export does per weight file (``app.export.confidential.encrypt_file``): SHA-256
  of the plaintext, then age v1 encryption streamed from a RAM file (``/dev/shm`` when present) to a RAM file, three
  X25519 recipients (an owner, the operator's, the CVM's);
* ``age in memory``: ``pyrage.encrypt`` of the same bytes (no file I/O, no hash);
* ``decrypt``: ``pyrage.decrypt`` in memory, what a warm start or ``cvm-tune adapter decrypt`` does, plus SHA-256;
* the bound: ChaCha20-Poly1305 (``cryptography``, OpenSSL) over the same bytes in age's 64 KiB chunks, and SHA-256;
  ``bound`` = the time of both (age's payload cipher plus the plaintext hash the manifest binds).

MB = 10^6 bytes. The load average before and after is recorded (shared machines are noisy).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from timing import write_json  # bench/timing.py: the script directory is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CHUNK = 64 << 10  # age's STREAM chunk


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _chacha(data: bytes) -> None:
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    aead, view = ChaCha20Poly1305(os.urandom(32)), memoryview(data)
    for i, off in enumerate(range(0, len(data), CHUNK)):
        aead.encrypt(i.to_bytes(12, "big"), view[off:off + CHUNK], None)


def measure(name: str, files: list[bytes], ram: Path, recipients: tuple[str, ...], identity: str, repeat: int) -> dict:
    import pyrage

    from app.export.confidential import encrypt_file

    srcs = []
    for i, data in enumerate(files):
        p = ram / f"{name}-{i}.safetensors"
        p.write_bytes(data)
        srcs.append(p)
    total = sum(len(d) for d in files)
    rec = [pyrage.x25519.Recipient.from_str(r) for r in recipients]
    ids = [pyrage.x25519.Identity.from_str(identity)]
    sealed = [pyrage.encrypt(d, rec) for d in files]
    out = {
        "export": _median(lambda: [encrypt_file(p, p.with_suffix(".age"), recipients) for p in srcs], repeat),
        "age_in_memory": _median(lambda: [pyrage.encrypt(d, rec) for d in files], repeat),
        "decrypt_and_hash": _median(lambda: [hashlib.sha256(pyrage.decrypt(c, ids)).digest() for c in sealed], repeat),
        "chacha20poly1305": _median(lambda: [_chacha(d) for d in files], repeat),
        "sha256": _median(lambda: [hashlib.sha256(d).digest() for d in files], repeat),
    }
    for p in srcs:
        p.unlink()
        p.with_suffix(".age").unlink(missing_ok=True)
    bound = out["chacha20poly1305"] + out["sha256"]
    mbps = {k: round(total / v / 1e6, 1) for k, v in out.items()}
    return {"bytes": total, "files": len(files), "seconds": {k: round(v, 4) for k, v in out.items()},
            "mb_per_s": mbps, "bound_mb_per_s": round(total / bound / 1e6, 1),
            "ratios": {"export_vs_bound": round(out["export"] / bound, 2),
                       "age_in_memory_vs_chacha": round(out["age_in_memory"] / out["chacha20poly1305"], 2),
                       "decrypt_and_hash_vs_bound": round(out["decrypt_and_hash"] / bound, 2)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter-mib", type=int, default=16)
    ap.add_argument("--merged-mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "encrypt-cpu.json")
    args = ap.parse_args(argv)
    from attestation.outputs import confidential as C

    ids = [C.identity_from_secret(bytes([i]) * 32) for i in (1, 2, 3)]
    recipients = tuple(sorted(C.recipient_of(i) for i in ids))
    shm = Path("/dev/shm")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
        adapter = [os.urandom(args.adapter_mib << 20)]
        shard = args.merged_mib << 20 >> 2
        merged = [os.urandom(shard) for _ in range(4)]
        results = {"adapter": measure("adapter", adapter, Path(tmp), recipients, ids[0], args.repeat)}
        del adapter
        results["merged"] = measure("merged", merged, Path(tmp), recipients, ids[0], args.repeat)
    doc = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": platform.python_version(), "pyrage": _version("pyrage"),
                       "cryptography": _version("cryptography")},
           "date": time.strftime("%Y-%m-%d"), "load_before": [round(x, 2) for x in load0],
           "load_after": [round(x, 2) for x in os.getloadavg()], "recipients": len(recipients),
           "repeat": args.repeat, "results": results}
    write_json(doc, args.out)
    for name, r in results.items():
        print(f"{name}: {r['bytes'] / 1e6:.0f} MB in {r['files']} file(s): export {r['mb_per_s']['export']} MB/s, "
              f"age in memory {r['mb_per_s']['age_in_memory']} MB/s, decrypt+hash {r['mb_per_s']['decrypt_and_hash']} "
              f"MB/s; bound (ChaCha20-Poly1305 + SHA-256) {r['bound_mb_per_s']} MB/s; export/bound "
              f"{r['ratios']['export_vs_bound']}x")
    return 0


def _version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())
