"""What tune writes and prints: the table, the presets (one per batch size), the Pareto plot, the notes on the
sample sizes."""
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Sequence, Union

from ...core import NO_REDUCTION
from ...deployment.presets import device_type_of, versions, write_preset
from ...utils.extras import available, install_hint, pyplot
from ...files.outputs import replacing, write_text
from .budget import count
from .rows import BUDGET_MEASURES, Choice, TuneRow
from .select import bound_text, pareto_front


OUT_FILES = ("tune.csv", "tune_config.json", "table.md", "pareto.png", "preset*.json", "candidates")
CANDIDATES = "candidates"  # a preset per re-timed finalist, to deploy knowingly


@dataclass
class TuneResult:
    rows: List[TuneRow]
    choices: List[Choice]
    settings: Dict[str, Any] = field(default_factory=dict)
    answer: List[str] = field(default_factory=list)  # the last lines: the choice or the best measured, and the end

    def table(self) -> str:
        return format_table(self.rows, self.choices, self.settings.get("budget_measure", "agreement"))

    def budget_text(self) -> str:
        """'at most 1.0 points of top-1 lost on 384 held-out images (labelled)': what the choice was held to."""
        s = self.settings
        why = ("the images are labelled" if s["budget_on"] == "auto" and s["budget_measure"] == "top1" else
               "no labels: agreement with the plain model, stricter than top-1" if s["budget_on"] == "auto" else
               f"--budget-on {s['budget_on']}")
        return f"budget: at most {s['budget']} {BUDGET_MEASURES[s['budget_measure']]} on the {s['held_out']} " \
               f"held-out images ({why})"


def sample_notes(held_out: int, prune_images: int, budget: float, measure: str) -> List[str]:
    """A note when the held-out images cannot resolve the budget: one image moves the loss by 100 / held_out, and a
    budget of fewer than three images' worth is decided by one or two images' noise. Says how many would do."""
    step = 100.0 / held_out
    if budget == 0 or budget >= 3 * step:
        return []
    need = math.ceil(300.0 / budget)
    return [f"the budget of {budget} {BUDGET_MEASURES[measure]} is judged on {held_out} held-out images, where one "
            f"image is {step:.2f} points: fewer than three images decide it; {need} held-out images would resolve "
            f"it (--limit {need + prune_images} or more with --prune-images {prune_images})"]


def save_tuned_preset(path: Union[str, Path], choice: "Choice", settings: Dict[str, Any], overwrite: bool = False) -> None:
    """Write tune's choice for one batch size as a preset (kit.presets): the method and its params (kernel and
    prop_attn implementation included), or method 'none' with the reason; the execution mode it was timed in; and
    what it was measured with (torch device and its name, dtype, TF32, batch size, package / torch / timm versions).
    An existing file is refused unless overwrite."""
    row = choice.row
    tuned = {"model": settings["model"], "device": settings["device_name"],
             "torch_device": settings.get("device") or device_type_of(settings["device_name"]), "dtype": settings["dtype"], "tf32": settings["tf32"], "batch_size": choice.batch,
             "budget": settings["budget"], "budget_measure": settings.get("budget_measure", "agreement"),
             "reason": choice.reason, "versions": versions()}
    if row is not None:
        measure = tuned["budget_measure"]
        tuned.update(speedup=row.speedup, speedup_95=[row.speedup_lo, row.speedup_hi], agreement=row.agree,
                     images=row.agree_n, changed=row.changed, top1=row.top1, top1_plain=row.top1_plain,
                     loss=row.loss(measure), loss_upper_95=row.loss_upper(measure), ms=row.ms, ms_plain=row.ms_plain)
    write_preset(path, NO_REDUCTION if row is None else row.method, {} if row is None else json.loads(row.params),
                 overwrite, execution={"mode": "eager" if row is None else row.mode}, tuned=tuned)


def format_table(rows: Sequence[TuneRow], choices: Sequence[Choice], measure: str = "agreement") -> str:
    """Markdown: per batch size the timed candidates, fastest first (with the held-out loss in the budget's measure
    and its one-sided 95 % upper bound, which the budget is judged on), then what was not timed and why, then the
    choice."""
    out: List[str] = []
    for choice in choices:
        timed = sorted((r for r in rows if r.batch == choice.batch and r.status == "timed"), key=lambda r: r.ms)
        out += [f"### batch {choice.batch}", ""]
        if timed:
            out += ["| candidate | GMACs | ms (plain) | speed-up [95 %] | held-out agreement (changed / n) "
                    "| top-1 (plain), McNemar p | loss [95 % upper] |",
                    "| --- | --- | --- | --- | --- | --- | --- |"]
        else:
            out.append("no candidate was timed")
        for r in timed:
            agree = "-" if r.agree is None else f"{r.agree:.2f} % ({r.changed} / {r.agree_n})"
            top1 = "-" if r.top1 is None else f"{r.top1:.2f} ({r.top1_plain:.2f}), p = {r.top1_p:.2g}"
            mark = " **chosen**" if r.chosen else ""
            loss = "-" if r.agree_n is None else f"{r.loss(measure):.2f} [{r.loss_upper(measure):.2f}]"
            out.append(f"| {r.candidate}{mark} | {r.gmacs:.3f} | {r.ms:.2f} ({r.ms_plain:.2f}) | {r.speedup:.2f}x "
                       f"[{r.speedup_lo:.2f}, {r.speedup_hi:.2f}] | {agree} | {top1} | {loss} |")
        timed_settings = {r.setting for r in timed}
        skipped = [r for r in rows if r.batch == choice.batch and r.status != "timed"]
        if skipped:  # by setting (a setting's paths share its accuracy): settings none of whose paths was timed
            reasons: Dict[str, set] = {}
            for r in skipped:
                if r.setting not in timed_settings:
                    reasons.setdefault(_kind(r.status), set()).add(r.setting)
            paths = len({r.candidate for r in skipped if r.setting in timed_settings})
            said = [f"{count(len(names), 'setting')} {k}" for k, names in sorted(reasons.items())]
            said += [f"{count(paths, 'other path')} of timed settings"] if paths else []
            out += ["", "not timed: " + ", ".join(said)]
        verdict = "no reduction" if choice.row is None else choice.row.candidate
        if timed:
            out += ["", f"each timed row is a finalist with its preset in {CANDIDATES}/"]
        out += ["", f"choice: **{verdict}**: {choice.reason}", ""]
    return "\n".join(out).rstrip() + "\n"


