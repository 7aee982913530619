"""The verifier alone: ``requirements/verify.lock`` installs what checks bundles, without the training stack.

One venv per module (``install.sh`` with verify.lock, the source tree copied from git's tracked files, pip's cache
allowed): torch and the rest are absent, ``cvm-tune verify`` gives the dev venv's verdict, the training commands
name what to install. Plus epsilon recomputed without torch, cross-checked with Opacus where it is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / "tests" / "data" / "bundle"
POLICY = REPO / "tests" / "data" / "bundle-policy.yaml"
NOW = "1900000000"
TRAINING = ("torch", "transformers", "peft", "trl", "opacus", "flwr", "datasets", "accelerate")


def _tracked_tree(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bin/ of a fresh venv made as docs/verifier.md says: python3 -m venv + install.sh with verify.lock."""
    root = tmp_path_factory.mktemp("verifier-alone")
    tree = _tracked_tree(root / "tree")
    venv = root / ".venv-verify"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_clean_env())
    done = subprocess.run(["sh", "requirements/install.sh", str(venv), "requirements/verify.lock"], cwd=tree, env=_clean_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv / "bin"


def _clean_env() -> dict[str, str]:
    """A relying party's shell: nothing that points into the dev venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _run(exe: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, cwd=exe.parent.parent,
                          env=_clean_env())


def test_the_verifier_venv_has_no_training_stack(verifier: Path) -> None:
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    assert _run(verifier / "python", "-c", probe, *TRAINING).stdout.strip() == "[]"
    assert _run(verifier / "python", "-c", "import torch").returncode == 1


def test_verify_gives_the_dev_venvs_verdict(verifier: Path, tmp_path: Path) -> None:
    bundle = shutil.copytree(BUNDLE, tmp_path / "exports" / BUNDLE.name)
    args = ("verify", str(bundle), "--policy", str(POLICY), "--now", NOW, "--json")
    alone = _run(verifier / "cvm-tune", *args)
    dev = subprocess.run([str(Path(sys.executable).parent / "cvm-tune"), *args], capture_output=True, text=True,
                         cwd=tmp_path)
    assert alone.returncode == dev.returncode == 0, alone.stderr
    got, want = json.loads(alone.stdout), json.loads(dev.stdout)
    assert got["verdict"] == "accepted" and got == want
    chain = _run(verifier / "cvm-tune", "verify", "--chain", str(tmp_path / "exports"), "--policy", str(POLICY),
                 "--now", NOW)
    assert chain.returncode == 0, chain.stdout + chain.stderr


def test_verify_quote_and_round_bundles_need_no_training_stack(verifier: Path, tmp_path: Path) -> None:
    quote = _run(verifier / "cvm-tune", "verify-quote", str(BUNDLE / "quote.bin"), "--collateral",
                 str(BUNDLE / "collateral.json"), "--event-log", str(BUNDLE / "event_log.json"), "--policy", str(POLICY),
                 "--now", NOW)
    assert quote.returncode == 0, quote.stdout + quote.stderr
    round_dir = tmp_path / "round-1"
    round_dir.mkdir()
    (round_dir / "round-manifest.json").write_text("{}")
    rejected = _run(verifier / "cvm-tune", "verify", str(round_dir), "--policy", str(POLICY), "--now", NOW)
    assert rejected.returncode in (1, 2) and "internal error" not in rejected.stderr, rejected.stderr
    probe = "import attestation.rounds.verify, app.cli.verify, numpy, safetensors.numpy, dp_accounting"
    assert _run(verifier / "python", "-c", probe).returncode == 0


API_BUNDLE = REPO / "tests" / "data" / "api-bundle"
API_OPS = REPO / "tests" / "data" / "api-bundle-ops.jsonl"


@pytest.mark.parametrize("case", ["honest", "float32 overflow", "huge integer weight", "int64 overflow",
                                  "int32 overflow", "infinite adam", "huge integer adam", "float token"])
def test_ops_are_checked_without_the_training_stack_and_the_json_says_what_the_exit_code_says(
        verifier: Path, tmp_path: Path, case: str) -> None:
    lines = API_OPS.read_text().splitlines()
    fb, opt = json.loads(lines[0]), json.loads(lines[1])
    if case == "float32 overflow":
        fb["data"][0]["loss_fn_inputs"]["weights"][0] = 3.5e38
    elif case == "huge integer weight":
        fb["data"][0]["loss_fn_inputs"]["weights"][0] = 10 ** 40
    elif case == "int64 overflow":
        fb["data"][0]["loss_fn_inputs"]["target_tokens"][0] = 2 ** 63
    elif case == "int32 overflow":
        fb["data"][0]["model_input"][0] = -(2 ** 31) - 1
    elif case == "huge integer adam":
        opt["adam_params"]["eps"] = 10 ** 400
    elif case == "float token":
        fb["data"][0]["model_input"][0] = 2.0
    lines[0], lines[1] = json.dumps(fb), json.dumps(opt)
    if case == "infinite adam":
        lines[1] = lines[1].replace('"learning_rate": 0.01', '"learning_rate": 1e999')
    ops = tmp_path / "ops.jsonl"
    ops.write_text("\n".join(lines) + "\n")
    done = _run(verifier / "cvm-tune", "verify", str(API_BUNDLE), "--policy", str(POLICY), "--now", NOW, "--ops", str(ops),
                "--json")
    got = json.loads(done.stdout)
    chain = next(c for c in got["checks"] if c["name"] == "op_chain.ops")
    if case == "honest":
        assert (done.returncode, got["verdict"], chain["status"]) == (0, "accepted", "pass"), done.stderr
    else:
        assert (done.returncode, got["verdict"], chain["status"]) == (1, "rejected", "fail"), done.stderr
        # the op named: by its number, or by its line when it is not even JSON (a number of over 400 characters)
        assert any(f"{where} {n}" in chain["reason"] for where in ("op", "line") for n in (1, 2)), chain


def test_replay_says_it_needs_the_training_stack(verifier: Path) -> None:
    done = _run(verifier / "cvm-tune", "verify", str(API_BUNDLE), "--policy", str(POLICY), "--now", NOW, "--ops",
                str(API_OPS), "--replay")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "fix: install the training stack" in done.stderr


@pytest.mark.parametrize("command", [["run"], ["serve", "--once"]])
def test_training_commands_say_what_to_install(verifier: Path, command: list[str]) -> None:
    done = _run(verifier / "cvm-tune", *command)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.startswith("error: ")
    assert "fix: install the training stack: sh requirements/install.sh VENV requirements/cpu.lock" in done.stderr


def test_training_stack_names_are_the_extras() -> None:
    """app.cli.TRAINING_STACK (the modules whose absence means "install cpu.lock") = pyproject's [train] + [gpu]."""
    import re
    import tomllib

    from app.cli import TRAINING_STACK

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("-", "_") for r in extras["train"] + extras["gpu"]}
    assert names - {"cvm_tune"} == TRAINING_STACK


