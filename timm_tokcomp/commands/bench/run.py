"""`tokcomp bench`'s run: GMACs, throughput, speed-up, top-1 and agreement of several methods, measured side by side
(the table, CSV and plot of its rows: bench.report)."""
import copy
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import timm
import torch
from torch import nn
from tqdm import tqdm

from ...utils.checks import BATCH_SIZE, check_int, integer
from ...utils.memory import check_batch_fits
from ...core import apply, is_reduced, last_stats
from ...files.data import UnlabeledImages, check_num_classes, open_images
from ...deployment.specs import BASELINE, MethodItem
from ...deployment import modes as modes_
from ...measure.agreement import NonFiniteScores, evaluate, paired_flags
from ...deployment.modes import check_mode, warmup_calls
from ...measure.stats import p90, speedup_interval
from ...measure.counting import count_macs
from ...measure.timing import no_silent_eager_fallback, time_runs
from ...methods import exportable_methods, method_class, tocom_methods
from ...models.build import build_base_model, eval_transform, weights_source
from ...families import facade
from ...measure.precision import check_dtype, precision

TOCOM_SUFFIX = "+ToCom"
LATENCY_RUNS = integer("--latency-runs", 0, "(0: none)")
SOURCE_R = integer("--source-r", 0, "(the ToMe r the model was trained at)")


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
    check_mode(backend, device, dtype, flag="--modes", allowed=BACKENDS)
    for name, mode in row_modes(items, backend).items():
        if mode != backend:
            check_mode(mode, device, dtype, flag=f"--methods {name}: its recorded execution mode")
    if backend == "onnx":
        for item in items:
            if item.method != BASELINE and not method_class(item.method).exportable():
                raise ValueError(f"--modes onnx: {item.name} cannot be exported to ONNX: "
                                 f"{method_class(item.method).spec.export_refusal}; exportable: "
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
    from ...tocom import attach, compensate, load

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
        if not method_class(method).spec.tocom_compatible or not isinstance(r, int) or r > compensator.steps:
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
    BATCH_SIZE(batch_size)
    check_int("--rounds", timing_rounds, 0, "(0: no timing)")
    if checkpoint and pretrained:
        raise ValueError("give --checkpoint or --pretrained, not both")
    LATENCY_RUNS(latency_runs)
    SOURCE_R(source_r)
    items = list(methods)
    if not items or items[0].name != BASELINE:
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
        check_batch_fits("--batch-size", min(batch_size, len(dataset)), cfg["input_size"], torch.device(device))
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
        with precision(device, dtype, tf32):
            try:
                evaluation = evaluate(models, loader, device, show_progress)
            except NonFiniteScores as e:
                raise NonFiniteScores(f"{weights_source(model_name, checkpoint, pretrained)}: {e}") from None
        macs = evaluation.macs
        batch = next(iter(loader))[0].to(device)
    else:
        check_batch_fits("--batch-size", batch_size, cfg["input_size"], torch.device(device))
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
