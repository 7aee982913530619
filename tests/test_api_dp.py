"""DP-SGD per training-API model, checked against computations of its own: per-datum clipping against each datum's
plain gradient clipped by hand, the noise's scale and mean against σ·C, the ε of the prv accountant at a chosen δ
against Opacus, and a DP state loaded back continuing its accounting (and its bundle verifying, ε recomputed).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api_inproc import TOKENS, Client, fb_record, service, verify, write_ops

N, B = 100, 2


def _dp(sigma: float, clip: float, **more: str) -> dict[str, str]:
    return {"dp.noise_multiplier": str(sigma), "dp.max_grad_norm": str(clip), "dp.dataset_size": str(N),
            "dp.batch_size": str(B), **more}


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with service(tmp_path_factory.mktemp("api-dp")) as s:
        yield s


def _plain_grads(svc: Any, model: str, tokens: list[int]) -> list[Any]:
    """One datum's gradient on a plain (non-DP) model, by the engine's own forward/backward."""
    from app.api import wire

    engine = svc.engine
    m = engine.models[model]
    for p in engine._params(m.adapter):
        p.grad = None
    engine._activate(m.adapter, True)
    rec = fb_record([tokens])["data"][0]
    import numpy as np

    op = wire.Op(model, "cross_entropy", False, [wire.Datum(rec["model_input"], {
        "target_tokens": np.asarray(rec["loss_fn_inputs"]["target_tokens"], np.int64),
        "weights": np.asarray(rec["loss_fn_inputs"]["weights"], np.float32)})])
    engine._forward_backward(m, op)
    grads = [p.grad.detach().clone() for p in engine._params(m.adapter)]
    for p in engine._params(m.adapter):
        p.grad = None
    return grads


def test_each_datum_is_clipped_to_c_before_summing(svc: Any) -> None:
    import torch

    clip = 0.05  # below the tiny model's per-datum gradient norms: every datum is scaled down
    c = Client(svc)
    plain, private = c.create(seed=11), c.create(seed=11, user_metadata=_dp(1.0, clip))
    expected = None
    for t in TOKENS:
        g = _plain_grads(svc, plain, list(t))
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in g])))
        assert norm > clip  # the clipping is exercised
        scaled = [x * min(1.0, clip / (norm + 1e-6)) for x in g]
        expected = scaled if expected is None else [a + b for a, b in zip(expected, scaled)]
    assert c.forward_backward(private, fb_record([list(t) for t in TOKENS]))[0]
    sums = svc.engine.models[private].dp_sums
    assert all(torch.allclose(s, e, rtol=1e-5, atol=1e-8) for s, e in zip(sums, expected))
    assert all(p.grad is None for p in svc.engine._params(svc.engine.models[private].adapter))  # only the sums


def test_the_noise_has_scale_sigma_c_and_mean_zero(svc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    sigma, clip = 3.0, 0.5
    c = Client(svc)
    m = c.create(rank=8, seed=12, user_metadata=_dp(sigma, clip))
    assert c.forward_backward(m, fb_record([list(TOKENS[0])]))[0]
    model = svc.engine.models[m]
    sums = [s.clone() for s in model.dp_sums]
    seen: list[Any] = []
    real_step = type(model.optimizer).step

    def capture(opt: Any, *a: Any, **k: Any) -> Any:
        seen.append([p.grad.detach().clone() for p in svc.engine._params(model.adapter)])
        return real_step(opt, *a, **k)

    monkeypatch.setattr(type(model.optimizer), "step", capture)
    assert c.optim_step(m)[0]
    noise = torch.cat([(g * B - s).flatten() for g, s in zip(seen[0], sums)])
    assert noise.numel() > 5000
    std, mean = float(noise.std()), float(noise.mean())
    assert abs(std - sigma * clip) < 0.05 * sigma * clip and abs(mean) < 5 * sigma * clip / noise.numel() ** 0.5


def test_prv_at_a_chosen_delta_is_opacus_figure_and_verifies(svc: Any, tmp_path: Path) -> None:
    pytest.importorskip("opacus")
    from opacus.accountants import PRVAccountant

    c = Client(svc)
    m = c.create(seed=13, user_metadata=_dp(1.5, 1.0, **{"dp.accountant": "prv", "dp.delta": "1e-06"}))
    eps = []
    for _ in range(3):
        assert c.forward_backward(m, fb_record([list(TOKENS[1])]))[0]
        ok, body = c.optim_step(m)
        eps.append(json.loads(body)["metrics"]["dp_epsilon"])
    acc = PRVAccountant()
    acc.history = [(1.5, B / N, 3)]
    assert eps[-1] == pytest.approx(acc.get_epsilon(delta=1e-6), rel=1e-9) and eps[0] < eps[1] < eps[2]
    _path, bundle, ops = c.save(m, "prv")
    chain = json.loads((bundle / "manifest.json").read_text())["op_chain"]["dp"]
    assert chain["accountant"] == "prv" and chain["delta"] == 1e-6 and chain["steps"] == 3
    code, doc = verify(bundle, svc.out / "simulator-test-policy.yaml", write_ops(tmp_path / "ops.jsonl", ops))
    privacy = next(x for x in doc["checks"] if x["name"] == "privacy.dp")
    assert (code, privacy["status"]) == (0, "pass") and "prv accountant" in privacy["reason"]


def test_a_dp_state_loaded_back_continues_its_accounting(svc: Any, tmp_path: Path) -> None:
    from opacus.accountants import RDPAccountant

    c = Client(svc)
    m = c.create(seed=14, user_metadata=_dp(1.1, 1.0))
    for _ in range(2):
        assert c.forward_backward(m, fb_record([list(TOKENS[0])]))[0] and c.optim_step(m)[0]
    path, _bundle, _ops = c.save(m, "dp-2")
    ok, body, loaded = c.load(path, optimizer=True)
    assert ok, body
    assert svc.engine.models[loaded].dp["steps"] == 2
    assert c.forward_backward(loaded, fb_record([list(TOKENS[0])]))[0]
    ok, body = c.optim_step(loaded)
    acc = RDPAccountant()
    acc.history = [(1.1, B / N, 3)]
    assert json.loads(body)["metrics"]["dp_epsilon"] == pytest.approx(acc.get_epsilon(delta=1 / N**2), rel=1e-9)
    _p, bundle, ops = c.save(loaded, "dp-3")
    code, doc = verify(bundle, svc.out / "simulator-test-policy.yaml", write_ops(tmp_path / "ops.jsonl", ops))
    assert code == 0, [x for x in doc["checks"] if x["status"] == "fail"]
    assert json.loads((bundle / "manifest.json").read_text())["op_chain"]["dp"]["steps"] == 3


def test_a_policy_bounding_epsilon_applies_to_api_bundles(svc: Any, tmp_path: Path) -> None:
    import yaml

    c = Client(svc)
    m = c.create(seed=15, user_metadata=_dp(0.6, 1.0))
    for _ in range(2):
        assert c.forward_backward(m, fb_record([list(TOKENS[0])]))[0] and c.optim_step(m)[0]
    _p, bundle, ops = c.save(m, "bounded")
    eps = json.loads((bundle / "manifest.json").read_text())["op_chain"]["dp"]["epsilon"]
    policy = yaml.safe_load((svc.out / "simulator-test-policy.yaml").read_text())
    for bound, want in ((eps * 2, 0), (eps / 2, 1)):
        f = tmp_path / f"policy-{want}.yaml"
        f.write_text(yaml.safe_dump({**policy, "max_epsilon": bound}))
        code, doc = verify(bundle, f, write_ops(tmp_path / "ops.jsonl", ops))
        check = next(x for x in doc["checks"] if x["name"] == "privacy.policy")
        assert (code, check["status"]) == (want, "pass" if want == 0 else "fail"), check
