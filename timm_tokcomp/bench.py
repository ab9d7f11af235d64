"""`tokcomp bench`: GMACs, throughput, speedup, top-1 and agreement of several methods, side by side."""
import copy
import csv
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import timm
import torch
from torch import nn
from tqdm import tqdm

from .checks import check_int
from .core import apply, is_reduced, last_stats
from .data import UnlabeledImages, check_num_classes, open_images
from .extras import pyplot
from .kit.grammar import BASELINE, MethodItem
from .kit import modes as modes_
from .kit.agreement import NonFiniteScores, evaluate, paired_flags
from .kit.modes import check_mode, warmup_calls
from .kit.stats import noise_notes, p90, speedup_interval
from .measure import count_macs, no_silent_eager_fallback, time_runs
from .methods import exportable_methods, method_class, tocom_methods
from .models import build_base_model, eval_transform, weights_source
from .families import facade
from .precision import check_dtype, precision
from .outputs import new_output
from .tables import text_table

TOCOM_SUFFIX = "+ToCom"


@dataclass
class BenchRow:
    """One method's figures. gmacs: mean per image actually executed; gmacs_std: its spread (standard
    deviation) across batches, None without data; top1 / agreement: percentages, None without data;
    tokens_last_block: tokens entering the last block in the timing batch. Rows that modify another row
    (the '+ToCom' rows) are compared with it image by image: paired_with names that row, agree_gained /
    agree_lost count the images whose agreement with the baseline this row gains / loses against it,
    and agree_change_p is the exact two-sided McNemar p-value of that split (None elsewhere). backend: what
    ran the timed forwards; img_per_s: throughput of the timing batch, speedup: the geometric mean of the
    interleaved rounds' ratios (the baseline's time / this one), speedup_lo / speedup_hi: its 95 % interval (None
    without timing); latency_ms / latency_p90_ms: median and 90th percentile of single-image forwards,
    latency_speedup (lo, hi): the same ratio for them (None without latency runs). The speed-ups are against
    plain_row, the plain model in this row's mode ('none', or 'none@<mode>' where presets run in another mode);
    vs_fastest_plain (lo, hi): against the fastest of those plain rows, interleaved with it too."""

    method: str
    gmacs: float
    gmacs_std: Optional[float]
    img_per_s: Optional[float]
    speedup: Optional[float]
    top1: Optional[float]
    agreement: Optional[float]
    tokens_last_block: int
    paired_with: Optional[str] = None
    agree_gained: Optional[int] = None
    agree_lost: Optional[int] = None
    agree_change_p: Optional[float] = None
    dtype: str = "fp32"
    tf32: bool = False
    backend: str = "eager"
    latency_ms: Optional[float] = None
    latency_p90_ms: Optional[float] = None
    latency_speedup: Optional[float] = None
    speedup_lo: Optional[float] = None
    speedup_hi: Optional[float] = None
    latency_speedup_lo: Optional[float] = None
    latency_speedup_hi: Optional[float] = None
    plain_row: str = BASELINE
    vs_fastest_plain: Optional[float] = None
    vs_fastest_plain_lo: Optional[float] = None
    vs_fastest_plain_hi: Optional[float] = None
    plain_preset: bool = False  # a preset .json of method 'none' (a tune that found nothing to gain): plain runs


BACKENDS = ("eager", "compile", "onnx")


def row_modes(items: Sequence[MethodItem], backend: str) -> Dict[str, str]:
    """The execution mode each row is timed in: a preset's recorded mode where it is not eager (the compiled or
    CUDA-graph mode `tokcomp tune` chose, as timm_tokcomp.deploy runs it), else the backend."""
    return {item.name: item.mode if item.mode != "eager" else backend for item in items}


def check_backend(backend: str, device: str, dtype: str, items: Sequence[MethodItem]) -> None:
    """Raise ValueError naming the flag when the backend cannot run this device, dtype or a method, or a preset's
    recorded mode cannot run here."""
    check_mode(backend, device, dtype, flag="--backend", allowed=BACKENDS)
    for name, mode in row_modes(items, backend).items():
        if mode != backend:
            check_mode(mode, device, dtype, flag=f"--methods {name}: its recorded execution mode")
    if backend == "onnx":
        for item in items:
            if item.method != BASELINE and not method_class(item.method).exportable():
                raise ValueError(f"--backend onnx: {item.name} cannot be exported to ONNX: "
                                 f"{method_class(item.method).export_refusal}; exportable: "
                                 f"{', '.join(exportable_methods())}")


