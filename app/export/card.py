"""The bundle's model card (``README.md``): Hub front matter from ``huggingface_hub.ModelCardData``, a body from a
Jinja template (``ModelCard.from_template``). It says what the adapter is, how to load it, what the attestation proves
and does not, and how to check it. Hashes and counts only: never dataset content."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import app
from app.config import Config

if TYPE_CHECKING:
    from app.training import TrainResult

CARD_COUNTS = ("rows_read", "duplicates_dropped", "dropped_too_long", "truncated", "dropped_no_trainable", "trainable_tokens")
TAGS = ["lora", "peft", "confidential-computing", "tdx", "cvm-tune"]

TEMPLATE = """---
{{ card_data }}
---

# LoRA adapter `{{ run_id }}`
{% if simulated %}
> **Simulated attestation.** This adapter was produced against the cvm-tune guest-agent simulator: its quote is
> signed by a TEST CA and is **not** evidence of a TEE. The default verification policy rejects it (expected).
{% endif %}
A LoRA adapter fine-tuned inside an Intel TDX confidential VM (dstack) by cvm-tune {{ version }}. A TDX quote binds
the code, the base model, the encrypted dataset and these files together; an OpenSSF model signature made with a key
that only this deployment's CVM can derive covers the adapter files.

## Base model

{% if hub_id %}`{{ hub_id }}`{% if revision %} at revision `{{ revision }}`{% endif %}, from local weights with tree sha256 `{{ base_tree }}`
(the hash, not the name, is what the quote binds: compare it with your copy).
{% else %}`{{ base_name }}` (tree sha256 `{{ base_tree }}`). It has **no Hub id** (`base_model.hub_id` was not set), so
`adapter_config.json` names `{{ base_name }}`: keep the base model in a local directory of that name, or load it by path.
{% endif %}
## Use

The adapter directory (`adapter/` in the export bundle, the repository root once published) is a PEFT repository with
the tokenizer. With the base model in a local directory:

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

