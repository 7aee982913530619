"""The training API's saved states are sealed to the app (app/api/proof/vault.py): never plaintext on the output volume.

First the vault alone (what a state is sealed to, the sampler path, the RAM directory refused as a nightly run
refuses it), then a real ``cvm-tune api serve`` driven by the unmodified ``tinker`` SDK (CPU, the tiny model): no
tensor bytes of a saved state anywhere on the volume outside ``exports/``, a restarted server opens its states and
training continues with the same losses, sampling after a restart, and every way a state fails to open (changed,
cut, another key, another record's, plaintext) fails the future with its reason and changes nothing.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.api.errors import BadRequest
from app.api.proof.store import Checkpoint
from app.api.proof.vault import GETKEY_PATH, KEY_PURPOSE, LEGACY, SEALED, Vault, open_vault
from app.config import Config
from app.errors import ConfigError
from tests.api_drive import Server, _steps
from tests.test_api import ALICE, BASE, BOB, _client, _datums, close_clients, serving  # noqa: F401  (the fixture)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # the SDK's deprecation notes (load_state, …)
KEY = bytes(range(32))
FILES = ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "progress.json")


def _record(root: Path, **change: Any) -> Checkpoint:
    c = Checkpoint("tinker://s:train:0/weights/a", "ab" * 32, "s:train:0", "training", "a", str(root / "c1"), None,
                   "cd" * 32, 7, {"rank": 4, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True},
                   "2026-11-26T00:00:00Z")
    return dataclasses.replace(c, **change)


def _sealed_vault(tmp_path: Path) -> tuple[Vault, Checkpoint, dict[str, bytes]]:
    vault = Vault(tmp_path / "out" / "api" / "checkpoints", tmp_path / "ram", KEY)
    plain = {name: os.urandom(300) for name in FILES}
    c = _record(vault.root)
    with vault.plain() as ram:
        ram.mkdir()
        for name, data in plain.items():
            (ram / name).write_bytes(data)
        vault.seal(ram, c)
    return vault, c, plain


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_sealed_state_opens_only_under_its_key_and_its_record(tmp_path: Path) -> None:
    vault, c, plain = _sealed_vault(tmp_path)
    assert sorted(_tree(Path(c.dir))) == ["0000.enc", "0001.enc", "0002.enc", "0003.enc", "manifest.enc"]
    assert not [n for n, b in _tree(tmp_path / "out").items() for p in plain.values() if p[100:132] in b]
    assert not vault.ram.exists()  # the plaintext the engine saved is gone from RAM
    with vault.opened(c) as src:
        assert {n: (src / n).read_bytes() for n in FILES} == plain
    assert not vault.ram.exists()
    refusals = {  # the record in state/runs.sqlite edited, or the state opened by another app
        "sealed for other inputs (owner differ)": (vault, _record(vault.root, owner="ef" * 32)),
        "sealed for other inputs (op_head differ)": (vault, _record(vault.root, op_head="00" * 32)),
        "sealed for other inputs (path differ)": (vault, _record(vault.root, path="tinker://s:train:0/weights/b")),
        "manifest.enc belongs to another file or step": (vault, _record(vault.root, ops=8)),
        "sealed with another key (other app id)": (Vault(vault.root, tmp_path / "ram2", b"\x07" * 32), c),
    }
    before = _tree(tmp_path / "out")
    for reason, (v, record) in refusals.items():
        with pytest.raises(BadRequest) as exc:
            with v.opened(record):
                pass
        assert str(exc.value) == f"saved state {record.path} cannot be opened: {reason}; {SEALED}"
        assert not v.ram.exists()
    assert _tree(tmp_path / "out") == before  # a refusal removes nothing


def test_a_plaintext_or_missing_state_is_refused_with_the_reason(tmp_path: Path) -> None:
    vault, c, plain = _sealed_vault(tmp_path)
    shutil.rmtree(c.dir)
    with pytest.raises(BadRequest) as exc:
        with vault.opened(c):
            pass
    assert str(exc.value) == f"saved state {c.path} cannot be opened: its directory is missing from the output volume"
    Path(c.dir).mkdir()  # what an older version wrote (or what someone who can write the volume plants)
    for name, data in plain.items():
        (Path(c.dir) / name).write_bytes(data)
    with pytest.raises(BadRequest) as exc:
        with vault.opened(c):
            pass
    assert str(exc.value) == f"saved state {c.path} is refused: {LEGACY}"
    assert _tree(Path(c.dir)) == plain and not vault.ram.exists()  # refused, not removed


def test_a_sampler_path_is_stable_and_not_decrypted_while_the_engine_holds_it(tmp_path: Path) -> None:
    vault, c, plain = _sealed_vault(tmp_path)
    seen = []
    with vault.sampler(c, lambda key: seen.append(key) or False) as src:
        assert (src / "adapter_model.safetensors").read_bytes() == plain["adapter_model.safetensors"]
    assert not src.exists() and seen == [str(src)]
    (Path(c.dir) / "0001.enc").write_bytes(b"changed")  # not read while the engine holds the adapter
    with vault.sampler(c, lambda key: True) as again:
        assert again == src and not again.exists()
    with pytest.raises(BadRequest, match="cannot be opened: corrupt"):
        with vault.sampler(c, lambda key: False):
            pass
    assert not vault.ram.exists()


def test_no_ram_directory_or_no_guest_agent_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = Config.model_validate({"output": {"dir": str(out), "scratch_dir": str(tmp_path)}})  # a disk, not RAM
    with pytest.raises(ConfigError, match=f"output.scratch_dir {tmp_path} is on a .* file system, not in RAM"):
        open_vault(cfg, out, agent=None)
    missing = Config.model_validate({"output": {"dir": str(out), "scratch_dir": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="does not exist"):
        open_vault(missing, out, agent=None)
    with pytest.raises(ConfigError, match="no guest agent to derive the key of its saved states with"):
        open_vault(Config(), out, agent=None)
    assert not out.exists()


# --- a real server --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server whose system temporary directory is a private one (searched for plaintext like the volume)."""
    from tests.test_api import LIMITS

    tmp = tmp_path_factory.mktemp("sealed")
    (tmp / "tmpdir").mkdir()
    srv = Server(tmp, LIMITS, keys=(ALICE, BOB), env={"TMPDIR": str(tmp / "tmpdir")})
    srv.tmpdir = tmp / "tmpdir"  # type: ignore[attr-defined]
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def saved(server: Server) -> dict[str, Any]:
    """Alice trains 6 steps, saves her state and sampler weights, then trains 2 more (the losses a load repeats)."""
    tc = _client(server).create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    datums = _datums(server)
    _steps(tc, datums, 6, [])
    state = tc.save_state("s6").result().path
    sampler = tc.save_weights_for_sampler("w6").result().path
    return {"state": state, "sampler": sampler, "after": _steps(tc, datums, 2, []), "datums": datums}


