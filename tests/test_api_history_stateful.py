"""A Hypothesis state machine drives the training API's service with random sequences of valid and hostile ops
(NaN, infinite and huge numbers, unknown loss settings, out-of-range Adam parameters, unknown models, loads of
another key's state, of a DP-mismatched or other-rank state, loads with a gradient pending) while the client keeps
the record of what succeeded. Invariants: a refused op changes nothing (weights, pending gradient, DP sums,
optimizer, chain); after every save the bundle verifies against the record and replays to the same weights, and a
record with one op more, one less or one changed is rejected.

Bounded (a few examples of a few steps each): one run from a fixed seed, one from a random seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from tests.api_inproc import ADAM, TOKENS, Client, fb_record, service, verify, write_ops
from tests.test_api_history import DP, _ppo, _same, _state

NUMBERS = st.sampled_from([1.0, 0.5, -0.25, 0.0, 1e6, 3e38, math.nan, math.inf, -math.inf])
ADAM_CHANGES = st.sampled_from([{}, {"grad_clip_norm": 1.0}, {"grad_clip_norm": math.nan}, {"weight_decay": math.inf},
                                {"learning_rate": -1.0}, {"beta1": 1.0}, {"eps": 0.0}, {"learning_rate": 1e300}])
CONFIGS = st.sampled_from([None, {"clip_low_threshold": 0.1}, {"clip_low_threshold": math.nan},
                           {"clip_high_threshold": -math.inf}, {"surprise": 1.0}])


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with service(tmp_path_factory.mktemp("stateful")) as s:
        yield s


def _machine(svc: Any, tmp: Path) -> type[RuleBasedStateMachine]:
    policy = svc.out / "simulator-test-policy.yaml"
    counter = iter(range(10 ** 9))

    class History(RuleBasedStateMachine):
        models = Bundle("models")
        saved = Bundle("saved")

        def __init__(self) -> None:
            super().__init__()
            self.c = Client(svc)
            self.other = Client(svc, owner="b" * 64)

        @initialize(target=models)
        def first(self) -> str:
            return self.c.create(seed=next(counter) % 5)

        @rule(target=models, private=st.booleans(), rank=st.sampled_from([2, 4]))
        def create(self, private: bool, rank: int) -> str:
            return self.c.create(rank=rank, seed=next(counter) % 5, user_metadata=DP if private else None)

        def _atomic(self, m: str, do: Any) -> bool:
            before = _state(svc, m)
            ok, body = do()
            if not ok:
                assert json.loads(body)["category"] == "user", body  # refused with its reason, never a server error
                assert _same(_state(svc, m), before), "a refused op changed the model"
            return ok

        @rule(m=models, weight=NUMBERS, two=st.booleans())
        def forward_backward(self, m: str, weight: float, two: bool) -> None:
            record = fb_record([list(t) for t in (TOKENS if two else TOKENS[:1])], weights=weight)
            ok = self._atomic(m, lambda: self.c.forward_backward(m, record))
            if not math.isfinite(weight):
                assert not ok

        @rule(m=models, config=CONFIGS)
        def ppo(self, m: str, config: dict[str, Any] | None) -> None:
            ok = self._atomic(m, lambda: self.c.forward_backward(m, _ppo(config)))
            if config and (set(config) - {"clip_low_threshold", "clip_high_threshold"}
                           or not all(math.isfinite(v) and v >= 0 for v in config.values())):
                assert not ok

        @rule(m=models, change=ADAM_CHANGES)
        def optim_step(self, m: str, change: dict[str, float]) -> None:
            adam = {**ADAM, **change}
            ok = self._atomic(m, lambda: self.c.optim_step(m, adam))
            valid = all(math.isfinite(v) for v in adam.values()) and adam["learning_rate"] >= 0 and 0 <= adam["beta1"] < 1 \
                and adam["eps"] > 0 and adam["grad_clip_norm"] >= 0 and adam["weight_decay"] >= 0
            assert ok == valid

        @rule(m=models)
        def unknown_model(self, m: str) -> None:
            ok, body = self.other.forward_backward(m, fb_record([list(TOKENS[0])]))  # another key: as if absent
            assert not ok and json.loads(body)["status"] == 404

        @rule(target=saved, m=models)
        def save(self, m: str) -> str:
            path, bundle, ops = self.c.save(m, f"s{next(counter)}")
            private = svc.engine.models[m].dp is not None
            code, doc = verify(bundle, policy, write_ops(tmp / "ops.jsonl", ops), *([] if private else ["--replay"]))
            assert (code, doc["verdict"]) == (0, "accepted"), [c for c in doc["checks"] if c["status"] == "fail"]
            for bad in self._mutations(ops):
                code, doc = verify(bundle, policy, write_ops(tmp / "bad.jsonl", bad))
                assert (code, doc["verdict"]) == (1, "rejected")
            return path

        @staticmethod
        def _mutations(ops: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
            out = [ops + [{"op": "optim_step", "adam_params": ADAM}]]
            if ops:
                out.append(ops[:-1])
                changed = json.loads(json.dumps(ops))
                last = changed[-1]
                if last["op"] == "optim_step":
                    last["adam_params"]["learning_rate"] = last["adam_params"]["learning_rate"] + 1e-3
                elif last["op"] == "forward_backward":
                    last["data"][0]["model_input"][0] ^= 1
                else:
                    last["optimizer"] = not last["optimizer"]
                out.append(changed)
            return out

        @rule(p=saved, m=models, optimizer=st.booleans())
        def load_into(self, p: str, m: str, optimizer: bool) -> None:
            c, have = svc.store.checkpoint(p), svc.engine.models[m]
            ok = self._atomic(m, lambda: self.c.load(p, model_id=m, optimizer=optimizer)[:2])
            from app.api.engine import saved_dp  # noqa: F401  (what the server compares: DP or not)

            expect = have.pending == 0 and c.lora["rank"] == have.lora["rank"] and \
                (have.dp is None) == (self._dp(p) is None)
            assert ok == expect

        def _dp(self, p: str) -> Any:
            return json.loads((Path(svc.store.checkpoint(p).bundle) / "manifest.json").read_text())["op_chain"].get("dp")

        @rule(target=models, p=saved, optimizer=st.booleans())
        def load_new(self, p: str, optimizer: bool) -> str:
            ok, body, model_id = self.c.load(p, optimizer=optimizer)
            assert ok, body
            return model_id

        @rule(p=saved)
        def load_foreign(self, p: str) -> None:
            ok, body, _ = self.other.load(p)
            assert not ok and json.loads(body)["status"] == 404

        @invariant()
        def chains_match_records(self) -> None:
            from attestation.outputs import op_chain

            for m, ops in self.c.ops.items():
                got = svc.engine.models.get(m)
                if got is not None:
                    assert (got.op_head, got.ops) == (op_chain.head(ops), len(ops))

    return History


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-seed", "random-seed"])
def test_random_op_sequences_keep_every_proof_true(svc: Any, tmp_path: Path, fixed: bool) -> None:
    run_state_machine_as_test(_machine(svc, tmp_path), settings=settings(
        max_examples=3, stateful_step_count=12, deadline=None, database=None, derandomize=fixed,
        suppress_health_check=list(HealthCheck), print_blob=True))
