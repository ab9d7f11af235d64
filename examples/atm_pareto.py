"""ATM against ToMe on real images, measured in one run: GMACs, top-1 and agreement of each ATM
setting next to ToMe's agreement and top-1 linearly interpolated at the same GMACs, then the
batch-size robustness of the first ATM setting (paper Table A1).

    D=$TOKCOMP_DATA      # the evaluation data folder (CONTRIBUTING.md)
    python examples/atm_pareto.py --checkpoint $D/deit_tiny_patch16_224.safetensors \
        --data $D/imagenet-val-1300 --methods atm,atm_balanced,atm_fast --batch-sizes 1,16,64,256
"""
import argparse
import sys
from typing import Dict, List, Sequence, Tuple

import timm
import torch

from timm_tokcomp.commands.bench import build_method_models
from timm_tokcomp.measure.agreement import evaluate
from timm_tokcomp.deployment.specs import parse_methods
from timm_tokcomp.models.build import build_base_model
from timm_tokcomp.files.data import open_dataset

TOME = ["tome_r4", "tome_r8", "tome_r12", "tome_r16"]


def interpolate(points: Sequence[Tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through points sorted by x (extrapolates from the end segments)."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1 or (x1, y1) == pts[-1]:
            return y0 + (x - x0) * (y1 - y0) / (x1 - x0)
    raise ValueError("need at least two points")


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deit_tiny_patch16_224")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", required=True, help="labelled images (labels.csv folder or ImageFolder)")
    parser.add_argument("--methods", default="atm", help="ATM tags or preset .json files, comma separated")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,16,64,256", help="for the robustness check ('' to skip)")
    parser.add_argument("--limit", type=int)
    args = parser.parse_args(argv)

    base = build_base_model(args.model, args.checkpoint, False, "cpu")
    dataset = open_dataset(args.data, timm.data.create_transform(**timm.data.resolve_model_data_config(base)))
    if args.limit:
        dataset = torch.utils.data.Subset(dataset, range(min(args.limit, len(dataset))))

    def run(models: Dict[str, torch.nn.Module], batch_size: int):
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=2)
        return evaluate(models, loader, "cpu", show_progress=True)

    atm_names = parse_methods(args.methods)[1:]
    ev = run(build_method_models(base, ["none"] + TOME + atm_names), args.batch_size)
    gm = {k: v / 1e9 for k, v in ev.macs.items()}
    tome_agree = [(gm[t], ev.agreement[t]) for t in TOME]
    tome_top1 = [(gm[t], ev.top1[t]) for t in TOME]
    print(f"\n{len(dataset)} images, batch {args.batch_size}")
    print(f"{'method':<22}{'GMACs':>8}{'+-batch':>9}{'top-1':>8}{'agree':>8}{'ToMe@GMACs agree':>18}{'top-1':>8}{'d agree':>9}{'d top-1':>9}")
    for name in ["none"] + TOME + atm_names:
        line = f"{name:<22}{gm[name]:>8.4f}{ev.macs_std[name] / 1e9:>9.4f}{ev.top1[name]:>8.2f}{ev.agreement[name]:>8.2f}"
        if name in atm_names:
            ta, tt = interpolate(tome_agree, gm[name]), interpolate(tome_top1, gm[name])
            line += f"{ta:>18.2f}{tt:>8.2f}{ev.agreement[name] - ta:>+9.2f}{ev.top1[name] - tt:>+9.2f}"
        print(line)

    if args.batch_sizes and atm_names:
        name = atm_names[0]
        print(f"\nbatch-size robustness of {name}")
        print(f"{'batch':>6}{'GMACs':>9}{'+-batch':>9}{'top-1':>8}{'agree':>8}")
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            ev = run(build_method_models(base, ["none", name]), bs)
            print(f"{bs:>6}{ev.macs[name] / 1e9:>9.4f}{ev.macs_std[name] / 1e9:>9.4f}{ev.top1[name]:>8.2f}"
                  f"{ev.agreement[name]:>8.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
