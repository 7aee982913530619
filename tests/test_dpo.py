"""Preference training (``training.objective: dpo``): rows, config, TRL's DPOTrainer on the tiny model, resume after
kill -9, the promotion gate and the attested bundle.

Run: ``python -m pytest tests/test_dpo.py -q`` (CPU, offline; the tiny model is built once per session).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from app.config import TrainingSettings, load_config
from app.dataset.row_sets import check_objective
from app.dataset.rows import parse_jsonl
from app.errors import ConfigError, RowError
from app.training import TrainRequest, TrainResult, build_tiny_model, train
from app.training.checkpoints import latest_name
from app.training.dpo import eval_scores, reference_scores, token_policy
from tests.owner_fixtures import KEY, encrypt_to, jsonl, owner_key

REPO = Path(__file__).resolve().parent.parent
FP = "ab" * 32
CKPT_KEY = bytes(range(32))
TRAIN_SUBJECTS = ["the cat", "a dog", "the river", "my friend", "the city", "a teacher", "the garden", "an engine"]
HELD_OUT = ["the moon", "a song", "the market", "a child"]  # never trained on
SETTINGS = {"objective": "dpo", "max_steps": 8, "per_device_batch_size": 2, "gradient_accumulation_steps": 1,
            "learning_rate": 5e-3, "max_length": 64, "save_steps": 4, "logging_steps": 1}
OWNER = owner_key()


def pair(subject: str, **extra: Any) -> dict[str, Any]:
    """The owner prefers a friendly answer over a refusal, whatever the subject."""
    return {"prompt": f"Tell me about {subject}.", "chosen": f"Sure, {subject} is lovely and kind.",
            "rejected": f"No. I refuse to talk about {subject}.", **extra}


def chat_pair(subject: str) -> dict[str, Any]:
    p = pair(subject)
    return {"prompt": [{"role": "user", "content": p["prompt"]}],
            "chosen": [{"role": "assistant", "content": p["chosen"]}],
            "rejected": [{"role": "assistant", "content": p["rejected"]}]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    build_tiny_model(path)
    return path


def _request(base: Path, run_dir: Path, **kw: Any) -> TrainRequest:
    fields: dict[str, Any] = {"base_model_dir": base, "base_model_name": "cvm-tune/tiny-llama",
                              "rows": [pair(s) for s in TRAIN_SUBJECTS], "run_dir": run_dir,
                              "settings": TrainingSettings(**SETTINGS), "fingerprint": FP, "checkpoint_key": CKPT_KEY}
    fields.update(kw)
    return TrainRequest(**fields)


@pytest.fixture(scope="module")
def baseline(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainResult:
    """One uninterrupted 8-step DPO run."""
    return train(_request(tiny, tmp_path_factory.mktemp("dpo-baseline")))


def _tensors(adapter_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


# --- rows and config -------------------------------------------------------------------------------------------


def test_preference_rows_validate_plain_and_conversational() -> None:
    rows, rep = parse_jsonl([jsonl([pair("x"), chat_pair("y"), pair("z", split="eval")])], source="p.jsonl",
                            max_row_bytes=10_000)
    assert len(rows) == 3 and rep.by_kind == {"messages": 0, "text": 0, "preference": 3}


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "q", "chosen": "a"}, "p.jsonl line 2: rejected: missing"),
    ({"prompt": "q", "chosen": "a", "rejected": "   "}, "p.jsonl line 2: rejected: must not be empty"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "text": "t"}, "line 2: 1 unexpected key"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
     "line 2: prompt, chosen and rejected must all be strings or all be message arrays"),
    ({**chat_pair("s"), "chosen": [{"role": "user", "content": "a"}]}, "line 2: chosen[0].role: expected 'assistant'"),
    ({**chat_pair("s"), "rejected": []}, "line 2: rejected: expected exactly one assistant message, got 0"),
    ({**chat_pair("s"), "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "line 2: prompt: must end with a user message"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "split": "test"}, "line 2: split: expected"),
])
def test_bad_preference_rows_are_refused_naming_the_line(row: dict, message: str) -> None:
    with pytest.raises(RowError) as err:
        parse_jsonl([jsonl([pair("ok"), row])], source="p.jsonl", max_row_bytes=10_000)
    assert message in err.value.message
    assert "Tell me" not in err.value.message  # never content


def test_rows_must_fit_the_objective() -> None:
    rows = [{"text": "hello"}, pair("x"), pair("y")]
    with pytest.raises(RowError, match=r"d.jsonl line 7: a text or chat row, but training.objective is dpo \(1 of 3"):
        check_objective(rows, (7, 8, 9), "dpo", source="d.jsonl")
    with pytest.raises(RowError, match=r"d.parquet row 8: a preference row .*training.objective is sft \(2 of 3 rows\)"):
        check_objective(rows, (7, 8, 9), "sft", source="d.parquet", unit="row")
    check_objective(rows[1:], (8, 9), "dpo", source="d.jsonl")


def test_dp_sgd_with_dpo_is_refused_up_front(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"training": {"objective": "dpo", "privacy": {"mode": "dp-sgd"}}}))
    with pytest.raises(ConfigError, match="training.objective dpo does not support training.privacy.mode dp-sgd"):
        load_config(cfg)
    with pytest.raises(ValueError, match="assistant_only_loss"):
        TrainingSettings(objective="dpo", assistant_only_loss=True)
    assert TrainingSettings().objective == "sft" and TrainingSettings(objective="dpo").dpo.beta == 0.1


def test_token_policy_counts_pairs_and_drops_prompts_that_fill_max_length(tiny: Path) -> None:
    rows = [pair("a"), {"prompt": "word " * 80, "chosen": "yes", "rejected": "no"}, pair("b")]
    kept, rep = token_policy(rows, base_model_dir=tiny, max_length=32, too_long="truncate", lines=(3, 5, 9))
    assert kept == [rows[0], rows[2]] and rep.no_trainable_lines == (5,) and rep.too_long_lines == (5,)
    assert rep.rows_out == 2 and 0 < rep.trainable_tokens < rep.tokens
    with pytest.raises(RowError, match="mix plain strings and message arrays"):
        token_policy([pair("a"), chat_pair("b")], base_model_dir=tiny, max_length=32, too_long="truncate")


# --- training ----------------------------------------------------------------------------------------------------


def test_dpo_lowers_the_loss_and_learns_the_preference_on_held_out_pairs(baseline: TrainResult, tiny: Path) -> None:
    losses = [loss for _, loss in baseline.losses]
    assert [s for s, _ in baseline.losses] == list(range(1, 9))
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)  # the adapter starts as the reference: margin 0, ln 2
    assert losses[-1] < 0.5 * losses[0]
    held = [pair(s) for s in HELD_OUT]
    s = TrainingSettings(**SETTINGS)
    base_loss, base_acc = eval_scores(tiny, None, held, s)
    loss, acc = eval_scores(tiny, baseline.adapter_dir, held, s)
    assert (base_loss, base_acc) == reference_scores(s)
    assert loss < base_loss - 0.2 and acc == 1.0 > base_acc


def test_conversational_pairs_train(tiny: Path, tmp_path: Path) -> None:
    s = TrainingSettings(**{**SETTINGS, "max_steps": 2, "save_steps": 2, "eval_fraction": 0.25,
                            "dpo": {"beta": 0.5, "loss_type": "ipo"}})
    r = train(_request(tiny, tmp_path, rows=[chat_pair(x) for x in TRAIN_SUBJECTS], settings=s))
    assert r.global_step == 2 and all(loss == loss for _, loss in r.losses)
    assert [step for step, _ in r.eval_losses] == [2]  # the held-out share is scored by the DPO loss


_KILLED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from app.config import TrainingSettings
    from app.training import TrainRequest, train
    from tests.test_dpo import CKPT_KEY, FP, SETTINGS, TRAIN_SUBJECTS, pair

    def log(m):  # from step 5 on, slow down (outside the math) so the kill lands before checkpoint-8
        print("step", m["step"], flush=True)
        if m["step"] >= 5:
            time.sleep(0.5)

    base, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    train(TrainRequest(base_model_dir=base, base_model_name="cvm-tune/tiny-llama", rows=[pair(s) for s in TRAIN_SUBJECTS],
                       run_dir=run_dir, settings=TrainingSettings(**SETTINGS), fingerprint=FP, checkpoint_key=CKPT_KEY,
                       on_log=log))
""")


