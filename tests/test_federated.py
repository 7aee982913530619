"""Attested federated rounds on Flower's simulation engine: three data owners' CVMs (embedded simulators, their own
owner-signed encrypted datasets, the tiny model), two rounds, one client replaying its round-1 bundle in round 2;
the aggregator excludes it with the reason recorded, and the final round bundle verifies recursively (API and CLI).
The unit tests below check the admission gate and the round verifier against tampering without running Flower."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from attestation.bundle import manifest as B
from attestation.rounds import manifest as R
from attestation.policy import simulator_policy
from attestation.rounds.verify import verify_round
from tests.owner_fixtures import KEY, encrypt_to, jsonl, owner_key

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = [json.loads(line) for line in (ROOT / "app" / "data" / "sample.jsonl").read_text().splitlines() if line.strip()]
CLIENTS = ("clinic-a", "clinic-b", "clinic-c")
REPLAYER = "clinic-c"
NOW = 2_000_000_000


def _sim() -> Any:
    from app.simulator import GuestAgentSimulator

    return GuestAgentSimulator()


def _policy() -> Any:
    return simulator_policy(_sim().test_root_ca_der)


def _owner(i: int) -> Any:
    return owner_key(bytes([0x50 + i]) * 32)


def _pub(i: int) -> str:
    return _owner(i).public_key().public_bytes_raw().hex()


def _client_config(root: Path, i: int, name: str) -> Path:
    """One data owner's CVM: its own signed, encrypted dataset and output volume."""
    d = root / name
    (d / "data").mkdir(parents=True)
    rows = SAMPLE[i * 12:(i + 1) * 12 + 4 * i]  # different sizes: different weights
    encrypt_to(d / "data" / "set-v1.cvmds", jsonl(rows), signer=_owner(i), dataset_id=f"set-{name}", dataset_version=1)
    (d / "dataset.key").write_bytes(KEY)
    (d / "dataset.key").chmod(0o600)
    cfg = {"output": {"dir": str(d / "out")},
           "dataset": {"source": "encrypted-file", "path": str(d / "data"), "dataset_id": f"set-{name}",
                       "owner_public_key": _pub(i), "key": {"source": "file", "file": str(d / "dataset.key")}},
           "training": {"max_steps": 2, "save_steps": 2},
           "alerts": {"webhook_url_env": "CVM_TUNE_TEST_NO_WEBHOOK"},
           "federation": {"client_name": name, "aggregator_compose_hashes": [_sim().compose_hash.hex()]}}
    path = d / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _server_config(root: Path, **federation: Any) -> Path:
    cfg = {"output": {"dir": str(root / "aggregator")},
           "alerts": {"webhook_url_env": "CVM_TUNE_TEST_NO_WEBHOOK"},
           "federation": {"rounds": 2, "min_clients": 2, "strategy": "fedavg",
                          "client_compose_hashes": [_sim().compose_hash.hex()],
                          "clients": {n: {"owner_public_keys": [_pub(i)]} for i, n in enumerate(CLIENTS)},
                          **federation}}
    path = root / "aggregator.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class ConfigByPartition:
    """Simulation: SuperNode partition i is data owner i (picklable for Ray's actors)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __call__(self, context: Any) -> Path:
        return self.paths[int(context.node_config["partition-id"])]


class ReplayingClient:
    """A malicious client: honest in round 1, then resends its round-1 bundle instead of training."""

    def __init__(self, paths: list[Path], replayer: int) -> None:
        self.paths, self.replayer = paths, replayer

    def __call__(self, msg: Any, context: Any) -> Any:
        from app.federated.client_app import reply_for, train_round

        i = int(context.node_config["partition-id"])
        if i == self.replayer and int(msg.content["config"]["server-round"]) > 1:
            old = sorted((self.paths[i].parent / "out" / "exports").glob("fed-r1-*"))[0]
            return reply_for(msg, CLIENTS[i], old)
        return train_round(msg, self.paths[i])


def _run_simulation(server_cfg: Path, client_cfgs: list[Path]) -> None:
    from flwr.clientapp import ClientApp
    from flwr.simulation import run_simulation

    from app.federated.server_app import make_server_app

    client = ClientApp()
    client.train()(ReplayingClient(client_cfgs, CLIENTS.index(REPLAYER)))
    pythonpath = os.environ.get("PYTHONPATH")  # Flower's ray backend sets it to this process's sys.path
    try:
        run_simulation(server_app=make_server_app(server_cfg), client_app=client, num_supernodes=len(client_cfgs),
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": 2, "include_dashboard": False}})
    finally:  # later tests' subprocesses (a fresh venv among them) must not inherit this venv's site-packages
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath


class _Shown(logging.Handler):
    """The records Flower's logger lets through to its console (what `flwr run` shows of the ServerApp)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


