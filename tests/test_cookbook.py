"""The tinker-cookbook's recipes, unmodified, against ``cvm-tune api serve`` on the tiny model (docs/api.md, "The
Tinker cookbook"): ``sl_loop`` and its resume from its own checkpoint, ``rl_loop`` (stop strings: the role-colon
renderer stops on ``"\\n\\nUser:"``), the DPO recipe and ``prompt_distillation``; and the cookbook's RL training code
(``tinker_cookbook.rl.train``) on a task with a verifiable reward (tests/cookbook_rl_task.py), which it must learn,
its final checkpoint replayed from the ops it sent. Every checkpoint any of them saved then verifies with
``cvm-tune verify``.

The recipes run in the cookbook's own venv (tests/cookbook_env.py: made on first use, a few minutes, then cached),
offline: the tokenizer and renderer through the cookbook's registries, the Hub datasets from local stand-ins
(tests/cookbook_data.py). The served base is the tiny model under a public name the cookbook's model table knows
(``base_model.hub_id``; nothing is downloaded), since its recipes pick their renderer by that name.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api_drive import KEY, ROOT, Server
from tests.cookbook_run import RENDERER

SERVED = "meta-llama/Llama-3.2-1B"  # the tiny model, named so the cookbook picks its role-colon renderer
LIMITS = "api:\n  max_seq_len: 512\n  max_sample_tokens: 32\n  long_poll_s: 1\n"


@pytest.fixture(scope="module")
def venv_python(request: pytest.FixtureRequest) -> Path:
    """The cookbook venv's python: the first run makes the venv (minutes; it says so on the terminal), a failure to
    make it fails the tests."""
    from tests.cookbook_env import ensure

    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        return ensure()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, venv_python: Path) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("cookbook"), f"base_model:\n  hub_id: {SERVED}\n{LIMITS}")
    srv.start()
    yield srv  # pytest runs what follows at teardown, whatever the tests did
    srv.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.cookbook_data import write

    return write(tmp_path_factory.mktemp("recipes"))


def recipe(server: Server, python: Path, data: Path, module: str, *args: str, timeout: float = 300) -> str:
    """Run ``module`` (a cookbook recipe) with ``args`` against ``server``; returns its output."""
    env = {**os.environ, "TINKER_API_KEY": KEY, "PYTHONPATH": str(ROOT), "HF_HOME": str(data / ".hf"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("TINKER_BASE_URL", None)
    tokenizer = server.out / "models" / "tiny-llama"  # the served base model's directory
    run = subprocess.run([str(python), str(ROOT / "tests" / "cookbook_run.py"), str(tokenizer), SERVED, module,
                          f"base_url={server.url}", f"model_name={SERVED}", *args],
                         cwd=data, env=env, capture_output=True, text=True, timeout=timeout)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-8000:]
    return out


def records(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (log_path / "checkpoints.jsonl").read_text().splitlines()]


def test_the_cookbook_lock_is_up_to_date_with_its_pins() -> None:
    from tests.cookbook_env import ROOT, lock_module

    lock = lock_module()
    assert not lock.is_stale("cookbook"), "run .venv/bin/python tests/cookbook_env.py --lock"
    _, pins = lock.parse_pins(ROOT / "requirements" / "cookbook.txt")
    assert dict(pins)["torch"] == "2.13.0" and ("transformers", "5.5.4") in pins  # the local CPU build; <=5.5.4


def test_sl_loop_trains_saves_and_resumes_from_its_own_checkpoint(server: Server, venv_python: Path,
                                                                  data: Path) -> None:
    log = data / "runs" / "sl"
    args = (f"log_path={log}", "batch_size=2", "learning_rate=0.01", "lora_rank=8", "save_every=2", "max_length=256")
    recipe(server, venv_python, data, "tinker_cookbook.recipes.sl_loop", *args, "max_steps=3")
    first = records(log)
    assert [(r["name"], r["batch"]) for r in first] == [("000002", 2), ("final", 4)]
    assert "sampler_path" in first[1] and "state_path" in first[0]
    # as if killed before its final save: the recipe resumes from its last state (batch 2), in a new model
    (log / "checkpoints.jsonl").write_text(json.dumps(first[0]) + "\n")
    out = recipe(server, venv_python, data, "tinker_cookbook.recipes.sl_loop", *args)
    assert "Resuming from batch 2" in out
    again = records(log)
    assert [(r["name"], r["batch"]) for r in again] == [("000002", 2), ("000002", 2), ("final", 4)]
    assert again[1]["state_path"] != first[0]["state_path"]  # saved by the resumed model


def test_rl_loop_samples_with_its_renderers_stop_string(server: Server, venv_python: Path, data: Path) -> None:
    log = data / "runs" / "rl"
    out = recipe(server, venv_python, data, "tinker_cookbook.recipes.rl_loop", f"log_path={log}", "batch_size=1",
                 "group_size=4", "max_tokens=16", "lora_rank=8", "save_every=1", "learning_rate=0.001")
    assert [(r["name"], r["batch"]) for r in records(log)] == [("000001", 1), ("final", 2)]
    assert "Training completed" in out


def test_the_cookbooks_rl_training_learns_a_verifiable_task_through_the_api(server: Server, venv_python: Path,
                                                                          data: Path) -> None:
    """tinker_cookbook.rl.train with a task of its own (tests/cookbook_rl_task.py): the reward is the share of low
    token ids in a completion. Every batch has non-zero advantages and trains, and the policy learns it: the mean
    reward of the last third of the batches is above that of the first third."""
    from tests.api_inproc import verify

    log, ops = data / "runs" / "rl-task", data / "rl-task-ops.jsonl"
    recipe(server, venv_python, data, "tests.cookbook_rl_task", f"log_path={log}", f"ops_path={ops}", timeout=600)
    rows = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["env/all/reward/total"] for r in rows]
    third = len(rewards) // 3
    assert len(rewards) == 20 and all(r["progress/batch"] == i for i, r in enumerate(rows))
    assert sum(rewards[-third:]) / third > sum(rewards[:third]) / third, rewards
    assert all(r["env/all/by_group/frac_mixed"] > 0 for r in rows[:third]), rows  # rewards differ in every group
    sent = [json.loads(x) for x in ops.read_text().splitlines()]
    assert [o["op"] for o in sent] == ["forward_backward", "optim_step"] * 20
    advantages = [a for o in sent[:2 * third:2] for d in o["data"] for a in d["loss_fn_inputs"]["advantages"]]
    assert {o["loss_fn"] for o in sent[::2]} == {"importance_sampling"} and any(a != 0 for a in advantages)
    # the final checkpoint's bundle verifies with the ops the loop sent, and they replay to its weights
    final = next(r for r in records(log) if r["name"] == "final")
    with sqlite3.connect(f"file:{server.out / 'state' / 'runs.sqlite'}?mode=ro", uri=True) as db:
        (bundle,), = db.execute("SELECT bundle FROM api_checkpoints WHERE path = ?", (final["state_path"],))
    code, doc = verify(Path(bundle), server.out / "simulator-test-policy.yaml", ops, "--replay")
    checks = {c["name"]: c["status"] for c in doc["checks"]}
    assert code == 0 and checks["op_chain.ops"] == checks["op_chain.replay"] == "pass", doc


def test_dpo_recipe_trains_against_a_reference_sampler(server: Server, venv_python: Path, data: Path) -> None:
    log = data / "runs" / "dpo"
    recipe(server, venv_python, data, "tinker_cookbook.recipes.preference.dpo.train", "dataset=hhh",
           f"renderer_name={RENDERER}", f"log_path={log}", "batch_size=2", "max_length=256", "max_steps=2",
           "learning_rate=0.001", "behavior_if_log_dir_exists=delete")
    assert any("state_path" in r for r in records(log))


def test_prompt_distillation_trains_on_its_conversation_file(server: Server, venv_python: Path, data: Path) -> None:
    log = data / "runs" / "prompt-distillation"
    recipe(server, venv_python, data, "tinker_cookbook.recipes.prompt_distillation.train",
           f"file_path={data / 'conversations.jsonl'}", f"renderer_name={RENDERER}", f"log_path={log}",
           "batch_size=2", "max_length=256", "max_steps=2", "lora_rank=8", "learning_rate=0.001",
           "behavior_if_log_dir_exists=delete")
    assert any("state_path" in r for r in records(log))


def test_every_checkpoint_the_recipes_saved_verifies(server: Server) -> None:
    """Every export bundle the recipes' saves made verifies; every training state they saved has one."""
    from tests.api_inproc import verify

    with sqlite3.connect(f"file:{server.out / 'state' / 'runs.sqlite'}?mode=ro", uri=True) as db:
        saved = db.execute("SELECT path, kind, bundle FROM api_checkpoints").fetchall()
    bundles = {path: bundle for path, _kind, bundle in saved if bundle}
    assert {path for path, kind, _b in saved if kind == "training"} <= set(bundles) and len(bundles) >= 8
    policy = server.out / "simulator-test-policy.yaml"
    failed = {}
    for path, bundle in bundles.items():
        code, doc = verify(Path(bundle), policy, None)
        if code != 0:
            failed[path] = [c for c in doc.get("checks", []) if c["status"] == "fail"]
    assert failed == {}
