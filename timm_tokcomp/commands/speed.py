"""`tokcomp speed`: how fast each method runs against the plain model and against its limit, per batch size
and execution mode (eager, torch.compile, torch.compile's CUDA graphs, the eager forward in a CUDA graph).

A method's limit is the same blocks on the same token schedule with no matching at all: after attention each
block keeps its first tokens and drops the others (LimitReducer). No implementation of that schedule can be
faster, so `speed / limit speed` says how much the reduction step itself costs."""
import copy
import csv
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import timm
import torch
from torch import nn
from tqdm import tqdm

from ..utils.checks import check_int_list, integer
from ..utils.memory import check_batch_fits
from ..core import apply, get_reducer, last_stats
from ..models.build import build_base_model, eval_transform
from ..files.data import open_images
from ..deployment import modes as modes_
from ..deployment.specs import BASELINE, MethodItem
from ..deployment.modes import check_batches, check_modes
from ..measure.stats import noise_notes, speedup_interval
from ..plans import TruncatePlan
from ..measure.timing import no_silent_eager_fallback, synchronizer, time_runs
from ..measure.precision import check_dtype, precision
from ..methods import method_class
from ..methods.base import TokenReducer
from ..methods.params import REQUIRED, Param
from ..methods.places import ReducesAt
from ..files.outputs import new_output
from ..families import patched_family
from ..patch import patch
from ..methods.schedules import BlockCost
from ..utils.tables import text_table

LIMIT_SUFFIX = " limit"
ROUNDS = integer("--rounds", 1)  # the check of speed's --rounds


def _check_kept(kept: Sequence[int]) -> List[int]:
    return check_int_list("kept", kept, 1, "token counts")


class LimitReducer(TokenReducer):
    """Block l keeps its first kept[l] tokens after attention (after its MLP with after_mlp, as the study
    protocol's methods reduce) and drops the rest (no metric, no matching). kept: tokens leaving each block,
    from a method's forward (limit_schedule)."""

    spec = TokenReducer.spec.but(
        name="limit",
        params=(Param("kept", REQUIRED, _check_kept, "tokens leaving each block"),
                Param("after_mlp", False, bool, "reduce after the MLP, as the study's methods do")))
    prop_attn = False
    prefix_only_last_block = False

    @property
    def reduces_at(self) -> ReducesAt:
        return ReducesAt.AFTER_MLP if self.after_mlp else ReducesAt.AFTER_ATTENTION

    def check_depth(self, num_blocks: int) -> None:
        if len(self.kept) != num_blocks:
            raise ValueError(f"kept needs one entry per block ({num_blocks}), got {len(self.kept)}")

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost) -> List[Optional[int]]:
        entering = [num_tokens] + self.kept[:-1]
        return [k if k < n else None for k, n in zip(self.kept, entering)]

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k  # unused: plan only needs the setting

    def plan(self, metric: torch.Tensor, keep: int, num_prefix: int, size: Optional[torch.Tensor]) -> TruncatePlan:
        return TruncatePlan(keep)


@torch.no_grad()
def limit_schedule(model: nn.Module, x: torch.Tensor) -> List[int]:
    """Tokens leaving each block in one forward of the reduced model on x: (B, 3, H, W)."""
    model(x)
    stats = last_stats(model)
    return stats.tokens_per_block[1:] + [stats.tokens_out]


@dataclass
class SpeedRow:
    """One method at one batch size and mode. ms: median milliseconds per forward; vs_plain: the speed-up
    against the plain model (> 1: faster), the geometric mean of the interleaved rounds' ratios plain time / this
    time, with its 95 % interval (vs_plain_lo, vs_plain_hi; kit.stats.speedup_interval); vs_limit: limit time /
    this time, the same statistic (<= 1; None for the plain model, the limit rows and methods without one);
    vs_fastest_plain: the median ms of the fastest plain model at this batch size, in any mode the run timed (plain
    compiled, say) / this median (a ratio of medians from separate groups, so no interval); first_s: seconds from
    building this mode's runner to the end of its first forward (compile or CUDA-graph capture included)."""

    mode: str
    batch: int
    method: str
    ms: float
    vs_plain: float
    vs_limit: Optional[float]
    vs_plain_lo: Optional[float] = None
    vs_plain_hi: Optional[float] = None
    vs_fastest_plain: Optional[float] = None
    first_s: Optional[float] = None