def build_method_models(base: nn.Module, items: Sequence[MethodItem]) -> Dict[str, nn.Module]:
    """{item name: base (the plain item) or a copy of it with the item's method applied}."""
    models = {}
    for item in items:
        if item.name == BASELINE:
            models[item.name] = base
            continue
        try:
            models[item.name] = apply(copy.deepcopy(base), item.method, **item.params)
        except (ValueError, TypeError) as e:  # which --methods item failed: a preset's params look like a tag's
            raise type(e)(f"--methods {item.name}: {e}") from None
    return models


def add_tocom_models(models: Dict[str, nn.Module], items: Sequence[MethodItem], tocom: str, source_r: int,
                     scale: Optional[float]) -> Dict[str, nn.Module]:
    """After every ToMe / EViT row with an integer r, a '<tag>+ToCom' row: the model with the
    compensator for (source_r -> r) from `tocom` (local folder or Hub repo). Other rows get none."""
    from .tocom import attach, compensate, load

    compensator, config = load(tocom, flag="--tocom")
    compensator.check_degree("--source-r", source_r)
    trained_with = config.get("method")
    out: Dict[str, nn.Module] = {}
    specs = {item.name: item for item in items}
    for name, model in models.items():
        out[name] = model
        if name == BASELINE or name.endswith(".json"):
            continue
        method, r = specs[name].method, specs[name].params.get("r")
        if not method_class(method).tocom_compatible or not isinstance(r, int) or r > compensator.steps:
            print(f"note: no +ToCom row for {name} (compensators serve {' / '.join(tocom_methods())} with one r in "
                  f"[0, {compensator.steps}])", file=sys.stderr)
            continue
        if trained_with and method != trained_with:
            print(f"note: the compensator was trained with {trained_with}; {name}+ToCom applies it to {method}",
                  file=sys.stderr)
        compensated = attach(copy.deepcopy(model), compensator, source_r=source_r, scale=scale)
        compensate(compensated, r)
        out[name + TOCOM_SUFFIX] = compensated
    return out


def _tokens_last_block(model: nn.Module, num_tokens: int) -> int:
    """Tokens entering the last block in the model's last forward (num_tokens when unreduced)."""
    stats = last_stats(model) if is_reduced(model) else None
    return num_tokens if stats is None or not stats.tokens_per_block else stats.tokens_per_block[-1]


def paired_change(agrees: Dict[str, torch.Tensor], row: str, reference: str) -> Dict:
    """BenchRow's paired fields for `row` against `reference`, from per-image agreement flags."""
    gained, lost, p = paired_flags(agrees[row], agrees[reference])
    return {"paired_with": reference, "agree_gained": gained, "agree_lost": lost, "agree_change_p": p}


