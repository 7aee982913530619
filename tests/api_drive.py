"""Drive a running ``cvm-tune api serve`` with the unmodified tinker SDK: train, save, sample, verify.

:class:`Server` and the step and bundle helpers serve tests/test_api*.py too. :func:`drive` is shared by
tests/test_api_backend.py (the Unsloth branch on the CPU, with a stand-in ``unsloth`` package) and
tests/test_gpu_api.py (the real Unsloth on a GPU): the same checks, whatever loaded the model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
KEY = "tml-backend-key"
ADAM = {"learning_rate": 0.005}
# The server under the test socket guard (loopback allowed: its own port); what it refused is printed when it stops.
# After its shutdown uvicorn raises the SIGTERM it caught again, under the handler found before: this one.
NETGUARD = """
import atexit, json, signal, sys
from tests.netguard import guard as _guard
_attempts = _guard(allow_loopback=True).__enter__()
def _said(*_):
    print("NET-ATTEMPTS " + json.dumps(_attempts), flush=True)
atexit.register(_said)
signal.signal(signal.SIGTERM, lambda *_: (_said(), sys.exit(0)))
"""


class Server:
    """``cvm-tune api serve`` on a free loopback port in a fresh interpreter, its output volume ``tmp/"out"``.

    ``config``: YAML after ``output.dir``; ``tls``: HTTPS (else ``--plain-http``); ``keys``: the API keys (the first
    is the default client's); ``preamble``: code run before the CLI; ``netguard``: under the test socket guard
    (:meth:`net_attempts` after :meth:`stop`). ``cmd``/``env`` also run it by hand (``subprocess.run``).
    """

    def __init__(self, tmp: Path, config: str = "", *, tls: bool = False, keys: tuple[str, ...] = (KEY,),
                 env: dict[str, str] | None = None, preamble: str = "", netguard: bool = False) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.tmp, self.out, self.keys = tmp, tmp / "out", keys
        self.cfg = tmp / "api.yaml"
        self.cfg.write_text(f"output:\n  dir: {self.out}\n{config}")
        self.log = tmp / "serve.log"
        self.env = {**os.environ, "CVM_TUNE_API_KEYS": ",".join(keys), "HF_HUB_OFFLINE": "1", **(env or {})}
        paths = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT)])
        self.argv = ["api", "serve", "--listen", f"127.0.0.1:{self.port}", "--config", str(self.cfg),
                     *([] if tls else ["--plain-http"])]
        code = f"{NETGUARD if netguard else ''}{preamble}\nfrom app.cli import main\nraise SystemExit(main({self.argv!r}))"
        self.cmd = [sys.executable, "-c", code]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300) -> str:
        """Start and wait for ``listening on`` in the log this start writes (a restart appends); returns that part."""
        seen = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp)
        deadline = time.monotonic() + timeout
        while b"listening on" not in (new := self.log.read_bytes()[seen:]):
            assert self.proc.poll() is None, self.log.read_text()[-6000:]
            assert time.monotonic() < deadline, self.log.read_text()[-6000:]
            time.sleep(0.2)
        return new.decode(errors="replace")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def net_attempts(self) -> list[Any] | None:
        """The connections the guard refused (``None``: the server did not exit through its own shutdown)."""
        lines = [x for x in self.log.read_text().splitlines() if x.startswith("NET-ATTEMPTS ")]
        return json.loads(lines[-1].removeprefix("NET-ATTEMPTS ")) if lines else None


def _datums(tokenizer_dir: Path) -> list[Any]:
    from tinker import types
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    out = []
    for text in ("The enclave keeps the weights sealed.", "A quote binds the manifest to the measured code."):
        ids = tok(text)["input_ids"]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}))
    return out


def _record(datums: list[Any]) -> dict[str, Any]:
    """The op as the client keeps it (docs/api.md): plain JSON numbers."""
    return {"op": "forward_backward", "loss_fn": "cross_entropy", "data": [
        {"model_input": d.model_input.to_ints(),
         "loss_fn_inputs": {k: v.tolist() for k, v in d.loss_fn_inputs.items()}} for d in datums]}


def _steps(tc: Any, datums: list[Any], n: int, ops: list[dict[str, Any]]) -> list[float]:
    """``n`` cross-entropy steps with Adam; appends them to ``ops`` as the client records them. Returns the losses."""
    from tinker import types

    losses = []
    for _ in range(n):
        fb = tc.forward_backward(datums, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(**ADAM))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
        ops += [_record(datums), {"op": "optim_step", "adam_params": types.AdamParams(**ADAM).model_dump(mode="json")}]
    return losses


def _bundle(srv: Server, model_id: str, path: str, key: str | None = None) -> Path:
    """The export bundle of checkpoint ``path``, as the checkpoint list reports it (``key``: the server's first)."""
    r = httpx.get(f"{srv.url}/api/v1/training_runs/{model_id}/checkpoints", headers={"X-API-Key": key or srv.keys[0]})
    r.raise_for_status()
    found = {c["tinker_path"]: c for c in r.json()["checkpoints"]}
    return Path(found[path]["user_metadata"]["bundle"])


def drive(srv: Server, tokenizer_dir: Path, *, steps: int = 6, **lora: Any) -> dict[str, Any]:
    """Train ``steps`` cross-entropy steps, save state and sampler weights, sample greedily, and compare the sampled
    tokens' log-probabilities (KV-cache decode) with a forward pass over the same sequence.

    Returns losses, the saved path, the bundle, the ops as sent, the forward loss and log-probabilities after the last
    step, the greedy sample and the forward pass's log-probabilities of it.
    """
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=srv.url, api_key=srv.keys[0])
    base = sc.get_server_capabilities().supported_models[0].model_name
    tc = sc.create_lora_training_client(base_model=base, rank=8, seed=0, **lora).result()
    datums, ops = _datums(tokenizer_dir), []
    losses = _steps(tc, datums, steps, ops)
    path = tc.save_state("after").result().path
    sampler = tc.save_weights_for_sampler("sampler").result().path
    fwd = tc.forward(datums, "cross_entropy").result()  # forward only: not an op
    prompt = datums[0].model_input.to_ints()[:4]
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, seed=1)
    sample = sc.create_sampling_client(model_path=sampler).result().sample(
        prompt=types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=greedy).result().sequences[0]
    seq = prompt + list(sample.tokens)
    check = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)})
    again = tc.forward([check], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    bundle = _bundle(srv, tc.model_id, path)
    sc.close("success").result(timeout=60)  # ends the session: no heartbeat thread outlives the server
    return {"losses": losses, "path": path, "bundle": bundle, "ops": ops, "base": base,
            "forward_loss": fwd.metrics["loss:sum"], "data": _record(datums)["data"],
            "sample_tokens": list(sample.tokens), "sample_logprobs": list(sample.logprobs),
            "forward_logprobs": again[len(prompt) - 1:]}


def verify(srv: Server, bundle: Path, ops: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    """``cvm-tune verify BUNDLE --policy <simulator policy> --ops OPS`` in a fresh interpreter."""
    ops_file = srv.tmp / f"ops-{time.monotonic_ns()}.jsonl"
    ops_file.write_text("".join(json.dumps(op) + "\n" for op in ops))
    return subprocess.run([sys.executable, "-m", "app", "verify", str(bundle), "--policy",
                           str(srv.out / "simulator-test-policy.yaml"), "--ops", str(ops_file)],
                          env=srv.env, cwd=srv.tmp, capture_output=True, text=True, timeout=300)


PEFT_CHECK = """
import json, sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
spec = json.loads(sys.argv[1])
base = AutoModelForCausalLM.from_pretrained(spec["base"], local_files_only=True, dtype=torch.float32)
model = PeftModel.from_pretrained(base, spec["adapter"]).eval()  # plain PEFT
total = 0.0
with torch.no_grad():
    for d in spec["data"]:
        logits = model(input_ids=torch.tensor([d["model_input"]])).logits[0].float()
        target = torch.tensor(d["loss_fn_inputs"]["target_tokens"])
        logp = torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]
        total += float(-(logp * torch.tensor(d["loss_fn_inputs"]["weights"])).sum())
print(json.dumps({"loss": total, "unsloth": "unsloth" in sys.modules}))
"""


def plain_peft_loss(srv: Server, base_dir: Path, adapter: Path, data: list[dict[str, Any]]) -> dict[str, Any]:
    """The cross-entropy (sum) of ``data`` under ``adapter`` loaded by plain PEFT in a fresh interpreter."""
    spec = {"base": str(base_dir), "adapter": str(adapter), "data": data}
    proc = subprocess.run([sys.executable, "-c", PEFT_CHECK, json.dumps(spec)], env=srv.env, cwd=srv.tmp,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
