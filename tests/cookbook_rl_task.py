"""A small RL task with a verifiable reward, trained by the tinker-cookbook's own RL loop (``tinker_cookbook.rl.train``)
against ``cvm-tune api serve``: the cookbook's sampling, advantages, importance-sampling loss and checkpoints, with this
task as its environment. Run through tests/cookbook_run.py in the cookbook's venv:

    python tests/cookbook_run.py TOKENIZER_DIR SERVED tests.cookbook_rl_task base_url=URL log_path=DIR [KEY=VALUE ...]

The task: after a fixed prompt, emit tokens whose ids are below :data:`TARGET_BELOW`. The reward of a completion is
the share of its tokens that are, so it is graded from the tokens alone and a policy that has not learned it yet gets
rewards that vary within a group (non-zero advantages from the first step). Each batch is ``batch_size`` groups of
``group_size`` completions of ``max_tokens`` tokens, never stopped early.

Like any client that wants its checkpoints replayed, the run keeps a record of every op it sends (docs/api.md, "The
lines a Tinker user adds"), here by wrapping the SDK's ``TrainingClient.forward_backward`` and ``optim_step``: one JSON
line per op in ``ops_path``, in the order the ops were sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, TextIO

import chz
import tinker
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import (
    Action,
    Env,
    EnvGroupBuilder,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)

PROMPT = [5, 17, 42, 9, 3, 88, 140, 61]
TARGET_BELOW = 128  # of the tiny model's 768 token ids: about 1 in 6 of an untrained policy's tokens


def reward(tokens: Sequence[int]) -> float:
    """The share of ``tokens`` whose id is below :data:`TARGET_BELOW` (0 for none)."""
    return sum(t < TARGET_BELOW for t in tokens) / len(tokens) if tokens else 0.0


class LowTokensEnv(Env):
    """One episode: the prompt, one completion, its reward."""

    async def initial_observation(self) -> tuple[tinker.ModelInput, list[int]]:
        return tinker.ModelInput.from_ints(PROMPT), []  # no stop: every completion is max_tokens long

    async def step(self, action: Action, *, extra: object = None) -> StepResult:
        return StepResult(reward=reward(action), episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=[], metrics={"low_share": reward(action)})


class LowTokensGroup(EnvGroupBuilder):
    def __init__(self, size: int) -> None:
        self.size = size

    async def make_envs(self) -> Sequence[Env]:
        return [LowTokensEnv() for _ in range(self.size)]

    def logging_tags(self) -> list[str]:
        return ["low_tokens"]


class LowTokensDataset(RLDataset):
    def __init__(self, batches: int, batch_size: int, group_size: int) -> None:
        self.batches, self.batch_size, self.group_size = batches, batch_size, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [LowTokensGroup(self.group_size) for _ in range(self.batch_size)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class LowTokensBuilder(RLDatasetBuilder):
    batches: int = 20
    batch_size: int = 2
    group_size: int = 4

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return LowTokensDataset(self.batches, self.batch_size, self.group_size), None


def record_ops(out: TextIO) -> None:
    """Append each forward_backward and optim_step the SDK sends to ``out`` (the op lines of docs/api.md)."""
    fb, step = tinker.TrainingClient.forward_backward, tinker.TrainingClient.optim_step

    def forward_backward(self: Any, data: list[Any], loss_fn: str, loss_fn_config: Any = None) -> Any:
        line = {"op": "forward_backward", "loss_fn": loss_fn, "data": [
            {"model_input": d.model_input.to_ints(), "loss_fn_inputs": {k: v.tolist() for k, v in
                                                                        d.loss_fn_inputs.items()}} for d in data]}
        out.write(json.dumps({**line, **({"loss_fn_config": dict(loss_fn_config)} if loss_fn_config else {})}) + "\n")
        return fb(self, data, loss_fn, loss_fn_config)

    def optim_step(self: Any, optim_params: Any = None, *, adam_params: Any = None) -> Any:
        params = optim_params if optim_params is not None else adam_params
        out.write(json.dumps({"op": "optim_step", "adam_params": params.model_dump(mode="json")}) + "\n")
        return step(self, optim_params, adam_params=adam_params)

    tinker.TrainingClient.forward_backward, tinker.TrainingClient.optim_step = forward_backward, optim_step


@chz.chz
class Task:
    base_url: str
    log_path: str
    ops_path: str
    model_name: str = "meta-llama/Llama-3.2-1B"
    batches: int = 20
    batch_size: int = 2
    group_size: int = 4
    max_tokens: int = 8
    learning_rate: float = 0.03
    lora_rank: int = 8


def main(task: Task) -> None:
    config = train.Config(
        learning_rate=task.learning_rate, model_name=task.model_name, recipe_name="cvm_tune_low_tokens",
        dataset_builder=LowTokensBuilder(batches=task.batches, batch_size=task.batch_size,
                                         group_size=task.group_size),
        max_tokens=task.max_tokens, log_path=task.log_path, lora_rank=task.lora_rank, eval_every=0,
        save_every=0, base_url=task.base_url, rollout_error_tolerance=False)
    with open(task.ops_path, "w", encoding="utf-8") as ops:
        record_ops(ops)
        asyncio.run(train.main(config))


if __name__ == "__main__":
    chz.nested_entrypoint(main)