def run_speed(
    model_name: str,
    methods: Sequence[MethodItem],
    batches: Sequence[int] = (1, 32, 64, 256),
    modes: Sequence[str] = ("eager",),
    device: str = "cpu",
    dtype: str = "fp32",
    tf32: bool = False,
    rounds: int = 20,
    checkpoint: Optional[str] = None,
    pretrained: bool = False,
    data: Optional[str] = None,
    show_progress: bool = True,
    on_rows: Optional[Callable[[List[SpeedRow]], None]] = None,
) -> List[SpeedRow]:
    """Forward times of the plain model, every method (--methods items, read once by kit.grammar.parse_methods; the
    plain model's item is skipped: it is always timed) and every method's limit, interleaved per (mode, batch) so
    that machine noise hits them alike (SpeedRow: medians, and speed-ups with their 95 % intervals).
    Data-dependent methods (ATM, ATS) run in eager mode only. modes: eager, compile, cudagraph (torch.compile
    with CUDA graphs: compiling.compile), graph (the eager forward in a CUDA graph, graphs.GraphedForward). data: a
    folder of images whose first batch is timed (random inputs without it). on_rows: called with all rows so far after
    each (mode, batch), so a run stopped later keeps what it measured (the CLI writes --out there)."""
    check_batches(batches)
    ROUNDS(rounds)
    check_dtype(dtype)
    check_modes(modes, device)
    items = [item for item in methods if item.name != BASELINE]  # a preset of method none stays: its own row
    base = build_base_model(model_name, checkpoint, pretrained, device)
    inputs = _inputs(data, base, max(batches), device)
    rows: List[SpeedRow] = []
    groups = [(mode, b) for mode in modes for b in batches]
    with tqdm(total=len(groups), desc="speed", disable=not show_progress, file=sys.stderr) as bar, \
            precision(device, dtype, tf32):
        for mode, batch in groups:
            x = inputs[:batch]
            models = _models(base, items, x, static=mode != "eager")
            torch._dynamo.reset()
            with no_silent_eager_fallback(len(models)):
                runners, first = _first_calls(models, mode, x)
                seconds = time_runs(runners, x, rounds=rounds, warmup=0 if mode == "eager" else 2)
            rows += _rows(mode, batch, seconds, first)
            _against_fastest_plain(rows, batch)
            if on_rows is not None:
                on_rows(list(rows))
            bar.update(1)
    return rows


def _inputs(data: Optional[str], model: nn.Module, count: int, device: str) -> torch.Tensor:
    check_batch_fits("--batches", count, timm.data.resolve_model_data_config(model)["input_size"], torch.device(device))
    if not data:
        return torch.randn(count, *timm.data.resolve_model_data_config(model)["input_size"], device=device)
    dataset = open_images(data, eval_transform(model), limit=count)
    if len(dataset) < count:
        raise ValueError(f"--data holds {len(dataset)} images; the largest --batches needs {count}")
    return torch.stack([dataset[i][0] for i in range(count)]).to(device)


def _models(base: nn.Module, items: Sequence[MethodItem], x: torch.Tensor, static: bool) -> Dict[str, nn.Module]:
    """plain, then each method followed by its limit (the token schedule its forward on x ran; none for a dense method
    or on SAM's windowed encoders); static (compiled
    or graph modes): without the data-dependent methods. A preset of method 'none' (tune declined) is a row of its
    own, the plain model."""
    models = {BASELINE: base}
    for name, method, params, _ in items:
        if method == BASELINE:
            models[name] = base
            continue
        if static and method_class(method).spec.data_dependent:
            continue
        model = apply(copy.deepcopy(base), method, **params)
        models[name] = model
        # no limit for a dense method (it keeps every token) nor on a family that keeps the grid (SAM): dropping
        # tokens to the schedule would break the grid its blocks read
        if not get_reducer(model).spec.dense and patched_family(model).method_refusal(LimitReducer) is None:
            limit = copy.deepcopy(base)
            after_mlp = get_reducer(model).reduces_at == "after_mlp"
            patch(limit, LimitReducer(limit_schedule(model, x), after_mlp=after_mlp), patched_family(model))
            models[name + LIMIT_SUFFIX] = limit
    return models


@torch.inference_mode()  # as time_runs calls them
def _first_calls(models: Dict[str, nn.Module], mode: str, x: torch.Tensor
                 ) -> Tuple[Dict[str, Callable], Dict[str, float]]:
    """(each model's runner in mode, the seconds from building it to the end of its first forward of x)."""
    sync = synchronizer(x)
    runners, first = {}, {}
    for name, model in models.items():
        sync()
        start = time.perf_counter()
        runners[name] = modes_.runner(model, mode, x)
        runners[name](x)
        sync()
        first[name] = time.perf_counter() - start
    return runners, first