def run_bench(
    model_name: str,
    methods: Sequence[MethodItem],
    checkpoint: Optional[str] = None,
    pretrained: bool = False,
    data: Optional[str] = None,
    batch_size: int = 64,
    device: str = "cpu",
    timing_rounds: int = 5,
    limit: Optional[int] = None,
    num_workers: int = 2,
    show_progress: bool = True,
    tocom: Optional[str] = None,
    source_r: int = 0,
    tocom_scale: Optional[float] = None,
    dtype: str = "fp32",
    tf32: bool = False,
    backend: str = "eager",
    latency_runs: int = 30,
) -> List[BenchRow]:
    """Benchmark methods (--methods items, read once by kit.grammar.parse_methods: the plain model first) against
    the unmodified model in one run. Without data, MACs and timing use
    one random batch and top1 / agreement are None; with a folder of unlabeled images, top1 is None and
    agreement is measured. tocom: a compensator (folder or Hub repo) for a model trained at ToMe r =
    source_r; adds a '+ToCom' row after each ToMe / EViT row (its scale, or tocom_scale). dtype: 'fp32',
    or 'bf16' / 'fp16' autocast for every forward; tf32: allow TF32 on CUDA (torch's default is off).
    backend: 'eager', 'compile' or 'onnx' (onnxruntime, CPU) runs the timed forwards; GMACs and accuracy come
    from the PyTorch models. timing_rounds: timed batch forwards per model (0, --no-timing: none, and no latency
    either; the timing batch is the first batch of the data, so no larger than `limit`). latency_runs: single-image
    forwards timed per model (0: none)."""
    check_dtype(dtype)
    check_int("--batch-size", batch_size, 1)
    check_int("--timing-rounds", timing_rounds, 0, "(0: no timing)")
    if checkpoint and pretrained:
        raise ValueError("give --checkpoint or --pretrained, not both")
    check_int("--latency-runs", latency_runs, 0, "(0: none)")
    items = list(methods)
    if not items or items[0].method != BASELINE:
        raise ValueError("methods must start with the plain model ('none'), as kit.grammar.parse_methods gives them")
    check_backend(backend, device, dtype, items)
    base = build_base_model(model_name, checkpoint, pretrained, device)
    models = build_method_models(base, items)
    if tocom:
        models = add_tocom_models(models, items, tocom, source_r, tocom_scale)
    cfg = timm.data.resolve_model_data_config(base)

    evaluation = None
    labelled = False
    if data:
        dataset = open_images(data, eval_transform(base), limit=limit)
        labelled = not isinstance(dataset, UnlabeledImages)
        if labelled and getattr(base, "num_classes", 0):
            check_num_classes(dataset, base.num_classes)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
        with precision(device, dtype, tf32):
            try:
                evaluation = evaluate(models, loader, device, show_progress)
            except NonFiniteScores as e:
                raise NonFiniteScores(f"{weights_source(model_name, checkpoint, pretrained)}: {e}") from None
        macs = evaluation.macs
        batch = next(iter(loader))[0].to(device)
    else:
        batch = torch.randn(batch_size, *cfg["input_size"], device=device)
        macs = {k: count_macs(m, batch[:1]) for k, m in models.items()}

    modes = {**row_modes(items, backend), **{name: backend for name in models if name.endswith(TOCOM_SUFFIX)}}
    plain = plain_rows(modes)  # mode -> the plain row timed in it: each row is compared with plain in its own mode
    for mode, name in plain.items():
        if name != BASELINE:
            models, modes = {BASELINE: base, name: base, **models}, {**modes, name: mode}
            macs[name] = macs[BASELINE]
    times, latency = _time(models, batch, modes, timing_rounds, latency_runs if timing_rounds else 0, device, dtype,
                           tf32, show_progress)
    view = facade(base)
    num_tokens = view.patch_embed.num_patches + view.num_prefix_tokens
    paired = {}
    if evaluation is not None:
        paired = {name: paired_change(evaluation.agrees, name, name[:-len(TOCOM_SUFFIX)])
                  for name in models if name.endswith(TOCOM_SUFFIX)}
    fastest = min(plain.values(), key=lambda name: statistics.median(times[name])) if times else BASELINE
    source = {name: BASELINE if name in plain.values() else name for name in models}  # whose accuracy a row has
    plain_presets = {item.name for item in items if item.name != BASELINE and item.method == BASELINE}
    rows = []
    for name, model in models.items():
        own = plain[modes[name]]
        speed, fast, overall = _ratio(times, name, own), _ratio(latency, name, own), _ratio(times, name, fastest)
        rows.append(BenchRow(
            method=name,
            gmacs=macs[name] / 1e9,
            gmacs_std=None if evaluation is None else evaluation.macs_std[source[name]] / 1e9,
            img_per_s=len(batch) / statistics.median(times[name]) if times else None,
            speedup=speed[0],
            top1=evaluation.top1[source[name]] if labelled else None,
            agreement=None if evaluation is None else evaluation.agreement[source[name]],
            tokens_last_block=_tokens_last_block(model, num_tokens),
            **paired.get(name, {}),
            dtype=dtype,
            tf32=tf32,
            backend=modes[name],
            latency_ms=1e3 * statistics.median(latency[name]) if latency else None,
            latency_p90_ms=1e3 * p90(latency[name]) if latency else None,
            latency_speedup=fast[0], speedup_lo=speed[1], speedup_hi=speed[2], latency_speedup_lo=fast[1],
            latency_speedup_hi=fast[2], plain_row=own, vs_fastest_plain=overall[0], vs_fastest_plain_lo=overall[1],
            vs_fastest_plain_hi=overall[2], plain_preset=name in plain_presets,
        ))
    return rows


def plain_rows(modes: Dict[str, str]) -> Dict[str, str]:
    """mode -> the plain row timed in that mode: 'none' in the plain row's own mode, 'none@<mode>' in every other
    mode a row runs in (a preset recorded compiled, say, is compared with plain compiled)."""
    return {mode: BASELINE if mode == modes[BASELINE] else f"{BASELINE}@{mode}"
            for mode in dict.fromkeys(modes.values())}


