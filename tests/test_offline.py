"""No network: a whole CPU run (imports, model build and load, training, save, export, attest) under a socket guard.

The run happens in a fresh interpreter with the guard installed before torch/transformers/peft/trl
are imported, so import-time calls (telemetry, version checks) are caught too. A deliberate request at
the end proves the guard was live in that process. Run: ``python -m pytest tests/test_offline.py -q``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.netguard import guard

REPO = Path(__file__).resolve().parent.parent

_RUN = textwrap.dedent("""
    import json, sys, urllib.request
    from tests.netguard import guard
    with guard() as attempts:
        import app.training.backend as B
        real, loaded = B.prepare_backend, []
        def spy(settings):  # what Unsloth would find already imported, were it the backend
            loaded.append(sorted(m for m in ("transformers", "trl", "peft") if m in sys.modules))
            return real(settings)
        B.prepare_backend = spy
        from app.cli import main
        rc = main(["run", "--config", sys.argv[1]])
        n_run = len(attempts)
        try:
            urllib.request.urlopen("https://huggingface.co/api/models", timeout=5)  # the control
        except OSError:
            pass
    print(json.dumps({"rc": rc, "during_run": attempts[:n_run], "control": attempts[n_run:], "loaded": loaded}))
""")


def test_guard_records_and_refuses_but_lets_unix_sockets_through() -> None:
    with guard() as attempts:
        with pytest.raises(OSError, match="blocked"):
            socket.create_connection(("203.0.113.7", 443), timeout=1)
        with pytest.raises(OSError):
            urllib.request.urlopen("http://example.org/", timeout=1)
        a, b = socket.socketpair(socket.AF_UNIX)
        a.sendall(b"ok")
        assert b.recv(2) == b"ok"
        a.close()
        b.close()
        with pytest.raises(OSError):
            socket.getaddrinfo("huggingface.co", 443)
    assert [what for what, _ in attempts] == ["create_connection", "create_connection", "getaddrinfo"]
    assert socket.create_connection.__module__ == "socket"  # restored afterwards


def test_cpu_run_makes_no_network_connection(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"output": {"dir": str(tmp_path / "out")}, "training": {"max_steps": 3, "save_steps": 2}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}  # the app must set them
    env.update(PYTHONPATH=str(REPO), HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, "-c", _RUN, str(cfg)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0
    assert report["during_run"] == []
    assert report["control"]  # the guard was live in that process
    assert report["loaded"][0] == []  # the backend was prepared (Unsloth imported) before transformers/trl/peft
    assert next((tmp_path / "out" / "exports").iterdir()).joinpath("manifest.json").is_file()