def _key(path: str = GETKEY_PATH, purpose: str = KEY_PURPOSE) -> bytes:
    """The key the server derives: the simulator's GetKey is the same for the same app."""
    from app.config import TeeSettings
    from app.dataset import DerivedKeySource
    from app.tee import open_guest_agent

    with open_guest_agent(TeeSettings(mode="embedded-simulator")) as agent:
        return DerivedKeySource(agent.get_key, path, purpose).dataset_key()


def _decrypt(c: Checkpoint, at: Path) -> Path:
    """The test's own plaintext copy of ``c`` (in its tmp_path, never on the server's volume)."""
    vault = Vault(at.parent / "vault-root", at.parent / "vault-ram", _key())
    with vault.opened(c) as src:
        shutil.copytree(src, at)
    return at


def _records(out: Path) -> dict[str, Checkpoint]:
    db = sqlite3.connect(f"file:{out / 'state' / 'runs.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT path, owner, model_id, kind, name, dir, bundle, op_head, ops, lora, created_at"
                          " FROM api_checkpoints").fetchall()
    finally:
        db.close()
    return {r[0]: Checkpoint(*r[:9], json.loads(r[9]), r[10]) for r in rows}


def _models(out: Path) -> int:
    db = sqlite3.connect(f"file:{out / 'state' / 'runs.sqlite'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT COUNT(*) FROM api_models").fetchone()[0]
    finally:
        db.close()


def _ram(out: Path) -> Path:
    from app.run.inputs import scratch_dir

    ram = scratch_dir(Config(), out.resolve())
    return ram.with_name(ram.name + "-api")


def _windows(data: bytes) -> list[bytes]:
    """A 32-byte window from the middle of a tensor's bytes (none for a small or all-zero one)."""
    mid = len(data) // 2
    return [data[mid:mid + 32]] if len(data) >= 64 and data[mid:mid + 32].strip(b"\x00") else []


def _needles(plain: Path) -> list[bytes]:
    """Windows of every LoRA tensor and every optimizer state tensor of a decrypted state."""
    import torch
    from safetensors.torch import load_file

    out = [w for name, t in load_file(str(plain / "adapter_model.safetensors")).items() if "lora_" in name
           for w in _windows(t.numpy().tobytes())]
    if (plain / "optimizer.pt").is_file():
        opt = torch.load(io.BytesIO((plain / "optimizer.pt").read_bytes()), weights_only=True)
        out += [w for s in opt["state"].values() for t in s.values() if t.dim() > 0 for w in _windows(t.numpy().tobytes())]
    return out


