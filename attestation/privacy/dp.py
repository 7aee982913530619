"""Differential privacy in the manifest: the ``privacy`` block and the verifier step ``privacy.dp``.

A bundle trained with ``training.privacy.mode: dp-sgd`` carries a ``privacy`` block: the mechanism's parameters
(clipping norm, noise multiplier, Poisson sample rate, steps, accountant) and the (epsilon, delta) they spent. The
quote binds the manifest, so the block says what the measured code did, not what someone claims.

``privacy.dp`` trusts none of the numbers it can recompute:

* ``rows`` = ``dataset.rows`` (N after deduplication and the token policy), ``steps`` = ``training.global_step``,
  ``sample_rate`` = ``expected_batch_size / rows``, ``delta`` < 1/N;
* clipping norm, accountant, target epsilon, a configured noise multiplier and the batch are the bundle config's
  ``training`` section (``config.json``, hashed in the manifest);
* epsilon is recomputed without torch (:mod:`attestation.privacy.epsilon`: RDP as Opacus evaluates it, PRV with
  ``dp-accounting``'s independent PLD accountant) from (noise multiplier, sample rate, steps) at delta, and the
  recorded figure (the training side's Opacus accountant, :func:`accountant_epsilon`) must agree with it: within
  float noise for ``rdp``, within ``PRV_ABS_TOL + PRV_REL_TOL * epsilon`` for ``prv``; the recomputed figure is
  the one shown and bounded by the policy;
* ``privacy.dp`` depends on the bundle's bytes only (an integrity check: every honest export passes it); the
  separate ``privacy.policy`` check, present when the policy sets ``max_epsilon`` or ``max_delta``, bounds the
  recomputed values, and rejects a bundle trained without DP.

Every number is bounded before the accountant sees it (:func:`history_problems`; the same bounds refuse a training
configuration): a noise multiplier outside [``NOISE_MIN``, ``NOISE_MAX``], more than ``MAX_STEPS`` steps, and for
``prv`` more than ``PRV_MAX_STEPS`` steps or a discretisation mesh over ``PRV_MAX_POINTS`` points (its memory grows
with it: 10**7 steps would need terabytes) fail the check instead of exhausting the verifier.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

from attestation.bundle.manifest import Manifest, PrivacyInfo
from attestation.privacy.epsilon import PRV_ABS_TOL, PRV_REL_TOL, pld_epsilon, prv_half_width, rdp_epsilon
from attestation.io.safe_yaml import parse_json
from attestation.verdict import QuoteFindings

if TYPE_CHECKING:
    from attestation.policy import Policy

CHECK = "privacy.dp"
POLICY_CHECK = "privacy.policy"
EPSILON_REL_TOL = 1e-6  # the recomputed epsilon may differ from the recorded one by float noise only
NOISE_MIN, NOISE_MAX = 0.01, 1e6  # sigma; Opacus derives at most 655360 (its MAX_SIGMA is 1e6), and 0.0235 for epsilon 1000
MAX_STEPS = 10_000_000  # training.max_steps' own bound
PRV_MAX_STEPS = 100_000  # prv: its mesh grows with the square root of the steps (and with epsilon and 1/delta)
PRV_MAX_POINTS = 1 << 22  # prv mesh points: about 700 MB and 10 s on a CPU
MAX_ROWS = 10**12
MAX_BATCH = 1 << 32  # per_device_batch_size x gradient_accumulation_steps, each at most 65536



def _number(value: object, low: float, high: float) -> bool:
    """A finite int or float (not a bool) within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (isinstance(value, int) or math.isfinite(value)) and low <= value <= high  # a huge int: no float()


def history_problems(accountant: str, history: list[tuple[float, float, int]], delta: float) -> list[str]:
    """Why the accountant must not be run on ``history`` at ``delta`` (empty: it may). Cheap: for ``prv`` the mesh
    size is computed (Opacus' own formula, from RDP bounds) before anything is discretised."""
    if accountant not in ("rdp", "prv"):
        return [f"accountant {str(accountant)[:20]!r} is not rdp or prv"]
    problems = [] if _number(delta, 0.0, 1.0) and 0 < delta < 1 else ["delta is not a number between 0 and 1"]
    max_steps = PRV_MAX_STEPS if accountant == "prv" else MAX_STEPS
    for sigma, q, steps in history:
        if not _number(sigma, NOISE_MIN, NOISE_MAX):
            problems.append(f"noise multiplier {sigma!r:.20} is outside [{NOISE_MIN:g}, {NOISE_MAX:g}]")
        if not (_number(q, 0.0, 1.0) and q > 0):
            problems.append(f"sample rate {q!r:.20} is outside (0, 1]")
        if not (isinstance(steps, int) and not isinstance(steps, bool) and 0 <= steps <= max_steps):
            problems.append(f"{str(steps)[:20]} steps is outside [0, {max_steps}] for the {accountant} accountant")
    if problems or accountant != "prv" or not any(n for _s, _q, n in history):
        return problems
    try:
        points = prv_mesh_points(history, delta)
    except (ArithmeticError, RuntimeError, ValueError) as exc:
        return [f"the prv accountant's mesh cannot be sized for these parameters: {str(exc)[:200]}"]
    if not points <= PRV_MAX_POINTS:
        problems.append(f"the prv accountant would discretise {points:.3g} points for these parameters (at most "
                        f"{PRV_MAX_POINTS}): use the rdp accountant")
    return problems