def _time(models: Dict[str, nn.Module], batch: torch.Tensor, modes: Dict[str, str], rounds: int, latency_runs: int,
          device: str, dtype: str, tf32: bool, show_progress: bool) -> Tuple[Dict[str, List[float]], Dict[str, List[float]]]:
    """Seconds per round of batch forwards and of single-image forwards, every model interleaved ({} for none), each
    in its mode (kit.modes.runner; a CUDA-graph mode captures once per input shape)."""
    if not rounds:
        return {}, {}
    warmup = max(warmup_calls(mode) for mode in modes.values())
    shown = ", ".join(dict.fromkeys(modes.values()))
    total = len(models) * (rounds + warmup + (latency_runs + warmup if latency_runs else 0))
    with tempfile.TemporaryDirectory() as workdir, no_silent_eager_fallback(len(models)), \
            tqdm(total=total, desc=f"timing ({shown})", disable=not show_progress, file=sys.stderr) as bar, \
            precision(device, dtype, tf32):
        def build(x: torch.Tensor, names: Sequence[str]) -> Dict[str, Callable]:
            return {name: modes_.runner(models[name], modes[name], x, workdir, f"model{i}")
                    for i, name in enumerate(models) if name in names}

        built = build(batch, list(models))
        times = time_runs(built, batch, rounds=rounds, warmup=warmup, progress=bar.update)
        latency = {}
        if latency_runs:  # a CUDA graph replays one shape: the single-image forward is captured apart
            single = {**built, **build(batch[:1], [name for name in models if modes[name] == "graph"])}
            latency = time_runs(single, batch[:1], rounds=latency_runs, warmup=warmup, progress=bar.update)
    return times, latency


def _ratio(times: Dict[str, List[float]], name: str, plain: str
           ) -> Tuple[Optional[float], Optional[float], Optional[float]]:
    """(the speed-up against the plain row `plain`, its 95 % interval: kit.stats.speedup_interval), or Nones without
    timing."""
    return speedup_interval(times[plain], times[name]) if times else (None, None, None)


def format_table(rows: Sequence[BenchRow]) -> str:
    """GMACs +- its spread across batches (adaptive methods vary per batch); throughput and latency with their
    ratios to the plain model and the ratios' 95 % intervals; top-1, agreement, tokens entering the last block;
    a legend; a note on the ratios within timing noise; for rows compared with another row, the images whose
    agreement changed."""
    timed, with_latency = rows[0].speedup is not None, rows[0].latency_ms is not None
    plain = {r.plain_row for r in rows}
    modes = timed and len(plain) > 1  # rows in several modes: each against plain in its own, and the fastest plain
    header = ["method", "GMACs", "+-batch"]
    header += ["tput img/s", "tput x [95%]"] if timed else []
    header += ["mode", "x fastest plain [95%]"] if modes else []
    header += ["lat ms", "lat p90", "lat x [95%]"] if with_latency else []
    header += ["top-1 %", "agree %", "tokens@last"]
    cells = []
    for r in rows:
        row = [r.method, f"{r.gmacs:.4f}", "-" if r.gmacs_std is None else f"{r.gmacs_std:.4f}"]
        if timed:
            row += [f"{r.img_per_s:.1f}", _ratio_cell(r.speedup, r.speedup_lo, r.speedup_hi)]
        if modes:
            row += [r.backend, _ratio_cell(r.vs_fastest_plain, r.vs_fastest_plain_lo, r.vs_fastest_plain_hi)]
        if with_latency:
            row += [f"{r.latency_ms:.2f}", f"{r.latency_p90_ms:.2f}",
                    _ratio_cell(r.latency_speedup, r.latency_speedup_lo, r.latency_speedup_hi)]
        row += ["-" if r.top1 is None else f"{r.top1:.2f}", "-" if r.agreement is None else f"{r.agreement:.2f}",
                str(r.tokens_last_block)]
        cells.append(row)
    lines = text_table(header, cells, rule=True)
    legend = ["+-batch: the standard deviation of the GMACs across batches (adaptive methods vary)"]
    legend += ["tput: throughput of the timing batch"] if timed else []
    legend += ["lat: one image (median, 90th percentile)"] if with_latency else []
    legend += ["x: speed-up against the plain model, the geometric mean of the interleaved rounds' time ratios "
               "[its 95 % interval]"] if timed else []
    legend += [f"rows run in several modes: x is against plain in the row's mode ({', '.join(sorted(plain))}), "
               "'x fastest plain' against the fastest of those"] if modes else []
    lines += ["", "; ".join(legend + ["tokens@last: tokens entering the last block"])]
    lines += noise_notes([(r.method, {"tput x": (r.speedup_lo, r.speedup_hi),
                                      "lat x": (r.latency_speedup_lo, r.latency_speedup_hi)})
                          for r in rows if r.method not in plain], "--timing-rounds, --latency-runs")
    idle = [r.method for r in rows if r.method not in plain and r.tokens_last_block == rows[0].tokens_last_block
            and r.gmacs >= rows[0].gmacs]
    plain_presets = [r.method for r in rows if r.plain_preset and r.method in idle]
    if plain_presets:
        lines.append(f"note: {', '.join(plain_presets)}: a preset of method '{BASELINE}' (the tune that wrote it found "
                     f"nothing to gain within its budget): the plain model runs")
    drifted = [r for r in rows if r.method in plain_presets and r.speedup_lo is not None
               and not r.speedup_lo <= 1.0 <= r.speedup_hi]
    if drifted:
        lines.append("note: " + ", ".join(f"{r.method} {_ratio_cell(r.speedup, r.speedup_lo, r.speedup_hi)}"
                                          for r in drifted) +
                     ": the plain model against itself, yet its interval excludes 1.00x: the machine drifted between "
                     "rounds, so read every ratio here with that margin (--timing-rounds, a quieter machine)")
    idle = [name for name in idle if name not in plain_presets]
    if idle:
        lines.append(f"note: reduced nothing on these inputs: {', '.join(idle)} (an adaptive method merges only tokens "
                     f"more similar than its thresholds, which random weights or inputs rarely reach; a schedule of "
                     f"r = 0 reduces nothing by design)")
    compared = [r for r in rows if r.paired_with is not None]
    if compared:
        width = max(len(r.method) for r in compared) + 2
        lines += ["", "agreement changed image by image, against the row modified "
                      "(exact McNemar p; p > 0.05: within noise):"]
        lines += [f"  {r.method:<{width}}+{r.agree_gained} / -{r.agree_lost} images vs {r.paired_with}, "
                  f"p = {r.agree_change_p:.2g}" for r in compared]
    return "\n".join(lines)


