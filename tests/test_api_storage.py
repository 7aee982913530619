"""Storage that grows with training, not with saves (the service in-process: tests/api_inproc.py).

A sampler save is a sealed state only, exported when asked (``user_metadata`` ``export: "true"``, or
``Service.export`` later: the bundle the save would have made); saved states expire after ``ttl_seconds``
(``api.sampler_ttl_s`` for sampler saves without one); ``api.max_saved_bytes`` refuses a save that would pass it.
Every refusal is checked for its exact reason and for changing nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api_inproc import OWNER, TOKENS, Client, fb_record, service, verify, wait, write_ops


# What each export has of its own (the rest of two bundles of one saved state is the same): its run id and time,
# its records' place in the audit chain, the GPU evidence's nonce, its signing key, the peak memory (report),
# and the files that name or hash them
OWN = {"run_id", "started_at", "created_at", "audit", "gpu", "signing", "files", "memory"}
OWN_FILES = {"README.md", "adapter/model.sig", "audit.jsonl", "gpu-evidence.json", "report/loss.png",
             "report/report.json"}


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with service(tmp_path_factory.mktemp("storage")) as s:
        yield s


@pytest.fixture
def limits(svc: Any) -> Iterator[Any]:
    """Change the storage's limits and clock in a test; both restored after."""
    before, clock = svc.storage.limits, svc.storage.clock
    yield svc
    svc.storage.limits, svc.storage.clock = before, clock


def _trained(svc: Any, steps: int = 2) -> tuple[Client, str]:
    c = Client(svc)
    m = c.create()
    for _ in range(steps):
        assert c.forward_backward(m, fb_record([list(t) for t in TOKENS]))[0]
        assert c.optim_step(m)[0]
    return c, m


def _save(c: Client, model_id: str, name: str, kind: str = "sampler", **fields: Any) -> tuple[bool, bytes]:
    from tinker import types

    req = (types.SaveWeightsForSamplerRequest if kind == "sampler" else types.SaveWeightsRequest)(
        model_id=model_id, path=name, **fields)
    return c._call(c.svc.save, req, kind)


def _path(model_id: str, name: str, kind: str = "sampler") -> str:
    return f"tinker://{model_id}/{'sampler_weights' if kind == 'sampler' else 'weights'}/{name}"


def _volume(svc: Any) -> dict[str, list[str]]:
    """What a refused request must not change: the files of saved states and bundles, every checkpoint record."""
    rows = svc.store.conn.execute("SELECT * FROM api_checkpoints ORDER BY path").fetchall()
    return {"files": sorted(str(p.relative_to(svc.out)) for d in ("api", "exports") for p in (svc.out / d).rglob("*")),
            "records": [repr(r) for r in rows]}


def _sample(c: Client, path: str) -> tuple[bool, bytes]:
    from tinker import types

    req = types.SampleRequest(prompt=types.ModelInput.from_ints([1, 5, 9]), num_samples=1, model_path=path,
                              sampling_params=types.SamplingParams(max_tokens=4, seed=1))
    return c._call(c.svc.sample, req)


def _load(c: Client, path: str) -> tuple[bool, bytes]:
    from tinker import types

    return c._call(c.svc.load, types.LoadWeightsRequest(path=path, optimizer=False, session_id=c.session,
                                                         model_seq_id=c._next()))


def _error(body: bytes) -> str:
    return json.loads(body)["error"]


def _listed(svc: Any, model_id: str) -> dict[str, Any]:
    return {c.tinker_path: c for c in svc.checkpoints.list_run(OWNER, model_id).checkpoints}


def test_a_sampler_save_is_a_sealed_state_only_and_samples(svc: Any) -> None:
    c, m = _trained(svc)
    exports = sorted((svc.out / "exports").iterdir())
    ok, body = _save(c, m, "quiet")
    assert ok, body
    rec = svc.store.checkpoint(_path(m, "quiet"))
    assert rec.bundle is None and rec.bundle_bytes == 0 and rec.state_bytes > 0 and Path(rec.dir).is_dir()
    assert sorted((svc.out / "exports").iterdir()) == exports  # no bundle, no quote
    listed = _listed(svc, m)[_path(m, "quiet")]
    assert listed.user_metadata["bundle"] == "" and listed.size_bytes == rec.state_bytes
    ok, body = _sample(c, _path(m, "quiet"))  # from the sealed state
    assert ok, body
    ok, body = _save(c, m, "state", kind="training")  # training saves export as before
    assert ok and svc.store.checkpoint(_path(m, "state", "training")).bundle is not None