def prv_mesh_points(history: list[tuple[float, float, int]], delta: float) -> float:
    """Points of the mesh Opacus' PRV accountant discretises (its ``_get_domain`` at the default error bounds),
    computed without Opacus."""
    eps_error, delta_error = 0.01, delta / 1000  # PRVAccountant.get_epsilon's defaults
    history = [(s, q, n) for s, q, n in history if n]
    half = prv_half_width(history, delta_error, eps_error)
    mesh = eps_error / math.sqrt(sum(n for _s, _q, n in history) * math.log(12 / delta_error) / 2)
    return 2 * half / mesh + 1


def recompute_epsilon(accountant: str, history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon spent at ``delta`` by ``history`` [(noise multiplier, sample rate, steps)], recomputed without torch
    (:mod:`attestation.privacy.epsilon`): what the verifier shows.

    Raises:
        ValueError: the parameters are outside the bounds above, or the accountant cannot compute them.
    """
    if not history:
        return 0.0
    history = [tuple(h) for h in history]  # type: ignore[misc]
    if problems := history_problems(accountant, history, delta):
        raise ValueError("; ".join(problems))
    try:
        eps = rdp_epsilon(history, delta) if accountant == "rdp" else pld_epsilon(history, delta)
    except (ArithmeticError, RuntimeError, ValueError) as exc:
        raise ValueError(f"the {accountant} accountant cannot compute epsilon: {str(exc)[:200]}") from exc
    if math.isnan(eps):
        raise ValueError(f"the {accountant} accountant computed no epsilon (NaN)")
    return eps


def epsilon_agrees(accountant: str, recomputed: float, recorded: float) -> bool:
    """The recorded (Opacus) epsilon is the recomputed one: to float noise for ``rdp`` (the same formulas), within
    ``PRV_ABS_TOL + PRV_REL_TOL * epsilon`` for ``prv`` (two numerical methods)."""
    if accountant == "prv":
        return abs(recomputed - recorded) <= PRV_ABS_TOL + PRV_REL_TOL * max(recomputed, recorded)
    return math.isclose(recomputed, recorded, rel_tol=EPSILON_REL_TOL, abs_tol=1e-9)


def accountant_epsilon(accountant: str, history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon spent at ``delta`` by ``history`` [(noise multiplier, sample rate, steps)], computed by Opacus: the
    training side's figure (recorded in the manifest); the verifier uses :func:`recompute_epsilon`.

    Raises:
        ValueError: the parameters are outside the bounds above, or the accountant cannot compute them (Opacus'
            own errors, whatever their class, are re-raised as ValueError).
    """
    from opacus.accountants import create_accountant  # imports torch: only for bundles that carry DP

    if not history:
        return 0.0
    history = [tuple(h) for h in history]  # type: ignore[misc]
    if problems := history_problems(accountant, history, delta):
        raise ValueError("; ".join(problems))
    acc = create_accountant(mechanism=accountant)
    acc.history = history
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Optimal order is the")
            eps = float(acc.get_epsilon(delta=delta))
    except (ArithmeticError, RuntimeError, ValueError) as exc:  # e.g. prv: "Discrete mean differs significantly"
        raise ValueError(f"the {accountant} accountant cannot compute epsilon: {str(exc)[:200]}") from exc
    if math.isnan(eps):
        raise ValueError(f"the {accountant} accountant computed no epsilon (NaN)")
    return eps


def _config_problems(dp: PrivacyInfo, config_bytes: bytes | None) -> list[str]:
    """The block's parameters must be the bundle config's ``training.privacy`` and batch."""
    try:
        training = parse_json(config_bytes or b"", "config.json", ValueError)["training"]  # type: ignore[index]
        p = training["privacy"]
        batch = int(training["per_device_batch_size"]) * int(training["gradient_accumulation_steps"])
        if not isinstance(p, dict):
            raise TypeError("training.privacy is not a mapping")
    except (ValueError, KeyError, TypeError, ArithmeticError):
        return ["the bundle config has no readable training.privacy section"]
    want: dict[str, Any] = {"mode": "dp-sgd", "max_grad_norm": dp.max_grad_norm, "accountant": dp.accountant,
                            "target_epsilon": dp.target_epsilon}
    if not dp.noise_derived:
        want["noise_multiplier"] = dp.noise_multiplier
    if p.get("target_delta") is not None:
        want["target_delta"] = dp.delta
    problems = [f"{k} {p.get(k)!r} in the bundle config, {v!r} in the manifest" for k, v in want.items() if p.get(k) != v]
    if batch != dp.expected_batch_size:
        problems.append(f"expected batch {dp.expected_batch_size} is not the config's {batch}")
    return problems


def _problems(dp: PrivacyInfo, m: Manifest, config_bytes: bytes | None) -> tuple[list[str], float]:
    """What is inconsistent in the block, and epsilon as recomputed (inf when it cannot be)."""
    bounds = _bound_problems(dp)
    if bounds:  # nothing is computed with numbers out of range
        return bounds, math.inf
    problems = _config_problems(dp, config_bytes)
    if dp.rows != m.dataset.rows:
        problems.append(f"privacy rows {dp.rows} != dataset rows {m.dataset.rows}")
    if dp.steps != m.training.global_step:
        problems.append(f"privacy steps {dp.steps} != global_step {m.training.global_step}")
    if not math.isclose(dp.sample_rate, dp.expected_batch_size / dp.rows, rel_tol=1e-9):
        problems.append(f"sample rate {dp.sample_rate:g} != expected batch {dp.expected_batch_size} / {dp.rows} rows")
    if not dp.delta < 1 / dp.rows:
        problems.append(f"delta {dp.delta:.3g} is not below 1/N = 1/{dp.rows}")
    try:
        eps = recompute_epsilon(dp.accountant, [(dp.noise_multiplier, dp.sample_rate, dp.steps)], dp.delta)
    except ImportError as exc:
        problems.append(f"epsilon cannot be recomputed without {exc.name}: install the verifier "
                        "(sh requirements/install.sh VENV requirements/verify.lock)")
        return problems, math.inf
    except ValueError as exc:
        problems.append(f"epsilon cannot be recomputed from the block: {exc}")
        return problems, math.inf
    if not epsilon_agrees(dp.accountant, eps, dp.epsilon):
        problems.append(f"recorded epsilon {dp.epsilon:.6g} is not what the {dp.accountant} accountant gives for "
                        f"these parameters ({eps:.6g})")
    if dp.epsilon > dp.target_epsilon * (1 + EPSILON_REL_TOL):
        problems.append(f"epsilon {dp.epsilon:.4g} exceeds the run's target {dp.target_epsilon:g}")
    return problems, eps


def _bound_problems(dp: PrivacyInfo) -> list[str]:
    """The block's numbers out of range (checked before any arithmetic: rows and batch may be huge integers)."""
    problems = []
    if not _number(dp.rows, 2, MAX_ROWS):
        problems.append(f"privacy rows {str(dp.rows)[:20]} is outside [2, {MAX_ROWS:g}]")
    if not _number(dp.expected_batch_size, 1, MAX_BATCH):
        problems.append(f"expected batch {str(dp.expected_batch_size)[:20]} is outside [1, {MAX_BATCH}]")
    for name in ("max_grad_norm", "epsilon", "target_epsilon"):
        if not math.isfinite(getattr(dp, name)):
            problems.append(f"{name} is not a finite number")
    return problems + history_problems(dp.accountant, [(dp.noise_multiplier, dp.sample_rate, dp.steps)], dp.delta)


def check(f: QuoteFindings, m: Manifest, policy: Policy, config_bytes: bytes | None) -> None:
    """Add ``privacy.dp`` (the block is what the run did; bundle bytes only) and, when the policy bounds epsilon or
    delta, ``privacy.policy`` for a bundle whose manifest parsed (``config_bytes``: its config.json)."""
    dp = m.privacy
    bounded = policy.max_epsilon is not None or policy.max_delta is not None
    chain = getattr(m, "op_chain", None)
    if dp is None and chain is not None and chain.dp is not None:
        _check_api(f, m, policy)
        return
    if dp is None:
        f.add(CHECK, "skip", "trained without differential privacy (training.privacy off)")
        if bounded:
            f.add(POLICY_CHECK, "fail", "the policy requires differential privacy (max_epsilon "
                  f"{policy.max_epsilon}, max_delta {policy.max_delta}); this run trained without DP-SGD")
        return
    problems, eps = _problems(dp, m, config_bytes)
    _conclude(f, policy, problems, eps, dp.delta, "privacy block", lambda: (
        f"(ε, δ) = ({eps:.4g}, {dp.delta:.3g}) as run: DP-SGD, Poisson sampling q={dp.sample_rate:.4g} "
        f"of N={dp.rows} rows, clipping C={dp.max_grad_norm:g}, noise σ={dp.noise_multiplier:.4g}, {dp.steps} "
        f"steps, {dp.accountant} accountant, opacus {dp.library.opacus} recorded ε {dp.epsilon:.4g}"))


def _conclude(f: QuoteFindings, policy: Policy, problems: list[str], eps: float, delta: float, block: str,
              shown: Any) -> None:
    """Add ``privacy.dp`` (and, when the policy bounds (ε, δ), ``privacy.policy``) from what was found: an ε that
    could not be recomputed (out of range, malformed) fails both; ``shown()`` describes the guarantee otherwise."""
    bounded = policy.max_epsilon is not None or policy.max_delta is not None
    if not math.isfinite(eps):  # out of range or not recomputable: nothing else is worth showing
        f.add(CHECK, "fail", "; ".join(problems))
        if bounded:
            f.add(POLICY_CHECK, "fail", f"epsilon cannot be recomputed from the bundle's {block}")
        return
    f.add(CHECK, "fail" if problems else "pass", "; ".join([*problems, shown()]))
    if bounded:
        _policy(f, policy, eps, delta)


def _check_api(f: QuoteFindings, m: Manifest, policy: Policy) -> None:
    """``privacy.dp`` for a training-API checkpoint trained with DP-SGD (``op_chain.dp``): the ε its accountant
    recorded is recomputed from σ, q = batch / dataset size, the optimizer steps and δ, as for a nightly run; the
    policy's bounds apply alike."""
    dp, chain = m.op_chain.dp, m.op_chain  # type: ignore[union-attr]
    problems: list[str] = []
    try:
        sigma, clip, eps_rec = (float(dp[k]) for k in ("noise_multiplier", "max_grad_norm", "epsilon"))
        n, b, steps = (dp[k] for k in ("dataset_size", "batch_size", "steps"))
        q, delta, accountant = float(dp["sample_rate"]), float(dp["delta"]), str(dp["accountant"])
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (n, b, steps)):
            raise TypeError("dataset_size, batch_size and steps must be integers")
    except (KeyError, TypeError, ValueError) as exc:
        return _conclude(f, policy, [f"op_chain.dp is incomplete or malformed: {exc}"], math.inf, 0.0, "op_chain.dp",
                         None)
    if not (_number(n, 2, MAX_ROWS) and _number(b, 1, min(n, MAX_BATCH))):
        problems.append(f"dataset_size {str(n)[:20]} / batch_size {str(b)[:20]} out of range")
    elif not math.isclose(q, b / n, rel_tol=1e-9):
        problems.append(f"sample rate {q:g} != batch_size {b} / dataset_size {n}")
    if steps != chain.optimizer_steps:
        problems.append(f"DP steps {steps} != the model's optimizer steps {chain.optimizer_steps}")
    if not (math.isfinite(clip) and clip > 0 and math.isfinite(eps_rec)):
        problems.append("max_grad_norm and epsilon must be finite (max_grad_norm > 0)")
    eps = math.inf
    if not problems:
        try:
            eps = recompute_epsilon(accountant, [(sigma, q, steps)] if steps else [], delta)  # no step: none spent
        except ImportError as exc:
            problems.append(f"epsilon cannot be recomputed without {exc.name}: install the verifier "
                            "(sh requirements/install.sh VENV requirements/verify.lock)")
        except ValueError as exc:
            problems.append(f"epsilon cannot be recomputed from op_chain.dp: {exc}")
        else:
            if not epsilon_agrees(accountant, eps, eps_rec):
                problems.append(f"recorded epsilon {eps_rec:.6g} is not what the {accountant} accountant gives for "
                                f"these parameters ({eps:.6g})")
    _conclude(f, policy, problems, eps, delta, "op_chain.dp", lambda: (
        f"(ε, δ) = ({eps:.4g}, {delta:.3g}) as served: DP-SGD per datum, sample rate q={q:.4g} (batch {b} of "
        f"{n}, the client's Poisson sampling), clipping C={clip:g}, noise σ={sigma:.4g}, {steps} steps, "
        f"{accountant} accountant, recorded ε {eps_rec:.4g}"))


def _policy(f: QuoteFindings, policy: Policy, eps: float, delta: float) -> None:
    """``privacy.policy``: the recomputed (ε, δ) within the policy's bounds."""
    over = []
    if policy.max_epsilon is not None and eps > policy.max_epsilon:
        over.append(f"epsilon {eps:.4g} is above the policy's max_epsilon {policy.max_epsilon:g}")
    if policy.max_delta is not None and delta > policy.max_delta:
        over.append(f"delta {delta:.3g} is above the policy's max_delta {policy.max_delta:g}")
    f.add(POLICY_CHECK, "fail" if over else "pass", "; ".join(over) or
          f"(ε, δ) = ({eps:.4g}, {delta:.3g}) within the policy's max_epsilon {policy.max_epsilon}, "
          f"max_delta {policy.max_delta}")
