"""Continual retraining: dataset versions from a directory or the owner's URL (a real HTTP server on loopback),
warm start from the promoted adapter with a verifiable lineage, the promotion gate, skipping unchanged nights, and
thirty nights of the service on an injectable clock with the real pipeline."""

from __future__ import annotations

import json
import random
import shutil
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from app.cli import main as cli_main
from app.config import Config
from app.dataset.sources import PART, Located, download, locate, newest_version
from app.errors import (
    ConfigError,
    DataError,
    DatasetSignatureError,
    DatasetTooLargeError,
    InputsUnchanged,
    TrainingError,
)
from app.run.pipeline import RunHooks, run_once
from app.service.scheduler import Service
from tests.owner_fixtures import KEY, encrypt_to, jsonl, owner_key

SAMPLE = [json.loads(line) for line in (Path(__file__).resolve().parent.parent / "app" / "data" / "sample.jsonl")
          .read_text().splitlines() if line.strip()]
EVAL = [dict(r, split="eval") for r in SAMPLE[150:170]]
OWNER = owner_key()
OWNER_PUB = OWNER.public_key().public_bytes_raw()
OTHER = owner_key(b"\x07" * 32)
UTC = timezone.utc


def _garbage(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    return [{"text": " ".join(rnd.choice(["zq", "xv", "kk", "pp", "##", "@@"]) for _ in range(60))} for _ in range(n)]


def _version(directory: Path, version: int, rows: list[dict], *, signer: Any = OWNER, dataset_id: str = "tickets",
             name: str | None = None) -> Path:
    path = directory / (name or f"tickets-v{version}.cvmds")
    encrypt_to(path, jsonl(rows), signer=signer, dataset_id=dataset_id, dataset_version=version)
    return path


def _cfg(root: Path, *, source: str = "encrypted-file", gate: str = "loss", **training: Any) -> Config:
    key = root / "dataset.key"
    if not key.exists():
        key.write_bytes(KEY)
        key.chmod(0o600)
    dataset: dict[str, Any] = {"source": source, "dataset_id": "tickets", "owner_public_key": OWNER_PUB.hex(),
                               "key": {"source": "file", "file": str(key)}}
    if source == "url":
        dataset["url"] = training.pop("url")
        dataset["download"] = {"retries": 1, "retry_backoff_s": 0, "timeout_s": 5}
    else:
        dataset["path"] = str(root / "data")
    return Config.model_validate({
        "output": {"dir": str(root / "out")}, "dataset": dataset, "evaluation": {"gate": gate},
        "training": {"max_steps": 4, "save_steps": 2, "init": "previous", **training},
        "schedule": {"max_attempts": 2, "retry_backoff_s": 1},
        "alerts": {"webhook_url_env": "CVM_TUNE_TEST_NO_WEBHOOK"}})


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- directory of versions ----------------------------------------------------------------------------------


def test_directory_uses_the_newest_valid_version(tmp_path: Path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    _version(d, 1, SAMPLE[:10])
    _version(d, 3, SAMPLE[:12])
    _version(d, 2, SAMPLE[:11])
    _version(d, 4, SAMPLE[:13], signer=OTHER)  # newest, but not the owner's
    _version(d, 9, SAMPLE[:5], dataset_id="other-set")  # another dataset
    (d / "README.txt").write_text("not a dataset")
    got = newest_version(d, "tickets", OWNER_PUB)
    assert (got.path.name, got.version) == ("tickets-v3.cvmds", 3)
    assert got.skipped == [f"tickets-v4.cvmds: signed by another owner key ({_kid(OTHER)[:16]}…)"]


def _kid(key: Any) -> str:
    import hashlib

    return hashlib.sha256(key.public_key().public_bytes_raw()).hexdigest()


def test_directory_without_a_valid_version_or_id_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    _version(d, 5, SAMPLE[:10], signer=OTHER)
    before = _files(d)
    with pytest.raises(DataError, match="no valid version of dataset 'tickets'.*signed by another owner key"):
        newest_version(d, "tickets", OWNER_PUB)
    with pytest.raises(ConfigError, match="set dataset.dataset_id"):
        locate("encrypted-file", d, None, OWNER_PUB, tmp_path / "out")
    assert _files(d) == before


# --- the owner's URL on a real loopback server --------------------------------------------------------------


class _Server:
    """Serves one file; can drop connections half-way, answer with an error status, and records Range headers."""

    def __init__(self) -> None:
        self.body = b""
        self.drop_first = 0  # close this many responses half-way
        self.status: int | None = None
        self.ranges: list[str | None] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                server.ranges.append(self.headers.get("Range"))
                if server.status is not None:
                    self.send_response(server.status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng and self.headers.get("If-Range") == '"v1"':
                    start = int(rng.removeprefix("bytes=").rstrip("-"))
                body = server.body[start:]
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(server.body) - 1}/{len(server.body)}")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", '"v1"')
                self.end_headers()
                if server.drop_first > 0:
                    server.drop_first -= 1
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def log_message(self, *_a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/tickets/current.cvmds"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Any:
    s = _Server()
    yield s
    s.close()


def _fetch(server: _Server, inbox: Path, **kw: Any) -> Path:
    inbox.mkdir(parents=True, exist_ok=True)
    args = {"dataset_id": "tickets", "owner_public_key": OWNER_PUB, "timeout_s": 5, "retries": 2, "backoff_s": 0,
            "max_bytes": 1 << 30, **kw}
    return download(server.url, inbox, **args)


def test_download_resumes_a_dropped_transfer_with_range(server: _Server, tmp_path: Path) -> None:
    src = _version(tmp_path, 7, [{"text": f"row {i} " + "word " * 200} for i in range(400)])  # ~400 KiB
    server.body, server.drop_first = src.read_bytes(), 1
    got = _fetch(server, tmp_path / "inbox")
    assert got.name.startswith("tickets-v7-") and got.read_bytes() == src.read_bytes()
    assert server.ranges[0] is None
    resumed_at = int(server.ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= len(server.body) // 2  # resumed, not restarted
    assert sorted(p.name for p in (tmp_path / "inbox").iterdir()) == [got.name]  # no partial file left


def test_download_truncated_for_good_keeps_the_part_for_next_time(server: _Server, tmp_path: Path) -> None:
    src = _version(tmp_path, 7, [{"text": f"row {i} " + "word " * 200} for i in range(400)])
    server.body, server.drop_first = src.read_bytes(), 10
    inbox = tmp_path / "inbox"
    with pytest.raises(DataError, match="after 3 attempt"):
        _fetch(server, inbox)
    assert not list(inbox.glob("*.cvmds")) and (inbox / PART).is_file()
    server.drop_first = 0  # the next night: resumed, not restarted
    got = _fetch(server, inbox)
    assert got.read_bytes() == src.read_bytes() and server.ranges[-1] is not None


def test_download_over_the_size_cap_is_refused(server: _Server, tmp_path: Path) -> None:
    server.body = _version(tmp_path, 7, SAMPLE[:60]).read_bytes()
    inbox = tmp_path / "inbox"
    with pytest.raises(DatasetTooLargeError, match="over dataset.download.max_bytes"):
        _fetch(server, inbox, max_bytes=1000)
    assert not list(inbox.glob("*.cvmds")) and not (inbox / PART).exists()


def test_download_of_another_owners_version_is_discarded(server: _Server, tmp_path: Path) -> None:
    server.body = _version(tmp_path, 8, SAMPLE[:20], signer=OTHER).read_bytes()
    inbox = tmp_path / "inbox"
    with pytest.raises(DatasetSignatureError, match="signed by another owner key"):
        _fetch(server, inbox)
    assert list(inbox.iterdir()) == []


def test_download_http_error_is_not_retried(server: _Server, tmp_path: Path) -> None:
    server.status = 404
    with pytest.raises(DataError, match="HTTP 404"):
        _fetch(server, tmp_path / "inbox")
    assert len(server.ranges) == 1


def test_unreachable_url_keeps_the_last_fetched_version(tmp_path: Path) -> None:
    out = tmp_path / "out"
    inbox = out / "datasets" / "fetched"
    inbox.mkdir(parents=True)
    _version(inbox, 2, SAMPLE[:10], name="tickets-v2-0123456789abcdef.cvmds")

    def unreachable(_inbox: Path) -> None:
        raise DataError("cannot download the dataset from https://owner.example/x after 4 attempt(s): ConnectionError")

    got = locate("url", None, "tickets", OWNER_PUB, out, fetch=unreachable)
    assert isinstance(got, Located) and got.version == 2 and "ConnectionError" in (got.fetch_error or "")
    shutil.rmtree(inbox)
    with pytest.raises(DataError, match=r"dataset download failed \(cannot download.*no earlier version was fetched"):
        locate("url", None, "tickets", OWNER_PUB, out, fetch=unreachable)


def test_url_source_trains_on_the_download_and_keeps_it_when_the_url_is_gone(server: _Server, tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    server.body = _version(tmp_path, 1, SAMPLE[:40] + EVAL).read_bytes()
    cfg = _cfg(tmp_path, source="url", gate="off", url=server.url)
    first = run_once(cfg, hooks=RunHooks(service=True))
    assert json.loads((first.bundle_dir / "manifest.json").read_bytes())["dataset"]["dataset_version"] == 1
    server.status = 503  # the owner's server is down tonight: same version, nothing new
    with pytest.raises(InputsUnchanged, match="inputs unchanged since the promoted run"):
        run_once(cfg, hooks=RunHooks(service=True))
    assert any("dataset.fetch_failed" in r.getMessage() for r in caplog.records)


# --- warm start, lineage, gate, skip ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """v1 -> A (from the base model), v2 -> B (warm from A, promoted), v3 (garbage) -> C (promotion refused)."""
    root = tmp_path_factory.mktemp("chain")
    (root / "data").mkdir()
    cfg = _cfg(root)
    _version(root / "data", 1, SAMPLE[:60] + EVAL)
    a = run_once(cfg, hooks=RunHooks(service=True))
    with pytest.raises(InputsUnchanged):
        run_once(cfg, hooks=RunHooks(service=True))
    _version(root / "data", 2, SAMPLE[:120] + EVAL)
    b = run_once(cfg, hooks=RunHooks(service=True))
    _version(root / "data", 3, _garbage(60) + EVAL)
    c = run_once(cfg, hooks=RunHooks(service=True))
    return {"root": root, "cfg": cfg, "a": a, "b": b, "c": c}


def _manifest(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / "manifest.json").read_bytes())


def test_warm_start_records_a_lineage_bound_in_the_audit_chain(chain: dict[str, Any]) -> None:
    a, b = chain["a"].bundle_dir, chain["b"].bundle_dir
    ma, mb = _manifest(a), _manifest(b)
    assert ma["lineage"] is None
    import hashlib

    assert mb["lineage"] == {"parent_run_id": ma["run_id"],
                             "parent_manifest_sha256": hashlib.sha256((a / "manifest.json").read_bytes()).hexdigest(),
                             "parent_adapter_sha256": ma["files"]["adapter/adapter_model.safetensors"]}
    start = [json.loads(line) for line in (b / "audit.jsonl").read_text().splitlines()][0]
    assert start["type"] == "run.start" and start["data"]["parent_manifest_sha256"] == mb["lineage"]["parent_manifest_sha256"]
    assert chain["a"].promoted and chain["b"].promoted
    assert (chain["root"] / "out" / "exports" / "PROMOTED").read_text() == f"{mb['run_id']}\n"


def test_regressed_candidate_is_exported_but_not_promoted(chain: dict[str, Any]) -> None:
    c, b = chain["c"], chain["b"]
    ev = _manifest(c.bundle_dir)["evaluation"]
    assert ev["promote"] is False and ev["candidate_loss"] > ev["parent_loss"] and ev["parent"] == f"run {b.run_id}"
    assert not c.promoted and c.promotion_refused.startswith("promotion refused: eval loss")
    exports = chain["root"] / "out" / "exports"
    assert (exports / "PROMOTED").read_text() == f"{b.run_id}\n" and (exports / "CANDIDATE").read_text() == f"{c.run_id}\n"
    # Nothing new since the refused candidate (same data, same parent): the night is skipped, not retrained.
    with pytest.raises(InputsUnchanged, match="whose promotion was refused"):
        run_once(chain["cfg"], hooks=RunHooks(service=True))


def _policy(chain: dict[str, Any]) -> str:
    return str(chain["root"] / "out" / "simulator-test-policy.yaml")


def test_verify_parent_and_chain(chain: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    a, b, c = (chain[k].bundle_dir for k in "abc")
    assert cli_main(["verify", str(b), "--parent", str(a), "--policy", _policy(chain)]) == 0
    assert "lineage: the bundle continued from this parent" in capsys.readouterr().out
    assert cli_main(["verify", str(c), "--parent", str(a), "--policy", _policy(chain)]) == 1
    assert "lineage: BROKEN: parent manifest hash differs" in capsys.readouterr().out
    assert cli_main(["verify", "--chain", str(a.parent), "--policy", _policy(chain), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [x["run_id"] for x in report["bundles"]] == [chain[k].run_id for k in "abc"]
    assert report["promoted"] == chain["b"].run_id and report["first_broken"] is None


def test_chain_names_the_first_broken_link(chain: dict[str, Any], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    exports = tmp_path / "exports"
    shutil.copytree(chain["root"] / "out" / "exports", exports)
    weights = exports / chain["b"].run_id / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    assert cli_main(["verify", "--chain", str(exports), "--policy", _policy(chain)]) == 1
    out = capsys.readouterr().out
    assert f"first broken link: {chain['b'].run_id}" in out and "manifest.files" in out
    shutil.rmtree(exports / chain["a"].run_id)  # a missing parent is a broken link too
    assert cli_main(["verify", "--chain", str(exports), "--policy", _policy(chain), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["bundles"][0]["run_id"] == chain["b"].run_id
    assert "is not in" in report["bundles"][0]["link_problems"][0]
    assert cli_main(["verify"]) == 2  # neither BUNDLE nor --chain (ConfigError)


def test_promotion_decision_is_recomputed_by_the_verifier(chain: dict[str, Any]) -> None:
    from attestation.bundle import manifest as B
    from attestation.bundle.input_checks import evaluation
    from attestation.verify import QuoteFindings

    c = chain["c"].bundle_dir
    m = B.Manifest.model_validate_json((c / "manifest.json").read_bytes())
    f = QuoteFindings()
    evaluation(f, m, (c / "config.json").read_bytes())
    assert [(x.name, x.status) for x in f.checks] == [("evaluation.decision", "pass")]
    forged = m.model_copy(update={"evaluation": m.evaluation.model_copy(update={"promote": True})})
    f = QuoteFindings()
    evaluation(f, forged, (c / "config.json").read_bytes())
    assert f.checks[0].status == "fail" and "contradicts the scores" in f.checks[0].detail


def _clone(chain: dict[str, Any], tmp_path: Path) -> Path:
    root = tmp_path / "clone"
    shutil.copytree(chain["root"], root, symlinks=True)
    return root


def test_a_promoted_bundle_failing_verification_is_not_continued_from(chain: dict[str, Any], tmp_path: Path) -> None:
    root = _clone(chain, tmp_path)
    exports = root / "out" / "exports"
    weights = exports / chain["b"].run_id / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    _version(root / "data", 4, SAMPLE[:90] + EVAL)
    before = sorted(p.name for p in exports.iterdir())
    with pytest.raises(TrainingError, match=f"the promoted bundle {chain['b'].run_id} fails verification"):
        run_once(_cfg(root), hooks=RunHooks(service=True))
    assert sorted(p.name for p in exports.iterdir()) == before
    assert (exports / "PROMOTED").read_text() == f"{chain['b'].run_id}\n"


def test_another_lora_shape_cannot_continue(chain: dict[str, Any], tmp_path: Path) -> None:
    root = _clone(chain, tmp_path)
    _version(root / "data", 4, SAMPLE[:90] + EVAL)
    with pytest.raises(TrainingError, match="another LoRA shape \\(r differ\\)"):
        run_once(_cfg(root, lora={"r": 4}), hooks=RunHooks(service=True))
    from app.state import RunDB

    assert all(r.status == "exported" for r in RunDB(root / "out").runs(1000))  # nothing left to resume


def test_gate_without_eval_rows_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    _version(tmp_path / "data", 1, SAMPLE[:40])
    with pytest.raises(DataError, match="0 eval row\\(s\\).*the promotion gate needs at least 1"):
        run_once(_cfg(tmp_path), hooks=RunHooks(service=True))
    out = tmp_path / "out"
    assert not list((out / "runs").iterdir()) and not list((out / "exports").iterdir())


def test_eval_rows_are_never_trained_on(chain: dict[str, Any]) -> None:
    m = _manifest(chain["a"].bundle_dir)
    assert m["dataset"]["validation"]["eval_rows"] == len(EVAL) - 1  # one eval row duplicates another in the sample
    v = m["dataset"]["validation"]
    assert m["dataset"]["rows"] + v["eval_rows"] == v["rows_read"] - v["duplicates_dropped"]
    assert m["evaluation"]["rows"] == len(EVAL) - 1


# --- a year in a minute -------------------------------------------------------------------------------------


class _Killed(BaseException):
    """Stands for kill -9: nothing in the service or the pipeline handles it."""


def test_thirty_nights(tmp_path: Path) -> None:
    """New versions on some nights, a regressed one, a rollback, a kill -9 mid-run: every night ends with a reason,
    no slot runs twice, and the promoted chain verifies end to end."""
    root = tmp_path
    data = root / "data"
    data.mkdir()
    cfg = _cfg(root)
    start = datetime(2026, 1, 1, 2, 1, tzinfo=UTC)
    arrivals = {1: SAMPLE[:60], 6: SAMPLE[:120], 11: _garbage(60), 19: SAMPLE[:150]}
    kill_night, rollback_night = 19, 15
    version = 0
    for night in range(1, 31):
        now = start + timedelta(days=night - 1)
        if night in arrivals:
            version += 1
            _version(data, version, arrivals[night] + EVAL)
        if night == rollback_night:  # the newer files vanish: only v1 is left on the volume
            moved = [p for p in data.iterdir() if p.name != "tickets-v1.cvmds"]
            (root / "aside").mkdir()
            for p in moved:
                p.rename(root / "aside" / p.name)
        if night == rollback_night + 1:
            for p in (root / "aside").iterdir():
                p.rename(data / p.name)

        class Clock:
            def now(self) -> datetime:
                return now

            def monotonic(self) -> float:
                return 0.0

        svc = Service(cfg, clock=Clock())
        if night == kill_night:
            def killing(**kw: Any) -> Any:
                def on_step(step: int) -> None:
                    if step == 3:
                        raise _Killed()
                return svc._run_pipeline(**{**kw, "on_step": on_step})

            svc.runner = killing
            with pytest.raises(_Killed):
                svc.tick()
            svc = Service(cfg, clock=Clock())  # the restarted container
        svc.tick()
    rows = {r.id: r for r in svc.db.recent(100)}
    assert len(rows) == 30
    day = lambda n: f"nightly-{(start + timedelta(days=n - 1)).date().isoformat()}"  # noqa: E731
    status = {n: (rows[day(n)].status, rows[day(n)].reason or "") for n in range(1, 31)}
    trained = [n for n in range(1, 31) if status[n][0] == "succeeded"]
    assert trained == [1, 6, 11, 19]
    assert "promotion refused" in status[11][1]
    assert status[rollback_night][0] == "failed" and "DatasetRollbackError" in status[rollback_night][1]
    assert all(status[n][0] == "skipped" and status[n][1].startswith("inputs unchanged")
               for n in range(1, 31) if n not in (*trained, rollback_night))
    assert rows[day(kill_night)].attempts == 2  # killed once, resumed from its sealed checkpoint
    exports = root / "out" / "exports"
    assert sorted(p.name for p in exports.iterdir() if p.is_dir()) == sorted(day(n) for n in trained)
    assert (exports / "PROMOTED").read_text().strip() == day(19)
    chain_m = _manifest(exports / day(19))
    assert chain_m["lineage"]["parent_run_id"] == day(6)  # night 11 was refused: 19 continued from 6
    assert cli_main(["verify", "--chain", str(exports), "--policy", str(root / "out" / "simulator-test-policy.yaml")]) == 0


# --- a new key waits for its grant --------------------------------------------------------------------------


def test_a_version_under_a_new_key_waits_for_its_grant(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The released version keeps being used (and said so) until the owner releases the new key."""
    import hashlib

    from app.dataset.owner import load_owner_key
    from app.errors import KeyReleasePendingError
    from app.simulator import GuestAgentSimulator
    from attestation.policy import policy_file_text, simulator_policy

    (tmp_path / "data").mkdir()
    assert cli_main(["keys", "new", "-o", str(tmp_path / "acme")]) == 0
    signer = load_owner_key(tmp_path / "acme.key")
    sim = GuestAgentSimulator()
    policy = tmp_path / "owner-policy.yaml"
    policy.write_text(policy_file_text(simulator_policy(sim.test_root_ca_der).model_copy(
        update={"name": "acme", "compose_hashes": (sim.compose_hash.hex(),)})))
    keys = {1: tmp_path / "v1.key", 2: tmp_path / "v2.key"}
    for n, k in keys.items():
        k.write_bytes(hashlib.sha256(f"key {n}".encode()).digest())
        k.chmod(0o600)
    _version(tmp_path / "data", 1, SAMPLE[:40], signer=signer)
    for p in (tmp_path / "data").iterdir():  # re-encrypt under key 1
        encrypt_to(p, jsonl(SAMPLE[:40]), keys[1].read_bytes(), signer=signer, dataset_id="tickets", dataset_version=1)
    cfg = Config.model_validate({
        "output": {"dir": str(tmp_path / "out")}, "training": {"max_steps": 2, "save_steps": 2},
        "dataset": {"source": "encrypted-file", "path": str(tmp_path / "data"), "dataset_id": "tickets",
                    "owner_public_key": (tmp_path / "acme.pub").read_text().strip(), "key": {"source": "release"}},
        "alerts": {"webhook_url_env": "CVM_TUNE_TEST_NO_WEBHOOK"}})
    request, grant = tmp_path / "out" / "key-release" / "request.json", tmp_path / "out" / "key-release" / "grant.json"

    def release(version: int) -> None:
        assert cli_main(["dataset", "release", str(request), "--policy", str(policy), "--dataset",
                         str(tmp_path / "data" / f"tickets-v{version}.cvmds"), "--key-file", str(keys[version]),
                         "--owner-key", str(tmp_path / "acme.key"), "-o", str(grant)]) == 0

    with pytest.raises(KeyReleasePendingError):
        run_once(cfg, hooks=RunHooks(service=True))
    release(1)
    first = run_once(cfg, hooks=RunHooks(service=True))
    encrypt_to(tmp_path / "data" / "tickets-v2.cvmds", jsonl(SAMPLE[:80]), keys[2].read_bytes(), signer=signer,
               dataset_id="tickets", dataset_version=2)
    with pytest.raises(InputsUnchanged, match=r"key release pending for dataset v2 .*using v1, the last released"):
        run_once(cfg, hooks=RunHooks(service=True))
    assert json.loads(request.read_bytes())["request"]["dataset_version"] == 2
    assert any("key_release.pending" in r.getMessage() for r in caplog.records)
    grant.unlink()  # the operator replaces the old grant with the new one
    release(2)
    second = run_once(cfg, hooks=RunHooks(service=True))
    m = _manifest(second.bundle_dir)
    assert m["dataset"]["dataset_version"] == 2 and m["lineage"]["parent_run_id"] == first.run_id