def _kind(status: str) -> str:
    """A status without the figures and names that differ from row to row, for counting."""
    for prefix, kind in (("pruned: milder than", "pruned: milder than one within the budget"),
                         ("pruned: the same token schedule", "pruned: the same schedule as another")):
        if status.startswith(prefix):
            return kind
    return status.split(" (")[0]


def preset_paths(out: str, batches: Sequence[int]) -> Dict[int, Path]:
    """preset.json for one batch size, `preset_b<B>.json` for several."""
    if len(batches) == 1:
        return {batches[0]: Path(out) / "preset.json"}
    return {b: Path(out) / f"preset_b{b}.json" for b in batches}


def write_outputs(result: TuneResult, out: str) -> None:
    """table.md, pareto.png (with the plot extra; a note without it) and the presets, in the run folder out."""
    s = result.settings
    write_text(Path(out) / "table.md", f"# tokcomp tune: {s['model']} on {s['device_name']}, {s['dtype']}"
                                       f"{', TF32' if s['tf32'] else ''}\n\n{result.budget_text()}\n\n"
                                       + result.table() + "\n## Answer\n\n"
                                       + "".join(f"- {line.strip()}\n" for line in result.answer)
                                       + "\n## Stages\n\n"
                                       + "".join(f"- {line}\n" for line in s.get("stages", [])))
    if available("matplotlib"):  # the one output the core install leaves out (the plot extra)
        plot_pareto(result, Path(out) / "pareto.png")
    else:
        s["notes"].append(f"pareto.png not drawn: it needs matplotlib, which the core install leaves out: "
                          f"{install_hint('matplotlib', 'plot')}")
    for batch, path in preset_paths(out, s["batches"]).items():
        choice = next(c for c in result.choices if c.batch == batch)
        save_tuned_preset(path, choice, s, overwrite=True)  # inside the run folder tune holds
    presets = candidate_presets(result, out)
    folder = Path(out) / CANDIDATES
    for old in folder.glob("*.json") if folder.is_dir() else ():  # an earlier (resumed) run's finalists
        if old not in presets:
            old.unlink()
    for path, choice in presets.items():
        folder.mkdir(exist_ok=True)
        save_tuned_preset(path, choice, s, overwrite=True)


def candidate_presets(result: TuneResult, out: str) -> Dict[Path, Choice]:
    """out/candidates/<candidate>[_b<B>].json -> a Choice of each re-timed finalist, its reason saying whether its
    loss is promised (within the budget at the 95 % upper bound) and by how much it was measured faster."""
    measure, budget = result.settings["budget_measure"], result.settings["budget"]
    several = len(result.settings["batches"]) > 1
    out_paths = {}
    for r in result.rows:
        if r.status != "timed":
            continue
        name = re.sub(r"[^A-Za-z0-9.=-]+", "_", r.candidate).strip("_") + (f"_b{r.batch}" if several else "")
        promised = "within the budget" if r.keeps(measure, budget) else "NOT promised: above the budget"
        out_paths[Path(out) / CANDIDATES / f"{name}.json"] = Choice(
            r.batch, r, f"a finalist, {promised} at its 95 % upper bound: {r.speedup:.2f}x plain in {r.mode} mode "
                        f"(95 % interval {r.speedup_lo:.2f}-{r.speedup_hi:.2f}), {bound_text(r, measure, budget)}")
    return out_paths


def plot_pareto(result: TuneResult, path: Path) -> None:
    """Speed-up against the held-out loss in the budget's measure, one panel per batch size: every timed candidate,
    the frontier (no other point both faster and losing less), the budget line and the chosen point."""
    plt = pyplot("plot", "tune's pareto.png")
    batches = [c.batch for c in result.choices]
    measure = result.settings["budget_measure"]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, choice in zip(axes[0], result.choices):
        pts = [r for r in result.rows if r.batch == choice.batch and r.status == "timed"
               and r.loss(measure) is not None]
        ax.scatter([r.loss(measure) for r in pts], [r.speedup for r in pts], s=12, alpha=0.6, label="timed candidates")
        frontier = sorted(pareto_front(pts, measure), key=lambda r: r.loss(measure))
        ax.plot([r.loss(measure) for r in frontier], [r.speedup for r in frontier], "-", color="C1", label="frontier")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axvline(result.settings["budget"], color="C3", ls="--", lw=0.8, label="budget")
        if choice.row is not None:
            ax.plot([choice.row.loss(measure)], [choice.row.speedup], "*", ms=14, color="C2", label="chosen")
        ax.set_xlabel(f"held-out loss: {BUDGET_MEASURES[measure]}")
        ax.set_ylabel("speed-up against plain (same mode)")
        ax.set_title(f"batch {choice.batch}" + ("" if choice.row else ": no reduction"))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
