"""How far a grid-keeping method moves a SAM-layout encoder's output, image by image: the cosine, per patch position,
between the reduced and the plain encoder's output (the neck's input grid, 64 x 64 at 1024 px), and the GMACs of each,
counted from the run.

SAM's own weights are not reachable offline, so the encoder is samvit_base_patch16's layout (16-pixel patches, 14 x 14
windows, global blocks 2, 5, 8, 11, relative positions) at DeiT-Tiny's width, carrying DeiT-Tiny's trained weights
(patch embedding, position embedding resampled to the grid, the twelve blocks; no class token; the relative-position
tables zero, as timm starts them): a trained ViT's token statistics at SAM's size, not SAM's features.

    python scripts/sam_agreement.py --checkpoint $TOKCOMP_DATA/deit_tiny_patch16_224.safetensors \\
        --data $TOKCOMP_DATA/photos-3000 --limit 48 --methods cubist_r4,cubist_r8,dense_tome_r4
"""
import argparse
import copy
import sys

import timm
import torch
from safetensors.torch import load_file
from timm.layers import resample_abs_pos_embed
from tqdm import tqdm

import timm_tokcomp
from timm_tokcomp.files.data import open_images
from timm_tokcomp.deployment.specs import method_spec
from timm_tokcomp.measure.counting import count_macs


def sam_from_deit(checkpoint: str, img_size: int) -> torch.nn.Module:
    """samvit_base_patch16's layout at DeiT-Tiny's width with DeiT-Tiny's weights (see the module docstring)."""
    deit = load_file(checkpoint)
    model = timm.create_model("samvit_base_patch16", img_size=img_size, embed_dim=192, num_heads=3, neck_chans=None,
                              num_classes=0)
    grid = model.patch_embed.grid_size
    pos = resample_abs_pos_embed(deit["pos_embed"], list(grid), num_prefix_tokens=1)
    state = {"pos_embed": pos[:, 1:].reshape(1, *grid, -1)}  # the class token's row dropped
    for key, value in deit.items():
        if key.startswith(("patch_embed.", "blocks.")):
            state[key] = value
    for key, value in model.state_dict().items():
        if key.endswith(("rel_pos_h", "rel_pos_w")):
            state[key] = torch.zeros_like(value)  # DeiT has no relative positions: no bias
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("neck.") for k in missing):
        raise ValueError(f"transplant mismatch: missing {missing}, unexpected {unexpected}")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="DeiT-Tiny's safetensors")
    parser.add_argument("--data", required=True, help="a folder of images")
    parser.add_argument("--methods", required=True, help="comma list of method tags or preset files")
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--img-size", type=int, default=1024)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    plain = sam_from_deit(args.checkpoint, args.img_size)
    transform = timm.data.create_transform(input_size=(3, args.img_size, args.img_size), crop_pct=1.0,
                                           interpolation="bicubic")
    images = [x for x, _ in torch.utils.data.DataLoader(open_images(args.data, transform, limit=args.limit),
                                                        batch_size=1)]
    reference, plain_macs = [], 0.0
    for x in tqdm(images, desc="plain", file=sys.stderr):
        reference.append(plain.forward_features(x))
        plain_macs += count_macs(plain, x)
    print(f"SAM layout, DeiT-Tiny weights, {args.img_size} px, {len(images)} images of {args.data}")
    print(f"plain: {plain_macs / len(images) / 1e9:.2f} GMACs per image")
    print("method | GMACs | of plain | cosine per position: mean | 5th percentile | images' worst mean")
    for item in args.methods.split(","):
        method, params = method_spec(item)
        model = timm_tokcomp.apply(copy.deepcopy(plain), method, **params)
        cosines, image_means, macs = [], [], 0.0
        for x, ref in zip(tqdm(images, desc=item, file=sys.stderr), reference):
            out = model.forward_features(x)
            cos = torch.nn.functional.cosine_similarity(out, ref, dim=1).flatten()
            cosines.append(cos)
            image_means.append(cos.mean().item())
            macs += count_macs(model, x)
        every = torch.cat(cosines)
        print(f"{item} | {macs / len(images) / 1e9:.2f} | {macs / plain_macs:.3f} | {every.mean():.4f} | "
              f"{every.quantile(0.05):.4f} | {min(image_means):.4f}")


if __name__ == "__main__":
    main()
