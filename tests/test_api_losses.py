"""The Tinker losses at exact values (docs/api.md): PPO and CISPO clip the importance ratio itself (Tinker's
thresholds, default 0.8 and 1.2), CISPO weights the log-probability by the clipped ratio as a constant, DRO adds
beta/2 times the squared log-ratio (default beta 0.05); a cispo and a dro step train through the API, are recorded in
the op chain and replay.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.api.engine import losses
from app.api.errors import BadRequest

LOGP = [-1.0, -2.0, -0.5]
SAMPLER = [-1.0, -1.0, -1.5]  # ratios 1, e^-1 (0.368), e (2.718)
ADV = [0.5, 1.0, -2.0]


def _inputs() -> dict[str, np.ndarray]:
    return {"target_tokens": np.array([1, 2, 3], np.int64), "logprobs": np.array(SAMPLER, np.float32),
            "advantages": np.array(ADV, np.float32)}


def _loss(name: str, config: dict[str, Any] | None = None) -> tuple[float, list[float]]:
    logp = torch.tensor(LOGP, requires_grad=True)
    out = losses.loss(name, logp, _inputs(), config)
    out.backward()
    return float(out), logp.grad.tolist()


def test_ppo_clips_the_ratio_to_tinkers_bounds() -> None:
    r = [1.0, math.exp(-1), math.e]
    value, _ = _loss("ppo")
    want = -sum(min(x * a, min(max(x, 0.8), 1.2) * a) for x, a in zip(r, ADV))
    assert value == pytest.approx(want, rel=1e-6)
    value, _ = _loss("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0})
    assert value == pytest.approx(-sum(min(x * a, min(max(x, 0.5), 3.0) * a) for x, a in zip(r, ADV)), rel=1e-6)


def test_cispo_weights_logp_by_the_clipped_ratio_as_a_constant() -> None:
    r = [1.0, math.exp(-1), math.e]
    coef = [min(max(x, 0.8), 1.2) for x in r]
    value, grad = _loss("cispo")
    assert value == pytest.approx(-sum(c * lp * a for c, lp, a in zip(coef, LOGP, ADV)), rel=1e-6)
    assert grad == pytest.approx([-c * a for c, a in zip(coef, ADV)], rel=1e-6)  # no gradient through the ratio


def test_dro_is_the_advantage_term_less_the_quadratic_penalty() -> None:
    for beta in (None, 0.3):
        b = 0.05 if beta is None else beta
        value, grad = _loss("dro", None if beta is None else {"beta": beta})
        assert value == pytest.approx(-sum(lp * a - 0.5 * b * (lp - q) ** 2 for lp, q, a in zip(LOGP, SAMPLER, ADV)),
                                      rel=1e-6)
        assert grad == pytest.approx([-(a - b * (lp - q)) for lp, q, a in zip(LOGP, SAMPLER, ADV)], rel=1e-6)


@pytest.mark.parametrize(("name", "config", "reason"), [
    ("dro", {"clip_low_threshold": 0.8}, "not a setting of loss dro"),
    ("cispo", {"beta": 0.1}, "not a setting of loss cispo"),
    ("cispo", {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2}, "above clip_high_threshold"),
    ("ppo", {"clip_high_threshold": 0.5}, "above clip_high_threshold"),
    ("dro", {"beta": math.nan}, "finite number"),
])
def test_bad_settings_are_refused(name: str, config: dict[str, float], reason: str) -> None:
    with pytest.raises(BadRequest, match=reason):
        losses.check_config(name, config)


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.api_inproc import service

    with service(tmp_path_factory.mktemp("losses")) as s:
        yield s


def test_cispo_and_dro_train_through_the_api_and_replay(svc: Any, tmp_path: Path) -> None:
    from tests.api_inproc import TOKENS, Client, fb_record, verify, write_ops

    c = Client(svc)
    m = c.create(seed=21)
    for name, config in (("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}), ("dro", {"beta": 0.1})):
        rec = fb_record([list(TOKENS[0])], loss_fn=name, config=config)
        n = len(TOKENS[0]) - 1
        rec["data"][0]["loss_fn_inputs"] = {"target_tokens": TOKENS[0][1:], "logprobs": [-3.0] * n,
                                            "advantages": [1.0] * n}
        ok, body = c.forward_backward(m, rec)
        assert ok, body
        assert c.optim_step(m)[0]
    _path, bundle, ops = c.save(m, "rl-losses")
    code, doc = verify(bundle, svc.out / "simulator-test-policy.yaml", write_ops(tmp_path / "ops.jsonl", ops), "--replay")
    assert code == 0, [x for x in doc["checks"] if x["status"] == "fail"]
