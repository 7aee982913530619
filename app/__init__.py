"""cvm-tune: attested nightly LoRA fine-tuning inside a dstack confidential VM.

The pipeline (``app.run.pipeline.run_once``) reads top to bottom:
decrypt -> validate -> train -> export -> attest. Heavy libraries (torch, transformers,
trl, peft) are imported lazily by ``app.training`` only.
"""

__version__ = "0.1.0"
