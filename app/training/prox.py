"""FedProx on the client: the proximal term ``mu/2 * ||w - w0||^2`` added to the trainer's loss.

``w0`` is the trainable (LoRA) weights at the moment the trainer is built: after the warm start from the round's
global adapter, that is the global model FedProx anchors to (Li et al., 2020). Flower's FedProx strategy sends ``mu``
(``proximal-mu``) and leaves this term to the client.
"""

from __future__ import annotations

from typing import Any

from app.errors import TrainingError


def add_proximal_term(trainer: Any, mu: float) -> None:
    """Wrap ``trainer.compute_loss`` so every training loss carries the proximal term.

    Raises:
        TrainingError: the model has no trainable weights to anchor.
    """
    pairs = [(p, p.detach().clone()) for p in trainer.model.parameters() if p.requires_grad]
    if not pairs:
        raise TrainingError("FedProx: the model has no trainable (LoRA) weights to anchor the proximal term to")
    inner = trainer.compute_loss

    def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        out = inner(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        loss = out[0] if return_outputs else out
        prox = sum(((p - w0.to(p.device)) ** 2).sum() for p, w0 in pairs)
        loss = loss + (mu / 2.0) * prox
        return (loss, *out[1:]) if return_outputs else loss

    trainer.compute_loss = compute_loss
