"""docs/verifier-spec.md section 15's exact rules for an ops file and a checkpoint's op chain, each pinned: how the
file is split into lines and which are blank, the bounds of one line, the two roundings of a float32 field, the
`tinker://` path of a `load` and its ASCII JSON, `dp_epsilon` against `op_chain.dp`, the form of a custom-loss
document and the JSON kinds of `op_chain.dp`, `lora` and `determinism`. Each case runs through the Python verifier
and, where the page checks the same thing, through the page's own modules (web/test/units.mjs), which must agree.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from attestation.outputs import op_chain
from attestation.verdict import QuoteFindings
from tests.test_api import close_clients  # noqa: F401  (autouse: closes the snippet test's clients)
from tests.test_web_units import call
from tests.test_web_verify import pytestmark as needs_web
from tests.test_web_verify import web_copy  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parent.parent
SPEC = (ROOT / "docs" / "verifier-spec.md").read_text(encoding="utf-8")


def block(name: str) -> dict[str, str]:
    found = re.search(rf"^```{name}\n(.*?)^```", SPEC, flags=re.S | re.M)
    assert found, name
    return dict(line.split(" = ", 1) for line in found.group(1).splitlines())


V = block("op-chain-vectors")
FB, OPT = V["op_1"], V["op_2"]
DOC = block("custom-loss-vector")["document"]


def head_of(*lines: str) -> str:
    return op_chain.head([json.loads(line) for line in lines])


def with_member(line: str, **members: Any) -> str:
    return json.dumps({**json.loads(line), **members})


def chain(*lines: str, **extra: Any) -> dict[str, Any]:
    """A manifest's op_chain block recording ``lines`` (their head and count)."""
    return {"head": head_of(*lines), "ops": len(lines), "optimizer_steps": 0, "checkpoint": "tinker://m/weights/w",
            "lora": {}, **extra}


def lax_chain(*lines: str, **extra: Any) -> dict[str, Any]:
    """The op_chain block a verifier without the length and prefix rules of a ``load`` and the float32 range rule
    would accept for ``lines``: their chain hashed by hand (a load as ASCII JSON, a float32 field's bytes as
    ``struct`` packs them, infinity included), so each case below fails only by the rule it pins."""
    h = bytes(32)
    for line in lines:
        op = json.loads(line)
        if op["op"] == "load":
            canon = json.dumps(op, sort_keys=True, separators=(",", ":"))
        elif op["op"] == "optim_step":
            canon = json.dumps({"op": "optim_step", "adam_params": {
                k: struct.pack("<d", v).hex() for k, v in op["adam_params"].items()}}, sort_keys=True,
                separators=(",", ":"))
        else:
            d = op["data"][0]
            w = b"".join(struct.pack("<f", x) if abs(x) < 3.4e38 else b"\x00\x00\x80\x7f"
                         for x in d["loss_fn_inputs"]["weights"])
            canon = json.dumps({"op": op["op"], "loss_fn": op["loss_fn"], "loss_fn_config": None, "data": [{
                "model_input": struct.pack(f"<{len(d['model_input'])}i", *d["model_input"]).hex(),
                "loss_fn_inputs": {"target_tokens": struct.pack(f"<{len(d['model_input'])}q",
                                                                *d["loss_fn_inputs"]["target_tokens"]).hex(),
                                   "weights": w.hex()}}]}, sort_keys=True, separators=(",", ":"))
        h = hashlib.sha256(b"cvm-tune-op-chain-v1:" + h + hashlib.sha256(canon.encode()).digest()).digest()
    return {**chain(FB), "head": h.hex(), "ops": len(lines), **extra}


def load_line(checkpoint: str, before: tuple[str, ...] = (FB, OPT)) -> str:
    return json.dumps({"op": "load", "checkpoint": checkpoint, "checkpoint_head": head_of(*before),
                       "checkpoint_ops": len(before), "weights_sha256": "5e" * 32, "optimizer": True,
                       "model_head": "0" * 64})


