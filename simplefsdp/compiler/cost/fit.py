"""Fitting ``seconds = alpha + beta * bytes`` to timings that carry noise.

Timings on a shared host have outliers (a repeat that met a descheduled thread, a size
that met another job); a plain least-squares line follows them. ``robust_fit`` takes
the median of each size's repeats, a Theil-Sen line through those, drops the sizes far
off it and fits the rest by weighted least squares. Pure arithmetic: no torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``seconds ~ alpha + beta * nbytes``, both clamped to >= 0.

    Residuals are weighted by ``1 / seconds**2`` (a fit of the *relative* error): the
    sizes span three orders of magnitude and an unweighted fit would let the largest
    message decide everything, leaving alpha to noise. Pure Python floats, so the same
    inputs give bit-identical output on every rank.
    """
    if len(nbytes) != len(seconds) or not nbytes:
        raise ValueError("need as many sizes as times, at least one")
    scale = max(float(n) for n in nbytes) or 1.0
    xs = [float(n) / scale for n in nbytes]
    ys = [float(t) for t in seconds]
    ws = [1.0 / max(y, 1e-12) ** 2 for y in ys]
    s = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs, strict=True))
    sy = sum(w * y for w, y in zip(ws, ys, strict=True))
    sxx = sum(w * x * x for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * x * y for w, x, y in zip(ws, xs, ys, strict=True))
    det = s * sxx - sx * sx
    if len(xs) >= 2 and det > 0:
        b = (s * sxy - sx * sy) / det
        a = (sy - b * sx) / s
    else:  # one size (or all equal): no slope information
        a, b = sy / s, 0.0
    if a < 0:  # refit through the origin
        a, b = 0.0, (sxy / sxx if sxx > 0 else 0.0)
    if b < 0:  # flat: latency only
        a, b = sy / s, 0.0
    return max(a, 0.0), max(b, 0.0) / scale


OUTLIER_FACTOR = 2.0  # a size whose median is off the first fit by 2x either way


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Theil-Sen line ``y ~ a + b * x``: ``b`` the median of the pairwise slopes, ``a`` the
    median of ``y - b * x``. Exact on points that lie on a line, and a minority of wild
    points moves neither (breakdown point ~29%). Pure Python: bit-identical on every rank.
    """
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs))
              for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    b = statistics.median(slopes) if slopes else 0.0
    a = statistics.median(y - b * x for x, y in zip(xs, ys, strict=True))
    return a, b


def robust_fit(nbytes: Sequence[float], samples: Sequence[float | Sequence[float]]
               ) -> tuple[tuple[float, float], list[int]]:
    """``(alpha, beta)`` of ``seconds ~ alpha + beta * nbytes`` from noisy timings, and the
    indices of the sizes dropped as outliers.

    ``samples[i]``: one time or the repeated times of size ``nbytes[i]``. 1. the median
    of each size's repeats (a descheduled rank stalls single timings by several x);
    2. a Theil-Sen line through the medians; 3. sizes whose median is more than
    ``OUTLIER_FACTOR`` off that line (either way) are dropped, as long as two sizes
    remain; 4. :func:`fit_alpha_beta` (least squares of the relative error, both >= 0)
    on the rest. Exact on noiseless data (every step is).
    """
    if len(nbytes) != len(samples) or not nbytes:
        raise ValueError("need as many sizes as timings, at least one")
    medians = [statistics.median(s) if isinstance(s, Sequence) else float(s) for s in samples]
    xs = [float(n) for n in nbytes]
    if len(set(xs)) < 2:
        return fit_alpha_beta(xs, medians), []
    a, b = theil_sen(xs, medians)
    keep, dropped = [], []
    for i, (x, y) in enumerate(zip(xs, medians, strict=True)):
        line = a + b * x
        ok = line > 0 and y > 0 and 1 / OUTLIER_FACTOR <= y / line <= OUTLIER_FACTOR
        (keep if ok else dropped).append(i)
    if len({xs[i] for i in keep}) < 2:  # the line itself is unusable: keep everything
        keep, dropped = list(range(len(xs))), []
    return fit_alpha_beta([xs[i] for i in keep], [medians[i] for i in keep]), dropped
