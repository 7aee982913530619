"""Over HTTP with the SDK (docs/api.md, "Sampling" and "What is served"): stop strings and top-k prompt logprobs
reach the SDK's own types; ``weights_info`` (``RestClient.get_weights_info_by_tinker_path``) and ``unload_model``
are served; the server's start lines say how saves are kept, and to whom export bundles are encrypted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api_drive import KEY, Server

BASE = "cvm-tune/tiny-llama"


@pytest.fixture(scope="module")
def recipient() -> str:
    import pyrage

    return str(pyrage.x25519.Identity.generate().to_public())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, recipient: str) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("sampling-server"),
                 f"export:\n  recipients: [{recipient}]\napi:\n  max_sample_tokens: 16\n  long_poll_s: 1\n")
    srv.start()
    yield srv  # pytest runs what follows at teardown, whatever the tests did
    srv.stop()


@pytest.fixture(scope="module")
def sc(server: Server) -> Iterator[Any]:
    import tinker

    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result(timeout=60)


def test_the_start_lines_say_saves_are_encrypted_and_to_whom(server: Server, recipient: str) -> None:
    from app.api import saves_line

    line = next(x for x in server.log.read_text().splitlines() if x.startswith("saves: "))
    assert f"age-encrypted to 1 export.recipients ({recipient}) and the CVM's key age1" in line
    assert "sealed to this app" in line
    clear = saves_line((), lambda *_: pytest.fail("no key is derived without recipients"))
    assert clear.endswith("export bundles' weights in the clear (no export.recipients)")


def test_stop_strings_and_topk_prompt_logprobs_through_the_sdk(server: Server, sc: Any) -> None:
    from tinker import types
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(server.out / "models" / "tiny-llama"))  # what the server decodes with
    sampler = sc.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints([5, 17, 42, 9, 3])
    free = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=12, temperature=0.0, stop=[])).result().sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 12
    stop = tok.decode(free.tokens[:6])[-3:]
    end = next(i for i in range(12) if stop in tok.decode(free.tokens[:i + 1]))
    got = sampler.sample(prompt=prompt, num_samples=2, sampling_params=types.SamplingParams(
        max_tokens=12, temperature=0.0, stop=[stop]), include_prompt_logprobs=True, topk_prompt_logprobs=2).result()
    assert [(s.tokens, s.stop_reason) for s in got.sequences] == [(free.tokens[:end + 1], "stop")] * 2
    assert got.topk_prompt_logprobs[0] is None and all(len(r) == 2 for r in got.topk_prompt_logprobs[1:])
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == 5


def test_weights_info_and_unload_model(server: Server, sc: Any) -> None:
    import tinker

    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0, train_mlp=False).result()
    path = tc.save_state("info").result().path
    info = tinker.RestClient(base_url=server.url, api_key=KEY).get_weights_info_by_tinker_path(path).result()
    got = (info.base_model, info.is_lora, info.lora_rank, info.train_mlp, info.train_attn)
    assert got == (BASE, True, 4, False, True)
    h = {"X-API-Key": KEY}
    missing = httpx.post(f"{server.url}/api/v1/weights_info", headers=h, json={"tinker_path": path + "-not-saved"})
    assert missing.status_code == 404

    fut = httpx.post(f"{server.url}/api/v1/unload_model", headers=h, json={"model_id": tc.model_id}).json()
    deadline = time.monotonic() + 60
    while (r := httpx.post(f"{server.url}/api/v1/retrieve_future", headers=h,
                           json={"request_id": fut["request_id"]}).json()).get("type") == "try_again":
        assert time.monotonic() < deadline
    assert r == {"model_id": tc.model_id, "type": "unload_model"}
    gone = httpx.post(f"{server.url}/api/v1/get_info", headers=h, json={"model_id": tc.model_id})
    assert gone.status_code == 200  # the model is known (its checkpoints stay listed) ...
    refused = httpx.post(f"{server.url}/api/v1/unload_model", headers=h, json={"model_id": tc.model_id})
    assert refused.status_code == 404 and "not loaded" in refused.json()["detail"]  # ... but not loaded
    again = sc.create_training_client_from_state_with_optimizer(path).result()  # its saved state continues it
    assert again.model_id != tc.model_id
