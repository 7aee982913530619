"""Streaming decrypt + verify throughput and peak memory for a dataset larger than the process's memory limit.

    python bench/decrypt.py [--size-mib 2048] [--limit-mib 192] [--repeat 3] [--out bench/results/decrypt-cpu.json]

Writes an owner-signed (format version 2) dataset of ``--size-mib`` in a temporary directory
(deleted afterwards), then runs one child process under ``RLIMIT_AS = --limit-mib`` (smaller than
the file) that measures, in the same run on the same machine:

* raw AES-256-GCM decrypt (``AESGCM.decrypt`` on 1 MiB chunks in memory) and raw SHA-256: the ceilings;
* ``open_encrypted`` streaming the file: key check, header MAC, owner signature, every chunk's
  tag, SHA-256 of the ciphertext and of the plaintext, and the signed statement at the end: the
  path the pipeline takes before it parses rows (two stages, the default);
* the same on the calling thread only, to show what the second stage buys;
* the child's peak RSS (``VmHWM``).

MB = 10^6 bytes. The file is read back from the page cache right after it was written, so this is
CPU throughput, not disk; the load average before and after is recorded (shared machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from timing import write_json  # bench/timing.py: the script directory is on sys.path

ROOT = Path(__file__).resolve().parents[1]
KEY = bytes(range(32))
CHUNK = 1 << 20


class _Rows:
    """``total`` bytes of JSONL rows generated on the fly (the plaintext never exists whole)."""

    def __init__(self, total: int) -> None:
        self.left = total
        self._pattern = b"".join(
            b'{"messages": [{"role": "user", "content": "question %d about the ledger"}, '
            b'{"role": "assistant", "content": "answer %d: reconcile the entries first"}]}\n' % (i, i) for i in range(4000))
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        n = min(n, self.left)
        out = bytearray()
        while len(out) < n:
            take = min(n - len(out), len(self._pattern) - self._pos)
            out += self._pattern[self._pos : self._pos + take]
            self._pos = (self._pos + take) % len(self._pattern)
        self.left -= n
        return bytes(out)


def _hwm_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024


def child(path: Path, pub_hex: str, limit: int, repeat: int) -> dict:
    """Runs under RLIMIT_AS = limit (set before the imports below)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import hashlib

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from app.dataset import format as fmt

    size = path.stat().st_size

    def stream_once() -> tuple[float, str]:
        t = time.perf_counter()
        with open(path, "rb") as fh:
            stream = fmt.open_encrypted(fh, KEY, owner_public_key=bytes.fromhex(pub_hex))
            for _piece in stream:
                pass
        return size / (time.perf_counter() - t) / 1e6, stream.plaintext_sha256

    threaded, single, digests = [], [], set()
    for _ in range(repeat):
        mbs, digest = stream_once()
        threaded.append(mbs)
        digests.add(digest)
    from app.dataset import format_read

    default = format_read.THREADED_HASH_MIN_CHUNK
    format_read.THREADED_HASH_MIN_CHUNK = 1 << 40  # read, hash and decrypt on the calling thread
    for _ in range(repeat):
        mbs, digest = stream_once()
        single.append(mbs)
        digests.add(digest)
    format_read.THREADED_HASH_MIN_CHUNK = default
    assert len(digests) == 1
    peak = _hwm_mib()  # before the raw loops below allocate their in-memory chunks

    aead, block = AESGCM(KEY), os.urandom(CHUNK)
    cts = [aead.encrypt(i.to_bytes(12, "big"), block, b"aad") for i in range(32)]  # 32 MiB: fits under the limit
    raw_aes, raw_sha = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(16):  # 512 MiB per sample
            for i, ct in enumerate(cts):
                aead.decrypt(i.to_bytes(12, "big"), ct, b"aad")
        raw_aes.append(512 * CHUNK / (time.perf_counter() - t) / 1e6)
        h, t = hashlib.sha256(), time.perf_counter()
        for _ in range(16):
            for ct in cts:
                h.update(ct)
        raw_sha.append(512 * (CHUNK + 16) / (time.perf_counter() - t) / 1e6)

    def stats(xs: list[float]) -> dict:
        return {"best": round(max(xs)), "median": round(statistics.median(xs))}

    return {"raw_aes_gcm_decrypt_mb_s": stats(raw_aes), "raw_sha256_mb_s": stats(raw_sha),
            "stream_decrypt_verify_mb_s": stats(threaded), "stream_decrypt_verify_single_thread_mb_s": stats(single),
            "stream_peak_rss_mib": round(peak, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=2048, help="plaintext size (default 2048)")
    ap.add_argument("--limit-mib", type=int, default=192, help="the child's RLIMIT_AS (default 192; must be < the file)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    ap.add_argument("--child", nargs=3, metavar=("FILE", "PUB", "LIMIT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), args.child[1], int(args.child[2]), args.repeat)))
        return
    sys.path.insert(0, str(ROOT))
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from app.dataset import encrypt_stream

    owner = Ed25519PrivateKey.generate()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cvm-tune-bench-decrypt-") as tmp:
        path = Path(tmp) / "big.cvmds"
        t = time.perf_counter()
        with open(path, "wb") as out:
            res = encrypt_stream(_Rows(args.size_mib << 20), out, KEY, dataset_id="bench", owner_key=owner)  # type: ignore[arg-type]
        encrypt_s = time.perf_counter() - t
        if res.ciphertext_size <= args.limit_mib << 20:
            raise SystemExit("--limit-mib must be below the file size")
        proc = subprocess.run([sys.executable, __file__, "--repeat", str(args.repeat), "--child", str(path),
                               owner.public_key().public_bytes_raw().hex(), str(args.limit_mib << 20)],
                              capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if proc.returncode != 0:
            raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
        measured = json.loads(proc.stdout)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    report = {
        "machine": f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "file_mib": round(res.ciphertext_size / (1 << 20), 1), "plaintext_mib": args.size_mib,
        "chunk_size": res.header.chunk_size, "format_version": 2, "memory_limit_mib (RLIMIT_AS)": args.limit_mib,
        "encrypt_sign_mb_s": round(res.ciphertext_size / encrypt_s / 1e6),
        **measured,
        "target_mb_s": 1000,
        "note": "stream_* = open_encrypted over the whole file (owner signature, key check, header MAC, every GCM tag, "
                "SHA-256 of ciphertext and plaintext, signed statement); file read from the page cache",
    }
    print(json.dumps(report, indent=2))
    write_json(report, args.out)


if __name__ == "__main__":
    main()
