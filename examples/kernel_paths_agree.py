"""Does kernel="triton" give the torch path's predictions? One model, the same images through both paths, image by
image: same top-1 class, largest logit difference, and the images each path gets right alone.

GPU (the compiled kernels):
    python examples/kernel_paths_agree.py --device cuda --method tome --r 16 \
        --checkpoint $D/deit_tiny_patch16_224.safetensors --data $D/imagenet-val-1300 --limit 1300
CPU (Triton's interpreter, slow: about 5 s per image for DeiT-Tiny):
    python examples/kernel_paths_agree.py --method evit --r 8 --checkpoint ... --data ... --limit 200
"""
import argparse
import os
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deit_tiny_patch16_224")
    p.add_argument("--checkpoint", help="safetensors weights of --model (default: timm's pretrained weights)")
    p.add_argument("--data", required=True, help="labelled image folder (as tokcomp bench reads it)")
    p.add_argument("--method", default="tome", choices=("tome", "evit", "atm"))
    p.add_argument("--r", type=int, default=16, help="tokens per block (tome, evit; default %(default)s)")
    p.add_argument("--limit", type=int, default=200, help="first N images (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

    import timm
    import torch
    from safetensors.torch import load_file
    from tqdm import tqdm

    import timm_tokcomp
    from timm_tokcomp.files.data import open_images

    model = timm.create_model(args.model, pretrained=args.checkpoint is None).eval()
    if args.checkpoint:
        model.load_state_dict(load_file(args.checkpoint))
    model.to(args.device)
    params = {} if args.method == "atm" else {"r": args.r}
    timm_tokcomp.apply(model, args.method, **params)
    images = open_images(args.data, timm.data.create_transform(**timm.data.resolve_data_config({}, model=model)))
    count = min(args.limit, len(images))
    same = torch_only = triton_only = both = off = 0
    max_diff = 0.0
    for start in tqdm(range(0, count, args.batch_size), desc="images", unit="batch", file=sys.stderr):
        batch = [images[i] for i in range(start, min(count, start + args.batch_size))]
        x = torch.stack([img for img, _ in batch]).to(args.device)
        labels = torch.tensor([label for _, label in batch], device=args.device)
        with torch.no_grad():
            timm_tokcomp.set_params(model, kernel="torch")
            a = model(x).float()
            timm_tokcomp.set_params(model, kernel="triton")
            b = model(x).float()
        ok_a, ok_b = a.argmax(1) == labels, b.argmax(1) == labels
        same += int((a.argmax(1) == b.argmax(1)).sum())
        both += int((ok_a & ok_b).sum())
        torch_only += int((ok_a & ~ok_b).sum())
        triton_only += int((ok_b & ~ok_a).sum())
        diff = (a - b).abs().amax(dim=1)
        off += int((diff > 1e-3).sum())
        max_diff = max(max_diff, float(diff.max()))
    label = f"{args.method}" + ("" if args.method == "atm" else f" r = {args.r}")
    print(f"{args.model}, {label}, {count} images of {args.data} on {args.device}")
    print(f"same top-1: {same}/{count}; largest |logit difference| {max_diff:.2e}; images with one above 1e-3: {off}")
    print(f"top-1 right: torch {both + torch_only}, triton {both + triton_only} "
          f"(torch alone {torch_only}, triton alone {triton_only})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
