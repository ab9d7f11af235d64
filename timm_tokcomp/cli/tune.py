"""`tokcomp tune`: measure on this device and choose the fastest setting within a budget, or none."""
import argparse
import sys

from ..commands.tune.budget import TIME_BUDGET
from ..commands.tune.run import BUDGET, BUDGET_ON_CHOICES, LIMIT, MIN_SPEEDUP, PRUNE_IMAGES, ROUNDS
from ..deployment.modes import check_batches
from ..utils.checks import comma_list, flag_type
from .flags import (FOLDER_OUT, deprecated, device_flag, hf_model_flag, model_flags, precision_flags, progress_flag,
                    random_weights, weights_flags)


def add(sub: argparse._SubParsersAction) -> None:
    tu = sub.add_parser("tune", help="measure the training-free methods on this device and choose the fastest that "
                                      "keeps accuracy within a budget (top-1 with labels, agreement without), or no "
                                      "reduction")
    model_flags(tu, "timm architecture, e.g. deit_small_patch16_224, or open_clip:ARCH (required, unless "
                    "--hf-model)")
    tu.add_argument("--data", required=True, help="folder of images (labels not needed; with labels top-1 is reported)")
    tu.add_argument("--out", required=True, help="folder for tune.csv, table.md, pareto.png and preset.json "
                                                 "(preset_b<B>.json per batch size when several)")
    weights_flags(tu)
    hf_model_flag(tu)
    device_flag(tu)
    precision_flags(tu)
    tu.add_argument("--batches", type=flag_type(check_batches, comma_list(int)), default="64",
                    help="batch sizes, one choice each (default: %(default)s)")
    tu.add_argument("--budget", type=flag_type(BUDGET, float), default=1.0,
                    help="the largest loss allowed on the held-out images, in points of --budget-on's measure")
    tu.add_argument("--budget-on", choices=BUDGET_ON_CHOICES, default="auto",
                    help="top1: points of top-1 accuracy lost (needs labels); agreement: %% of the plain model's "
                         "predictions changed (no labels needed; several times stricter); auto: top1 when --data "
                         "is labelled")
    tu.add_argument("--min-speedup", type=flag_type(MIN_SPEEDUP, float),
                    help="choose only a candidate at least this much faster (>= 1)")
    tu.add_argument("--modes", help="execution modes to try (eager, compile, cudagraph, graph); default: eager on "
                                    "the CPU, all four on CUDA")
    tu.add_argument("--torchcompile", dest="modes", action="store_const", const="compile",
                    help="timm's spelling of --modes compile")
    tu.add_argument("--methods", help="candidate settings instead of the default space: method tags or presets, "
                                      "comma separated (each still tried on every path and mode)")
    tu.add_argument("--limit", type=flag_type(LIMIT), default=1500,
                    help="images read from --data at most (default: %(default)s; the held-out ones decide how small "
                         "a loss can be promised)")
    tu.add_argument("--prune-images", type=flag_type(PRUNE_IMAGES), default=128,
                    help="the first images, used to screen candidates; "
                         "the rest decide (default: %(default)s)")
    deprecated(tu, "--max-rounds", "--rounds", "max_rounds", type=flag_type(ROUNDS))
    tu.add_argument("--rounds", dest="max_rounds", type=flag_type(ROUNDS), default=30,
                    help="timed rounds per candidate at most (a round: one forward of it and one of the plain "
                         "model; default: %(default)s)")
    tu.add_argument("--time-budget", type=flag_type(TIME_BUDGET, float), default=15.0, metavar="MINUTES",
                    help="wall-clock minutes for the whole run, loading included; every stage ends by its share, and "
                         "when the budget ends tune chooses from what it measured and says what it did not reach "
                         "(--resume with more minutes continues; default: %(default)s)")
    tu.add_argument("--resume", action="store_true", help="continue a killed run in --out from its tune.csv")
    tu.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    tu.add_argument("--verbose", action="store_true", help="also print every candidate's status and figures (what "
                                                           "tune.csv holds), one line each")
    progress_flag(tu)
    tu.set_defaults(func=run, outputs=(FOLDER_OUT,))


def run(args: argparse.Namespace) -> int:
    from ..deployment.specs import parse_space
    from ..commands.tune import preset_paths, tune

    if random_weights(args):
        args.notes.append("no --checkpoint or --pretrained: random weights were tuned, whose agreement says nothing")
    space = None if args.methods is None else parse_space(args.methods)
    result = tune(args.model, args.data, batches=args.batches, device=args.device,
                  dtype=args.dtype, tf32=args.tf32, budget=args.budget, budget_on=args.budget_on,
                  min_speedup=args.min_speedup,
                  modes=args.modes.split(",") if args.modes else None, space=space, checkpoint=args.checkpoint,
                  pretrained=args.pretrained, limit=args.limit, prune_images=args.prune_images,
                  max_rounds=args.max_rounds, time_budget=args.time_budget, out=args.out, resume=args.resume,
                  overwrite=args.overwrite,
                  show_progress=not args.no_progress)
    s = result.settings
    print(f"{s['model']} on {s['device_name']}: {s['dtype']}{', TF32' if s['tf32'] else ''}, modes "
          f"{', '.join(s['modes'])}; {result.budget_text()}")
    for note in s["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(result.table())
    if args.verbose:
        for r in result.rows:
            speed = "" if r.speedup is None else f", {r.speedup:.2f}x [{r.speedup_lo:.2f}, {r.speedup_hi:.2f}]"
            loss = "" if r.agree_n is None else f", loss {r.loss(s['budget_measure']):.2f} on {r.agree_n} images"
            print(f"batch {r.batch}: {r.candidate}: {r.status}{speed}{loss}")
    for batch, path in preset_paths(args.out, s["batches"]).items():
        print(f"saved {path} (batch {batch})")
    for line in result.answer:  # the last lines: what a user came for
        print(line)
    return 0