SHOWN = _Shown()


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (requirements/test.txt)")
    root = tmp_path_factory.mktemp("fed")
    clients = [_client_config(root, i, n) for i, n in enumerate(CLIENTS)]
    logging.getLogger("flwr").addHandler(SHOWN)
    try:
        _run_simulation(_server_config(root), clients)
    finally:
        logging.getLogger("flwr").removeHandler(SHOWN)
    return root


def test_the_server_app_shows_a_line_per_round_instead_of_flower_s_banners(federation: Path) -> None:
    """Flower's strategy banner and per-round progress (INFO, ~40 lines) give way to one line per round: where its
    bundle went and how many client bundles it admitted and rejected."""
    r1, r2 = (p.resolve() for p in _rounds(federation))
    ours = [f"INFO round 1: 3 admitted, 0 rejected: {r1}", f"INFO round 2: 2 admitted, 1 rejected: {r2}"]
    assert [line for line in SHOWN.lines if line.startswith("INFO")] == ours
    assert not any("fraction_evaluate" in line for line in SHOWN.lines)


def _rounds(root: Path) -> list[Path]:
    return sorted((root / "aggregator" / "rounds").glob("*/round-*"))


def test_two_rounds_replay_excluded_and_round_bundle_verifies_recursively(federation: Path) -> None:
    rounds = _rounds(federation)
    assert [p.name for p in rounds] == ["round-0001", "round-0002"]
    m1, m2 = (json.loads((p / R.ROUND_MANIFEST).read_bytes()) for p in rounds)
    assert sorted(a["client"] for a in m1["admitted"]) == list(CLIENTS) and m1["rejected"] == []
    assert m1["global_adapter_in_sha256"] is None
    # round 2: the replayed round-1 bundle is excluded, with the reason recorded; the round completes with two
    assert sorted(a["client"] for a in m2["admitted"]) == ["clinic-a", "clinic-b"]
    assert [(r["client"], "replayed or stale" in r["reason"]) for r in m2["rejected"]] == [(REPLAYER, True)]
    assert m2["global_adapter_in_sha256"] == m1["global_adapter_sha256"]
    assert m2["previous_round_sha256"] == hashlib.sha256((rounds[0] / R.ROUND_MANIFEST).read_bytes()).hexdigest()
    tokens = {a["client"]: a["trainable_tokens"] for a in m2["admitted"]}
    assert tokens["clinic-a"] != tokens["clinic-b"]  # weighted by each owner's verified trainable tokens
    for p in rounds:
        verdict = verify_round(p, policy=_policy(), now=NOW)
        assert verdict.accepted, [(c.name, c.detail) for c in verdict.failed]
        names = {c.name: c.status for c in verdict.checks}
        assert names["round.aggregate"] == "pass" and names["report_data"] == "pass"
        assert all(names[f"client.{a['client']}"] == "pass" for a in json.loads((p / R.ROUND_MANIFEST).read_bytes())["admitted"])
    # every client bundle records the round it trained for
    for a in m2["admitted"]:
        fed = json.loads((rounds[1] / "clients" / a["client"] / B.MANIFEST).read_bytes())["federation"]
        assert (fed["round"], fed["nonce"], fed["global_adapter_sha256"]) == (2, m2["nonce"], m1["global_adapter_sha256"])


