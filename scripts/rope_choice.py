"""Which rope should a merged token carry? DeiT-Tiny's weights in an Eva with rotary positions turned on ('cat'
rope beside the absolute position embedding), distilled label-free from DeiT-Tiny on photos-3000 through the
training engine (resumable), then ToMe with rope_merge='dst' and 'centroid' side by side on imagenet-val-1300 and
nips17-1000: top-1, agreement with the student's unreduced predictions, paired counts and exact McNemar p.

    TOKCOMP_DATA=path/to/data python scripts/rope_choice.py --out runs/rope_choice [--epochs 4] [--resume]

The student is a stand-in for a rope model with meaningful weights (no pretrained DeiT-Tiny-sized rope model is
reachable offline); what it shows is about this student."""
import argparse
import csv
import os
import sys
from pathlib import Path

import timm
import torch
from torch import nn
from tqdm import tqdm

import timm_tokcomp
from timm_tokcomp.measure.stats import mcnemar_exact_p
from timm_tokcomp.files.data import UnlabeledImages
from timm_tokcomp.training.engine import SeededAugment, Schedule, TrainingTask, distill_loss, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import eva_from_deit  # noqa: E402


class RopeDistill(TrainingTask):
    """Every weight of the rope student trained to match DeiT-Tiny's softmax (KL, T = 1) on unlabelled photos."""

    name = "distil rope student"

    def __init__(self, teacher: nn.Module, student: nn.Module, photos: Path, epochs: int, batch_size: int,
                 device: str) -> None:
        self.teacher = teacher.to(device).eval().requires_grad_(False)
        self.module = student.to(device).train()
        config = timm.data.resolve_model_data_config(teacher)
        transform = timm.data.create_transform(**config, is_training=True, scale=(0.4, 1.0), auto_augment=None,
                                               re_prob=0.0, color_jitter=None)
        self.train_set = SeededAugment(UnlabeledImages(photos, transform), seed=0)
        per_epoch = len(self.train_set) // batch_size
        self.schedule = Schedule(steps=epochs * per_epoch, steps_per_epoch=per_epoch, batch_size=batch_size, lr=2e-4,
                                 weight_decay=0.05, warmup_steps=per_epoch // 2, seed=0, checkpoint_every=10)

    def loss(self, batch, step):
        x = batch[0]
        with torch.no_grad():
            target = self.teacher(x)
        return {"loss": distill_loss(self.forward(x), target, 1.0, True)}

    def finish(self, out: Path, writer: bool, seconds: float):
        if writer:
            torch.save(self.module.state_dict(), out / "student.pt")
        print(f"trained for {seconds / 60:.1f} min")
        return self.module


def rope_student(deit: nn.Module) -> nn.Module:
    """eva_from_deit's Eva with a 'cat' rope (RoPE-ViT's axial form, temperature 100, index grid) turned on."""
    plain = eva_from_deit(deit)
    student = timm.models.eva.Eva(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3,
                                  global_pool="token", use_fc_norm=False, use_post_transformer_norm=True,
                                  num_classes=1000, use_rot_pos_emb=True, rope_type="cat", rope_temperature=100.0)
    student.load_state_dict(plain.state_dict())
    for a, b in zip(student.blocks, plain.blocks):
        a.attn.k_bias.copy_(b.attn.k_bias)
    return student


def predictions(model: nn.Module, folder: Path, transform, batch: int = 64):
    with open(folder / "labels.csv") as f:
        rows = list(csv.DictReader(f))
    from PIL import Image

    out = []
    with torch.no_grad():
        for i in tqdm(range(0, len(rows), batch), desc=folder.name, leave=False):
            x = torch.stack([transform(Image.open(folder / "images" / r["file"]).convert("RGB"))
                             for r in rows[i:i + batch]])
            out.append(model(x).argmax(-1))
    return torch.cat(out), torch.tensor([int(r["label"]) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    data = Path(os.environ.get("TOKCOMP_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    deit = timm.create_model("deit_tiny_patch16_224",
                             checkpoint_path=str(data / "deit_tiny_patch16_224.safetensors")).eval()
    student = train(lambda device, world: RopeDistill(deit, rope_student(deit), data / "photos-3000", args.epochs,
                                                      args.batch_size, device),
                    args.out, ["student.pt", "training"], {"epochs": args.epochs, "batch_size": args.batch_size}, {},
                    resume=args.resume).eval()
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(deit))
    for name in ("imagenet-val-1300", "nips17-1000"):
        folder = data / name
        teacher, labels = predictions(deit, folder, transform)
        timm_tokcomp.remove(student)
        plain, _ = predictions(student, folder, transform)
        print(f"{name}: DeiT-Tiny top-1 {(teacher == labels).float().mean() * 100:.2f} %; rope student "
              f"{(plain == labels).float().mean() * 100:.2f} %, agreeing with DeiT-Tiny on "
              f"{(plain == teacher).float().mean() * 100:.2f} %")
        for r in (8, 16):
            got = {}
            for merge in ("dst", "centroid"):
                timm_tokcomp.apply(student, "tome", r=r, rope_merge=merge)
                got[merge], _ = predictions(student, folder, transform)
                print(f"  ToMe r{r} {merge:8s}: top-1 {(got[merge] == labels).float().mean() * 100:.2f} %, agreement "
                      f"{(got[merge] == plain).float().mean() * 100:.2f} %")
            right = {m: got[m] == labels for m in got}
            gained = int((right["centroid"] & ~right["dst"]).sum())
            lost = int((right["dst"] & ~right["centroid"]).sum())
            print(f"  r{r} centroid vs dst: {gained} images right only with centroid, {lost} only with dst, exact "
                  f"McNemar p = {mcnemar_exact_p(gained, lost):.3g}; predictions differ on "
                  f"{int((got['dst'] != got['centroid']).sum())} of {len(labels)}")


if __name__ == "__main__":
    main()
