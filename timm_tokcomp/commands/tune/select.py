"""The choice, pure logic over measured rows: the fastest candidate within the budget whose speed-up is surely above
1 (and the minimum asked), or none with the reason; the Pareto front."""
import math
import statistics
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ...measure.stats import images_needed
from .rows import BUDGET_MEASURES, Choice, TuneRow


def _plain_ms(rows: Sequence[TuneRow]) -> Dict[Tuple[int, str], float]:
    """(batch, mode) -> the plain model's median ms there: the median of the plain times of all chunks, which
    side-steps drift between chunks."""
    plain: Dict[Tuple[int, str], float] = {}
    for key in {(r.batch, r.mode) for r in rows if r.ms_plain is not None}:
        plain[key] = statistics.median(r.ms_plain for r in rows if (r.batch, r.mode) == key and r.ms_plain is not None)
    return plain


def eager_speedups(rows: Sequence[TuneRow]) -> Dict[int, float]:
    """id(row) -> its speed-up against the plain model in eager mode: its own ratio (measured interleaved with the
    plain model in its mode) times how much faster the plain model runs in that mode than in eager mode. Without
    eager rows, modes are not converted."""
    plain = _plain_ms(rows)
    return {id(r): r.speedup * plain.get((r.batch, "eager"), plain[(r.batch, r.mode)]) / plain[(r.batch, r.mode)]
            for r in rows if r.speedup is not None and r.ms_plain is not None}


def fastest_plain(rows: Sequence[TuneRow], batch: int) -> Optional[Tuple[str, float]]:
    """(mode, ms) of the fastest plain model measured at this batch size (plain compiled, in a CUDA graph, ...)."""
    plain = {mode: ms for (b, mode), ms in _plain_ms(rows).items() if b == batch}
    return min(plain.items(), key=lambda item: (item[1], item[0])) if plain else None


def against_fastest_plain(rows: Sequence[TuneRow]) -> Dict[int, Tuple[float, float]]:
    """id(row) -> (speed-up, its lower bound) against the fastest plain model measured at its batch size: its own
    ratio times how much faster that plain model runs than the plain model of its own mode."""
    plain = _plain_ms(rows)
    fastest = {}
    for (batch, _), ms in plain.items():
        fastest[batch] = min(ms, fastest.get(batch, ms))
    out = {}
    for r in rows:
        if r.speedup is not None and r.ms_plain is not None:
            scale = fastest[r.batch] / plain[(r.batch, r.mode)]
            out[id(r)] = (r.speedup * scale, r.speedup_lo * scale)
    return out


def loss_text(loss: float, measure: str) -> str:
    """'0.40 points of top-1 lost'; a negative top-1 loss reads as a gain."""
    if measure == "top1" and loss < 0:
        return f"{-loss:.2f} points of top-1 gained"
    return f"{loss:.2f} {BUDGET_MEASURES[measure]}"


def bound_text(row: TuneRow, measure: str, budget: float) -> str:
    """'0.40 points of top-1 lost, 95 % upper bound 0.95 (budget 1.0)'."""
    return f"{loss_text(row.loss(measure), measure)}, 95 % upper bound {row.loss_upper(measure):.2f} (budget {budget})"