def test_saved_states_leave_no_tensor_bytes_on_the_volume_outside_exports(server: Server, saved: dict[str, Any],
                                                                          tmp_path: Path) -> None:
    records = _records(server.out)
    needles: list[bytes] = []
    for i, path in enumerate((saved["state"], saved["sampler"])):
        # every byte sealed, beside the plaintext record of the key epochs it is sealed under (app.keys_epoch)
        assert all(n.endswith(".enc") or n == "key-epochs.json" for n in _tree(Path(records[path].dir)))
        needles += _needles(_decrypt(records[path], tmp_path / f"plain{i}"))
    assert len(needles) > 20
    files = _tree(server.out)
    outside = {p: b for p, b in files.items() if not p.startswith("exports/")}
    assert not [p for p, b in outside.items() if any(n in b for n in needles)]
    # the search finds them where they are in the clear: the attested export bundle's adapter (app/api/proof/bundle.py)
    assert any(n in b for p, b in files.items() if p.startswith("exports/") for n in needles)
    assert not _ram(server.out).exists()  # and none left in RAM
    # nor in the system temporary directory the server was given, nor in any RAM directory of this volume
    ram = _ram(server.out)
    mine = [d for d in ram.parent.iterdir() if d.name.startswith(ram.name.removesuffix("-api"))]
    elsewhere = [*_tree(server.tmpdir).items(), *(kv for d in mine for kv in _tree(d).items())]  # type: ignore[attr-defined]
    assert not [p for p, b in elsewhere if any(n in b for n in needles)]
    nightly = Vault(tmp_path / "root", tmp_path / "ram", _key("cvm-tune/checkpoints/v1", "cvm-tune-checkpoint-key"))
    with pytest.raises(BadRequest, match="sealed with another key"):  # a key of its own, not the nightly one's
        with nightly.opened(records[saved["state"]]):
            pass


def test_a_restarted_server_opens_its_states_and_training_continues_with_the_same_losses(
        server: Server, saved: dict[str, Any]) -> None:
    ram = _ram(server.out)
    server.stop()
    assert not ram.exists()  # only there while an operation runs
    ram.mkdir(mode=0o700)
    (ram / "left-by-kill-9").write_bytes(b"plaintext of an operation that was running")
    server.start()
    assert not ram.exists()  # removed at start
    tc = _client(server).create_training_client_from_state_with_optimizer(saved["state"]).result()
    assert _steps(tc, saved["datums"], 2, []) == pytest.approx(saved["after"], rel=1e-6)
    assert not ram.exists()


def test_sampling_from_saved_weights_after_a_restart_decrypts_them_once(server: Server, saved: dict[str, Any]) -> None:
    from tinker import types

    sc = _client(server)
    sampler = sc.create_sampling_client(model_path=saved["sampler"]).result()
    prompt = types.ModelInput.from_ints(saved["datums"][0].model_input.to_ints())
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3)

    def sample(client: Any) -> Any:
        return client.sample(prompt=prompt, num_samples=2, sampling_params=params, include_prompt_logprobs=True).result()

    first = sample(sampler)
    base = sample(sc.create_sampling_client(base_model=BASE).result())
    assert len(first.sequences) == 2 and sum(first.prompt_logprobs[1:]) > sum(base.prompt_logprobs[1:]) + 10
    sealed = Path(_records(server.out)[saved["sampler"]].dir)
    away = sealed.with_name(sealed.name + ".away")
    sealed.rename(away)  # the engine holds the adapter: the next sample reads nothing from the volume
    try:
        again = sample(sampler)
    finally:
        away.rename(sealed)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    assert not _ram(server.out).exists()


def _volume(out: Path) -> dict[str, bytes]:
    """Every file of the output volume but the database (where each operation is recorded)."""
    return {p: b for p, b in _tree(out).items() if not p.startswith("state/runs.sqlite")}


def _flip(d: Path, _ctx: dict[str, Any]) -> None:
    blob = d / "0001.enc"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))


def _cut(d: Path, _ctx: dict[str, Any]) -> None:
    blob = max(d.glob("*.enc"), key=lambda p: p.stat().st_size)  # the largest sealed file: a tensor file
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])


def _replace(d: Path, files: dict[str, bytes]) -> None:
    shutil.rmtree(d)
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)


def _other_key(d: Path, ctx: dict[str, Any]) -> None:
    other = Vault(ctx["tmp"] / "other", ctx["tmp"] / "ram-other", b"\x07" * 32)  # another app's key, same record
    c = dataclasses.replace(ctx["record"], dir=str(other.root / d.name))
    other.seal(ctx["plain"], c)
    _replace(d, _tree(Path(c.dir)))