base = AutoModelForCausalLM.from_pretrained("PATH/TO/BASE")   # tree sha256 {{ base_tree[:16] }}…
model = PeftModel.from_pretrained(base, "adapter")
tokenizer = AutoTokenizer.from_pretrained("adapter")
```

or, when `{{ hub_id or base_name }}` resolves (Hub cache or a local directory of that name):
`AutoPeftModelForCausalLM.from_pretrained("adapter")`.
{% if merged %}The merged weights (base + LoRA, `merge_and_unload`) are in `merged/`: `AutoModelForCausalLM.from_pretrained("merged")`.
{% endif %}
## Training data

| | |
|---|---|
| dataset | `{{ dataset.dataset_id }}` version {{ dataset.dataset_version }} ({{ dataset.format }}) |
| rows | {{ dataset.rows }} trained{% for k, v in validation %}; {{ k }} {{ v }}{% endfor %} |
| ciphertext sha256 | `{{ dataset.encrypted_sha256 }}` ({{ dataset.encrypted_size }} bytes) |
| plaintext sha256 | `{{ dataset.plaintext_sha256 }}` ({{ dataset.plaintext_size }} bytes, never left the CVM) |
| owner | {{ owner }} |

## Training

| | |
|---|---|
| backend | `{{ backend }}` |
{% for k, v in hyper %}| {{ k }} | {{ v }} |
{% endfor %}| optimizer steps | {{ steps }} |
| last training loss | {{ last_loss }} |
| last eval loss | {{ eval_loss }} |

## Attestation

What the quote proves, once `cvm-tune verify` accepts the bundle: an Intel TDX CVM whose measured app-compose (hash in
`manifest.json`) ran cvm-tune with source tree `{{ source_sha[:16] }}…`; it read the encrypted dataset and base model
with the hashes above and wrote exactly the files that `manifest.json` lists (report_data = SHA-512 of
`cvm-tune-manifest-v1:` + manifest.json); its audit chain records the run from start to export. The adapter's
signature key (ECDSA P-256, public key below and in `manifest.json`) is derived from the CVM's GetKey for this run
alone, so only this deployment can sign with it, and no other run's adapter verifies under it.

What it does not prove: that the dataset is good or lawful, that the base model is the one its name suggests (only its
hash is bound), anything about the host beyond TDX's guarantees, or the quality of the adapter.

## Verify

From the directory holding the bundle ({% if simulated %}the run's `exports/`; {% endif %}offline, with the bundle's collateral):

```sh
cvm-tune verify {{ run_id }}{% if simulated %} --policy ../simulator-test-policy.yaml{% endif %}
```
{% if verify_page_url %}
In a browser, installing nothing: open {{ verify_page_url }} and drop the bundle's folder (or a `.tar.gz` of it){% if
simulated %} and the policy file{% endif %}; the page runs the same checks offline and shows the same verdict.
{% endif %}{% if simulated %}
(`../simulator-test-policy.yaml` is the policy the run wrote next to `exports/`, trusting the simulator's test CA; for a
copy of the bundle elsewhere, pass that file's path.)
{% endif %}
The adapter signature alone, with the library's own CLI (`pip install model-signing`), using the public key bound by
the manifest:

```sh
python -c "import json; print(json.load(open('{{ run_id }}/manifest.json'))['signing']['public_key_pem'], end='')" > signing-key.pem
model_signing verify key {{ run_id }}/adapter --signature {{ run_id }}/adapter/model.sig --public_key signing-key.pem --no-ignore-git-paths
```

(`--no-ignore-git-paths`: the library skips `.git/`, `.gitattributes`, `.github/` and `.gitignore` by default; with
it, any file added to `adapter/` fails the check.)

The quote alone: paste `quote.hex` into https://proof.t16z.com (it checks the quote's signature and TCB, not the
binding to `manifest.json`, the audit events or the file hashes).

Signing public key:

```
{{ public_key_pem }}```
"""


@dataclass(frozen=True)
class CardInputs:
    """What the card says (all from values the manifest also records)."""

    run_id: str
    version: str
    simulated: bool
    base_name: str
    hub_id: str | None
    revision: str | None
    base_tree: str
    license: str
    dataset: dict[str, Any]
    backend: str
    hyper: dict[str, Any]  # training settings shown in the card, label -> value
    steps: int
    last_loss: float | None
    eval_loss: float | None
    source_sha: str
    public_key_pem: str
    merged: bool
    verify_page_url: str | None = None  # where the browser verifier is published (export.verify_page_url)


def model_card(c: CardInputs) -> bytes:
    """README.md bytes: ``ModelCard.load`` returns its front matter (base_model, library_name, tags, license, ...)."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(base_model=c.hub_id, library_name="peft", license=c.license, pipeline_tag="text-generation",
                         tags=[*TAGS, "cvm-tune-simulated"] if c.simulated else TAGS)
    owner = f"signed by owner key `{c.dataset['owner_key_id']}`" if c.dataset.get("owner_key_id") else "not owner-signed"
    card = ModelCard.from_template(
        data, template_str=TEMPLATE, run_id=c.run_id, version=c.version, simulated=c.simulated, base_name=c.base_name,
        hub_id=c.hub_id, revision=c.revision, base_tree=c.base_tree, dataset=c.dataset, owner=owner,
        validation=[(k, v) for k, v in sorted((c.dataset.get("validation") or {}).items()) if k in CARD_COUNTS], backend=c.backend, hyper=sorted(c.hyper.items()),
        steps=c.steps, last_loss=_fmt(c.last_loss), eval_loss=_fmt(c.eval_loss), source_sha=c.source_sha,
        public_key_pem=c.public_key_pem, merged=c.merged, verify_page_url=c.verify_page_url)
    return (card.content.rstrip("\n") + "\n").encode()


def card_inputs(cfg: Config, run_id: str, simulated: bool, base_name: str, base_tree: str, dataset: dict[str, Any],
                result: TrainResult, source_sha: str, public_key_pem: str) -> CardInputs:
    """The card's values for a finished training ``result`` under ``cfg``."""
    ts = cfg.training
    hyper = {"LoRA r / alpha / dropout": f"{ts.lora.r} / {ts.lora.alpha} / {ts.lora.dropout}",
             "target modules": ", ".join(ts.lora.target_modules), "learning rate": ts.learning_rate,
             "batch (per device x accumulation)": f"{ts.per_device_batch_size} x {ts.gradient_accumulation_steps}",
             "max length (tokens)": ts.max_length, "seed": ts.seed,
             "objective": "sft (supervised fine-tuning)" if ts.objective == "sft" else
             f"dpo (preference training: beta {ts.dpo.beta:g}, loss {ts.dpo.loss_type}, reference: the base model "
             "with the adapter disabled; losses below are DPO losses)"}
    return CardInputs(
        run_id=run_id, version=app.__version__, simulated=simulated, base_name=base_name, hub_id=cfg.base_model.hub_id,
        revision=cfg.base_model.revision, base_tree=base_tree, license=cfg.export.license, dataset=dataset,
        backend=result.backend, hyper=hyper, steps=result.global_step,
        last_loss=result.losses[-1][1] if result.losses else None,
        eval_loss=result.eval_losses[-1][1] if result.eval_losses else None,
        source_sha=source_sha, public_key_pem=public_key_pem, merged=cfg.export.merged,
        verify_page_url=cfg.export.verify_page_url)


def _fmt(x: float | None) -> str:
    return f"{x:.4f}" if x is not None else "n/a"