def test_kill_9_after_a_checkpoint_resumes_bit_identically(baseline: TrainResult, tiny: Path, tmp_path: Path) -> None:
    """SIGKILL once checkpoint-4 is sealed and step 5 trained (lost); the resumed run equals the uninterrupted one
    exactly: every logged loss and every adapter tensor."""
    import torch

    log = tmp_path / "log.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TMPDIR": str(tmp_path)}  # its scratch directory dies with it (SIGKILL: no clean-up runs)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(tiny), str(tmp_path / "run")], env=env, cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT)
    end = time.monotonic() + 240
    while not (latest_name(tmp_path / "run" / "checkpoints") == "checkpoint-4" and b"step 5\n" in log.read_bytes()):
        assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (tmp_path / "run" / "adapter").exists()
    resumed = train(_request(tiny, tmp_path / "run"))
    assert (resumed.resumed_from_step, resumed.global_step) == (4, 8)
    assert resumed.losses == baseline.losses  # bit-identical, steps 1-4 from the sealed log history
    a, b = _tensors(resumed.adapter_dir), _tensors(baseline.adapter_dir)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# --- the attested run ---------------------------------------------------------------------------------------------


def _cfg(root: Path, data: Path, **training: Any) -> Path:
    key = root / "dataset.key"
    key.write_bytes(KEY)
    key.chmod(0o600)
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps({
        "output": {"dir": str(root / "out")}, "evaluation": {"gate": "loss"},
        "dataset": {"source": "encrypted-file", "path": str(data), "owner_public_key":
                    OWNER.public_key().public_bytes_raw().hex(), "key": {"source": "file", "file": str(key)}},
        "training": {**SETTINGS, "max_steps": 4, "save_steps": 2, **training}}))
    return cfg


