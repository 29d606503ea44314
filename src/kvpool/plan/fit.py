"""Fit the prefill model's effective speeds to measured cold prefills.

A cold run (nothing cached) of ``N`` tokens takes, by :mod:`kvpool.plan.prefill`
(every attention kernel runs a cold prefill as the causal triangle),

    t(N) = overhead + F_lin(N) · a + F_attn(N) · b,   a = 1/R_lin, b = 1/R_attn.

Three unknowns, linear in them: with cold runs at three or more prompt lengths, least
squares gives them. Residuals are relative (each row divided by its measured time),
so a 50 ms run counts as much as a 3 s one: the prediction must hold at every hit
ratio, and high hits are short runs. The unknowns must be >= 0; when the
unconstrained solution has a negative one, every subset of unknowns is tried (3
unknowns: 7 subsets) and the best non-negative fit is kept (an exact small NNLS).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kvpool.errors import UserError
from kvpool.plan.prefill import Rates, prefill_flops
from kvpool.plan.spec import ModelSpec

_SLOW = 1e-30  # seconds per FLOP standing for "free": a rate of 1e30 FLOP/s


@dataclass(frozen=True)
class Fit:
    """Fitted speeds, and the worst relative error over the runs they were fitted on."""

    linear_flops: float
    attention_flops: float
    overhead_s: float
    max_rel_error: float

    def rates(self, bandwidth: float, attention_kernel: str = "causal") -> Rates:
        """These speeds with a load ``bandwidth`` (bytes/s) and an attention kernel."""
        return Rates(linear=self.linear_flops, attention=self.attention_flops,
                     overhead_s=self.overhead_s, bandwidth=bandwidth,
                     attention_kernel=attention_kernel)


def fit_cold(spec: ModelSpec, runs: list[tuple[int, float]]) -> Fit:
    """Fit overhead, linear and attention FLOP/s to cold runs ``[(prompt_tokens,
    seconds), ...]`` (three or more distinct prompt lengths).

    Raises: UserError with fewer than 3 distinct lengths or a non-positive time.
    """
    if len({n for n, _ in runs}) < 3:
        raise UserError("fitting needs cold runs at 3 or more prompt lengths")
    if any(t <= 0 for _, t in runs):
        raise UserError("measured times must be > 0")
    t = np.array([s for _, s in runs])
    rows = []
    for n, _ in runs:
        f = prefill_flops(spec, n, 0)
        rows.append((1.0, f.linear, f.attention))
    x = np.array(rows) / t[:, None]  # relative residuals: (x·θ − t)/t
    theta = _nonneg_lstsq(x, np.ones(len(t)))
    pred = np.array(rows) @ theta
    overhead, a, b = theta
    return Fit(linear_flops=1 / max(a, _SLOW), attention_flops=1 / max(b, _SLOW),
               overhead_s=float(overhead), max_rel_error=float(np.max(np.abs(pred / t - 1))))


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x·θ − y|| over θ >= 0, by trying every support set (few columns)."""
    cols = x.shape[1]
    best, best_err = np.zeros(cols), float(np.sum(y ** 2))
    for k in range(1, cols + 1):
        for support in itertools.combinations(range(cols), k):
            sub, *_ = np.linalg.lstsq(x[:, support], y, rcond=None)
            if np.any(sub < 0):
                continue
            theta = np.zeros(cols)
            theta[list(support)] = sub
            err = float(np.sum((x @ theta - y) ** 2))
            if err < best_err:
                best, best_err = theta, err
    return best
