"""A complete Tinker loop against `cvm-tune api serve`, with the lines that make its checkpoint checkable.

Run it with the environment `cvm-tune api attest` printed (TINKER_BASE_URL, TINKER_API_KEY, SSL_CERT_FILE):

    python docs/examples/api_loop.py cvm-tune-output/models/tiny-llama

It tokenizes locally (the served base model's own tokenizer: `tc.get_tokenizer()` would download it from the Hub),
trains a few cross-entropy steps, keeps `ops.jsonl` (the record of every op as sent), saves the state and prints its
bundle's directory: verify it with `cvm-tune verify BUNDLE --ops ops.jsonl [--replay]` (docs/api.md).
"""

import json
import sys

import tinker
from tinker import types
from transformers import AutoTokenizer

TEXTS = ["The enclave keeps the weights sealed.", "A quote binds the manifest to the measured code.",
         "Every checkpoint names the requests that made it.", "The owner's data never leaves the enclave in clear."]
ADAM = types.AdamParams(learning_rate=5e-3)


def datum(tok, text):
    ids = tok(text)["input_ids"]  # next-token prediction: inputs are ids[:-1], targets ids[1:], every token weighted
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def main(tokenizer_dir, steps=4, name="example"):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    batch = [datum(tok, t) for t in TEXTS]
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model="cvm-tune/tiny-llama", rank=8, seed=0).result()
    with open("ops.jsonl", "w") as ops:
        for step in range(steps):
            fb = tc.forward_backward(batch, "cross_entropy")
            opt = tc.optim_step(ADAM)
            loss = fb.result().metrics["loss:sum"]
            opt.result()
            # the record of what was sent, once each future succeeded (a refused op changes nothing: leave it out)
            ops.write(json.dumps({"op": "forward_backward", "loss_fn": "cross_entropy", "data": [
                {"model_input": d.model_input.to_ints(),
                 "loss_fn_inputs": {k: v.tolist() for k, v in d.loss_fn_inputs.items()}} for d in batch]}) + "\n")
            ops.write(json.dumps({"op": "optim_step", "adam_params": ADAM.model_dump(mode="json")}) + "\n")
            print(f"step {step + 1}/{steps}: loss {loss:.3f}")
    path = tc.save_state(name).result().path
    checkpoint = next(c for c in sc.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints
                      if c.tinker_path == path)
    print(f"saved {path}")
    print(f"bundle: {checkpoint.user_metadata['bundle']}")
    sc.close("success").result(timeout=60)  # the session ends; its models and checkpoints stay


if __name__ == "__main__":
    main(sys.argv[1])
