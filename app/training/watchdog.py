"""Loss watchdog (threats-and-faults case 26): NaN/Inf or a lasting loss spike aborts the run.

Fed every logged loss (and gradient norm) in order. NaN/Inf aborts at once (the trainer logs with
``logging_nan_inf_filter=False``: HF would otherwise log a NaN loss as the running mean). A loss above ``spike_factor`` × the
median of the previous ``window`` good losses is a spike; ``patience`` consecutive spikes abort.
While a spike lasts the trainer seals no checkpoint (``suspicious``), so the last sealed checkpoint
predates the divergence. Pure Python: no torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from app.config import LossWatchdogSettings


class LossWatchdog:
    """Stateful detector; :meth:`check` returns the reason to abort, or ``None``."""

    def __init__(self, settings: LossWatchdogSettings) -> None:
        self.settings = settings
        self.recent: deque[float] = deque(maxlen=settings.window)
        self.spikes = 0

    @property
    def suspicious(self) -> bool:
        """True while a spike lasts (checkpoints taken now could hold diverged weights)."""
        return self.spikes > 0

    def check(self, step: int, loss: float, grad_norm: float | None = None) -> str | None:
        """Record ``loss`` at ``step``; the abort reason (no data, numbers only) or ``None``."""
        if not self.settings.enabled:
            return None
        if not math.isfinite(loss):
            self.spikes += 1
            return f"loss is {loss} at step {step}"
        if grad_norm is not None and not math.isfinite(grad_norm):
            self.spikes += 1
            return f"gradient norm is {grad_norm} at step {step}"
        if self.recent:
            median = statistics.median(self.recent)
            if median > 0 and loss > self.settings.spike_factor * median:
                self.spikes += 1
                if self.spikes >= self.settings.patience:
                    return (f"loss spiked to {loss:.4g} at step {step} (> {self.settings.spike_factor:g} x median "
                            f"{median:.4g}) for {self.spikes} consecutive logs")
                return None
        self.spikes = 0
        self.recent.append(loss)
        return None