def test_dpo_run_exports_a_bundle_that_verifies_and_records_the_objective(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    data = tmp_path / "prefs.cvmds"
    encrypt_to(data, jsonl([pair(s) for s in TRAIN_SUBJECTS] + [pair(s, split="eval") for s in HELD_OUT]),
               signer=OWNER)
    assert main(["run", "--config", str(_cfg(tmp_path, data))]) == 0
    out = capsys.readouterr().out
    assert "evaluation: DPO loss" in out and "preference accuracy" in out
    rows_line = next(line for line in out.splitlines() if line.startswith("dataset: prefs.cvmds"))
    assert ", 12 preference rows, 0 duplicates dropped" in rows_line and "{" not in rows_line  # not a Python dict
    bundle = next(p for p in (tmp_path / "out" / "exports").iterdir() if p.is_dir())
    m = json.loads((bundle / "manifest.json").read_bytes())
    assert m["training"]["objective"] == "dpo"
    assert m["training"]["dpo"] == {"beta": 0.1, "loss_type": "sigmoid", "reference": "base model (adapter disabled)"}
    ev = m["evaluation"]
    assert ev["metric"] == "dpo_loss" and ev["rows"] == 4 and ev["promote"] is True
    assert ev["parent_loss"] == pytest.approx(0.693147, abs=1e-6) and ev["parent_accuracy"] == 0.0
    assert ev["candidate_loss"] < ev["parent_loss"] and ev["candidate_accuracy"] > 0.5
    assert m["dataset"]["plaintext_format"] == "jsonl" and m["dataset"]["validation"]["rows_read"] == 12
    assert "dpo (preference training: beta 0.1, loss sigmoid" in (bundle / "README.md").read_text()
    policy = tmp_path / "out" / "simulator-test-policy.yaml"
    assert main(["verify", str(bundle), "--policy", str(policy)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("ACCEPTED") and "objective: dpo (beta 0.1, loss sigmoid, reference: base model" in printed


def test_a_dpo_run_from_a_parquet_table_trains_the_jsonl_runs_adapter(tmp_path: Path) -> None:
    """The same preference rows as a Parquet table (owner-signed, encrypted like a JSONL dataset): the run records
    the table format and the same rows hash, trains the same adapter bytes as from JSONL, and its bundle verifies."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.cli import main
    from app.dataset import encrypt_stream
    from app.dataset.tabular import PARQUET

    rows = [pair(s) for s in TRAIN_SUBJECTS] + [pair(s, split="eval") for s in HELD_OUT]
    buf = io.BytesIO()
    schema = pa.schema([(c, pa.string()) for c in ("prompt", "chosen", "rejected", "split")])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf)
    results = {}
    for name in ("parquet", "jsonl"):
        root = tmp_path / name
        root.mkdir()
        data = root / "prefs.cvmds"
        if name == "parquet":
            with open(data, "wb") as out:
                encrypt_stream(io.BytesIO(buf.getvalue()), out, KEY, dataset_id="prefs", dataset_version=1,
                               owner_key=OWNER, content_type=PARQUET)
        else:
            encrypt_to(data, jsonl(rows), signer=OWNER, dataset_id="prefs")
        assert main(["run", "--config", str(_cfg(root, data))]) == 0
        bundle = next(p for p in (root / "out" / "exports").iterdir() if p.is_dir())
        assert main(["verify", str(bundle), "--policy", str(root / "out" / "simulator-test-policy.yaml")]) == 0
        results[name] = (json.loads((bundle / "manifest.json").read_bytes()),
                         (bundle / "adapter" / "adapter_model.safetensors").read_bytes())
    (pm, pw), (jm, jw) = results["parquet"], results["jsonl"]
    assert pm["training"]["objective"] == "dpo" and pm["dataset"]["plaintext_format"] == "parquet"
    assert pm["dataset"]["validation"]["rows_read"] == 12 and pm["evaluation"]["metric"] == "dpo_loss"
    assert pm["dataset"]["rows_sha256"] == jm["dataset"]["rows_sha256"] and pw == jw


def test_sft_rows_under_objective_dpo_are_a_data_error(tmp_path: Path) -> None:
    from app.cli import main

    data = tmp_path / "mixed.cvmds"
    encrypt_to(data, jsonl([pair("a"), {"text": "plain text row"}, pair("b")]), signer=OWNER)
    assert main(["run", "--config", str(_cfg(tmp_path, data))]) == 3
    assert not (tmp_path / "out" / "runs").exists() or not any((tmp_path / "out" / "runs").iterdir())


# --- GPU: Unsloth's DPO path ---------------------------------------------------------------------------------------


def _gpu_and_unsloth() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("unsloth") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_and_unsloth(), reason="needs a CUDA GPU and unsloth")
def test_unsloth_dpo_trains_and_exports(tmp_path: Path) -> None:
    """On a GPU with Unsloth: backend auto picks Unsloth, the DPO loss falls, the adapter is exported (a fresh
    interpreter: Unsloth must be imported before TRL)."""
    script = textwrap.dedent("""
        import json, sys
        from pathlib import Path
        import torch
        assert torch.cuda.is_available()
        from app.config import TrainingSettings
        from app.training import TrainRequest, build_tiny_model, train
        from tests.test_dpo import SETTINGS, TRAIN_SUBJECTS, pair
        root = Path(sys.argv[1]); build_tiny_model(root / "tiny")
        r = train(TrainRequest(base_model_dir=root / "tiny", base_model_name="cvm-tune/tiny-llama",
                               rows=[pair(s) for s in TRAIN_SUBJECTS], run_dir=root / "run",
                               settings=TrainingSettings(**SETTINGS), fingerprint="ab" * 32))
        print(json.dumps({"backend": r.backend, "losses": r.losses}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["backend"] == "unsloth" and got["losses"][-1][1] < got["losses"][0][1]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_dpo_warm_start_continues_the_promoted_adapter_with_lineage(tmp_path: Path) -> None:
    """Two nights, a new version each: the second DPO run warm-starts from the promoted DPO adapter (lineage in the
    manifest, the gate scores it against that parent), and its bundle verifies."""
    from app.cli import main
    from app.run.pipeline import RunHooks, run_once

    data = tmp_path / "data"
    data.mkdir()
    eval_rows = [pair(s, split="eval") for s in HELD_OUT]
    encrypt_to(data / "v1.cvmds", jsonl([pair(s) for s in TRAIN_SUBJECTS[:4]] + eval_rows), signer=OWNER,
               dataset_id="prefs", dataset_version=1)
    cfg_path = _cfg(tmp_path, data, init="previous")
    doc = json.loads(cfg_path.read_text())
    doc["dataset"]["dataset_id"] = "prefs"
    cfg_path.write_text(json.dumps(doc))
    cfg = load_config(cfg_path)
    first = run_once(cfg, hooks=RunHooks(service=True))
    encrypt_to(data / "v2.cvmds", jsonl([pair(s) for s in TRAIN_SUBJECTS[4:]] + eval_rows), signer=OWNER,
               dataset_id="prefs", dataset_version=2)
    second = run_once(cfg, hooks=RunHooks(service=True))
    m = json.loads((second.bundle_dir / "manifest.json").read_bytes())
    assert m["lineage"]["parent_run_id"] == first.run_id and m["training"]["objective"] == "dpo"
    ev = m["evaluation"]
    assert ev["parent"] == f"run {first.run_id}" and ev["parent_accuracy"] > 0 and ev["metric"] == "dpo_loss"
    assert second.verdicts[0][1].accepted  # the simulator policy (the default one rejects the test CA)
    assert main(["verify", "--chain", str(tmp_path / "out" / "exports"), "--policy",
                 str(tmp_path / "out" / "simulator-test-policy.yaml")]) == 0
