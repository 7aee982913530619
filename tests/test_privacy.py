"""Differential privacy (training.privacy dp-sgd): config and plan refusals, clipping and noise measured on a real
batch, epsilon = Opacus' accountant, resume accounting, the manifest/audit/verifier/policy side, the lifetime budget.

Run: ``python -m pytest tests/test_privacy.py -q`` (CPU, tiny model, a few optimizer steps per run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import PrivacySettings, TrainingSettings, load_config
from app.errors import ConfigError, PrivacyBudgetError
from app.run.privacy_budget import FILE as BUDGET_FILE
from app.run.privacy_budget import reserve

SAMPLE = Path(__file__).resolve().parent.parent / "app" / "data" / "sample.jsonl"
FP = "ab" * 32
CKPT_KEY = bytes(range(32))
INPUTS = {"config": "11" * 32, "dataset": "22" * 32, "base_model": "33" * 32}
DP = PrivacySettings(mode="dp-sgd", noise_multiplier=1.1, target_epsilon=20.0, max_grad_norm=0.5)
SETTINGS = TrainingSettings(max_steps=6, per_device_batch_size=2, gradient_accumulation_steps=2, max_length=64,
                            save_steps=3, logging_steps=1, privacy=DP)


def _rows(n: int = 20) -> list[dict[str, Any]]:
    with open(SAMPLE, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh][:n]


# --- config and plan: refused before anything is written (exit 2) --------------------------------------------


@pytest.mark.parametrize("privacy", [
    {"mode": "dp-sgd", "target_epsilon": 0},
    {"mode": "dp-sgd", "target_epsilon": -1},
    {"mode": "dp-sgd", "max_grad_norm": 0},
    {"mode": "dp-sgd", "noise_multiplier": 0},
    {"mode": "dp-sgd", "target_delta": 1.0},
    {"mode": "dp-sgd", "target_delta": 0},
    {"mode": "dp-sgd", "accountant": "gdp"},
    {"mode": "laplace"},
    {"mode": "dp-sgd", "epsilon": 3},
])
def test_bad_privacy_config_exits_2(tmp_path: Path, privacy: dict[str, Any]) -> None:
    from app.cli import main

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"output": {"dir": str(tmp_path / "out")}, "training": {"privacy": privacy}}))
    assert main(["run", "--config", str(cfg)]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("training", "names"), [
    ({"backend": "unsloth"}, "backend 'unsloth'"),
    ({"gpu": {"devices": 2}}, "devices > 1"),
    ({"gpu": {"gradient_checkpointing": "on"}}, "gradient_checkpointing 'on'"),
    ({"eval_fraction": 0.2}, "eval_fraction"),
])
def test_dp_refuses_what_it_cannot_run(tmp_path: Path, training: dict[str, Any], names: str) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"training": {**training, "privacy": {"mode": "dp-sgd"}}}))
    with pytest.raises(ConfigError, match=names) as exc:
        load_config(cfg)
    assert exc.value.exit_code == 2


def test_auto_backend_falls_back_to_hf_under_dp(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import app.training.privacy as P

    monkeypatch.setattr(P, "_fallback_said", False)
    assert P.backend_for(SETTINGS, "unsloth") == "hf"  # auto picked Unsloth (a GPU): DP trains with hf
    assert P.backend_for(SETTINGS, "unsloth") == "hf"
    assert caplog.text.count("instead of Unsloth") == 1  # said once
    assert P.backend_for(SETTINGS, "hf") == "hf"
    assert P.backend_for(TrainingSettings(), "unsloth") == "unsloth"  # DP off: untouched


def test_plan_refusals_name_the_setting(tmp_path: Path) -> None:
    from app.training.privacy import default_delta, plan

    assert plan(TrainingSettings(), rows=20) is None  # DP off
    with pytest.raises(ConfigError, match="not below 1/N = 1/20") as exc:
        plan(SETTINGS.model_copy(update={"privacy": DP.model_copy(update={"target_delta": 0.05})}), rows=20)
    assert exc.value.exit_code == 2
    with pytest.raises(ConfigError, match="effective batch"):
        plan(SETTINGS, rows=3)
    tight = SETTINGS.model_copy(update={"max_steps": 500, "privacy": DP.model_copy(update={"target_epsilon": 1.0})})
    with pytest.raises(ConfigError, match="max_steps 500 cannot fit the privacy budget"):
        plan(tight, rows=20)
    dp = plan(SETTINGS, rows=20)
    assert dp is not None and dp.sample_rate == 4 / 20 and dp.delta == default_delta(20) < 1 / 20
    assert dp.planned_epsilon <= DP.target_epsilon and not dp.noise_derived
    assert not list(tmp_path.iterdir())  # no ledger given: nothing written


def test_derived_noise_multiplier_fits_the_target() -> None:
    from app.training.privacy import epsilon, plan

    s = SETTINGS.model_copy(update={"privacy": DP.model_copy(update={"noise_multiplier": None, "target_epsilon": 8.0})})
    dp = plan(s, rows=20)
    assert dp is not None and dp.noise_derived
    assert 7.9 <= dp.planned_epsilon <= 8.0  # Opacus' search stops within 0.01 below the target
    assert epsilon("rdp", [(dp.noise_multiplier, dp.sample_rate, 6)], dp.delta) == dp.planned_epsilon


def test_prv_accountant_plan_equals_opacus() -> None:
    from opacus.accountants import PRVAccountant

    from app.training.privacy import plan

    dp = plan(SETTINGS.model_copy(update={"privacy": DP.model_copy(update={"accountant": "prv"})}), rows=20)
    assert dp is not None and dp.accountant == "prv"
    acc = PRVAccountant()
    for _ in range(SETTINGS.max_steps):
        acc.step(noise_multiplier=DP.noise_multiplier, sample_rate=dp.sample_rate)
    assert dp.planned_epsilon == pytest.approx(acc.get_epsilon(delta=dp.delta), rel=1e-9)


def test_lifetime_cap_refuses_the_night_that_would_exceed_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    reserve(state, cap=10.0, dataset_id="ds", version=1, run_id="night-1", epsilon=6.0, delta=1e-5)
    before = (state / BUDGET_FILE).read_bytes()
    with pytest.raises(PrivacyBudgetError, match="spent epsilon 6.000 in 1 run") as exc:
        reserve(state, cap=10.0, dataset_id="ds", version=1, run_id="night-2", epsilon=6.0, delta=1e-5)
    assert exc.value.exit_code == 2
    assert (state / BUDGET_FILE).read_bytes() == before  # nothing reserved
    reserve(state, cap=10.0, dataset_id="ds", version=1, run_id="night-1", epsilon=6.0, delta=1e-5)  # resume: same run
    reserve(state, cap=10.0, dataset_id="ds", version=2, run_id="night-2", epsilon=6.0, delta=1e-5)  # new version


# --- the mechanism, measured on a real batch ---------------------------------------------------------------


def _lora_model_and_batch(base: Path) -> tuple[Any, dict[str, Any]]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():  # LoRA B starts at zero: give it weights so that every LoRA parameter has a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    texts = [row["text"] if "text" in row else tok.apply_chat_template(row["messages"], tokenize=False) for row in _rows(6)]
    batch = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=48)
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    return model, {**batch, "labels": labels}


def test_clipping_bounds_per_example_gradients_and_noise_is_added(tiny_model: Path) -> None:
    import torch

    from app.training.privacy import PrivacyPlan, make_private, per_example_loss

    model, batch = _lora_model_and_batch(tiny_model)
    model.train()
    clip, sigma, n = 0.01, 1.3, int(batch["input_ids"].shape[0])
    dp = PrivacyPlan(noise_multiplier=sigma, noise_derived=False, max_grad_norm=clip, sample_rate=0.3,
                     expected_batch_size=4, rows=20, max_steps=1, target_epsilon=10.0, delta=1e-3, accountant="rdp",
                     planned_epsilon=1.0)
    steps: list[int] = []
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_private(model, torch.optim.SGD(params, lr=0.0), dp, device="cpu", on_step=lambda o: steps.append(1))
    per_example_loss(model, batch).sum().backward()
    raw = torch.stack([p.grad_sample.reshape(n, -1).norm(dim=1) for p in opt.params], dim=1).norm(dim=1)
    assert raw.shape == (n,) and (raw > clip).all()  # the bound binds: every example is clipped
    opt.clip_and_accumulate()
    factor = (clip / (raw + 1e-6)).clamp(max=1.0)
    clipped = raw * factor
    assert (clipped <= clip * (1 + 1e-5)).all()
    summed = [p.summed_grad.clone() for p in opt.params]
    assert torch.cat([s.flatten() for s in summed]).norm() <= n * clip * (1 + 1e-5)
    opt.add_noise()
    noise = torch.cat([(p.grad - s).flatten() for p, s in zip(opt.params, summed, strict=True)])
    assert noise.numel() > 1000
    assert abs(noise.std().item() / (sigma * clip) - 1) < 0.1  # N(0, (sigma C)^2) per coordinate
    # A second optimizer draws other noise: the generator is seeded by the OS, not by training.seed.
    model2, _ = _lora_model_and_batch(tiny_model)
    opt2 = make_private(model2, torch.optim.SGD([p for p in model2.parameters() if p.requires_grad], lr=0.0), dp,
                        device="cpu")
    for p, s in zip(opt2.params, summed, strict=True):
        p.summed_grad = s.clone()
    opt2.add_noise()
    noise2 = torch.cat([(p.grad - s).flatten() for p, s in zip(opt2.params, summed, strict=True)])
    assert not torch.allclose(noise, noise2)


# --- training: epsilon, resume, noise ------------------------------------------------------------------------


def _train(base: Path, run_dir: Path, **kw: Any) -> Any:
    from app.training import TrainRequest, train
    from app.training.privacy import plan

    s = kw.pop("settings", SETTINGS)
    return train(TrainRequest(base_model_dir=base, base_model_name="cvm-tune/tiny-llama", rows=_rows(), run_dir=run_dir,
                              settings=s, fingerprint=FP, checkpoint_key=CKPT_KEY, inputs=INPUTS,
                              privacy=plan(s, rows=20), **kw))


def _short_weights(base: Path, run_dir: Path, s: TrainingSettings) -> dict[str, Any]:
    from safetensors.torch import load_file

    res = _train(base, run_dir, settings=s)
    assert res.global_step == 2 and (res.privacy is None) == (s.privacy.mode == "off")
    return load_file(str(res.adapter_dir / "adapter_model.safetensors"))


SHORT = SETTINGS.model_copy(update={"max_steps": 2, "save_steps": 10, "logging_steps": 10})


def test_two_dp_runs_with_the_same_seed_differ(tiny_model: Path, tmp_path: Path) -> None:
    """Same seed, same rows, same LoRA initialisation: the OS-seeded noise and Poisson samples make DP runs differ."""
    d1, d2 = (_short_weights(tiny_model, tmp_path / f"dp-{i}", SHORT) for i in (1, 2))
    assert any(not d1[k].equal(d2[k]) for k in d1)


@pytest.mark.slow  # three more runs: the control for the test above
def test_plain_runs_with_the_same_seed_agree_and_dp_runs_with_other_seeds_differ(tiny_model: Path,
                                                                                 tmp_path: Path) -> None:
    plain = SHORT.model_copy(update={"privacy": PrivacySettings()})
    p1, p2 = (_short_weights(tiny_model, tmp_path / f"plain-{i}", plain) for i in (1, 2))
    assert all(p1[k].equal(p2[k]) for k in p1)  # without DP the same seed reproduces the adapter bit for bit
    d1 = _short_weights(tiny_model, tmp_path / "dp-seed-1", SHORT)
    d2 = _short_weights(tiny_model, tmp_path / "dp-seed-2", SHORT.model_copy(update={"seed": SHORT.seed + 1}))
    assert any(not d1[k].equal(d2[k]) for k in d1)


@pytest.mark.slow  # three DP runs; the pipeline test below covers resume + epsilon in the default suite
def test_dp_run_epsilon_equals_opacus_and_a_resumed_run_spends_the_same(tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from opacus.accountants import RDPAccountant
    from safetensors.torch import load_file

    from app.training import TrainingInterrupted
    from app.training.checkpoints import restore_checkpoint
    from app.training.privacy import STATE_FILE

    whole = _train(tiny_model, tmp_path / "whole")
    dp = whole.privacy
    assert whole.global_step == 6 and dp["steps"] == 6 and dp["rows"] == 20 and dp["sample_rate"] == 0.2
    acc = RDPAccountant()
    for _ in range(6):
        acc.step(noise_multiplier=1.1, sample_rate=0.2)
    assert dp["epsilon"] == acc.get_epsilon(delta=dp["delta"]) <= DP.target_epsilon
    assert dp["max_grad_norm"] == 0.5 and dp["noise_multiplier"] == 1.1 and dp["accountant"] == "rdp"

    run = tmp_path / "killed"
    with pytest.raises(TrainingInterrupted):
        _train(tiny_model, run, stop_after_step=3)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    choice = restore_checkpoint(run / "checkpoints", key=CKPT_KEY, fingerprint=FP, inputs=INPUTS, scratch=scratch)
    state = json.loads((choice.path / STATE_FILE).read_text())  # sealed with the checkpoint
    assert state["steps"] == 3 and state["accountant"]["history"] == [[1.1, 0.2, 3]]
    resumed = _train(tiny_model, run)
    assert resumed.resumed_from_step == 3 and resumed.global_step == 6
    assert resumed.privacy == dp  # same steps, same spend
    # Same seed, yet other weights: the noise and the Poisson samples do not come from training.seed.
    ta = load_file(str(whole.adapter_dir / "adapter_model.safetensors"))
    tb = load_file(str(resumed.adapter_dir / "adapter_model.safetensors"))
    assert any(not torch.equal(ta[k], tb[k]) for k in ta)


# --- pipeline: manifest, audit, verifier, policy, lifetime budget ------------------------------------------


def _cfg(tmp: Path, **privacy: Any) -> Path:
    data = {"output": {"dir": str(tmp / "out")},
            "training": {"max_steps": 4, "save_steps": 4, "per_device_batch_size": 2, "gradient_accumulation_steps": 2,
                         "max_length": 64, "privacy": {"mode": "dp-sgd", "noise_multiplier": 1.0,
                                                       "target_epsilon": 30.0, **privacy}}}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _policy(tmp: Path, **fields: Any) -> Path:
    policy = yaml.safe_load((tmp / "out" / "simulator-test-policy.yaml").read_text())
    path = tmp / f"policy-{len(list(tmp.glob('policy-*')))}.yaml"
    path.write_text(yaml.safe_dump({**policy, **fields}))
    return path


def test_pipeline_resumes_records_verifies_and_budgets_dp(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from opacus.accountants import RDPAccountant

    import app.training
    from app.cli import main

    real_train = app.training.train
    monkeypatch.setattr(app.training, "train", lambda req: real_train(dataclasses.replace(req, stop_after_step=2)))
    cfg = _cfg(tmp_path)
    assert main(["run", "--config", str(cfg)]) == 6  # killed after the step-2 checkpoint (TrainingInterrupted)
    monkeypatch.setattr(app.training, "train", real_train)
    assert main(["run", "--config", str(cfg)]) == 0
    bundle = next((tmp_path / "out" / "exports").iterdir())
    manifest = json.loads((bundle / "manifest.json").read_text())
    dp = manifest["privacy"]
    assert manifest["training"]["resumed_from_step"] == 2
    assert dp["rows"] == manifest["dataset"]["rows"] and dp["steps"] == manifest["training"]["global_step"] == 4
    assert dp["library"]["opacus"] == "1.6.0" and dp["sample_rate"] == 4 / dp["rows"]
    acc = RDPAccountant()  # the resumed run spent what 4 uninterrupted steps spend
    acc.history = [(1.0, dp["sample_rate"], 4)]
    assert dp["epsilon"] == acc.get_epsilon(delta=dp["delta"]) <= 30.0
    entries = [json.loads(line) for line in (bundle / "audit.jsonl").read_text().splitlines()]
    assert [e["data"] for e in entries if e["type"] == "privacy.spent"] == [dp]
    assert f"step 4/4  loss" in (progress := capsys.readouterr().out)  # the running spend, step by step
    assert f"ε {dp['epsilon']:.4g}  " in progress and f"spent (ε, δ) = ({dp['epsilon']:.4g}," in progress

    assert main(["verify", str(bundle), "--policy", str(_policy(tmp_path, max_epsilon=dp["epsilon"] + 0.01))]) == 0
    out = capsys.readouterr().out
    assert f"(ε, δ) = ({dp['epsilon']:.4g}, {dp['delta']:.3g}) as run" in out
    assert main(["verify", str(bundle), "--policy", str(_policy(tmp_path, max_epsilon=dp["epsilon"] * 0.9))]) == 1
    assert "above the policy's max_epsilon" in capsys.readouterr().out

    _tampered_blocks_fail(bundle, manifest)

    assert main(["status", "--config", str(cfg)]) == 0
    assert f"epsilon {dp['epsilon']:.4g} spent in 1 DP run(s)" in capsys.readouterr().out
    ledger = tmp_path / "out" / "state" / BUDGET_FILE
    before, exports = ledger.read_bytes(), sorted((tmp_path / "out" / "exports").iterdir())
    capped = _cfg(tmp_path, lifetime_epsilon=round(dp["epsilon"] * 1.5, 3))
    assert main(["run", "--config", str(capped)]) == 2  # a second night on this dataset version would exceed the cap
    assert "lifetime_epsilon" in capsys.readouterr().err
    assert ledger.read_bytes() == before and sorted((tmp_path / "out" / "exports").iterdir()) == exports
    ledger.unlink()  # a host that deletes the ledger does not reset the budget: it is rebuilt from the audit chain
    assert main(["run", "--config", str(capped)]) == 2
    assert ledger.read_bytes() == before and sorted((tmp_path / "out" / "exports").iterdir()) == exports


def test_policy_max_epsilon_rejects_a_bundle_without_dp() -> None:
    from attestation.privacy import dp as privacy
    from attestation.policy import Policy
    from attestation.verify import QuoteFindings

    f = QuoteFindings()
    manifest = type("M", (), {"privacy": None})()
    privacy.check(f, manifest, Policy(max_epsilon=8.0), None)  # type: ignore[arg-type]
    privacy.check(f, manifest, Policy(), None)  # type: ignore[arg-type]
    assert [(c.name, c.status) for c in f.checks] == [("privacy.dp", "skip"), ("privacy.policy", "fail"),
                                                      ("privacy.dp", "skip")]
    assert "requires differential privacy" in f.checks[1].detail


def _tampered_blocks_fail(bundle: Path, manifest: dict[str, Any]) -> None:
    """privacy.dp recomputes what it can: a block that does not match its parameters, the config or the manifest
    fails (whatever the quote says); the untouched block passes."""
    from attestation.privacy import dp as privacy
    from attestation.bundle.manifest import Manifest
    from attestation.policy import Policy
    from attestation.verify import QuoteFindings

    config = (bundle / "config.json").read_bytes()
    cases = {
        "untouched": ({}, config, None),
        "epsilon": ({"epsilon": manifest["privacy"]["epsilon"] / 2}, config, "accountant gives"),
        "noise": ({"noise_multiplier": 3.0}, config, "noise_multiplier 1.0 in the bundle config"),
        "steps": ({"steps": 3}, config, "privacy steps 3 != global_step 4"),
        "rows": ({"rows": manifest["privacy"]["rows"] + 1}, config, "dataset rows"),
        "clipping": ({"max_grad_norm": 9.0}, config, "max_grad_norm 1.0 in the bundle config"),
        "config": ({}, config.replace(b'"mode":"dp-sgd"', b'"mode":"off"'), "mode 'off' in the bundle config"),
    }
    for name, (change, cfg_bytes, why) in cases.items():
        m = Manifest.model_validate({**manifest, "privacy": {**manifest["privacy"], **change}})
        f = QuoteFindings()
        privacy.check(f, m, Policy(), cfg_bytes)
        (c,) = f.checks
        assert (c.name, c.status) == ("privacy.dp", "pass" if why is None else "fail"), (name, c.detail)
        assert why is None or why in c.detail, (name, c.detail)


def test_service_does_not_retry_a_night_refused_by_the_lifetime_budget(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import datetime, timezone

    from app import alerts
    from app.config import Config
    from app.service.scheduler import Service

    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(alerts, "send", lambda settings, event, output: sent.append(dict(event)) or True)
    now = datetime(2026, 11, 20, 2, 0, tzinfo=timezone.utc)
    clock = type("Clock", (), {"now": lambda self: now, "monotonic": lambda self: 0.0})()
    calls: list[str] = []

    def refused(*, run_id: str, **_kw: Any) -> Any:
        calls.append(run_id)
        raise PrivacyBudgetError("privacy budget: dataset 'ds' v1 has spent epsilon 16.000 in 2 run(s)")

    cfg = Config.model_validate({"output": {"dir": str(tmp_path / "out")}, "schedule": {"max_attempts": 3}})
    svc = Service(cfg, clock=clock, runner=refused)
    assert svc.tick() == "failed: nightly-2026-11-20 attempt 1, final"
    assert svc.tick() == "idle: nightly-2026-11-20 failed" and calls == ["nightly-2026-11-20"]
    row = svc.db.get("nightly-2026-11-20")
    assert row.next_attempt_at is None and row.reason.startswith("PrivacyBudgetError: privacy budget")
    assert [e["event"] for e in sent] == ["failed"] and sent[0]["retry_at"] is None


@pytest.mark.slow  # two real processes
def test_sigkill_mid_dp_run_resumes_to_the_uninterrupted_epsilon(tmp_path: Path) -> None:
    """kill -9 after the step-4 checkpoint (step 5 already trained and lost), then `cvm-tune run` again: the run
    resumes from step 4 and the manifest's epsilon is what 8 uninterrupted steps spend (Opacus' accountant)."""
    import importlib.util
    import signal
    import time

    from opacus.accountants import RDPAccountant

    from app.training.checkpoints import latest_name

    spec = importlib.util.spec_from_file_location("faults", Path(__file__).resolve().parent.parent / "bench" / "faults.py")
    faults = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(faults)  # type: ignore[union-attr]
    cfg = faults.write_config(tmp_path, steps=8, save_steps=4)
    doc = json.loads(cfg.read_text())
    doc["training"]["privacy"] = {"mode": "dp-sgd", "noise_multiplier": 1.0, "target_epsilon": 30.0}
    cfg.write_text(json.dumps(doc))
    log = tmp_path / "log.txt"
    proc = faults.start(cfg, log, args=("run",))
    end = time.monotonic() + 300
    while not (latest_name(next((tmp_path / "out" / "runs").glob("run-*/checkpoints"), tmp_path / "none"))
               == "checkpoint-4" and faults.last_step(log) >= 5):
        assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert faults.start(cfg, log, args=("run",)).wait(timeout=300) == 0, log.read_text()[-3000:]
    (bundle,) = (tmp_path / "out" / "exports").glob("run-*")
    manifest = json.loads((bundle / "manifest.json").read_text())
    dp = manifest["privacy"]
    assert manifest["training"]["resumed_from_step"] == 4 and dp["steps"] == manifest["training"]["global_step"] == 8
    acc = RDPAccountant()
    for _ in range(8):
        acc.step(noise_multiplier=1.0, sample_rate=dp["sample_rate"])
    assert dp["epsilon"] == acc.get_epsilon(delta=dp["delta"])
    ledger = json.loads((tmp_path / "out" / "state" / BUDGET_FILE).read_text())["datasets"]
    (entry,) = ledger.values()
    assert list(entry["runs"].values()) == [{"epsilon": dp["epsilon"], "delta": dp["delta"], "status": "spent"}]