def choose(rows: Sequence[TuneRow], batch: int, budget: float, min_speedup: Optional[float] = None,
           measure: str = "agreement", prune_images: Optional[int] = None) -> Choice:
    """The fastest timed row of this batch size whose held-out loss in the budget's measure (top-1 points lost, or %
    of predictions changed) is within `budget` at its one-sided 95 % upper bound (TuneRow.loss_upper) and whose
    speed-up's lower bound against the fastest plain model measured at that batch size (against_fastest_plain:
    plain compiled, say, where that beats plain eager) is above 1 (and whose speed-up against plain in its mode is
    at least min_speedup); Choice(batch, None, reason) when none qualifies, naming the candidate that came closest
    (among the rows with a held-out figure) and, where the held-out images are too few for its bound to fit, how
    many would be needed (with the --limit that gives them when prune_images is given)."""
    timed = [r for r in rows if r.batch == batch and r.status == "timed"]
    unit = BUDGET_MEASURES[measure]
    within = [r for r in timed if r.keeps(measure, budget)]
    score = against_fastest_plain(timed)
    faster = [r for r in within if r.speedup_lo is not None and score[id(r)][1] > 1.0]
    enough = [r for r in faster if min_speedup is None or r.speedup >= min_speedup]
    fastest = fastest_plain(timed, batch)
    if enough:
        best = max(enough, key=lambda r: (score[id(r)][0], r.speedup_lo, [-ord(ch) for ch in r.candidate]))
        other = "" if fastest[0] == best.mode else f", {score[id(best)][0]:.2f}x plain in {fastest[0]} mode"
        return Choice(batch, best, f"fastest within the budget: {best.speedup:.2f}x plain in {best.mode} mode "
                                   f"(95 % interval {best.speedup_lo:.2f}-{best.speedup_hi:.2f}){other}, "
                                   f"{bound_text(best, measure, budget)}")
    if not within:
        measured = [r for r in rows if r.batch == batch and r.loss_upper(measure) is not None]
        if not measured:
            return Choice(batch, None, "no candidate was timed (all were pruned, failed or not reached)")
        best = min(measured, key=lambda r: (r.loss_upper(measure), -(r.speedup or 0.0), r.candidate))
        speed = "" if best.speedup is None else f", at {best.speedup:.2f}x"
        reason = (f"no candidate stays within the budget of at most {budget} {unit} at its one-sided 95 % upper "
                  f"bound on the held-out images (closest: {best.candidate}, {bound_text(best, measure, budget)}"
                  f"{speed})")
        need = images_needed(measure, best.agree_n, best.changed, best.gained or 0, best.lost or 0, budget)
        if need is not None and need > best.agree_n:
            limit = "" if prune_images is None else f" (--limit {need + prune_images})"
            reason += (f"; its {best.agree_n} held-out images are too few for a promise: about {need} at the same "
                       f"rates would bring its bound within the budget{limit}")
        return Choice(batch, None, reason)
    if not faster:
        own = [r for r in within if r.speedup_lo > 1.0]  # faster than plain in their mode, not in the fastest mode
        if own:
            best = max(own, key=lambda r: (score[id(r)][1], r.candidate))
            return Choice(batch, None, f"no candidate within the budget is surely faster than plain in {fastest[0]} "
                                       f"mode, the fastest plain model ({fastest[1]:.1f} ms; best: {best.candidate}, "
                                       f"{best.speedup:.2f}x plain in {best.mode} mode, {score[id(best)][0]:.2f}x "
                                       f"plain in {fastest[0]} mode, lower bound {score[id(best)][1]:.2f})")
        best = max(within, key=lambda r: r.speedup_lo)
        return Choice(batch, None, f"no candidate within the budget is surely faster than plain (best: {best.candidate}, "
                                   f"{best.speedup:.2f}x, lower bound {best.speedup_lo:.2f})")
    best = max(faster, key=lambda r: r.speedup)
    return Choice(batch, None, f"no candidate reaches the minimum speed-up {min_speedup}x (best: {best.candidate}, "
                               f"{best.speedup:.2f}x)")


def pareto_front(rows: Iterable[TuneRow], measure: str = "agreement") -> List[TuneRow]:
    """The rows no other row beats in both speed-up and held-out loss (TuneRow.loss)."""
    rows = list(rows)
    return [r for r in rows if not any(o.speedup >= r.speedup and o.loss(measure) <= r.loss(measure)
                                       and (o.speedup > r.speedup or o.loss(measure) < r.loss(measure))
                                       for o in rows)]


def best_measured(rows: Sequence[TuneRow], batch: int, measure: str) -> Optional[TuneRow]:
    """When nothing could be chosen: of the re-timed finalists of this batch size surely faster than the fastest
    plain model measured there, the one closest to a promise (the lowest 95 % upper bound of its loss; the faster
    among equals); without such, the fastest finalist; None when no finalist was re-timed."""
    timed = [r for r in rows if r.batch == batch and r.status == "timed" and r.loss(measure) is not None]
    if not timed:
        return None
    score = against_fastest_plain([r for r in rows if r.batch == batch and r.status == "timed"])
    sure = [r for r in timed if score[id(r)][1] > 1.0]
    if sure:
        return min(sure, key=lambda r: (round(r.loss_upper(measure), 6), -score[id(r)][0], r.candidate))
    return max(timed, key=lambda r: (score[id(r)][0], r.candidate))


def promise_text(row: TuneRow, measure: str, budget: float, prune_images: Optional[int] = None) -> str:
    """What would let row be promised: 'about N more labelled held-out images at its rates (--limit L)' and/or
    '--budget X' (its upper bound, rounded up to a tenth)."""
    upper = row.loss_upper(measure)
    wider = math.ceil(upper * 10 - 1e-9) / 10
    need = images_needed(measure, row.agree_n, row.changed, row.gained or 0, row.lost or 0, budget)
    kind = "labelled " if measure == "top1" else ""
    ways = []
    if need is not None and need > row.agree_n:
        limit = "" if prune_images is None else f" (--limit {need + prune_images})"
        ways.append(f"about {need - row.agree_n:,} more {kind}held-out images at its rates{limit}")
    ways.append(f"--budget {wider:g}")
    return " or ".join(ways)