def test_a_sampler_save_exported_later_is_the_bundle_its_save_would_have_made(svc: Any, tmp_path: Path) -> None:
    c, m = _trained(svc)
    ops = list(c.ops[m])
    assert _save(c, m, "now", user_metadata={"export": "true"})[0]  # exported at once
    assert _save(c, m, "later")[0]  # the same state, not exported
    _trained_more = [c.forward_backward(m, fb_record([list(TOKENS[0])])), c.optim_step(m)]
    assert all(ok for ok, _ in _trained_more)  # the model moved on: its head is not the saved one's

    ok, body = wait(svc, svc.export(OWNER, _path(m, "later")))
    assert ok, body
    later = Path(json.loads(body)["bundle"])
    assert json.loads(body)["path"] == _path(m, "later") and later.is_dir()
    now = Path(svc.store.checkpoint(_path(m, "now")).bundle)
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (now, later))
    assert b["op_chain"]["head"] == svc.store.checkpoint(_path(m, "later")).op_head != svc.engine.models[m].op_head
    b["op_chain"]["checkpoint"] = a["op_chain"]["checkpoint"]  # head, ops, progress, Adam: the save's
    assert {k: v for k, v in b.items() if k not in OWN} == {k: v for k, v in a.items() if k not in OWN}
    assert a["files"].keys() == b["files"].keys()
    assert {k for k in a["files"] if a["files"][k] != b["files"][k]} <= OWN_FILES  # the weights are the same
    report_a, report_b = (json.loads((d / "report" / "report.json").read_text()) for d in (now, later))
    assert {k: v for k, v in report_b.items() if k not in OWN} == {k: v for k, v in report_a.items() if k not in OWN}
    code, doc = verify(later, svc.out / "simulator-test-policy.yaml", write_ops(tmp_path / "ops.jsonl", ops))
    assert (code, doc["verdict"]) == (0, "accepted"), [ch for ch in doc["checks"] if ch["status"] == "fail"]
    assert _listed(svc, m)[_path(m, "later")].user_metadata["bundle"] == str(later)
    ok, body = wait(svc, svc.export(OWNER, _path(m, "later")))  # asked again: the same bundle, no other
    assert ok and json.loads(body)["bundle"] == str(later)


@pytest.mark.parametrize(("kind", "metadata", "error"), [
    ("sampler", {"export": "yes"}, "user_metadata export must be \"true\" or \"false\" (got 'yes')"),
    ("training", {"export": "false"}, "user_metadata export \"false\": a training save is always exported"),
    ("sampler", None, "ttl_seconds 60 is outside 3600..315360000 (1 hour to 10 years)"),
])
def test_a_bad_save_request_is_refused_with_its_reason_and_changes_nothing(svc: Any, kind: str,
                                                                             metadata: dict[str, str] | None,
                                                                             error: str) -> None:
    c, m = _trained(svc, steps=1)
    before = _volume(svc)
    ok, body = _save(c, m, "bad", kind=kind, user_metadata=metadata, ttl_seconds=None if metadata else 60)
    assert not ok and json.loads(body) == {"error": error, "category": "user", "status": 400}
    assert _volume(svc) == before


def test_exporting_another_keys_or_an_unknown_state_is_not_found(svc: Any) -> None:
    from app.api.errors import NotFound

    c, m = _trained(svc, steps=1)
    assert _save(c, m, "mine")[0]
    before = _volume(svc)
    for owner, path in (("b" * 64, _path(m, "mine")), (OWNER, _path(m, "nothing"))):
        with pytest.raises(NotFound, match=f"^checkpoint {path} not found$"):
            svc.export(owner, path)
    assert _volume(svc) == before


def test_an_expired_state_is_refused_with_its_reason_then_swept_and_its_bundle_stays(limits: Any) -> None:
    import time

    svc = limits
    c, m = _trained(svc, steps=1)
    assert _save(c, m, "short", ttl_seconds=3600, user_metadata={"export": "true"})[0]
    assert _save(c, m, "long", ttl_seconds=7200)[0]
    assert _save(c, m, "kept", kind="training")[0]
    short, long = svc.store.checkpoint(_path(m, "short")), svc.store.checkpoint(_path(m, "long"))
    assert _listed(svc, m)[short.path].expires_at is not None and short.expires_at < long.expires_at
    assert svc.store.checkpoint(_path(m, "kept", "training")).expires_at is None  # no ttl_seconds: kept
    t0 = time.time()
    svc.storage.clock = lambda: t0 + 3601
    why = (f"checkpoint {short.path} expired at {short.expires_at} (its ttl_seconds): its saved state was removed; "
           f"its export bundle {short.bundle} stays")
    for ok, body in (_sample(c, short.path), _load(c, short.path)):  # before any sweep: refused, 410
        assert not ok and json.loads(body) == {"error": why, "category": "user", "status": 410}
    assert Path(short.dir).is_dir()

    assert svc.storage.sweep() == [short.path]
    assert not Path(short.dir).exists() and Path(short.bundle).is_dir()  # a published bundle is evidence: it stays
    assert svc.store.checkpoint(short.path).removed_at is not None
    assert short.path not in _listed(svc, m) and long.path in _listed(svc, m)
    assert _load(c, short.path)[1] == json.dumps({"error": why, "category": "user", "status": 410}).encode()
    assert _sample(c, long.path)[0] and _load(c, _path(m, "kept", "training"))[0]  # the others are untouched
    assert svc.storage.sweep() == []