def _rows(mode: str, batch: int, seconds: Dict[str, List[float]], first: Dict[str, float]) -> List[SpeedRow]:
    """One row per model from the seconds of its interleaved rounds and of its first call."""
    rows = []
    for name, t in seconds.items():
        point, lo, hi = speedup_interval(seconds[BASELINE], t)
        limit = seconds.get(name + LIMIT_SUFFIX)
        rows.append(SpeedRow(mode, batch, name, 1e3 * statistics.median(t), point,
                             None if limit is None else speedup_interval(limit, t)[0],
                             None if name == BASELINE else lo, None if name == BASELINE else hi,
                             first_s=first[name]))
    return rows


def _against_fastest_plain(rows: List[SpeedRow], batch: int) -> None:
    """Set vs_fastest_plain on every row of this batch size from the fastest plain row measured so far."""
    fastest = min(r.ms for r in rows if r.batch == batch and r.method == BASELINE)
    for r in rows:
        if r.batch == batch:
            r.vs_fastest_plain = fastest / r.ms


def format_speed(rows: Sequence[SpeedRow]) -> str:
    """One table per mode: a row per method, a column per batch with 'x plain [95 %] (of limit) ms', then a note
    naming the cells whose interval holds 1.00x."""
    out: List[str] = []
    for mode in dict.fromkeys(r.mode for r in rows):
        in_mode = [r for r in rows if r.mode == mode]
        batches = list(dict.fromkeys(r.batch for r in in_mode))
        methods = list(dict.fromkeys(r.method for r in in_mode))
        cell: Dict = {(r.method, r.batch): r for r in in_mode}
        out.append(f"{mode}: speed-up against plain (x) [95 % interval], against the method's limit in parentheses, "
                   f"median ms per forward")
        cells = []
        for m in methods:
            row = [m]
            for b in batches:
                r = cell.get((m, b))
                interval = "" if r is None or r.vs_plain_lo is None else f" [{r.vs_plain_lo:.2f}, {r.vs_plain_hi:.2f}]"
                limit = "" if r is None or r.vs_limit is None else f" ({r.vs_limit:.2f})"
                row.append("-" if r is None else f"{r.vs_plain:.2f}x{interval}{limit} {r.ms:.1f}ms")
            cells.append(row)
        out += text_table(["method"] + [f"batch {b}" for b in batches], cells)
        out += noise_notes([(f"{r.method} at batch {r.batch}", {"x plain": (r.vs_plain_lo, r.vs_plain_hi)})
                            for r in in_mode if r.method != BASELINE and not r.method.endswith(LIMIT_SUFFIX)],
                           "--rounds")
        out.append("")
    if len({r.mode for r in rows}) > 1:
        out += _fastest_plain_table(rows)
    return "\n".join(out).rstrip()


def _fastest_plain_table(rows: Sequence[SpeedRow]) -> List[str]:
    """Every mode's rows against the fastest plain model at each batch size, with their first calls' seconds."""
    batches = list(dict.fromkeys(r.batch for r in rows))
    fastest = {b: min((r for r in rows if r.batch == b and r.method == BASELINE), key=lambda r: r.ms) for b in batches}
    cell: Dict = {(r.mode, r.method, r.batch): r for r in rows}
    keys = list(dict.fromkeys((r.mode, r.method) for r in rows if not r.method.endswith(LIMIT_SUFFIX)))

    def text(r: Optional[SpeedRow]) -> str:
        return "-" if r is None else f"{r.vs_fastest_plain:.2f}x ({r.first_s:.1f} s)"

    cells = [[f"{method} ({mode})"] + [text(cell.get((mode, method, b))) for b in batches] for mode, method in keys]
    head = ", ".join(f"batch {b}: {fastest[b].mode}, {fastest[b].ms:.1f}ms" for b in batches)
    return [f"against the fastest plain model ({head}): ratio of medians (x), seconds to the first output in "
            "parentheses (compile or capture included)"] + \
        text_table(["method (mode)"] + [f"batch {b}" for b in batches], cells)


def write_speed_csv(rows: Sequence[SpeedRow], path: str, model_name: str, settings: Dict[str, Any],
                    overwrite: bool = False) -> None:
    """rows as CSV, with the model name and the run's settings (device, dtype, ...) on every line; an existing file
    is refused unless overwrite."""
    with new_output(path, overwrite, "--out") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model"] + [fl.name for fl in fields(SpeedRow)] + list(settings))
        writer.writeheader()
        for r in rows:
            writer.writerow({"model": model_name, **asdict(r), **settings})