DAMAGE: dict[str, tuple[Callable[[Path, dict[str, Any]], None], str]] = {
    "a changed byte": (_flip, "cannot be opened: corrupt (failed authentication); " + SEALED),
    "cut short": (_cut, "cannot be opened: corrupt (failed authentication); " + SEALED),
    "another key": (_other_key, "cannot be opened: sealed with another key (other app id); " + SEALED),
    "another record's": (lambda d, ctx: _replace(d, _tree(Path(ctx["sampler"].dir))),
                         "cannot be opened: sealed for other inputs (dir, kind, path differ); " + SEALED),
    "plaintext": (lambda d, ctx: _replace(d, _tree(ctx["plain"])), "is refused: " + LEGACY),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_state_that_does_not_open_fails_its_future_with_the_reason_and_changes_nothing(
        server: Server, saved: dict[str, Any], tmp_path: Path, damage: str) -> None:
    import tinker
    from tinker.types import RequestErrorCategory

    records, path, datums = _records(server.out), saved["state"], saved["datums"]
    sealed = Path(records[path].dir)
    ctx = {"tmp": tmp_path, "record": records[path], "sampler": records[saved["sampler"]],
           "plain": _decrypt(records[path], tmp_path / "plain")}
    sc, bob = _client(server), _client(server, BOB).create_lora_training_client(base_model=BASE, rank=4).result()
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    tc.load_state(path).result()
    loss = tc.forward(datums, "cross_entropy").result().metrics["loss:sum"]
    shutil.copytree(sealed, tmp_path / "kept")
    DAMAGE[damage][0](sealed, ctx)
    volume, models = _volume(server.out), _models(server.out)

    for load in (lambda: tc.load_state_with_optimizer(path), lambda: sc.create_training_client_from_state(path)):
        with pytest.raises(tinker.RequestFailedError) as exc:
            load().result()
        assert exc.value.category == RequestErrorCategory.User
        assert exc.value.message.startswith(f"Request failed: saved state {path} {DAMAGE[damage][1]} for "), exc.value
    assert _volume(server.out) == volume  # nothing written, nothing removed (the damaged state neither)
    assert _models(server.out) == models and not _ram(server.out).exists()
    assert tc.forward(datums, "cross_entropy").result().metrics["loss:sum"] == loss  # the model is as it was
    assert bob.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"] > 0  # others keep training

    shutil.rmtree(sealed)
    shutil.copytree(tmp_path / "kept", sealed)
    tc.load_state_with_optimizer(path).result()  # the state itself was not lost


def test_a_save_whose_record_does_not_commit_leaves_no_state_and_no_bundle(server: Server, saved: dict[str, Any]) -> None:
    """The checkpoint's row fails to commit after the state was sealed and its bundle published (here a trigger in the
    server's own database aborts the insert, as a full or failing disk would): the future fails, and neither the sealed
    state nor the bundle stays (a bundle for a checkpoint the server does not have would be a claim nobody can load).
    The same save after the fault succeeds; the model was not changed."""
    import tinker

    records, datums = _records(server.out), saved["datums"]
    tc = _client(server).create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    tc.load_state(saved["state"]).result()
    loss = tc.forward(datums, "cross_entropy").result().metrics["loss:sum"]
    exports = sorted(p.name for p in (server.out / "exports").iterdir())
    sealed = sorted(p.name for p in Path(records[saved["state"]].dir).parent.iterdir())
    db = sqlite3.connect(server.out / "state" / "runs.sqlite", timeout=30)
    try:
        with db:
            db.execute("CREATE TRIGGER doomed BEFORE INSERT ON api_checkpoints WHEN NEW.name = 'doomed' "
                       "BEGIN SELECT RAISE(ABORT, 'disk I/O error (test)'); END")
        with pytest.raises(tinker.RequestFailedError):
            tc.save_state("doomed").result()
    finally:
        with db:
            db.execute("DROP TRIGGER IF EXISTS doomed")
        db.close()
    assert sorted(p.name for p in (server.out / "exports").iterdir()) == exports  # nothing published, nothing half-gone
    assert sorted(p.name for p in Path(records[saved["state"]].dir).parent.iterdir()) == sealed
    assert _records(server.out) == records and not _ram(server.out).exists()
    assert tc.forward(datums, "cross_entropy").result().metrics["loss:sum"] == loss
    path = tc.save_state("doomed").result().path  # the name was not taken by the failed save
    assert Path(str(_records(server.out)[path].bundle)).is_dir()