ASTRAL = "\U0001f600"  # one code point, two UTF-16 units
DP = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "dataset_size": 100, "batch_size": 10, "sample_rate": 0.1,
      "delta": 1e-5, "accountant": "rdp", "steps": 1, "epsilon": 0.5}
OPT_DP = with_member(OPT, dp_epsilon=0.5)
# an unknown member holding U+2028 and U+0085 as raw characters (they end no line)
RAW_SEPARATORS = with_member(FB, note="a\u2028b\x85c").replace("\\u2028", "\u2028").replace("\\u0085", "\x85")
ESCAPED = "tinker://m/weights/é\x7f/\u2028\"\\"
DEEP_OK, DEEP = "[" * 31 + "]" * 31, "[" * 32 + "]" * 32  # with the op object: 32 and 33 levels


def custom(doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A custom forward_backward naming ``doc`` by its id, and the op_chain block holding it."""
    lid = hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    line = json.dumps({**json.loads(FB), "loss_fn": "custom", "loss_fn_config": {"loss_id": lid}})
    return line, chain(line, custom_losses={lid: doc})


def doc_with(change: Any) -> dict[str, Any]:
    doc = copy.deepcopy(json.loads(DOC))
    change(doc)
    return doc


# (name, the manifest's op_chain block, the ops file's text, the check's status)
CASES: list[tuple[str, dict[str, Any], str, str]] = [
    # lines: LF, CR LF, a lone CR; blank = empty or spaces and tabs only; nothing else ends or blanks a line
    ("lf", chain(FB, OPT), f"{FB}\n{OPT}\n", "pass"),
    ("crlf", chain(FB, OPT), f"{FB}\r\n{OPT}\r\n", "pass"),
    ("lone-cr", chain(FB, OPT), f"{FB}\r{OPT}", "pass"),
    ("blank-spaces-tabs", chain(FB, OPT), f"\n{FB}\n \t \n\r\n{OPT}\n\n", "pass"),
    ("spaces-around-json", chain(FB, OPT), f" \t{FB} \n{OPT}\t\n", "pass"),
    ("formfeed-line-is-not-blank", chain(FB, OPT), f"{FB}\n\f\n{OPT}\n", "fail"),
    ("nbsp-after-json", chain(FB, OPT), f"{FB}\u00a0\n{OPT}\n", "fail"),
    ("byte-order-mark", chain(FB, OPT), f"\ufeff{FB}\n{OPT}\n", "fail"),
    ("u2028-u0085-inside-a-string", chain(FB, OPT), RAW_SEPARATORS + "\n" + OPT + "\n", "pass"),
    # one line: no member twice, nesting, numbers, NaN
    ("member-twice", chain(FB, OPT), FB[:-1] + ', "op": "forward_backward"}\n' + OPT, "fail"),
    ("depth-32", chain(FB, OPT), FB[:-1] + f', "note": {DEEP_OK}}}\n{OPT}', "pass"),
    ("depth-33", chain(FB, OPT), FB[:-1] + f', "note": {DEEP}}}\n{OPT}', "fail"),
    ("number-of-400-characters", chain(FB, OPT), FB[:-1] + f', "note": {"9" * 400}}}\n{OPT}', "pass"),
    ("number-of-401-characters", chain(FB, OPT), FB[:-1] + f', "note": {"9" * 401}}}\n{OPT}', "fail"),
    ("nan", chain(FB, OPT), FB[:-1] + f', "note": NaN}}\n{OPT}', "fail"),
    # float32 fields: the float64 first, then float32, ties to even; infinite float32 has no canonical form
    ("float32-max", chain(FB.replace("0.5", "3.4028235677973362e38")), FB.replace("0.5", "3.4028235677973362e38"),
     "pass"),
    ("float32-overflow", lax_chain(FB.replace("0.5", "3.4028235677973366e38")),
     FB.replace("0.5", "3.4028235677973366e38"), "fail"),
    ("weight-rounds-to-the-same-float32", chain(FB.replace("0.5", "0.1")), FB.replace("0.5", "0.100000001"), "pass"),
    ("learning-rate-is-float64", chain(FB, OPT), f"{FB}\n{OPT.replace('0.001', '0.0010000000000000001')}", "pass"),
    ("learning-rate-differs", chain(FB, OPT), f"{FB}\n{OPT.replace('0.001', '0.001000001')}", "fail"),
    # load: tinker:// and at least one more character, at most 512 code points, hashed as ASCII JSON
    ("load", chain(FB, OPT, load_line("tinker://s:train:0/weights/w")),
     f"{FB}\n{OPT}\n{load_line('tinker://s:train:0/weights/w')}", "pass"),
    ("load-without-prefix", lax_chain(FB, OPT, load_line("s/weights/w")), f"{FB}\n{OPT}\n{load_line('s/weights/w')}",
     "fail"),
    ("load-prefix-only", lax_chain(FB, OPT, load_line("tinker://")), f"{FB}\n{OPT}\n{load_line('tinker://')}", "fail"),
    ("load-512-code-points", chain(FB, OPT, load_line("tinker://" + ASTRAL * 503)),
     f"{FB}\n{OPT}\n{load_line('tinker://' + ASTRAL * 503)}", "pass"),
    ("load-513-code-points", lax_chain(FB, OPT, load_line("tinker://" + ASTRAL * 504)),
     f"{FB}\n{OPT}\n{load_line('tinker://' + ASTRAL * 504)}", "fail"),
    ("load-escapes", chain(FB, OPT, load_line(ESCAPED)), f"{FB}\n{OPT}\n{load_line(ESCAPED)}", "pass"),
    # dp_epsilon: on every optim_step of a DP model, on none of another; the last one is op_chain.dp.epsilon
    ("dp-epsilon-without-dp", chain(FB, OPT_DP), f"{FB}\n{OPT_DP}", "fail"),
    ("dp-epsilon-null-without-dp", chain(FB, OPT), f"{FB}\n{with_member(OPT, dp_epsilon=None)}", "pass"),
    ("dp-epsilon-on-forward-backward", chain(FB, OPT), f"{with_member(FB, dp_epsilon=0.5)}\n{OPT}", "pass"),
    ("dp", chain(FB, OPT_DP, dp=DP), f"{FB}\n{OPT_DP}", "pass"),
    ("dp-step-without-dp-epsilon", chain(FB, OPT, dp=DP), f"{FB}\n{OPT}", "fail"),
    ("dp-last-epsilon-differs", chain(FB, OPT_DP, dp={**DP, "epsilon": 0.6}), f"{FB}\n{OPT_DP}", "fail"),
]


def _custom_cases() -> list[tuple[str, dict[str, Any], str, str]]:
    out = []
    for name, change, status in [
        ("custom-loss", lambda d: None, "pass"),
        ("custom-loss-float-2.0", lambda d: d["graph"]["nodes"][2]["args"].append(2.0), "pass"),
        ("custom-loss-extra-member", lambda d: d.update(note="x"), "fail"),
        ("custom-loss-node-without-kwargs", lambda d: d["graph"]["nodes"][0].pop("kwargs"), "fail"),
        ("custom-loss-rank-true", lambda d: d["inputs"][0].update(rank=True), "fail"),
        ("custom-loss-rank-1.0", lambda d: d["inputs"][0].update(rank=1.0), "fail"),
        ("custom-loss-format-2", lambda d: d["graph"].update(format=2), "fail"),
    ]:
        line, recorded = custom(doc_with(change))
        out.append((name, recorded, line + "\n", status))
    return out


CASES += _custom_cases()


def python_check(recorded: dict[str, Any], text: str, tmp_path: Path) -> tuple[str, str]:
    path = tmp_path / "ops.jsonl"
    path.write_bytes(text.encode("utf-8"))
    f = QuoteFindings()
    ops, source = op_chain.read_record(path)
    op_chain.check(f, SimpleNamespace(**{"custom_losses": None, "dp": None, **recorded}), ops, source)
    [check] = f.checks
    return check.status, check.detail


@pytest.mark.parametrize(("recorded", "text", "status"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_python_verifier(recorded: dict[str, Any], text: str, status: str, tmp_path: Path) -> None:
    got, why = python_check(recorded, text, tmp_path)
    assert got == status, why


@needs_web
def test_the_page_agrees_on_every_case(web_copy: Path) -> None:  # noqa: F811
    got = call(web_copy, *(("opChainExact", [json.dumps({"op_chain": recorded}), text])
                           for _n, recorded, text, _s in CASES))
    wrong = {n: (c["status"], c["reason"]) for (n, _r, _t, status), c in zip(CASES, got, strict=True)
             if c["status"] != status}
    assert not wrong


def test_the_rounding_vector_recomputed_from_the_spec_alone() -> None:
    """A float32 field: the JSON number's float64 first, then float32 (ties to even), as the vector says."""
    v = block("op-chain-rounding-vector")
    op = json.loads(v["op"])
    w = op["data"][0]["loss_fn_inputs"]["weights"][0]
    assert struct.pack("<f", w).hex() == "0000803f"  # 1 + 2^-24 as float64, the tie, rounds to 1.0
    from decimal import Decimal, localcontext

    with localcontext() as ctx:
        ctx.prec = 100
        exact = Decimal(re.search(r'"weights": \[([0-9.]+)\]', v["op"]).group(1))
        assert exact == 1 + Decimal(2) ** -24 + Decimal(2) ** -60  # rounded once to float32: 1 + 2^-23
    doc = {"op": "forward_backward", "loss_fn": "cross_entropy", "loss_fn_config": None,
           "data": [{"model_input": struct.pack("<i", 1).hex(),
                     "loss_fn_inputs": {"target_tokens": struct.pack("<q", 2).hex(),
                                        "weights": struct.pack("<f", w).hex()}}]}
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    assert canon == v["canonical"] and op_chain.canonical(op) == canon.encode()
    h = hashlib.sha256(b"cvm-tune-op-chain-v1:" + bytes(32) + hashlib.sha256(canon.encode()).digest()).hexdigest()
    assert h == v["head"] == op_chain.head([op])


def test_a_load_is_hashed_as_ascii_json() -> None:
    line = json.loads(load_line("tinker://m/weights/é\x7f/\u2028" + ASTRAL))
    assert b'"checkpoint":"tinker://m/weights/\\u00e9\\u007f/\\u2028\\ud83d\\ude00"' in op_chain.canonical(line)


def test_a_custom_loss_document_keeps_its_floats() -> None:
    doc = doc_with(lambda d: d["graph"]["nodes"][2]["args"].append(2.0))
    assert '{"ref":"weights"},2.0]' in json.dumps(doc, sort_keys=True, separators=(",", ":"))
    assert op_chain.document_problem(doc) is None
    assert op_chain.custom_loss_id(doc) != op_chain.custom_loss_id(doc_with(
        lambda d: d["graph"]["nodes"][2]["args"].append(2)))


# --- the JSON kinds of op_chain.dp, lora and determinism (manifest.schema) -----------------------------------------

def _manifest(**op_chain_members: Any) -> dict[str, Any]:
    m = json.loads((ROOT / "tests" / "data" / "bundle" / "manifest.json").read_text())
    m["op_chain"] = {**chain(FB, OPT_DP), "optimizer_steps": 1,
                     "lora": {"rank": 4, "seed": 3, "train_attn": True, "train_mlp": True, "train_unembed": False},
                     "dp": dict(DP), "determinism": {"device": "cpu", "torch_threads": 2, "pass_rows": 4},
                     **op_chain_members}
    return m


KINDS = [
    ("as-the-server-writes", {}, True),
    ("dp-integer-written-as-float", {"dp": {**DP, "dataset_size": 100.0}}, False),
    ("dp-number-as-string", {"dp": {**DP, "delta": "1e-05"}}, False),
    ("dp-boolean", {"dp": {**DP, "noise_multiplier": True}}, False),
    ("dp-null", {"dp": {**DP, "epsilon": None}}, False),
    ("dp-other-member", {"dp": {**DP, "target_epsilon": 1.0}}, False),
    ("dp-accountant-not-a-string", {"dp": {**DP, "accountant": 1}}, False),
    ("dp-number-written-as-integer", {"dp": {**DP, "noise_multiplier": 1}}, True),
    ("lora-seed-1.0", {"lora": {"rank": 4, "seed": 1.0, "train_attn": True}}, False),
    ("lora-seed-null", {"lora": {"rank": 4, "seed": None, "train_attn": True}}, True),
    ("determinism-pass-rows-true", {"determinism": {"device": "cpu", "pass_rows": True}}, False),
    ("determinism-threads-4.0", {"determinism": {"device": "cpu", "torch_threads": 4.0}}, False),
    ("adam-params-number-as-string", {"adam_params": {"learning_rate": "0.001"}}, False),
    ("adam-params-boolean", {"adam_params": {"learning_rate": True}}, False),
    ("adam-params-integer", {"adam_params": {"learning_rate": 1, "beta1": 0.9}}, True),
]


@pytest.mark.parametrize(("members", "valid"), [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_op_chain_member_kinds_in_python(members: dict[str, Any], valid: bool) -> None:
    from pydantic import ValidationError

    from attestation.bundle import manifest as B

    try:
        B.Manifest.model_validate(_manifest(**members))
    except ValidationError as exc:
        assert not valid, exc
    else:
        assert valid


@needs_web
def test_op_chain_member_kinds_on_the_page(web_copy: Path) -> None:  # noqa: F811
    got = call(web_copy, *(("manifestProblem", [json.dumps(_manifest(**members))]) for _n, members, _v in KINDS))
    assert [why is None for why in got] == [valid for _n, _m, valid in KINDS], got


# --- docs/api.md's custom-loss snippet, run against a loopback server --------------------------------------------

def api_snippet() -> str:
    """The ```python block of docs/api.md's section "Custom losses, on the server and in the proof"."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split("## Custom losses, on the server and in the proof", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert found, "the section has no python block"
    return found.group(1)


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.test_api import serving

    yield from serving(tmp_path_factory.mktemp("api-snippet"))


def test_the_api_custom_loss_snippet_runs_and_its_record_verifies(api_server: Any, tmp_path: Path) -> None:
    """The snippet, with what it continues (the loop of "The lines a Tinker user adds": a service and a training
    client, the open ops file, a batch with weights), trains with its loss, and the line it wrote is one the bundle's
    op chain verifies."""
    from tinker import types

    from tests.api_drive import ADAM, _bundle
    from tests.test_api import _client, _datums, _verify

    sc = _client(api_server)
    tc = sc.create_lora_training_client(base_model="cvm-tune/tiny-llama", rank=4, seed=0).result()
    batch = _datums(api_server)
    with (tmp_path / "ops.jsonl").open("w") as ops:
        exec(compile(api_snippet(), "docs/api.md", "exec"), {"sc": sc, "tc": tc, "batch": batch, "ops": ops})
        tc.optim_step(types.AdamParams(**ADAM)).result()
        ops.write(json.dumps({"op": "optim_step",
                              "adam_params": types.AdamParams(**ADAM).model_dump(mode="json")}) + "\n")
    recorded = [json.loads(line) for line in (tmp_path / "ops.jsonl").read_text().splitlines()]
    assert [op["op"] for op in recorded] == ["forward_backward", "optim_step"]
    assert recorded[0]["loss_fn"] == "custom"
    path = tc.save_state("snippet").result().path
    bundle = _bundle(api_server, tc.model_id, path)
    code, out = _verify(api_server, bundle, recorded, tmp_path)
    assert code == 0 and "1 custom loss(es), each hashing to its id" in out, out
