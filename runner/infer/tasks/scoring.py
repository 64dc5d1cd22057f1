"""RULER's scoring, with the sampling noise of a task score said out loud.

Owns: RULER's two metrics (`string_match_all`: the fraction of the references found in the prediction;
`string_match_part`: 1 if any is; both case-insensitive substring tests, as in RULER's `scripts/eval/synthetic/
constants.py`, after RULER's post-processing of the prediction), a task's score (the mean over its samples × 100),
its 95 % interval, whether an uncompressed score is informative, and how far a candidate fell beyond the noise.

Intervals (the mean of n per-sample scores, each in [0, 1]):
- every score 0 or 1 (single-needle tasks, `string_match_part`): the Wilson score interval for a proportion;
- fractional scores (multi-answer tasks under `string_match_all`): Student's t interval on the mean, clipped to
  [0, 1]; when the scores do not vary (t's width would be 0, e.g. every sample at 0.75) or n = 1, the Wilson
  interval of the mean over n trials instead, so no score is ever reported as exact.
Does not know about models or caches.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
Z = 1.959963984540054  # the standard normal's 97.5th percentile
# Student's t, 97.5th percentile, for 1..30 degrees of freedom; beyond, the Cornish–Fisher expansion (to ~1e-4)
_T975 = [12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423]
INFORMATIVE_FLOOR = 10.0  # points: an uncompressed score is informative when its interval lies above this


def postprocess(prediction: str) -> str:
    """RULER's `postprocess_pred`: strip, control characters become line breaks, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of `references` found in `prediction` (case-insensitive substrings), in [0, 1]."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    found = postprocess(prediction).lower()
    return sum(r.lower() in found for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any of `references` is in `prediction` (case-insensitive substrings), else 0.0."""
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    found = postprocess(prediction).lower()
    return float(any(r.lower() in found for r in references))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all, "string_match_part": string_match_part}


def score(metric: str, prediction: str, references: Sequence[str]) -> float:
    """One sample's score in [0, 1] under the metric named `metric`."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; metrics: {', '.join(METRICS)}")
    return METRICS[metric](prediction, references)


def task_score(metric: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's task score: the mean of the samples' scores × 100 (RULER rounds it to 2 decimals; we do not)."""
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"need one reference list per prediction, at least one "
                         f"(got {len(predictions)} predictions, {len(references)} reference lists)")
    return 100 * sum(score(metric, p, r) for p, r in zip(predictions, references)) / len(predictions)


@dataclass(frozen=True)
class Interval:
    """A 95 % interval for a task score, in points (0..100), and how it was made ("wilson" or "t")."""

    low: float
    high: float
    method: str

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high


def wilson(successes: float, n: int, z: float = Z) -> tuple[float, float]:
    """The Wilson score interval of a proportion successes / n, as fractions in [0, 1]."""
    if n < 1:
        raise ValueError("an interval needs at least one sample")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0))
    return max(0.0, centre - half), min(1.0, centre + half)


def t975(df: int) -> float:
    """Student's t 97.5th percentile for `df` ≥ 1 degrees of freedom."""
    if df < 1:
        raise ValueError("t needs at least one degree of freedom")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def interval(scores: Sequence[float]) -> Interval:
    """The 95 % interval of the mean of per-sample `scores` (each in [0, 1]), in points: see the module's rules."""
    n = len(scores)
    if n == 0:
        raise ValueError("an interval needs at least one sample")
    if any(not 0 <= s <= 1 for s in scores):
        raise ValueError(f"per-sample scores must lie in [0, 1] (got {list(scores)})")
    mean = sum(scores) / n
    if all(s in (0.0, 1.0) for s in scores) or n == 1 or statistics.pstdev(scores) == 0:
        low, high = wilson(mean * n, n)
        return Interval(100 * low, 100 * high, "wilson")
    half = t975(n - 1) * statistics.stdev(scores) / math.sqrt(n)
    return Interval(100 * max(0.0, mean - half), 100 * min(1.0, mean + half), "t")


@dataclass(frozen=True)
class TaskScore:
    """A task's score at one length: the mean × 100, its sample count and 95 % interval."""

    task: str
    length: int
    score: float  # points, 0..100
    n: int
    interval: Interval

    @classmethod
    def of(cls, task: str, length: int, scores: Sequence[float]) -> TaskScore:
        return cls(task, length, 100 * sum(scores) / len(scores) if scores else math.nan, len(scores),
                   interval(scores))

    @property
    def informative(self) -> bool:
        return informative(self.score, self.interval)


def informative(score: float, interval: Interval | tuple[float, float], floor: float = INFORMATIVE_FLOOR) -> bool:
    """Whether an uncompressed cache's task score can gate a compressed one: its 95 % interval lies wholly above
    `floor` points (10 by default). RULER's tasks have no chance level to speak of (guessing a 7-digit number or
    five variable names scores ~0), so "above chance" means "clearly above zero": with 5 samples of a 0/1 task that
    takes at least 2 right (Wilson's low bound for 2/5 is 11.8; for 1/5, 3.6). Below it, a drop cannot be told from
    noise and the task is reported as uninformative for that model and length, not used as a gate."""
    low = interval.low if isinstance(interval, Interval) else interval[0]
    return score > floor and low > floor


def drop_beyond_noise(baseline: TaskScore, candidate: TaskScore) -> float:
    """Points the candidate's score fell below the baseline's 95 % interval (0 when within it or above): a drop
    within the interval is not a drop."""
    return max(0.0, baseline.interval.low - candidate.score)