def test_a_load_queued_before_its_state_was_swept_says_it_expired(limits: Any) -> None:
    import time

    from tinker import types

    svc = limits
    c, m = _trained(svc, steps=1)
    assert _save(c, m, "racing", ttl_seconds=3600)[0]
    rec = svc.store.checkpoint(_path(m, "racing"))
    svc.engine.submit(lambda: time.sleep(0.5))  # the engine is busy while the load is accepted, then it is swept
    fut = svc.load(OWNER, types.LoadWeightsRequest(path=rec.path, optimizer=False, session_id=c.session,
                                                   model_seq_id=c._next()))
    t0 = time.time()
    svc.storage.clock = lambda: t0 + 3601
    assert svc.storage.sweep() == [rec.path]
    ok, body = wait(svc, fut)
    assert not ok and _error(body) == (f"checkpoint {rec.path} expired at {rec.expires_at} (its ttl_seconds): its "
                                       "saved state was removed")


def test_sampler_saves_take_the_configured_default_ttl(limits: Any) -> None:
    import time

    svc = limits
    svc.storage.limits = svc.storage.limits.model_copy(update={"sampler_ttl_s": 7200})
    c, m = _trained(svc, steps=1)
    t0 = time.time()
    svc.storage.clock = lambda: t0
    assert _save(c, m, "default")[0] and _save(c, m, "own", ttl_seconds=3600)[0]
    assert _save(c, m, "training", kind="training")[0]
    got = {n: svc.store.checkpoint(_path(m, n, k)).expires_at for n, k in
           (("default", "sampler"), ("own", "sampler"), ("training", "training"))}
    assert got == {"default": svc.storage.now(7200), "own": svc.storage.now(3600), "training": None}


def test_the_default_ttl_and_the_quota_are_checked_settings() -> None:
    from pydantic import ValidationError

    from app.config.api import ApiSettings

    for bad in ({"sampler_ttl_s": 60}, {"max_saved_bytes": 0}, {"max_saved_byte": 1}):
        with pytest.raises(ValidationError):
            ApiSettings(**bad)
    assert ApiSettings().sampler_ttl_s is None and ApiSettings().max_saved_bytes is None


@pytest.mark.parametrize("kind", ["sampler", "training"])
def test_a_save_past_the_quota_is_refused_and_writes_nothing(limits: Any, kind: str) -> None:
    svc = limits
    c, m = _trained(svc, steps=1)
    used = svc.store.saved_bytes()
    svc.storage.limits = svc.storage.limits.model_copy(update={"max_saved_bytes": used + 1000})
    before = _volume(svc)
    ok, body = _save(c, m, "over", kind=kind)
    path = _path(m, "over", kind)
    assert not ok and json.loads(body)["category"] == "user"
    assert _error(body).startswith(f"{path} is not saved: the saved states and export bundles hold {used} bytes and "
                                   "this needs about ")
    assert _error(body).endswith(f"more, past api.max_saved_bytes ({used + 1000}); nothing was written. Let sampler "
                                 "states expire (ttl_seconds, api.sampler_ttl_s) or raise the limit")
    assert _volume(svc) == before and svc.store.saved_bytes() == used and not svc.vault.ram.exists()
    svc.storage.limits = svc.storage.limits.model_copy(update={"max_saved_bytes": None})
    assert _save(c, m, "over", kind=kind)[0]  # the name was not taken
    rec = svc.store.checkpoint(path)
    assert svc.store.saved_bytes() == used + rec.state_bytes + rec.bundle_bytes > used


def test_a_later_export_past_the_quota_is_refused_and_writes_nothing(limits: Any) -> None:
    svc = limits
    c, m = _trained(svc, steps=1)
    assert _save(c, m, "unexported")[0]
    used = svc.store.saved_bytes()
    svc.storage.limits = svc.storage.limits.model_copy(update={"max_saved_bytes": used})
    before = _volume(svc)
    ok, body = wait(svc, svc.export(OWNER, _path(m, "unexported")))
    assert not ok and _error(body).startswith(f"{_path(m, 'unexported')} is not exported: the saved states and export "
                                              f"bundles hold {used} bytes")
    assert _volume(svc) == before
