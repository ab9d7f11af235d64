"""GMACs per image of a method run one image at a time (batch 1), counted from the run: what each image costs alone.
For methods whose counts differ per image (DyMU, ATS, LTMP), a batch pads to its largest count, so the GMACs a batched
run counts (paired_methods.py, bench) are higher than this.

    python scripts/gmacs_per_image.py --checkpoint $TOKCOMP_DATA/deit_tiny_patch16_224.safetensors \\
        --data $TOKCOMP_DATA/imagenet-val-1300 --method dymu_r8.json
"""
import argparse
import sys

import timm
import torch
from tqdm import tqdm

import timm_tokcomp
from timm_tokcomp.files.data import open_images
from timm_tokcomp.measure.agreement import predict
from timm_tokcomp.deployment.specs import method_spec
from timm_tokcomp.models.build import build_base_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deit_tiny_patch16_224")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", required=True, help="a folder of images")
    parser.add_argument("--method", required=True, help="a method tag or preset file, as --methods items elsewhere")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    plain = build_base_model(args.model, args.checkpoint, False, "cpu")
    dataset = open_images(args.data, timm.data.create_transform(**timm.data.resolve_model_data_config(plain)))
    images = [x for x, _ in torch.utils.data.DataLoader(dataset, batch_size=1)]
    method, params = method_spec(args.method)
    model = timm_tokcomp.apply(plain, method, **params)
    _, macs = predict(model, tqdm(images, desc=args.method, file=sys.stderr), count_macs=True)
    print(f"{args.method} on {args.data} ({len(images)} images, one at a time): "
          f"{sum(macs) / len(macs) / 1e9:.4f} GMACs per image")


if __name__ == "__main__":
    main()
