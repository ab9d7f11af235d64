"""A NaFlexVit on NaFlex batches, plain against a method, side by side in one process: median milliseconds per
forward (the two models interleaved round by round), aten ops and host syncs per forward (OpCounter). Two batches of
random images made as timm's NaFlex pipeline makes them (Patchify, NaFlexCollator): one whose images share a patch
grid, one mixing `--grids` grids (the reduced model runs one group of images per token count, or per grid where the
rope or the method reads it). Random weights.

    python scripts/naflex_speed.py naflexvit_base_patch16_siglip --method tome_r16 --images 8 --grids 4
    python scripts/naflex_speed.py vit_base_patch16_224 --use-naflex --method tome_r16 --device cuda --amp"""
import argparse
import contextlib
import warnings

import timm
import torch
from timm.data.naflex_dataset import NaFlexCollator
from timm.data.naflex_transforms import Patchify

import timm_tokcomp
from timm_tokcomp.measure.counting import OpCounter
from timm_tokcomp.measure.timing import time_side_by_side
from timm_tokcomp.models.timm_names import split_method_tag

# (rows, cols) patch grids of about the same token count, different aspect ratios
GRIDS = ((16, 16), (12, 20), (20, 12), (14, 18), (18, 14), (10, 24), (24, 10), (13, 19))


def naflex_batch(grids, patch: int, width: int, device: str):
    images = [torch.randn(3, rows * patch, cols * patch) for rows, cols in grids]
    batch = NaFlexCollator(max_seq_len=width)([(Patchify(patch)(image), 0) for image in images])[0]
    return {k: v.to(device) for k, v in batch.items() if torch.is_tensor(v)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a NaFlexVit architecture, or any timm ViT / EVA name with --use-naflex")
    parser.add_argument("--use-naflex", action="store_true", help="build the name with use_naflex=True")
    parser.add_argument("--method", default="tome_r16", help="a method tag (default tome_r16)")
    parser.add_argument("--images", type=int, default=8, help="images per batch (default 8)")
    parser.add_argument("--grids", type=int, default=4, help=f"distinct grids in the mixed batch, 1-{len(GRIDS)}")
    parser.add_argument("--rounds", type=int, default=5, help="timed forwards per model and batch (default 5)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    args = parser.parse_args()
    if not 1 <= args.grids <= min(len(GRIDS), args.images):
        parser.error(f"--grids must be between 1 and {min(len(GRIDS), args.images)}, got {args.grids}")
    try:
        _, tag = split_method_tag(args.model, args.method)
    except ValueError as e:
        parser.error(f"--method: {e}")
    if tag is None:
        parser.error(f"--method {args.method!r} is not a method tag (e.g. tome_r16, evit_r16)")
    torch.manual_seed(0)
    extra = dict(use_naflex=True) if args.use_naflex else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = timm.create_model(args.model, **extra).eval().to(args.device)
        reduced = timm.create_model(args.model, **extra).eval().to(args.device)
    reduced.load_state_dict(plain.state_dict())
    timm_tokcomp.apply(reduced, tag.method, **tag.params)
    patch = plain.embeds.patch_size[0]
    width = max(rows * cols for rows, cols in GRIDS)
    batches = {"1 grid": naflex_batch([GRIDS[0]] * args.images, patch, width, args.device),
               f"{args.grids} grids": naflex_batch([GRIDS[i % args.grids] for i in range(args.images)], patch, width,
                                                   args.device)}
    amp = torch.autocast(args.device.split(":")[0], torch.bfloat16) if args.amp else contextlib.nullcontext()
    models = {"plain": plain, args.method: reduced}
    print(f"{args.model}{' (use_naflex)' if args.use_naflex else ''}, {args.images} images of <= {width} patches, "
          f"{args.device}{' bf16' if args.amp else ''}, {args.rounds} rounds")
    with torch.no_grad(), amp:
        for label, batch in batches.items():
            counts = {}
            for name, model in models.items():
                model(batch)  # warm-up
                with OpCounter() as ops:
                    model(batch)
                counts[name] = (ops.total, ops.host_syncs)
            seconds = time_side_by_side(models, batch, rounds=args.rounds, warmup=0)
            ms = {name: 1000 * t for name, t in seconds.items()}
            cells = ", ".join(f"{name} {ms[name]:.1f} ms ({counts[name][0]} ops, {counts[name][1]} host syncs)"
                              for name in models)
            groups = len(reduced._groups(batch["patch_valid"].bool(), batch["patch_coord"]))
            print(f"{label} ({groups} group{'s' if groups > 1 else ''} of images run together): {cells}; "
                  f"speed-up {ms['plain'] / ms[args.method]:.2f}x")


if __name__ == "__main__":
    main()