POINTS = [(0.5295, 8 / 171, 10, 3.42e-5), (1.0, 0.01, 1000, 1e-5), (0.8, 0.1, 100, 1e-5), (0.4, 0.1, 1000, 1e-9),
          (2.0, 0.001, 30000, 1e-5), (5.0, 1.0, 50, 1e-5)]


@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), POINTS)
def test_rdp_epsilon_without_torch_is_opacus_figure(sigma: float, q: float, steps: int, delta: float) -> None:
    pytest.importorskip("opacus")
    from opacus.accountants import RDPAccountant

    from attestation.privacy.dp import recompute_epsilon

    acc = RDPAccountant()
    acc.history = [(sigma, q, steps)]
    want = acc.get_epsilon(delta=delta)
    assert recompute_epsilon("rdp", [(sigma, q, steps)], delta) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), [POINTS[0], POINTS[1], (1.641, 8 / 137, 30, 1e-5)])
def test_prv_epsilon_from_dp_accounting_agrees_with_opacus(sigma: float, q: float, steps: int, delta: float) -> None:
    pytest.importorskip("opacus")
    from opacus.accountants import PRVAccountant

    from attestation.privacy.dp import PRV_ABS_TOL, epsilon_agrees, recompute_epsilon

    acc = PRVAccountant()
    acc.history = [(sigma, q, steps)]
    want = acc.get_epsilon(delta=delta)
    got = recompute_epsilon("prv", [(sigma, q, steps)], delta)
    assert epsilon_agrees("prv", got, want) and abs(got - want) < PRV_ABS_TOL
    assert not epsilon_agrees("prv", got, want * 0.9)


def test_prv_mesh_points_without_torch_is_opacus_mesh() -> None:
    pytest.importorskip("opacus")
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV, compute_safe_domain_size

    from attestation.privacy.dp import prv_mesh_points

    sigma, q, steps, delta = 0.7, 0.05, 1000, 1e-6
    half = compute_safe_domain_size([PoissonSubsampledGaussianPRV(q, sigma)], [steps], eps_error=0.01,
                                    delta_error=delta / 1000)
    mesh = 0.01 / (steps * __import__("math").log(12 / (delta / 1000)) / 2) ** 0.5
    assert prv_mesh_points([(sigma, q, steps)], delta) == pytest.approx(2 * half / mesh + 1, rel=1e-9)


def test_recomputing_epsilon_imports_no_torch() -> None:
    code = ("import sys; from attestation.privacy.dp import recompute_epsilon as r; r('rdp', [(1.0, 0.01, 100)], 1e-5); "
            "r('prv', [(1.0, 0.01, 100)], 1e-5); print(sorted(m for m in ('torch', 'opacus') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.strip() == "[]"
