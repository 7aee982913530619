"""Checkpoints out through the stock Tinker CLI: ``tinker checkpoint download`` (the SDK's own console script) makes
an external-weights export of a saved state, fetches its files through signed URLs and deletes the export; the
directory it writes is what ``cvm-tune verify`` accepts. ``checkpoint list``/``info``/``set-ttl``/``delete`` and
the RestClient behind them; publishing is refused; another key gets 404 for everything; a changed, expired or
foreign URL is refused without reading anything; deleting a saved state keeps its export bundle.

Two servers: ``cvm-tune api serve`` itself (plain HTTP on loopback, keys ALICE and BOB), and the same service in
this process behind uvicorn, with ``export.recipients``, whose clock the expiry tests move. Every refusal is checked
for its exact status and reason and for changing nothing on the volume.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.api_drive import Server, _bundle, _steps
from tests.api_inproc import load_line
from tests.test_api import ALICE, BASE, BOB, LIMITS, _client, _datums, _verify, close_clients, serving  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # the SDK's deprecation notes
REFUSED = "this download URL is not valid: it was changed, or signed for another file or by another server"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("api-external"))


@pytest.fixture(scope="module")
def owner() -> Any:
    import pyrage

    return pyrage.x25519.Identity.generate()


@pytest.fixture(scope="module")
def clocked(tmp_path_factory: pytest.TempPathFactory, owner: Any) -> Iterator[Any]:
    """The service in this process with ``export.recipients``, served by uvicorn on loopback; its clock is
    ``svc.storage.clock`` (restored after each test that moves it)."""
    import uvicorn

    from app.api.http.server import create_app
    from tests.api_inproc import service

    tmp = tmp_path_factory.mktemp("api-external-clocked")
    keys = frozenset(hashlib.sha256(k.encode()).hexdigest() for k in (ALICE, BOB))
    with service(tmp, LIMITS + f"export:\n  recipients: ['{owner.to_public()}']\n") as svc:
        srv = uvicorn.Server(uvicorn.Config(create_app(svc, keys), host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=srv.run, daemon=True)
        thread.start()
        while not srv.started:
            assert thread.is_alive()
            time.sleep(0.05)
        port = srv.servers[0].sockets[0].getsockname()[1]
        try:
            yield SimpleNamespace(svc=svc, url=f"http://127.0.0.1:{port}", out=svc.out, tmp=tmp)
        finally:
            srv.should_exit = True
            thread.join(30)


@pytest.fixture
def clock(clocked: Any) -> Iterator[Any]:
    before = clocked.svc.storage.clock
    yield clocked
    clocked.svc.storage.clock = before


def _cli(url: str, key: str, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The stock ``tinker`` console script, configured as the SDK reads it (TINKER_BASE_URL, TINKER_API_KEY; ``env``:
    more variables)."""
    script = Path(sys.executable).with_name("tinker")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "tinker.cli"]
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key, **env}
    return subprocess.run([*cmd, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def _volume(out: Path) -> dict[str, Any]:
    """What a refused request must not change: the files of saved states and bundles, every checkpoint record."""
    db = sqlite3.connect(f"file:{out / 'state' / 'runs.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT * FROM api_checkpoints ORDER BY path").fetchall()
    finally:
        db.close()
    return {"files": sorted(str(p.relative_to(out)) for d in ("api", "exports") for p in (out / d).rglob("*")),
            "records": rows}


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _trained(srv: Any, name: str, steps: int = 2) -> tuple[Any, str, list[dict[str, Any]]]:
    """(training client, the path of its saved state ``name``, the ops that made it)."""
    tc = _client(srv).create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    ops: list[dict[str, Any]] = []
    _steps(tc, _datums(srv), steps, ops)
    return tc, tc.save_state(name).result().path, ops


def _rest(srv: Any, key: str = ALICE) -> Any:
    import tinker

    return tinker.RestClient(base_url=srv.url, api_key=key)


def _call(srv: Any, method: str, route: str, key: str = ALICE, **kw: Any) -> httpx.Response:
    return httpx.request(method, f"{srv.url}/api/v1/{route}", headers={"X-API-Key": key}, timeout=120, **kw)


def _one(path: str) -> str:
    """The REST route of one checkpoint: ``training_runs/<model>/checkpoints/<segment>/<name>``."""
    model, cid = path.removeprefix("tinker://").split("/", 1)
    return f"training_runs/{model}/checkpoints/{cid}"


def _verify_dir(srv: Any, bundle: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    """``cvm-tune verify BUNDLE --policy <simulator policy> --json …`` in this process: (exit code, checks by name)."""
    import io

    from app.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["verify", str(bundle), "--policy", str(srv.out / "simulator-test-policy.yaml"), "--json", *extra])
    return code, {c["name"]: c for c in json.loads(buf.getvalue())["checks"]}


# --- the stock CLI ---------------------------------------------------------------------------------


def test_the_stock_cli_downloads_a_saved_state_as_a_bundle_verify_accepts(server: Server, tmp_path: Path) -> None:
    tc, path, ops = _trained(server, "kept")
    saved = _bundle(server, tc.model_id, path)
    before = _volume(server.out)

    done = _cli(server.url, ALICE, "checkpoint", "download", path, "--output", str(tmp_path / "dl"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = tmp_path / "dl" / path.removeprefix("tinker://").replace("/", "_")
    assert sorted(_files(got)) == sorted(_files(saved))  # every file of a bundle, under the bundle's names
    chain = json.loads((got / "manifest.json").read_text())["op_chain"]
    assert chain["checkpoint"].endswith("/external_weights/download") and chain["ops"] == len(ops) + 1

    # the saved state's ops, then the load of it (a training client created from the state: no optimizer)
    code, out = _verify(server, got, [*ops, load_line(saved, False)], tmp_path)
    assert code == 0 and "op chain: pass" in out, out

    after = _volume(server.out)  # the temporary export is gone, record and files; the saved state is untouched
    assert after["files"] == before["files"] and after["records"] == before["records"]
    assert _verify(server, saved, ops, tmp_path)[0] == 0  # nothing the saved state's bundle needs was removed


def test_the_stock_cli_lists_and_shows_checkpoints(server: Server, tmp_path: Path) -> None:
    tc, path, _ops = _trained(server, "listed", steps=1)
    listed = _cli(server.url, ALICE, "--format", "json", "checkpoint", "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    mine = {c["tinker_path"]: c for c in json.loads(listed.stdout)["checkpoints"]}
    assert mine[path]["checkpoint_type"] == "training" and mine[path]["user_metadata"]["bundle"]
    run = _cli(server.url, ALICE, "--format", "json", "checkpoint", "list", "--run-id", tc.model_id, cwd=tmp_path)
    assert [c["tinker_path"] for c in json.loads(run.stdout)["checkpoints"]] == [path]
    info = _cli(server.url, ALICE, "--format", "json", "checkpoint", "info", path, cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    shown = json.loads(info.stdout)
    assert (shown["tinker_path"], shown["is_lora"], shown["lora_rank"]) == (path, True, 4)

    page = _rest(server).list_user_checkpoints(limit=1, offset=0).result()
    assert len(page.checkpoints) == 1 and page.cursor.total_count == len(mine) and page.cursor.limit == 1
    assert _rest(server, BOB).list_user_checkpoints().result().checkpoints == []  # Bob has none of Alice's
    for query, why in (({"limit": 0}, "limit must be 1..1000 and offset at least 0"),
                       ({"offset": "x"}, "limit and offset must be integers")):
        r = _call(server, "GET", "checkpoints", params=query)
        assert (r.status_code, r.json()["detail"]) == (400, why)


def test_ttl_is_set_and_removed_through_the_cli(server: Server, tmp_path: Path) -> None:
    tc, path, _ops = _trained(server, "ttl", steps=1)

    def expires() -> Any:
        listed = _rest(server).list_checkpoints(tc.model_id).result().checkpoints
        return {c.tinker_path: c for c in listed}[path].expires_at

    assert _cli(server.url, ALICE, "checkpoint", "set-ttl", path, "--ttl", "7200", cwd=tmp_path).returncode == 0
    left = expires().timestamp() - time.time()
    assert 7200 - 60 < left <= 7200
    assert _cli(server.url, ALICE, "checkpoint", "set-ttl", path, "--remove", cwd=tmp_path).returncode == 0
    assert expires() is None
    before = _volume(server.out)
    for body, status, why in (({"ttl_seconds": 100}, 400, "ttl_seconds 100 is outside 3600..315360000 (1 hour to 10 "
                                                          "years)"),
                              ({"ttl_seconds": "7200"}, 400, "malformed _TtlRequest: ttl_seconds: Input should be a "
                                                             "valid integer"),
                              ({}, 400, "malformed _TtlRequest: ttl_seconds: Field required")):
        r = _call(server, "PUT", _one(path) + "/ttl", json=body)
        assert (r.status_code, r.json()["detail"]) == (status, why)
    r = _call(server, "PUT", _one(path) + "/ttl", BOB, json={"ttl_seconds": 7200})
    assert (r.status_code, r.json()["detail"]) == (404, f"checkpoint {path} not found")
    assert _volume(server.out) == before


def test_over_tls_the_urls_are_the_attested_listeners_and_the_cli_trusts_them(tmp_path: Path) -> None:
    from tests.test_api_attest import _attest

    (tmp_path / "tls").mkdir()
    with contextlib.closing(serving(tmp_path / "tls", tls=True)) as started:
        srv = next(started)
        trust = tmp_path / "trust.pem"
        assert _attest(srv.url, srv.out / "simulator-test-policy.yaml", trust)[0] == 0
        env = {**os.environ, "SSL_CERT_FILE": str(trust), "TINKER_BASE_URL": srv.url, "TINKER_API_KEY": ALICE}
        script = (f"import json, tinker; sc = tinker.ServiceClient(); tc = sc.create_lora_training_client("
                  f"base_model={BASE!r}, rank=2).result(); path = tc.save_state('tls').result().path; "
                  "ext = tc.save_weights_external('tls-ext').result().path; "
                  "urls = tinker.RestClient().get_external_weights_urls(ext).result().urls; "
                  "print(json.dumps([path, sorted(urls.values())])); sc.close('success').result()")
        made = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert made.returncode == 0, made.stderr
        path, urls = json.loads(made.stdout.splitlines()[-1])
        assert urls and all(u.startswith(f"{srv.url}/api/v1/cvm_tune/external_weights?") for u in urls)
        done = _cli(srv.url, ALICE, "checkpoint", "download", path, cwd=tmp_path, SSL_CERT_FILE=str(trust))
        assert done.returncode == 0, done.stderr
        got = tmp_path / path.removeprefix("tinker://").replace("/", "_")
        assert _verify_dir(srv, got)[0] == 0


# --- external weights and their URLs ---------------------------------------------------------------


def test_save_weights_external_serves_the_bundle_through_signed_urls(server: Server) -> None:
    tc, _path, _ops = _trained(server, "for-urls", steps=1)
    ext = tc.save_weights_external("ext").result().path
    assert ext == f"tinker://{tc.model_id}/external_weights/ext"
    bundle = _bundle(server, tc.model_id, ext)
    got = _rest(server).get_external_weights_urls(ext).result()
    assert sorted(got.urls) == sorted(_files(bundle)) and 800 < got.expires.timestamp() - time.time() <= 900
    for name, url in got.urls.items():
        assert url.startswith(f"{server.url}/api/v1/cvm_tune/external_weights?")  # the server's own origin
        r = httpx.get(url, timeout=60)  # no API key: the URL is the capability
        assert r.status_code == 200 and r.content == (bundle / name).read_bytes(), name
        assert int(r.headers["content-length"]) == len(r.content)

    listed = {c.tinker_path: c for c in _rest(server).list_checkpoints(tc.model_id).result().checkpoints}[ext]
    assert listed.checkpoint_type == "external" and listed.user_metadata["bundle"] == str(bundle)
    r = _call(server, "GET", _one(_path) + "/external_weights_urls")
    assert (r.status_code, r.json()["detail"]) == (400, f"{_path} is not external weights: only tinker://<model>/"
                                                        "external_weights/<name> has files to download "
                                                        "(save_weights_external makes one)")
    with pytest.raises(Exception, match="is an export to download") as refused:  # not a state to load
        _client(server).create_training_client_from_state(ext).result()
    assert getattr(refused.value, "status_code", 400) == 400


def test_a_changed_or_unknown_url_is_refused_alike_and_reads_nothing(server: Server) -> None:
    tc, path, _ops = _trained(server, "tamper", steps=1)
    ext = tc.save_weights_external("tamper-ext").result().path
    other = tc.save_weights_external("other-ext").result().path
    urls = _rest(server).get_external_weights_urls(ext).result().urls
    weights = next(u for n, u in urls.items() if "adapter_model" in n)
    base, query = weights.split("?")
    q = dict(urllib.parse.parse_qsl(query))
    before = _volume(server.out)

    def changed(**fields: str | None) -> str:
        items = {**q, **fields}
        return f"{base}?{urllib.parse.urlencode({k: v for k, v in items.items() if v is not None})}"

    cases = {
        "another file": changed(file="manifest.json"),
        "another checkpoint": changed(checkpoint=other),
        "a later expiry": changed(expires=str(int(q["expires"]) + 1)),
        "a changed signature": changed(signature=("0" if q["signature"][0] != "0" else "1") + q["signature"][1:]),
        "no checkpoint": changed(checkpoint=f"tinker://{tc.model_id}/external_weights/none"),
        "a saved state": changed(checkpoint=path),
        "a way out": changed(file="../../state/runs.sqlite"),
        "an absolute path": changed(file="/etc/passwd"),
        "no signature": changed(signature=None),
        "a field more": changed(owner=ALICE),
        "not a number": changed(expires="1e12"),
        "a field twice": weights + "&file=manifest.json",
    }
    for what, url in cases.items():
        r = httpx.get(url, timeout=60)
        assert (r.status_code, r.json()) == (403, {"detail": REFUSED, "category": "user"}), what
    assert _volume(server.out) == before
    assert httpx.get(weights, timeout=60).status_code == 200  # the genuine URL still works


def test_bad_external_saves_are_refused_and_write_nothing(server: Server) -> None:
    tc, _path, _ops = _trained(server, "bad-ext", steps=1)
    assert tc.save_weights_external("taken").result().path
    before = _volume(server.out)
    m = tc.model_id
    for fields, status, why in (
            ({"path": "../up"}, 400, "checkpoint name '../up': 1-64 letters, digits, '.', '_' or '-'"),
            ({"path": "taken"}, 400, f"checkpoint tinker://{m}/external_weights/taken exists already; save under "
                                     "another name"),
            ({"path": "x", "ttl_seconds": 60}, 400, "ttl_seconds 60 is outside 3600..315360000 (1 hour to 10 years)"),
            ({"path": "x", "age_encryption_recipients": ["age1qqqq"]}, 400,
             "age_encryption_recipients is not served: an export's weights are encrypted to the server's "
             "export.recipients and the CVM's key, or not at all (the server's start line says which)"),
            ({"path": "x", "model_id": "nobody:train:0"}, 404, "model nobody:train:0 not found")):
        r = _call(server, "POST", "save_weights_external", json={"model_id": m, **fields})
        assert (r.status_code, r.json()["detail"]) == (status, why), fields
    r = _call(server, "POST", "save_weights_external", BOB, json={"model_id": m, "path": "x"})
    assert (r.status_code, r.json()["detail"]) == (404, f"model {m} not found")
    assert _volume(server.out) == before


# --- deletion, publishing, other keys --------------------------------------------------------------


def test_deleting_a_saved_state_keeps_its_bundle_and_says_so(server: Server, tmp_path: Path) -> None:
    tc, path, ops = _trained(server, "delete-me")
    bundle = _bundle(server, tc.model_id, path)
    sealed = [p for p in (server.out / "api" / "checkpoints").iterdir()]
    evidence = _files(bundle)
    before = _volume(server.out)
    r = _call(server, "DELETE", _one(path), BOB)  # another key: as if it did not exist, and nothing changes
    assert (r.status_code, r.json()["detail"]) == (404, f"checkpoint {path} not found")
    assert _volume(server.out) == before

    r = _call(server, "DELETE", _one(path))
    assert r.status_code == 200 and r.json() == {"deleted": path, "bundle": str(bundle), "detail": (
        f"the saved state of {path} was removed; its export bundle {bundle} stays (evidence for cvm-tune verify: "
        "nothing in it or in the audit chain needs the state)")}
    gone = [p for p in sealed if not p.exists()]
    assert len(gone) == 1 and _files(bundle) == evidence  # one sealed state removed; the bundle byte for byte
    assert _verify(server, bundle, ops, tmp_path)[0] == 0
    assert path not in {c.tinker_path for c in _rest(server).list_checkpoints(tc.model_id).result().checkpoints}
    r = _call(server, "DELETE", _one(path))
    assert r.status_code == 410 and r.json()["detail"].startswith(f"checkpoint {path} was deleted at ")
    with pytest.raises(Exception, match=f"checkpoint {path} was deleted at .*its export bundle {bundle} stays"):
        _client(server).create_training_client_from_state(path).result()

    # a sampler save without a bundle leaves nothing, record included: its name is free again
    sampler = tc.save_weights_for_sampler("quick").result().path
    assert _cli(server.url, ALICE, "checkpoint", "delete", "-y", sampler, cwd=tmp_path).returncode == 0
    assert _call(server, "GET", _one(sampler) + "/external_weights_urls").status_code == 404
    assert tc.save_weights_for_sampler("quick").result().path == sampler


def test_publishing_is_not_served(server: Server, tmp_path: Path) -> None:
    from tinker import BadRequestError

    _tc, path, _ops = _trained(server, "public", steps=1)
    before = _volume(server.out)
    why = ("publishing checkpoints is not served: a checkpoint is its API key's alone (another key gets 404); share "
           "its export bundle, or download it with `tinker checkpoint download`")
    rest = _rest(server)
    for call in (rest.publish_checkpoint_from_tinker_path, rest.unpublish_checkpoint_from_tinker_path):
        with pytest.raises(BadRequestError) as refused:
            call(path).result()
        assert refused.value.status_code == 400 and why in str(refused.value)
    done = _cli(server.url, ALICE, "checkpoint", "publish", path, cwd=tmp_path)
    assert done.returncode == 1 and why in done.stderr
    assert _volume(server.out) == before


def test_another_key_gets_404_for_every_checkpoint_route(server: Server) -> None:
    from tinker import NotFoundError

    tc, path, _ops = _trained(server, "alices", steps=1)
    ext = tc.save_weights_external("alices-ext").result().path
    m = tc.model_id
    before = _volume(server.out)
    routes = [("GET", f"training_runs/{m}", {}), ("GET", f"training_runs/{m}/checkpoints", {}),
              ("GET", _one(ext) + "/external_weights_urls", {}),
              ("PUT", _one(path) + "/ttl", {"json": {"ttl_seconds": 7200}}),
              ("PUT", _one(ext) + "/ttl", {"json": {"ttl_seconds": None}}),
              ("POST", _one(path) + "/publish", {}), ("DELETE", _one(path) + "/publish", {}),
              ("DELETE", _one(path), {}), ("DELETE", _one(ext), {}),
              ("POST", "weights_info", {"json": {"tinker_path": path}}),
              ("POST", "save_weights_external", {"json": {"model_id": m, "path": "bobs"}})]
    for method, route, kw in routes:
        r = _call(server, method, route, BOB, **kw)
        assert r.status_code == 404 and r.json()["detail"].endswith(" not found"), (route, r.text)
    with pytest.raises(NotFoundError):
        _rest(server, BOB).get_external_weights_urls(ext).result()
    assert _volume(server.out) == before
    assert _rest(server).get_training_run(m).result().lora_rank == 4  # Alice still sees hers


# --- with recipients and a clock -------------------------------------------------------------------


def test_the_cli_download_of_confidential_weights_keeps_the_bundles_names(clocked: Any, owner: Any,
                                                                            tmp_path: Path) -> None:
    tc, path, ops = _trained(clocked, "secret")
    saved = Path(clocked.svc.store.checkpoint(path).bundle)
    done = _cli(clocked.url, ALICE, "checkpoint", "download", path, "--output", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = tmp_path / path.removeprefix("tinker://").replace("/", "_")
    files = _files(got)
    assert sorted(files) == sorted(_files(saved))  # the names the bundle gives them (age ciphertext as it is)
    assert all(files[n].startswith(b"age-encryption.org/v1\n") for n in files if "adapter_model" in n)
    key = tmp_path / "owner.key"
    key.write_text(str(owner) + "\n")
    code, checks = _verify_dir(clocked, got, "--identity", str(key))
    assert code == 0 and checks["confidential.plaintext"]["status"] == "pass"
    assert [c.kind for c in clocked.svc.store.checkpoints(tc.model_id)] == ["training"]  # the export went


def test_an_expired_url_is_gone_and_a_fresh_one_works(clock: Any) -> None:
    from app.api.proof.external import External

    tc, _path, _ops = _trained(clock, "clocked-urls", steps=1)
    ext = tc.save_weights_external("soon").result().path
    urls = _rest(clock).get_external_weights_urls(ext).result()
    name, url = next(iter(sorted(urls.urls.items())))
    t0 = time.time()
    clock.svc.storage.clock = lambda: t0 + 901
    r = httpx.get(url, timeout=60)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(urls.expires.timestamp()))
    assert (r.status_code, r.json()["detail"]) == (410, f"this download URL expired at {when}: ask for new ones "
                                                        "(get_external_weights_urls)")
    fresh = _rest(clock).get_external_weights_urls(ext).result().urls[name]
    assert httpx.get(fresh, timeout=60).status_code == 200

    # signed by another server (or this one before a restart: the key lives in memory only)
    c = clock.svc.store.checkpoint(ext)
    foreign = External(clock.svc).urls(c, clock.url).urls[name]
    r = httpx.get(foreign, timeout=60)
    assert (r.status_code, r.json()["detail"]) == (403, REFUSED)


def test_an_external_export_expires_with_its_ttl_and_is_swept(clock: Any) -> None:
    tc, path, _ops = _trained(clock, "ttl-source", steps=1)
    ext = tc.save_weights_external("short", ttl_seconds=3600).result().path
    _rest(clock).set_checkpoint_ttl_from_tinker_path(path, 3600).result()  # the saved state expires too
    rec, state = clock.svc.store.checkpoint(ext), clock.svc.store.checkpoint(path)
    url = next(iter(_rest(clock).get_external_weights_urls(ext).result().urls.values()))
    used = clock.svc.store.saved_bytes()
    t0 = time.time()
    clock.svc.storage.clock = lambda: t0 + 3601
    gone = f"the export {ext} was deleted or expired: its files are gone; save it again"
    for r in (httpx.get(url, timeout=60), _call(clock, "GET", _one(ext) + "/external_weights_urls"),
              _call(clock, "PUT", _one(ext) + "/ttl", json={"ttl_seconds": 7200})):
        assert (r.status_code, r.json()["detail"]) == (410, gone)
    with pytest.raises(Exception, match=f"checkpoint {path} expired at "):
        _client(clock).create_training_client_from_state(path).result()
    assert sorted(clock.svc.storage.sweep()) == sorted([ext, path])
    assert not Path(rec.bundle).exists()  # an export goes with its expiry, bundle included
    assert not Path(state.dir).exists() and Path(state.bundle).is_dir()  # a save's sealed state only: its bundle stays
    assert clock.svc.store.saved_bytes() == used - rec.state_bytes - state.state_bytes


def test_a_version_4_database_keeps_its_checkpoints_and_takes_external_ones(tmp_path: Path) -> None:
    from app.api.proof.store import Checkpoint, Store
    from app.state import RunDB

    db = RunDB(tmp_path)
    db.conn.execute("DROP TABLE api_checkpoints")  # as m003 and m004 made it
    db.conn.execute("CREATE TABLE api_checkpoints (path TEXT PRIMARY KEY, owner TEXT NOT NULL, model_id TEXT NOT "
                    "NULL, kind TEXT NOT NULL CHECK (kind IN ('training','sampler')), name TEXT NOT NULL, dir TEXT NOT "
                    "NULL, bundle TEXT, op_head TEXT NOT NULL, ops INTEGER NOT NULL, lora TEXT NOT NULL, created_at "
                    "TEXT NOT NULL, expires_at TEXT, removed_at TEXT, state_bytes INTEGER NOT NULL DEFAULT 0, "
                    "bundle_bytes INTEGER NOT NULL DEFAULT 0)")
    row = ("tinker://m/weights/a", "o", "m", "training", "a", "/d", "/b", "h", 3, "{}", "2026-01-01T00:00:00Z",
           None, None, 10, 20)
    db.conn.execute(f"INSERT INTO api_checkpoints VALUES ({', '.join('?' * len(row))})", row)
    db.conn.execute("PRAGMA user_version = 4")
    db.close()
    store = Store(tmp_path)
    try:
        assert store.conn.execute("SELECT * FROM api_checkpoints").fetchall() == [row]
        store.add_checkpoint(Checkpoint("tinker://m/external_weights/e", "o", "m", "external", "e", "/b2", "/b2", "h",
                                        3, {}, "2026-01-02T00:00:00Z", state_bytes=5))
        assert store.checkpoint("tinker://m/external_weights/e").kind == "external"
        with pytest.raises(sqlite3.IntegrityError):
            store.add_checkpoint(Checkpoint("tinker://m/x/e", "o", "m", "other", "e", "/c", None, "h", 3, {}, "t"))
    finally:
        store.close()