def test_cli_verifies_a_round_bundle(federation: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    policy = tmp_path / "policy.yaml"
    policy.write_text(_policy().to_yaml())
    last = _rounds(federation)[-1]
    assert main(["verify", str(last), "--policy", str(policy), "--now", str(NOW)]) == 0
    assert "ACCEPTED" in capsys.readouterr().out
    assert main(["verify", str(last), "--now", str(NOW)]) == 1  # the default policy trusts Intel's root only
    first = _rounds(federation)[0]
    capsys.readouterr()
    assert main(["verify", str(last), "--parent", str(first), "--policy", str(policy), "--now", str(NOW)]) == 0
    assert "link: this round continued the previous one" in capsys.readouterr().out
    assert main(["verify", str(first), "--parent", str(last), "--policy", str(policy), "--now", str(NOW)]) == 1
    assert "link: BROKEN: previous_round_sha256" in capsys.readouterr().out


def _copy(federation: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "round"
    shutil.copytree(_rounds(federation)[-1], dst)
    return dst


def _failed(p: Path) -> set[str]:
    return {c.name for c in verify_round(p, policy=_policy(), now=NOW).failed}


def test_tampered_global_adapter_is_rejected(federation: Path, tmp_path: Path) -> None:
    p = _copy(federation, tmp_path)
    raw = bytearray((p / R.GLOBAL_ADAPTER).read_bytes())
    raw[-1] ^= 1
    (p / R.GLOBAL_ADAPTER).write_bytes(bytes(raw))
    assert {"round.file_hashes", "round.aggregate"} <= _failed(p)


def test_swapped_client_bundle_is_rejected(federation: Path, tmp_path: Path) -> None:
    """A client bundle from round 1 put in place of its round-2 bundle: hashes and round terms fail."""
    p = _copy(federation, tmp_path)
    shutil.rmtree(p / "clients" / "clinic-a")
    shutil.copytree(_rounds(federation)[0] / "clients" / "clinic-a", p / "clients" / "clinic-a")
    assert {"client.clinic-a", "round.aggregate"} <= _failed(p)


def test_edited_round_manifest_breaks_the_quote_binding(federation: Path, tmp_path: Path) -> None:
    p = _copy(federation, tmp_path)
    doc = json.loads((p / R.ROUND_MANIFEST).read_bytes())
    doc["rejected"] = []  # hide the rejection
    (p / R.ROUND_MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    assert "report_data" in _failed(p)


def test_admission_rejects_other_compose_owner_and_mismatched_adapter(federation: Path, tmp_path: Path) -> None:
    """The gate on a real client bundle: compose-hash not allowed, dataset of another owner, adapter weights that
    are not the bundle's, a round it was not trained for, an unknown name, a second bundle, a dropped client."""
    import numpy as np
    from flwr.app import (
        Array,
        ArrayRecord,
        ConfigRecord,
        Error,
        Message,
        MessageType,
        Metadata,
        MetricRecord,
        RecordDict,
    )

    from app.config import load_config
    from app.federated.admission import Admission, Admitted, Rejected, RoundTerms
    from app.federated.transport import pack_bundle, safetensors_to_arrays

    last = _rounds(federation)[-1]
    m2 = json.loads((last / R.ROUND_MANIFEST).read_bytes())
    bundle = last / "clients" / "clinic-a"
    terms = RoundTerms(2, m2["nonce"], m2["global_adapter_in_sha256"], 0.0)
    fed = load_config(_server_config(tmp_path)).federation

    def reply(arrays: Any, client: str = "clinic-a") -> Any:
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"trainable-tokens": 10**9}),
                              "bundle": ConfigRecord({"client": client, "tar": pack_bundle(bundle)})})
        meta = Metadata(run_id=1, message_id="", src_node_id=7, dst_node_id=0, reply_to_message_id="r",
                        group_id="", created_at=0.0, ttl=60.0, message_type=MessageType.TRAIN)  # a node's reply
        return Message(content=content, metadata=meta)

    good = safetensors_to_arrays(bundle / B.ADAPTER_FILES[1])
    gate = Admission(fed, _policy(), tmp_path / "w1")
    ok = gate.check(reply(good), terms, set())
    listed = {a["client"]: a["trainable_tokens"] for a in m2["admitted"]}
    assert isinstance(ok, Admitted) and ok.trainable_tokens == listed["clinic-a"] != 10**9  # the manifest's count
    assert ok.quote_sha256 == R.quote_identity((bundle / B.QUOTE_BIN).read_bytes())
    cases = {
        "compose-hash": (fed.model_copy(update={"client_compose_hashes": ("0" * 64,)}), reply(good), terms),
        "not signed by an owner key": (fed.model_copy(update={"clients": {"clinic-a": fed.clients["clinic-b"]}}),
                                       reply(good), terms),
        "do not match the bundle": (fed, reply(ArrayRecord({k: Array(np.zeros_like(v.numpy())) for k, v in good.items()})),
                                    terms),
        "replayed or stale": (fed, reply(good), RoundTerms(3, "ab" * 32, terms.global_adapter_sha256, 0.0)),
        "not in federation.clients": (fed, reply(good, client="mallory"), terms),
        # clinic-b listing clinic-a's owner key does not let a reply pass clinic-a's bundle off as clinic-b's
        "attested config names 'clinic-a'": (fed.model_copy(update={"clients": {
            **fed.clients, "clinic-b": fed.clients["clinic-a"]}}), reply(good, client="clinic-b"), terms),
    }
    for i, (want, (settings, msg, t)) in enumerate(cases.items()):
        got = Admission(settings, _policy(), tmp_path / f"w{i + 2}").check(msg, t, set())
        assert isinstance(got, Rejected) and want in got.reason, (want, got)
    assert isinstance(gate.check(reply(good), terms, {"clinic-a"}), Rejected)  # one bundle per client and round
    # a client that dropped mid-round: Flower hands the aggregator an error reply in its place
    meta = Metadata(run_id=1, message_id="", src_node_id=9, dst_node_id=0, reply_to_message_id="r", group_id="",
                    created_at=0.0, ttl=60.0, message_type=MessageType.TRAIN)
    dropped = gate.check(Message(error=Error(code=0, reason="reply timed out"), metadata=meta), terms, set())
    assert isinstance(dropped, Rejected) and (dropped.node_id, dropped.reason) == (9, "the client failed: reply timed out")


