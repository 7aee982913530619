"""Epsilon of DP-SGD recomputed without torch: what ``privacy.dp`` (:mod:`attestation.privacy.dp`) shows and bounds.

The training side accounts with Opacus (which imports torch); the verifier recomputes the figure here, from the
manifest's (noise multiplier σ, sample rate q, steps T) at δ, with numpy, scipy and Google's ``dp-accounting``:

* ``rdp``: the Rényi DP of the Poisson-subsampled Gaussian mechanism at Opacus' orders (Mironov, Talwar and Zhang
  2019, section 3.3, the formulas Opacus' RDP accountant evaluates), converted to (ε, δ) with Balle et al. 2020,
  theorem 21. Written out below so that the figure equals Opacus' to float noise (``dp-accounting``'s own RDP
  accountant bounds orders below 2.5 more loosely: up to 2.8 times Opacus' ε in the ε > 100 range).
* ``prv``: ``dp-accounting``'s privacy loss distribution (PLD) accountant, an independent numerical method for the
  same mechanism (Opacus' PRV accountant discretises privacy loss random variables with its own error bounds).
  Its figure agrees with Opacus' within :data:`PRV_ABS_TOL` + :data:`PRV_REL_TOL` × ε (measured: 0.0063 to 0.0133
  below it on a grid of σ 0.4-5, q 0.001-1, T 1-30000, δ 1e-5 and 1e-9).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))  # Opacus' RDPAccountant.DEFAULT_ALPHAS
PLD_INTERVAL = 1e-4  # dp-accounting's default value discretisation interval
PLD_MAX_POINTS = 1 << 21  # a wider privacy-loss range is discretised more coarsely (still an upper bound)
PRV_ABS_TOL, PRV_REL_TOL = 0.03, 0.005  # PLD - Opacus PRV: -0.0133 to -0.0063 on 148 (σ, q, T, δ) points (docs)

History = Sequence[tuple[float, float, int]]


def _log_add(x: float, y: float) -> float:
    a, b = min(x, y), max(x, y)
    return b if a == -math.inf else math.log1p(math.exp(a - b)) + b


def _log_sub(x: float, y: float) -> float:
    if x < y:
        raise ValueError("the result of a subtraction in log space must be non-negative")
    if y == -math.inf:
        return x
    if x == y:
        return -math.inf
    try:
        return math.log(math.expm1(x - y)) + y
    except OverflowError:
        return x


def _log_erfc(x: float) -> float:
    from scipy import special

    return math.log(2) + float(special.log_ndtr(-x * 2**0.5))


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    from scipy import special

    log_a = -math.inf
    for i in range(alpha + 1):
        coef = math.log(special.binom(alpha, i)) + i * math.log(q) + (alpha - i) * math.log(1 - q)
        log_a = _log_add(log_a, coef + (i * i - i) / (2 * sigma**2))
    return log_a


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    from scipy import special

    log_a0, log_a1, i = -math.inf, -math.inf, 0
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    while True:  # the series' terms fall below e^-30 after O(σ·sqrt(log 1/q)) terms
        coef = float(special.binom(alpha, i))
        log_coef, j = math.log(abs(coef)), alpha - i
        log_t0 = log_coef + i * math.log(q) + j * math.log(1 - q)
        log_t1 = log_coef + j * math.log(q) + i * math.log(1 - q)
        log_s0 = log_t0 + (i * i - i) / (2 * sigma**2) + math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_s1 = log_t1 + (j * j - j) / (2 * sigma**2) + math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        if coef > 0:
            log_a0, log_a1 = _log_add(log_a0, log_s0), _log_add(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub(log_a0, log_s0), _log_sub(log_a1, log_s1)
        i += 1
        if max(log_s0, log_s1) < -30:
            return _log_add(log_a0, log_a1)


def _rdp(q: float, sigma: float, alpha: float) -> float:
    """RDP of one step of the Poisson-subsampled Gaussian mechanism at order ``alpha``."""
    if q == 1.0:
        return alpha / (2 * sigma**2)
    log_a = _log_a_int(q, sigma, int(alpha)) if float(alpha).is_integer() else _log_a_frac(q, sigma, alpha)
    return log_a / (alpha - 1)


def rdp_epsilon(history: History, delta: float) -> float:
    """(ε at δ) of ``history`` [(σ, q, T)] under RDP composition at :data:`ORDERS` (Opacus' figure)."""
    import numpy as np

    rdp = np.zeros(len(ORDERS))
    for sigma, q, steps in history:
        if steps:
            rdp += steps * np.array([_rdp(q, sigma, a) for a in ORDERS])
    orders = np.array(ORDERS)
    eps = rdp - (np.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders)
    return math.inf if np.isnan(eps).all() else float(np.nanmin(eps))


def prv_half_width(history: History, delta_error: float, eps_error: float) -> float:
    """Half-width L of the privacy-loss domain Opacus' PRV accountant discretises (its ``compute_safe_domain_size``:
    Gopi et al. 2021, remark 5.6, from RDP bounds)."""
    history = [(s, q, n) for s, q, n in history if n]
    total = sum(n for _s, _q, n in history)
    half = rdp_epsilon(history, delta_error / 4)
    for sigma, q, _n in history:
        half = max(half, rdp_epsilon([(sigma, q, 1)], delta_error / (8 * total)))
    return max(half, eps_error) + 3


@contextmanager
def _quiet_absl() -> Iterator[None]:
    """dp-accounting logs through absl (a WARNING per order it drops): not the verifier's output."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def pld_epsilon(history: History, delta: float) -> float:
    """(ε at δ) of ``history`` [(σ, q, T)] with dp-accounting's PLD accountant (add/remove one row, connect-the-dots,
    pessimistic: an upper bound). The interval is :data:`PLD_INTERVAL`, or coarser where the privacy loss spans more
    than :data:`PLD_MAX_POINTS` points of it (memory and time stay bounded; the bound stays an upper bound)."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    history = [(s, q, n) for s, q, n in history if n]
    if not history:
        return 0.0
    width = 2 * prv_half_width(history, delta / 1000, 0.01)
    accountant = PLDAccountant(value_discretization_interval=max(PLD_INTERVAL, width / PLD_MAX_POINTS))
    with _quiet_absl():
        for sigma, q, steps in history:
            event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
            accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
        return float(accountant.get_epsilon(delta))
