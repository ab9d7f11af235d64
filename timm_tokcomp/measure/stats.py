"""Statistics the measuring commands report: exact McNemar and Clopper-Pearson tests on paired image counts,
speed-up intervals on interleaved timing rounds, percentiles. Pure Python."""
import functools
import math
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple


def p90(values: List[float]) -> float:
    """90th percentile, linearly interpolated between the ordered values (a single value is its own)."""
    return statistics.quantiles(values, n=10, method="inclusive")[8] if len(values) > 1 else values[0]


def mcnemar_exact_p(gained: int, lost: int) -> float:
    """Exact two-sided McNemar test: the probability of a split of gained + lost changed images at
    least this uneven if each change were equally likely to go either way (binomial, p = 1/2)."""
    if gained < 0 or lost < 0:
        raise ValueError(f"gained and lost must be >= 0, got {gained}, {lost}")
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(gained, lost) + 1)) / 2 ** n
    return min(1.0, 2.0 * tail)


def _log_binom_pmf(k: int, n: int, p: float) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + (k * math.log(p) if k else 0.0) + ((n - k) * math.log1p(-p) if n - k else 0.0))


def disagreement_lower_bound(changed: int, n: int, confidence: float = 0.95) -> float:
    """One-sided exact (Clopper-Pearson) lower bound of the rate behind `changed` of `n` images, as a fraction."""
    if changed == 0:
        return 0.0
    alpha = 1 - confidence

    def upper_tail(p: float) -> float:  # P(X >= changed | p), summed over the shorter side
        if changed > n // 2:
            return sum(math.exp(_log_binom_pmf(k, n, p)) for k in range(changed, n + 1))
        return 1.0 - sum(math.exp(_log_binom_pmf(k, n, p)) for k in range(changed))

    lo, hi = 0.0, changed / n
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if upper_tail(mid) < alpha else (lo, mid)
    return lo