def _message(content: Any = None, *, node: int = 7) -> Any:
    from flwr.app import Message, MessageType, Metadata

    meta = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0, reply_to_message_id="r", group_id="",
                    created_at=0.0, ttl=60.0, message_type=MessageType.TRAIN)
    return Message(content=content, metadata=meta)


def test_a_malformed_reply_is_rejected_with_its_reason_and_leaves_nothing(tmp_path: Path) -> None:
    """Whatever one client sends, admission records a rejection for it (and the round goes on with the others):
    a bundle that is not tar bytes or is a huge integer, no or an invalid client name, a tar without manifest.json,
    an Array whose npy bytes or dtype are bad, two ArrayRecords."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from app.config import load_config
    from app.federated.admission import Admission, Rejected, RoundTerms
    from app.federated.transport import pack_bundle

    fed = load_config(_server_config(tmp_path)).federation
    not_a_bundle = tmp_path / "not-a-bundle"
    not_a_bundle.mkdir()
    (not_a_bundle / "README.md").write_text("no manifest here")
    tar = pack_bundle(not_a_bundle)
    floats = ArrayRecord({"lora_A.weight": Array(np.ones((2, 2), np.float32))})
    bad_npy = ArrayRecord({"lora_A.weight": Array(dtype="float32", shape=(2, 2), stype="numpy.ndarray",
                                                  data=b"\x93NUMPY garbage")})
    ints = ArrayRecord({"lora_A.weight": Array(np.ones((2, 2), np.int64))})

    def content(bundle: dict[str, Any] | None, *arrays: Any) -> Any:
        records: dict[str, Any] = {f"arrays{i}": a for i, a in enumerate(arrays)}
        if bundle is not None:
            records["bundle"] = ConfigRecord(bundle)
        return RecordDict(records)

    cases = {
        "is a str, not tar bytes": content({"client": "clinic-a", "tar": "tar as text"}, floats),
        "is a int, not tar bytes": content({"client": "clinic-a", "tar": 1 << 62}, floats),  # never bytes(2**62)
        "no valid client name": content({"client": 7, "tar": tar}, floats),
        "no valid client name ": content({"client": "clinic-a\x00", "tar": tar}, floats),
        "no bundle or adapter weights": content(None, floats),
        "no bundle or adapter weights ": content({"client": "clinic-a", "tar": tar}, floats, floats),
        "cannot be decoded (ValueError)": content({"client": "clinic-a", "tar": tar}, bad_npy),
        "has dtype int64, not a float type": content({"client": "clinic-a", "tar": tar}, ints),
        "the bundle has no manifest.json": content({"client": "clinic-a", "tar": tar}, floats),
        "not a readable tar archive": content({"client": "clinic-a", "tar": b"not a tar" * 100}, floats),
    }
    gate = Admission(fed, _policy(), tmp_path / "work")
    terms = RoundTerms(1, "00" * 32, None, 0.0)
    for i, (want, c) in enumerate(cases.items()):
        got = gate.check(_message(c, node=i), terms, set())
        assert isinstance(got, Rejected) and got.node_id == i and want.strip() in got.reason, (want, got)
        assert got.client in ("", "clinic-a")
    assert [p for p in (tmp_path / "work").rglob("*") if p.is_file()] == []


def test_an_unexpected_failure_while_admitting_rejects_only_that_reply(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An error nobody foresaw (here the verifier running out of memory) is a recorded rejection, not a failed
    round, and the unpacked bundle is removed."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from app.config import load_config
    from app.federated import admission
    from app.federated.transport import pack_bundle

    def exhausted(*_a: Any, **_k: Any) -> Any:
        raise MemoryError("verifier out of memory")

    monkeypatch.setattr(admission, "verify_bundle", exhausted)
    src = tmp_path / "bundle"
    src.mkdir()
    (src / B.MANIFEST).write_text("{}")
    reply = RecordDict({"arrays": ArrayRecord({"w": Array(np.ones(2, np.float32))}),
                        "bundle": ConfigRecord({"client": "clinic-b", "tar": pack_bundle(src)})})
    gate = admission.Admission(load_config(_server_config(tmp_path)).federation, _policy(), tmp_path / "work")
    got = gate.check(_message(reply, node=3), admission.RoundTerms(1, "00" * 32, None, 0.0), set())
    assert got == admission.Rejected("clinic-b", 3, "its reply could not be checked (MemoryError: verifier out of "
                                     "memory)")
    assert [p for p in (tmp_path / "work").rglob("*") if p.is_file()] == []


def test_a_client_quote_is_identified_by_its_signed_region(federation: Path, tmp_path: Path) -> None:
    """The same quote with 70 more zero bytes verifies the same in a client bundle, so the round that lists it
    verifies too (a round names a quote by its signed region, never by the whole blob)."""
    p = _copy(federation, tmp_path)
    client = p / "clients" / "clinic-a"
    quote = (client / B.QUOTE_BIN).read_bytes() + b"\0" * 70
    (client / B.QUOTE_BIN).write_bytes(quote)
    (client / B.QUOTE_HEX).write_text(quote.hex() + "\n")
    verdict = verify_round(p, policy=_policy(), now=NOW)
    assert verdict.accepted, [(c.name, c.detail) for c in verdict.failed]
    (client / B.QUOTE_BIN).write_bytes(quote[:-71] + b"\1" + quote[-70:])  # a non-zero byte: another quote
    (client / B.QUOTE_HEX).write_text((quote[:-71] + b"\1" + quote[-70:]).hex() + "\n")
    assert "client.clinic-a" in _failed(p)


def test_an_empty_directory_in_a_round_bundle_is_rejected(federation: Path, tmp_path: Path) -> None:
    """As in an export bundle (where a client bundle's own check already refuses one)."""
    for where, check in (("empty", "round.files"), ("adapter/empty", "round.files"),
                         ("clients/clinic-a/empty", "client.clinic-a")):
        p = _copy(federation, tmp_path / where.replace("/", "-"))
        (p / where).mkdir()
        failed = {c.name: c.detail for c in verify_round(p, policy=_policy(), now=NOW).failed}
        assert f"unexpected directory {where.removeprefix('clients/clinic-a/')}/" in failed.get(check, ""), failed


@pytest.mark.parametrize("adapter", [R.GLOBAL_ADAPTER, f"clients/clinic-a/{B.ADAPTER_FILES[1]}"])
def test_a_damaged_safetensors_header_is_a_failed_check(federation: Path, tmp_path: Path, adapter: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """One flipped byte in a safetensors header: the round is rejected (exit 1), never a crash (exit 70)."""
    from app.cli import main

    p = _copy(federation, tmp_path)
    raw = bytearray((p / adapter).read_bytes())
    raw[8] ^= 0xFF  # the first byte of the JSON header
    (p / adapter).write_bytes(bytes(raw))
    assert "round.aggregate" in _failed(p)
    policy = tmp_path / "policy.yaml"
    policy.write_text(_policy().to_yaml())
    assert main(["verify", str(p), "--policy", str(policy), "--now", str(NOW)]) == 1
    assert "round.aggregate" in capsys.readouterr().out


def test_round_fails_below_min_clients_with_a_clear_reason(tmp_path: Path) -> None:
    """Fewer admitted bundles than federation.min_clients: RoundFailedError naming the rejections, no round bundle."""
    from app.config import load_config
    from app.errors import RoundFailedError
    from app.federated.admission import Rejected, RoundTerms
    from app.federated.strategy import AttestedStrategy, make_strategy

    cfg = load_config(_server_config(tmp_path, min_clients=3))
    inner, record = make_strategy(cfg.federation)

    class Gate:
        def check(self, msg: Any, terms: Any, admitted: set[str]) -> Rejected:
            return Rejected("clinic-a", 1, "bundle rejected: quote.signature: bad")

    s = AttestedStrategy(inner, record, Gate(), None, tmp_path / "rounds", "f", cfg.federation)  # type: ignore[arg-type]
    s.terms = RoundTerms(1, "00" * 32, None, 0.0)
    with pytest.raises(RoundFailedError, match=r"round 1: 0 client bundle\(s\) admitted, federation.min_clients is 3 "
                                               r"\(clinic-a: bundle rejected: quote.signature: bad\)"):
        s.aggregate_train(1, [object()])
    assert not (tmp_path / "rounds").exists()


def test_fedyogi_needs_an_initial_adapter(tmp_path: Path) -> None:
    from app.config import load_config
    from app.errors import ConfigError
    from app.federated.strategy import make_strategy

    with pytest.raises(ConfigError, match="fedyogi needs federation.initial_adapter"):
        make_strategy(load_config(_server_config(tmp_path, strategy="fedyogi")).federation)
    inner, record = make_strategy(load_config(_server_config(tmp_path, strategy="fedprox", proximal_mu=0.5)).federation)
    assert (type(inner).__name__, record) == ("FedProx", {"name": "fedprox", "params": {"proximal_mu": 0.5}})


def test_fedprox_adds_the_proximal_term_to_the_training_loss() -> None:
    """mu/2 * ||w - w0||^2 over the trainable weights, w0 = the weights when the trainer was built (the global
    adapter after the warm start); frozen weights do not count."""
    import torch

    from app.training.prox import add_proximal_term

    class Trainer:
        def __init__(self) -> None:
            self.model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
            self.model[1].requires_grad_(False)

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            loss = model(inputs).sum()
            return (loss, "outputs") if return_outputs else loss

    t = Trainer()
    x = torch.ones(1, 3)
    base = t.compute_loss(t.model, x)
    add_proximal_term(t, 0.5)
    assert torch.allclose(t.compute_loss(t.model, x), base)  # at w0 the term is 0
    with torch.no_grad():
        t.model[0].weight += 2.0  # 6 weights moved by 2: ||dw||^2 = 24
        t.model[1].weight += 5.0  # frozen: not part of the term
    plain = t.model(x).sum()
    loss, out = t.compute_loss(t.model, x, return_outputs=True)
    assert out == "outputs" and torch.allclose(loss, plain + 0.25 * 24)
    loss.backward()
    # d/dw [w2 (w x) + mu/2 ||w - w0||^2] = w2^T x^T + mu (w - w0) = w2^T + 0.5 * 2
    assert torch.allclose(t.model[0].weight.grad, t.model[1].weight.detach().T.expand(2, 3) + 1.0)


def test_client_run_for_a_fedprox_round_records_it_in_the_manifest(tmp_path: Path) -> None:
    """One client round through the real pipeline with FedProx: the proximal term is in the loss, the manifest's
    federation block names the round, and the bundle verifies."""
    from attestation import verify_bundle

    from app.config import load_config
    from app.federated.round_input import RoundInput
    from app.run.pipeline import RunHooks, run_once

    cfg = load_config(_client_config(tmp_path, 0, "clinic-a"))
    ri = RoundInput(1, "cd" * 32, None, None, 0.25)
    res = run_once(cfg, run_id="fed-r1-prox", hooks=RunHooks(federation=ri))
    manifest = json.loads((res.bundle_dir / B.MANIFEST).read_bytes())
    assert manifest["federation"] == {"round": 1, "nonce": "cd" * 32, "global_adapter_sha256": None, "proximal_mu": 0.25}
    assert manifest["lineage"] is None
    assert verify_bundle(res.bundle_dir, policy=_policy(), now=NOW).accepted


@pytest.mark.parametrize("name", ["aggregator-compose.yaml", "client-compose.yaml"])
def test_compose_examples_carry_valid_configs(name: str) -> None:
    """The inline cvm-tune config of each role's compose is a valid config for that role."""
    from app.config import Config

    doc = yaml.safe_load((ROOT / "docs" / "examples" / "federated" / name).read_text())
    cfg = Config.model_validate(yaml.safe_load(doc["configs"]["cvm-tune"]["content"]))
    service = next(iter(doc["services"].values()))
    if name.startswith("aggregator"):
        assert service["entrypoint"] == ["flower-superlink"] and cfg.federation.clients
        assert "--disable-runtime-dependency-installation" in service["command"]
    else:
        assert service["entrypoint"] == ["flower-supernode"] and cfg.federation.client_name == "clinic-a"
        assert cfg.dataset.owner_public_key in {k for c in _aggregator_example().federation.clients.values()
                                                for k in c.owner_public_keys}


def _aggregator_example() -> Any:
    from app.config import Config

    doc = yaml.safe_load((ROOT / "docs" / "examples" / "federated" / "aggregator-compose.yaml").read_text())
    return Config.model_validate(yaml.safe_load(doc["configs"]["cvm-tune"]["content"]))


def test_client_config_comes_from_the_node_or_the_simulation_run_config(tmp_path: Path) -> None:
    from flwr.app import Context, RecordDict

    from app.errors import ConfigError
    from app.federated.client_app import node_config_path

    def ctx(node: dict[str, Any], run: dict[str, Any]) -> Any:
        return Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=run)

    assert node_config_path(ctx({"cvm-tune-config": "/a.yaml"}, {"client-configs": "/x /y"})) == Path("/a.yaml")
    assert node_config_path(ctx({"partition-id": 1}, {"client-configs": "/x.yaml /y.yaml"})) == Path("/y.yaml")
    with pytest.raises(ConfigError, match="simulated node 2 has no entry"):
        node_config_path(ctx({"partition-id": 2}, {"client-configs": "/x.yaml /y.yaml"}))


def test_an_adapter_of_another_shape_is_excluded_before_aggregation(tmp_path: Path) -> None:
    """A verified bundle whose LoRA tensors do not fit the round's (another base model or rank) is rejected, so it
    cannot break Flower's aggregation for everyone; with too few left the round fails and writes nothing."""
    import numpy as np
    from flwr.app import Array, ArrayRecord

    from app.config import load_config
    from app.errors import RoundFailedError
    from app.federated.admission import Admitted, RoundTerms
    from app.federated.strategy import AttestedStrategy, make_strategy

    cfg = load_config(_server_config(tmp_path, min_clients=2))
    inner, record = make_strategy(cfg.federation)

    def admitted(name: str, rank: int) -> Admitted:
        arrays = ArrayRecord({"lora_A.weight": Array(np.zeros((rank, 8), np.float32))})
        return Admitted(name, 1, tmp_path, "r", "0" * 64, "0" * 64, "0" * 64, 10, arrays)

    class Gate:
        def __init__(self) -> None:
            self.queue = [admitted("clinic-a", 4), admitted("clinic-b", 16)]

        def check(self, msg: Any, terms: Any, seen: set[str]) -> Admitted:
            return self.queue.pop(0)

    class Reply:
        content: Any = None

    s = AttestedStrategy(inner, record, Gate(), None, tmp_path / "rounds", "f", cfg.federation)  # type: ignore[arg-type]
    s.terms = RoundTerms(1, "00" * 32, None, 0.0)
    with pytest.raises(RoundFailedError, match=r"1 client bundle\(s\) admitted.*clinic-b: its adapter's tensors"):
        s.aggregate_train(1, [Reply(), Reply()])
    assert not (tmp_path / "rounds").exists()


def test_a_bfloat16_adapter_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from app.errors import DataError
    from app.federated.transport import safetensors_to_arrays

    save_file({"lora_A.weight": torch.ones(2, 2, dtype=torch.bfloat16)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(DataError, match="NumPy cannot represent"):
        safetensors_to_arrays(tmp_path / "adapter_model.safetensors")


def test_a_hostile_bundle_archive_is_refused_and_writes_nothing_outside(tmp_path: Path) -> None:
    """The aggregator unpacks untrusted tar bytes: links, escaping names and non-tar data are refused."""
    import io
    import tarfile

    from app.errors import DataError
    from app.federated.transport import unpack_bundle

    def archive(member: tarfile.TarInfo, data: bytes = b"") -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
        return buf.getvalue()

    link = tarfile.TarInfo("manifest.json")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    cases = {"link": archive(link), "escape": archive(tarfile.TarInfo("../outside.txt"), b"x"),
             "absolute": archive(tarfile.TarInfo(str(tmp_path / "abs.txt")), b"x"), "garbage": b"not a tar" * 100}
    for name, data in cases.items():
        with pytest.raises(DataError):
            unpack_bundle(data, tmp_path / "in" / name)
    assert not (tmp_path / "in" / "outside.txt").exists() and not (tmp_path / "abs.txt").exists()
    assert [p for p in (tmp_path / "in").rglob("*") if p.is_file()] == []


def test_a_client_trains_on_a_global_adapter_only_behind_the_aggregators_attested_round(federation: Path,
                                                                                       tmp_path: Path) -> None:
    from app.config import load_config
    from app.errors import TeeError
    from app.federated.aggregator_check import check_global_adapter
    from app.federated.round_export import head_files
    from app.federated.transport import pack_bundle

    first = _rounds(federation)[0]
    m1 = json.loads((first / R.ROUND_MANIFEST).read_bytes())
    cfg = load_config(_client_config(tmp_path, 0, "clinic-a"))
    evidence = pack_bundle(first, head_files(first))
    check_global_adapter(cfg, {"previous-round": evidence}, 2, m1["global_adapter_sha256"], tmp_path / "ok")
    forged = tmp_path / "forged"
    shutil.copytree(first, forged)
    doc = json.loads((forged / R.ROUND_MANIFEST).read_bytes())
    doc["global_adapter_sha256"] = "ee" * 32  # an impostor's adapter under the real aggregator's quote
    (forged / R.ROUND_MANIFEST).write_text(json.dumps(doc))
    other = cfg.model_copy(update={"federation": cfg.federation.model_copy(
        update={"aggregator_compose_hashes": ("0" * 64,)})})
    cases = [
        (cfg, {"previous-round": evidence}, 2, "ee" * 32, "does not name the global adapter of round 2"),
        (other, {"previous-round": evidence}, 2, m1["global_adapter_sha256"], "not in federation.aggregator_compose"),
        (cfg, {}, 2, m1["global_adapter_sha256"], "without the attested round"),
        (cfg, {"previous-round": pack_bundle(forged, head_files(forged))}, 2, "ee" * 32, "report_data"),
        (cfg, {}, 1, "ab" * 32, "without the attested round"),  # an initial adapter nobody pinned
    ]
    for i, (c, conf, round_, sha, want) in enumerate(cases):
        with pytest.raises(TeeError, match=want):
            check_global_adapter(c, conf, round_, sha, tmp_path / f"w{i}")
    pinned = cfg.model_copy(update={"federation": cfg.federation.model_copy(
        update={"initial_adapter_sha256": "ab" * 32})})
    check_global_adapter(pinned, {}, 1, "ab" * 32, tmp_path / "pinned")


def test_client_privacy_is_read_from_the_manifests_privacy_block() -> None:
    """Per-client DP composes: a client manifest's ``privacy`` (epsilon, delta) is what the round lists and checks."""
    from types import SimpleNamespace

    assert R.client_privacy(SimpleNamespace(privacy=None)) == (None, None)
    assert R.client_privacy(SimpleNamespace()) == (None, None)
    dp = SimpleNamespace(privacy=SimpleNamespace(epsilon=2.5, delta=1e-5))
    assert R.client_privacy(dp) == (2.5, 1e-5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_deployment_engine_on_loopback_with_flwr_run(tmp_path: Path) -> None:
    """Flower's own commands, as docs/federated.md shows them: flower-superlink, one flower-supernode per data owner
    (its cvm-tune config as node config), `flwr run federated` with the aggregator's config; one round."""
    import os
    import signal
    import subprocess
    import sys
    import time

    bin_dir = Path(sys.executable).parent
    configs = [_client_config(tmp_path, i, n) for i, n in enumerate(CLIENTS[:2])]
    server = _server_config(tmp_path, rounds=1)
    port = _free_port()
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr-home"), HF_HUB_OFFLINE="1",
               PATH=os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),  # they start flower-superexec
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "flwr-home").mkdir()
    (tmp_path / "flwr-home" / "config.toml").write_text(
        f'[superlink]\ndefault = "fed"\n\n[superlink.fed]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> None:
        log = open(tmp_path / f"{len(procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([str(bin_dir / args[0]), *args[1:]], env=env, stdout=log, stderr=log,
                                      start_new_session=True))

    try:
        start("flower-superlink", "--insecure", "--port", str(port), "--database", str(tmp_path / "state.db"),
              "--disable-runtime-dependency-installation")
        _wait_for_port(port, procs[0])
        for cfg in configs:
            start("flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(_free_port()),
                  "--node-config", f'cvm-tune-config="{cfg}"')
        run = subprocess.run([str(bin_dir / "flwr"), "run", str(ROOT / "federated"), "fed", "--stream",
                              "--run-config", f'cvm-tune-config="{server}"'], env=env, capture_output=True,
                             timeout=400, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    finally:  # stop what this test started: the three processes and every process they spawned (by id)
        started = [p.pid for p in procs]
        for pid in [*started, *(d for p in started for d in _descendants(p))]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
    rounds = sorted((tmp_path / "aggregator" / "rounds").glob("*/round-0001"))
    assert len(rounds) == 1
    verdict = verify_round(rounds[0], policy=_policy(), now=NOW)
    assert verdict.accepted, [(c.name, c.detail) for c in verdict.failed]
    assert sorted(a["client"] for a in json.loads((rounds[0] / R.ROUND_MANIFEST).read_bytes())["admitted"]) == \
        list(CLIENTS[:2])


def _wait_for_port(port: int, proc: Any, limit_s: float = 90.0) -> None:
    import socket
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "flower-superlink exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                time.sleep(1)  # the HTTP app finishes its startup after the listen
                return
        time.sleep(0.5)
    raise AssertionError(f"flower-superlink did not listen on {port} within {limit_s} s")


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def test_a_round_on_a_volume_another_process_holds_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    """A client's round takes its volume's run lock: with the nightly service (here this test) holding it, the round
    fails with the reason (the aggregator records it as the reply's rejection) and nothing is written."""
    from flwr.app import ConfigRecord, Message, MessageType, Metadata, RecordDict

    from app.config import load_config
    from app.errors import StateError
    from app.federated.client_app import train_round
    from app.state import run_lock

    path = _client_config(tmp_path, 0, "clinic-a")
    out = load_config(path).output.dir.resolve()
    out.mkdir(parents=True)
    meta = Metadata(run_id=1, message_id="m", src_node_id=0, dst_node_id=1, reply_to_message_id="", group_id="1",
                    created_at=0.0, ttl=60.0, message_type=MessageType.TRAIN)  # the aggregator's train message
    msg = Message(content=RecordDict({"config": ConfigRecord({"server-round": 1, "nonce": "ab" * 32})}), metadata=meta)
    with run_lock(out):
        before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
        with pytest.raises(StateError) as err:
            train_round(msg, path)
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before == ["state", "state/lock"]
    assert err.value.message == f"the output volume {out} is in use by another cvm-tune process (pid {os.getpid()})"