def _ratio_cell(point: float, lo: Optional[float], hi: Optional[float]) -> str:
    """'1.52x [1.40, 1.61]'; the interval is unbounded ('inf') with fewer than two rounds."""
    return f"{point:.2f}x [{lo:.2f}, {hi:.2f}]"


def write_csv(rows: Sequence[BenchRow], path: str, model_name: str, overwrite: bool = False) -> None:
    """rows as CSV, the model name on every line; an existing file is refused unless overwrite."""
    with new_output(path, overwrite, "--out") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model"] + [fl.name for fl in fields(BenchRow)])
        writer.writeheader()
        for r in rows:
            writer.writerow({"model": model_name, **asdict(r)})


def check_plot_format(path: str) -> str:
    """The image format named by path's suffix (none: png), or ValueError naming --plot and the formats matplotlib
    writes; MissingExtra without matplotlib."""
    plt = pyplot("plot", "bench --plot")
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if fmt not in formats:
        raise ValueError(f"--plot {path}: matplotlib cannot write .{fmt} files; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    return fmt


def plot_pareto(rows: Sequence[BenchRow], path: str, model_name: str, overwrite: bool = False) -> None:
    """GMACs against top-1 (throughput without labels, agreement without labels or timing), one labelled point per
    method; an existing file is refused unless overwrite."""
    fmt = check_plot_format(path)
    plt = pyplot("plot", "bench --plot")
    if rows[0].top1 is not None:
        ys, label = [r.top1 for r in rows], "top-1 (%)"
    elif rows[0].img_per_s is not None:
        ys, label = [r.img_per_s for r in rows], "images / s"
    elif rows[0].agreement is not None:
        ys, label = [r.agreement for r in rows], "agreement with the plain model (%)"
    else:
        raise ValueError("--plot needs --data or timing: with --no-timing and random inputs there is nothing to plot")
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot([r.gmacs for r in rows], ys, "o")
    for r, y in zip(rows, ys):
        ax.annotate(r.method, (r.gmacs, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("GMACs per image")
    ax.set_ylabel(label)
    ax.set_title(model_name)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    with new_output(path, overwrite, "--plot") as tmp:
        fig.savefig(tmp, format=fmt)
    plt.close(fig)
