"""A Hypothesis state machine drives the training API's service with random sequences of valid and hostile ops
(NaN, infinite and huge numbers, unknown loss settings, out-of-range Adam parameters, unknown models, loads of
another key's state, of a DP-mismatched or other-rank state, loads with a gradient pending, restarts of the server on
its volume, ops of several models waiting together: one packed pass, short ops padded) while the client keeps the
record of what succeeded. Invariants: a refused op changes nothing (weights, pending gradient, DP sums, optimizer,
chain); after every save the bundle verifies against the record and replays
to the same weights, and a record with one op more, one less or one changed is rejected; after a restart the models
are gone (404, nothing changes) and the saved states load, continuing their chains.

Bounded (a few examples of a few steps each): one run from a fixed seed, one from a random seed. (A kill -9 of a
real server process between steps, and the replay of the whole history across it, is tests/test_api.py's.)
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from tests.api_inproc import ADAM, OWNER, TOKENS, Client, fb_body, fb_record, service, verify, wait, write_ops
from tests.test_api_history import DP, _ppo, _same, _state

NUMBERS = st.sampled_from([1.0, 0.5, -0.25, 0.0, 1e6, 3e38, math.nan, math.inf, -math.inf])
ADAM_CHANGES = st.sampled_from([{}, {"grad_clip_norm": 1.0}, {"grad_clip_norm": math.nan}, {"weight_decay": math.inf},
                                {"learning_rate": -1.0}, {"beta1": 1.0}, {"eps": 0.0}, {"learning_rate": 1e300}])
CONFIGS = st.sampled_from([None, {"clip_low_threshold": 0.7}, {"clip_low_threshold": math.nan},
                           {"clip_high_threshold": -math.inf}, {"surprise": 1.0}, {"clip_low_threshold": 1.5}])


def _machine(tmp: Path) -> type[RuleBasedStateMachine]:
    counter = iter(range(10 ** 9))

    class History(RuleBasedStateMachine):
        models = Bundle("models")
        saved = Bundle("saved")

        def __init__(self) -> None:
            super().__init__()
            self.volume = tmp / f"volume-{next(counter)}"
            self.volume.mkdir()
            self.stack = contextlib.ExitStack()
            self.records: dict[str, list[dict[str, Any]]] = {}  # tinker path -> the ops it holds (across restarts)
            self._open()

        def _open(self) -> None:
            self.svc = self.stack.enter_context(service(self.volume))
            self.c = Client(self.svc)
            self.c.saved_records = self.records
            self.other = Client(self.svc, owner="b" * 64)

        def teardown(self) -> None:
            self.stack.close()

        def _alive(self, m: str) -> bool:
            return m in self.svc.engine.models

        @initialize(target=models)
        def first(self) -> str:
            return self.c.create(seed=next(counter) % 5)

        @rule(target=models, private=st.booleans(), rank=st.sampled_from([2, 4]))
        def create(self, private: bool, rank: int) -> str:
            return self.c.create(rank=rank, seed=next(counter) % 5, user_metadata=DP if private else None)

        def _atomic(self, m: str, do: Any) -> bool | None:
            """Run ``do``; a refusal changes nothing. None: the model did not survive a restart (404, nothing ran)."""
            if not self._alive(m):
                ok, body = do()
                assert not ok and json.loads(body)["status"] == 404, body
                return None
            before = _state(self.svc, m)
            ok, body = do()
            if not ok:
                assert json.loads(body)["category"] == "user", body  # refused with its reason, never a server error
                assert _same(_state(self.svc, m), before), "a refused op changed the model"
            return ok

        @rule(m=models, weight=NUMBERS, two=st.booleans())
        def forward_backward(self, m: str, weight: float, two: bool) -> None:
            record = fb_record([list(t) for t in (TOKENS if two else TOKENS[:1])], weights=weight)
            ok = self._atomic(m, lambda: self.c.forward_backward(m, record))
            if ok is not None and not math.isfinite(weight):
                assert not ok

        @rule(m1=models, m2=models, m3=models, weights=st.lists(NUMBERS, min_size=3, max_size=3), short=st.booleans())
        def shared_pass(self, m1: str, m2: str, m3: str, weights: list[float], short: bool) -> None:
            """forward_backward ops of up to three models waiting together (one packed pass, short ops padded): each
            ends as it would alone — the saves' replays check the bits."""
            import threading

            from app.api.errors import ApiError

            alive = [m for m in dict.fromkeys((m1, m2, m3)) if self._alive(m)]
            before = {m: _state(self.svc, m) for m in alive}
            gate = threading.Event()
            self.svc.engine.submit(lambda: gate.wait(30))  # the worker held: the ops below wait together
            futures = []
            try:
                for i, (m, w) in enumerate(zip(alive, weights)):
                    record = fb_record([list(TOKENS[i % 2][:2 if short else None])], weights=w)
                    try:
                        futures.append((m, w, record, self.svc.forward_backward(OWNER, fb_body(m, record))))
                    except ApiError as exc:  # refused before it was queued (the route's 400)
                        futures.append((m, w, record, exc))
            finally:
                gate.set()
            for m, w, record, fut in futures:
                if isinstance(fut, ApiError):
                    ok, body = False, str(fut)
                else:
                    ok, body = wait(self.svc, fut)
                    assert ok or json.loads(body)["category"] == "user", body
                if ok:
                    self.c.ops[m].append(record)
                else:
                    assert _same(_state(self.svc, m), before[m]), "a refused op in a shared pass changed its model"
                assert ok or not math.isfinite(w) or abs(w) > 1e30, body

        @rule(m=models, config=CONFIGS, loss=st.sampled_from(["ppo", "cispo"]))
        def policy_loss(self, m: str, config: dict[str, Any] | None, loss: str) -> None:
            record = {**_ppo(config), "loss_fn": loss}
            ok = self._atomic(m, lambda: self.c.forward_backward(m, record))
            valid = not config or (set(config) <= {"clip_low_threshold", "clip_high_threshold"} and all(
                math.isfinite(v) and v >= 0 for v in config.values()) and config.get("clip_low_threshold", 0.8) <= 1.2)
            if ok is not None and not valid:
                assert not ok

        @rule(m=models, change=ADAM_CHANGES)
        def optim_step(self, m: str, change: dict[str, float]) -> None:
            adam = {**ADAM, **change}
            ok = self._atomic(m, lambda: self.c.optim_step(m, adam))
            valid = all(math.isfinite(v) for v in adam.values()) and adam["learning_rate"] >= 0 and 0 <= adam["beta1"] < 1 \
                and adam["eps"] > 0 and adam["grad_clip_norm"] >= 0 and adam["weight_decay"] >= 0 \
                and adam["learning_rate"] / (1 - adam["beta1"]) <= 3.4028234663852886e38  # a float32 step size
            if ok is not None:
                assert ok == valid

        @rule(m=models)
        def unknown_model(self, m: str) -> None:
            ok, body = self.other.forward_backward(m, fb_record([list(TOKENS[0])]))  # another key: as if absent
            assert not ok and json.loads(body)["status"] == 404

        @rule(target=saved, m=models)
        def save(self, m: str) -> str:
            if not self._alive(m):
                return self._save_after_restart_is_refused(m)
            path, bundle, ops = self.c.save(m, f"s{next(counter)}")
            private = self.svc.engine.models[m].dp is not None
            policy = self.svc.out / "simulator-test-policy.yaml"
            code, doc = verify(bundle, policy, write_ops(tmp / "ops.jsonl", ops), *([] if private else ["--replay"]))
            assert (code, doc["verdict"]) == (0, "accepted"), [c for c in doc["checks"] if c["status"] == "fail"]
            for bad in self._mutations(ops):
                code, doc = verify(bundle, policy, write_ops(tmp / "bad.jsonl", bad))
                assert (code, doc["verdict"]) == (1, "rejected")
            return path

        def _save_after_restart_is_refused(self, m: str) -> str:
            from app.api.errors import NotFound

            from tinker import types

            with pytest.raises(NotFound):  # a model of the server before the restart: as if it did not exist
                self.svc.save(OWNER, types.SaveWeightsRequest(model_id=m, path="gone"), "training")
            return next(iter(self.records), "tinker://none")  # some saved state (or one that does not exist)

        @staticmethod
        def _mutations(ops: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
            out = [ops + [{"op": "optim_step", "adam_params": ADAM}]]
            if ops:
                out.append(ops[:-1])
                changed = json.loads(json.dumps(ops))
                last = changed[-1]
                if last["op"] == "optim_step":
                    last["adam_params"]["learning_rate"] = last["adam_params"]["learning_rate"] * 2 + 1e-3  # 1e300 too
                elif last["op"] == "forward_backward":
                    last["data"][0]["model_input"][0] ^= 1
                else:
                    last["optimizer"] = not last["optimizer"]
                out.append(changed)
            return out

        def _dp(self, p: str) -> Any:
            c = self.svc.store.checkpoint(p)
            return json.loads((Path(c.bundle) / "manifest.json").read_text())["op_chain"].get("dp")

        @rule(p=saved, m=models, optimizer=st.booleans())
        def load_into(self, p: str, m: str, optimizer: bool) -> None:
            if p not in self.records or not self._alive(m):
                return
            have = self.svc.engine.models.get(m)
            ok = self._atomic(m, lambda: self.c.load(p, model_id=m, optimizer=optimizer)[:2])
            if ok is None:
                return
            c = self.svc.store.checkpoint(p)
            expect = have.pending == 0 and c.lora["rank"] == have.lora["rank"] and (have.dp is None) == (self._dp(p) is None)
            assert ok == expect

        @rule(target=models, p=saved, optimizer=st.booleans())
        def load_new(self, p: str, optimizer: bool) -> str:
            if p not in self.records:
                return self.c.create(seed=1)
            ok, body, model_id = self.c.load(p, optimizer=optimizer)
            assert ok, body
            return model_id

        @rule(p=saved)
        def load_foreign(self, p: str) -> None:
            if p in self.records:
                ok, body, _ = self.other.load(p)
                assert not ok and json.loads(body)["status"] == 404

        @rule()
        def restart(self) -> None:
            """The server stops and starts again on its volume: training state is gone, saved states stay."""
            self.stack.close()
            self.stack = contextlib.ExitStack()
            self._open()
            assert not self.svc.engine.models

        @invariant()
        def chains_match_records(self) -> None:
            from attestation.outputs import op_chain

            for m, ops in self.c.ops.items():
                got = self.svc.engine.models.get(m)
                if got is not None:
                    assert (got.op_head, got.ops) == (op_chain.head(ops), len(ops))

    return History


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-seed", "random-seed"])
def test_random_op_sequences_keep_every_proof_true(tmp_path: Path, fixed: bool) -> None:
    run_state_machine_as_test(_machine(tmp_path), settings=settings(
        max_examples=4, stateful_step_count=20, deadline=None, database=None, derandomize=fixed,
        suppress_health_check=list(HealthCheck), print_blob=True))