def rate_upper_bound(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided exact (Clopper-Pearson) upper bound of the rate behind k of n, as a fraction (1 for n = 0)."""
    return 1.0 - disagreement_lower_bound(n - k, n, confidence)


@functools.lru_cache(maxsize=4096)
def loss_bounds(measure: str, n: int, changed: int, gained: int = 0, lost: int = 0,
                confidence: float = 0.95) -> Tuple[float, float, float]:
    """(loss, one-sided lower bound, one-sided upper bound) in percentage points on n paired images.
    'agreement': the % of images whose top-1 class changed, Clopper-Pearson on changed / n. 'top1': points of
    top-1 lost, (lost - gained) / n; of the d = gained + lost images whose correctness changed, `lost` turned
    wrong, and each bound is d (2 p - 1) / n with p the Clopper-Pearson bound of lost / d (the paired split, as
    McNemar's test reads it; 0 when d = 0)."""
    if measure == "agreement":
        return (100.0 * changed / n, 100.0 * disagreement_lower_bound(changed, n, confidence),
                100.0 * rate_upper_bound(changed, n, confidence))
    d = gained + lost
    if d == 0:
        return 0.0, 0.0, 0.0
    return (100.0 * (lost - gained) / n, 100.0 * d * (2 * disagreement_lower_bound(lost, d, confidence) - 1) / n,
            100.0 * d * (2 * rate_upper_bound(lost, d, confidence) - 1) / n)


def images_needed(measure: str, n: int, changed: int, gained: int, lost: int, budget: float,
                  most: int = 10 ** 6) -> Optional[int]:
    """How many paired images would put loss_bounds' upper bound within budget if the counts kept their rates
    (scaled from n images); None where no number would (the loss itself is at or above the budget, or it needs
    more than `most`)."""
    if loss_bounds(measure, n, changed, gained, lost)[0] >= budget:
        return None

    def fits(m: int) -> bool:
        scale = m / n
        return loss_bounds(measure, m, round(changed * scale), round(gained * scale), round(lost * scale))[2] <= budget

    return _fewest_fitting(fits, n, most)


def _fewest_fitting(fits: Callable[[int], bool], start: int, most: int) -> Optional[int]:
    """The fewest images m >= start, within 1 %, for which fits(m) (which holds from some m on): doubling from start,
    then bisection; None when it needs more than `most`."""
    lo = hi = start
    while not fits(hi):
        if hi > most:
            return None
        lo, hi = hi, 2 * hi
    while hi - lo > max(1, lo // 100):  # within 1 %: the counts' rates are estimates too
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """The 97.5 % quantile of Student's t with df degrees of freedom: the table to df = 30, a Cornish-Fisher
    expansion beyond (within 1e-4 there)."""
    if df < 1:
        return float("inf")
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2) \
        + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3)


def speedup_interval(plain: Sequence[float], times: Sequence[float]) -> Tuple[float, float, float]:
    """Speed-up of `times` against `plain` (seconds of interleaved rounds, paired by position): the geometric mean
    of the rounds' ratios plain / times, and its 95 % t interval (lo, hi), computed on the log ratios, so the
    estimate always lies inside its interval; (estimate, 0, inf) with fewer than 2 rounds."""
    if not plain or len(plain) != len(times):
        raise ValueError(f"speedup_interval needs paired rounds, got {len(plain)} and {len(times)}")
    logs = [math.log(p / t) for p, t in zip(plain, times)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, float("inf")
    half = t_quantile_975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def noise_notes(intervals: Sequence[Tuple[str, Dict[str, Tuple[Optional[float], Optional[float]]]]],
                more_rounds: str) -> List[str]:
    """One 'note: within timing noise' line per column whose 95 % interval holds 1.00x for some rows. intervals:
    (row name, {column: (lo, hi)}); more_rounds: the flags that time more rounds."""
    lines = []
    for column in dict.fromkeys(c for _, cols in intervals for c in cols):
        noisy = [name for name, cols in intervals
                 if cols.get(column, (None, None))[0] is not None and cols[column][0] <= 1.0 <= cols[column][1]]
        if noisy:
            lines.append(f"note: {column}: within timing noise (its 95 % interval holds 1.00x: the spread is larger "
                         f"than the effect): {', '.join(noisy)}; time more rounds ({more_rounds}) or on a quieter "
                         f"machine")
    return lines


# the share of images whose top-1 correctness a mild setting changes (gained + lost): ToMe r = 8 on DeiT-Tiny,
# imagenet-val-1300 (23 of 1,172 held-out images; 9 of 448); a promise's images scale with it
TYPICAL_DISCORDANT = 0.02


def images_for_promise(measure: str, loss: float, budget: float, discordant: float = TYPICAL_DISCORDANT,
                       most: int = 10 ** 6) -> Optional[int]:
    """About how many paired images bring loss_bounds' one-sided 95 % upper bound within budget for a setting whose
    true loss is `loss` points: 'top1' with a share `discordant` (at least the loss) of images changing correctness;
    'agreement' with loss % of predictions changed. None where no number up to `most` would (loss >= budget)."""
    if loss >= budget:
        return None
    rate = loss / 100.0
    d = max(discordant, rate)

    def fits(m: int) -> bool:
        if measure == "agreement":
            return loss_bounds(measure, m, round(rate * m))[2] <= budget
        lost, gained = round(m * (d + rate) / 2), round(m * (d - rate) / 2)
        return loss_bounds(measure, m, lost + gained, gained, lost)[2] <= budget

    # top-1: from ten changed images at least, so that rounding the counts does not decide
    return _fewest_fitting(fits, max(1, math.ceil(10 / d)) if measure == "top1" else 1, most)


def promisable_loss(measure: str, held_out: int, budget: float, discordant: float = TYPICAL_DISCORDANT) -> float:
    """The largest true loss (a multiple of budget / 20) that held_out images can promise within budget
    (images_for_promise); 0 when none."""
    step = budget / 20.0
    best = 0.0
    for k in range(1, 20):
        need = images_for_promise(measure, k * step, budget, discordant)
        if need is None or need > held_out:
            break
        best = k * step
    return best
