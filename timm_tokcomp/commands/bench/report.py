"""What `tokcomp bench` shows of its rows: the terminal table with its legend and notes, the CSV, the Pareto plot."""
import csv
from dataclasses import asdict, fields
from pathlib import Path
from typing import Optional, Sequence

from ...utils.extras import pyplot
from ...deployment.specs import BASELINE
from ...measure.stats import noise_notes
from ...files.outputs import new_output
from ...utils.tables import text_table
from .run import BenchRow


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
                          for r in rows if r.method not in plain], "--rounds, --latency-runs")
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
                     "rounds, so read every ratio here with that margin (--rounds, a quieter machine)")
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
