"""`cvm-tune verify-quote` on the REAL samples of manifest.json, and on malformed input (exit 2).

Each sample is verified through the CLI at its pinned ``now``, under a policy file that allows its
expected TCB status, and must give that status; every dstack sample with an event log must replay
RTMR0-3. Malformed input of any kind is exit 2 with ``error:``/``fix:`` and no traceback, in
bounded memory.
"""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import pytest

from attestation import Policy, TrustedRoot
from attestation.tdx.quote import Quote

from app.cli import main

from .conftest_data import TESTDATA, load_manifest

ENTRIES = load_manifest()
NEARMPC = TESTDATA / "dstack_nearmpc_quote.bin"
NEARMPC_ARGS = ["--collateral", str(TESTDATA / "dstack_nearmpc_collateral.json"), "--now", "1787894484"]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict | None, str]:
    """``main(["verify-quote", ...])`` -> (exit code, parsed --json output or None, stderr)."""
    rc = main(["verify-quote", *args])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if "--json" in args and rc in (0, 1) else None, err


def policy_file(tmp_path: Path, **fields: object) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(Policy(name="test", **fields).to_yaml())
    return str(path)


def checks(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"]}


@pytest.mark.parametrize("cmd", ["verify-quote", "collateral"])
def test_help(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([cmd, "--help"])
    assert exc.value.code == 0
    assert f"usage: cvm-tune {cmd}" in capsys.readouterr().out


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e['quote']}@{e['now']}" for e in ENTRIES])
def test_every_sample_gives_its_expected_status_through_the_cli(entry: dict, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    root = None
    if entry["root_ca_der"]:
        root = TrustedRoot(name="synthetic test root", der_hex=(TESTDATA / entry["root_ca_der"]).read_bytes().hex())
    policy = policy_file(tmp_path, allowed_tcb_statuses=(entry["expected_status"] or "UpToDate",),
                         trusted_root=root or "intel", allowed_app_events=("mpc-image-digest",))
    args = [str(TESTDATA / entry["quote"]), "--collateral", str(TESTDATA / entry["collateral"]),
            "--now", str(entry["now"]), "--policy", policy, "--json"]
    if entry["event_log"]:
        args += ["--event-log", str(TESTDATA / entry["event_log"])]
    rc, doc, _ = run(capsys, *args)
    by_name = checks(doc)
    if by_name["quote.tee_type"]["status"] == "fail":  # the SGX sample: rejected with a clear reason
        assert rc == 1 and "SGX quote" in by_name["quote.tee_type"]["reason"]
        return
    if entry["expected_error"]:
        assert rc == 1 and entry["expected_error"] in by_name["quote.signature"]["reason"]
        return
    assert rc == 0, [c for c in doc["checks"] if c["status"] == "fail"]
    assert (doc["tcb_status"], doc["advisory_ids"]) == (entry["expected_status"], entry["expected_advisory_ids"])
    assert doc["quote_hex"] == Quote.from_bytes(bytes.fromhex(doc["quote_hex"])).raw.hex()
    if entry["event_log_replays_all_rtmrs"]:
        m = doc["measurements"]
        assert doc["replayed_rtmrs"] == [m["rtmr0"], m["rtmr1"], m["rtmr2"], m["rtmr3"]]
        assert by_name["event_log.replay"]["status"] == "pass"
        assert doc["compose_hash"] and doc["app_id"]


def test_json_schema_has_every_documented_field(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc, _ = run(capsys, str(NEARMPC), *NEARMPC_ARGS, "--event-log", str(TESTDATA / "dstack_nearmpc_event_log.json"),
                     "--json")
    assert set(doc) == {"schema", "verdict", "policy", "test_root", "now", "checks", "tcb_status", "advisory_ids",
                        "measurements", "replayed_rtmrs", "compose_hash", "app_id", "quote_hex", "tcb_date",
                        "collateral", "bundle", "gpu", "verifier"}
    assert doc["schema"] == "cvm-tune/verdict/v1" and doc["bundle"] is None
    assert set(doc["measurements"]) == {"mrtd", "rtmr0", "rtmr1", "rtmr2", "rtmr3", "mr_config_id", "report_data"}
    assert doc["collateral"] == {"not_before": "2026-08-13T10:45:38Z", "not_after": "2026-09-11T23:57:11Z",
                                 "tcb_evaluation_data_number": 19}
    assert doc["tcb_date"] == "2025-08-13T00:00:00Z" and doc["verifier"]["dcap_qvl"] == "0.7.0"
    assert all(set(c) == {"name", "status", "reason"} and c["status"] in ("pass", "fail", "skip") for c in doc["checks"])
    assert doc["quote_hex"] == NEARMPC.read_bytes().hex()  # upload-ready for proof.t16z.com


def test_default_policy_is_strict(capsys: pytest.CaptureFixture[str]) -> None:
    """The NEAR MPC node's own app event is not one of cvm-tune's: the default policy says so."""
    rc, doc, _ = run(capsys, str(NEARMPC), *NEARMPC_ARGS, "--event-log", str(TESTDATA / "dstack_nearmpc_event_log.json"),
                     "--json")
    assert rc == 1 and [c["name"] for c in doc["checks"] if c["status"] == "fail"] == ["event_log.names"]
    assert doc["tcb_status"] == "UpToDate"


def test_default_policy_accepts_a_real_dstack_quote_with_boot_events_only(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc, _ = run(capsys, str(TESTDATA / "dstack_simulator_quote.bin"), "--now", "1787894484", "--json",
                     "--collateral", str(TESTDATA / "dstack_nearmpc_collateral_nopckchain.json"),
                     "--event-log", str(TESTDATA / "dstack_simulator_event_log.json"), "--report-data", "00")
    assert rc == 0, [c for c in doc["checks"] if c["status"] != "pass"]
    skipped = {c["name"] for c in doc["checks"] if c["status"] == "skip"}
    assert skipped == {"collateral.tcb_evaluation", "policy.measurements", "policy.compose_hash", "policy.app_id",
                       "gpu.policy"}


def test_getquote_json_input_carries_its_event_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    resp = {"quote": NEARMPC.read_bytes().hex(), "event_log": (TESTDATA / "dstack_nearmpc_event_log.json").read_text(),
            "report_data": Quote.from_bytes(NEARMPC.read_bytes()).td.report_data.hex()}
    path = tmp_path / "getquote.json"
    path.write_text(json.dumps(resp))
    policy = policy_file(tmp_path, allowed_app_events=("mpc-image-digest",))
    rc, doc, _ = run(capsys, str(path), *NEARMPC_ARGS, "--policy", policy, "--report-data", resp["report_data"], "--json")
    assert rc == 0
    assert checks(doc)["event_log.replay"]["status"] == "pass" and checks(doc)["report_data"]["status"] == "pass"


def test_without_collateral_it_cannot_verify(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc, _ = run(capsys, str(NEARMPC), "--json")
    assert rc == 1
    assert "cvm-tune collateral" in checks(doc)["collateral.window"]["reason"]
    assert "quote.signature" not in checks(doc)


def test_human_output_names_failed_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify-quote", str(NEARMPC), *NEARMPC_ARGS, "--report-data", "ab" * 64]) == 1
    out = capsys.readouterr().out
    assert out.startswith("REJECTED under policy 'default'") and "FAIL report_data:" in out


# ----------------------------------------------------------------------------- malformed input: exit 2
def _write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


MALFORMED_QUOTES = {
    "empty": (b"", "is empty"),
    "truncated": (NEARMPC.read_bytes()[:1000], "truncated"),
    "truncated-hex": (NEARMPC.read_bytes()[:3000].hex().encode(), "truncated"),
    "random-bytes": (random.Random(4).randbytes(5006), "unsupported quote"),
    "odd-hex": (b"0x" + NEARMPC.read_bytes().hex().encode()[:-1], "odd number of digits"),
    "bad-hex": (b"0x" + b"zz" * 100, "not valid hex"),
    "json-without-quote": (b'{"event_log": "[]"}', 'without a "quote"'),
    "json-quote-not-string": (b'{"quote": 5}', 'without a "quote"'),
    "json-list": (b"[1, 2, 3]", 'without a "quote"'),
    "broken-json": (b'{"quote": "0400', "does not parse"),
    "json-bad-event-log": (json.dumps({"quote": NEARMPC.read_bytes().hex(), "event_log": 5}).encode(), "event_log"),
    "sgx-truncated": ((TESTDATA / "dcapqvl_sgx_quote").read_bytes()[:500], "truncated"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_QUOTES))
def test_malformed_quote_is_exit_2_with_a_clear_message(name: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    data, words = MALFORMED_QUOTES[name]
    rc, _, err = run(capsys, _write(tmp_path, "q", data), *NEARMPC_ARGS)
    assert rc == 2
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("fix: "), err
    assert words in lines[0] and "Traceback" not in err


def test_missing_quote_file_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, str(tmp_path / "nope.bin"))
    assert rc == 2 and "cannot read quote" in err


@pytest.mark.parametrize("option", ["QUOTE", "--event-log", "--collateral", "--policy"])
def test_100_mb_file_is_exit_2_in_bounded_memory(option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big = tmp_path / "big"
    with open(big, "wb") as fh:  # sparse: 100 MB on paper, no disk used
        fh.truncate(100 << 20)
    args = [str(big), *NEARMPC_ARGS] if option == "QUOTE" else [str(NEARMPC), *NEARMPC_ARGS, option, str(big)]
    tracemalloc.start()
    try:
        rc = main(["verify-quote", *args])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert rc == 2 and "larger than" in err and "Traceback" not in err
    assert peak < 40 << 20, f"peak {peak >> 20} MiB while rejecting a 100 MB {option}"


BAD_OPTIONS = {
    "event-log-not-json": ("--event-log", b"{not json", "does not parse"),
    "event-log-object-without-log": ("--event-log", b'{"quote": "00"}', "event_log"),
    "event-log-bad-event": ("--event-log", b'[{"imr": 9}]', "event 0"),
    "event-log-empty-file": ("--event-log", b"", "is empty"),
    "collateral-not-json": ("--collateral", b"\x00\x01", "collateral"),
    "collateral-wrong-json": ("--collateral", b'{"tcb_info": 1}', "QuoteCollateralV3"),
    "collateral-list": ("--collateral", b"[]", "QuoteCollateralV3"),
    "policy-unknown-key": ("--policy", b"allow_everything: true\n", "allow_everything"),
    "policy-colon-event": ("--policy", b"allowed_app_events: ['a:b']\n", "never ':'"),
    "policy-long-grace": ("--policy", b"outofdate_grace_period_s: 99999999\n", "outofdate_grace_period_s"),
}


@pytest.mark.parametrize("name", sorted(BAD_OPTIONS))
def test_malformed_option_files_are_exit_2(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    option, data, words = BAD_OPTIONS[name]
    args = [str(NEARMPC), *NEARMPC_ARGS, option, _write(tmp_path, "f", data)]
    if option == "--collateral":
        args = [str(NEARMPC), "--now", "1787894484", option, _write(tmp_path, "f", data)]
    rc, _, err = run(capsys, *args)
    assert rc == 2 and err.startswith("error: ") and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("value", ["abc", "0x12zz", "00" * 65, "0x" + "1" * 129])
def test_bad_report_data_is_exit_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, str(NEARMPC), *NEARMPC_ARGS, "--report-data", value)
    assert rc == 2 and "--report-data" in err and "fix: " in err
