"""ToCom's training images: the held-out split and the g x g mosaics of random crops it trains on."""
from typing import TYPE_CHECKING, List, Sequence, Tuple

import torch
from torch import nn

from .engine import SeededAugment

if TYPE_CHECKING:
    from .tocom import TrainConfig


class Mosaic(torch.utils.data.Dataset):
    """Training images: a g x g grid (g drawn from `grids`) of random resized crops (area in
    crop_scale, bicubic, random flip) filling the model's input size; tile 0 is image i, the others are
    random images. Tiles of input_size / g upscale small images less, so their tokens carry detail
    closer to a photo's. Returns (normalised (3, H, W) tensor, -1)."""

    def __init__(self, images: torch.utils.data.Dataset, model: nn.Module, grids: Sequence[int],
                 crop_scale: Tuple[float, float]) -> None:
        import timm
        from torchvision import transforms

        cfg = timm.data.resolve_model_data_config(model)
        self.images, self.grids, self.crop_scale = images, tuple(grids), crop_scale
        self.height, self.width = cfg["input_size"][-2:]
        self.finish = transforms.Compose([transforms.ToTensor(), transforms.Normalize(cfg["mean"], cfg["std"])])

    def __len__(self) -> int:
        return len(self.images)

    def _tile(self, j: int, height: int, width: int):
        from torchvision import transforms

        crop = transforms.RandomResizedCrop((height, width), scale=self.crop_scale,
                                            interpolation=transforms.InterpolationMode.BICUBIC)
        return transforms.RandomHorizontalFlip()(crop(self.images[j][0]))

    def __getitem__(self, i: int):
        from PIL import Image

        g = self.grids[int(torch.randint(len(self.grids), ()))]
        rows = [round(k * self.height / g) for k in range(g + 1)]
        cols = [round(k * self.width / g) for k in range(g + 1)]
        canvas = Image.new("RGB", (self.width, self.height))
        for t in range(g * g):
            j = i if t == 0 else int(torch.randint(len(self.images), ()))
            r, c = divmod(t, g)
            canvas.paste(self._tile(j, rows[r + 1] - rows[r], cols[c + 1] - cols[c]), (cols[c], rows[r]))
        return self.finish(canvas), -1


def heldout_indices(count: int, holdout: int, pick: str) -> List[int]:
    """The `holdout` of `count` images never trained on: evenly spaced ("spread": index
    floor((k + 0.5) count / holdout), k < holdout) or the last ones ("end")."""
    if pick == "end":
        return list(range(count - holdout, count))
    return [int((k + 0.5) * count / holdout) for k in range(holdout)]


def split_images(data: str, model: nn.Module, config: "TrainConfig") -> Tuple[SeededAugment, torch.utils.data.Dataset]:
    """(training mosaics, the held-out images with the model's eval transform)."""
    from ..files.data import open_images
    from ..models.build import eval_transform

    pil = open_images(data, lambda img: img)
    evaluation = open_images(data, eval_transform(model))
    if config.holdout >= len(pil):
        raise ValueError(f"--holdout {config.holdout} leaves no training image: --data has {len(pil)} images")
    heldout = heldout_indices(len(pil), config.holdout, config.holdout_pick)
    kept = sorted(set(range(len(pil))) - set(heldout))
    train = Mosaic(torch.utils.data.Subset(pil, kept), model, config.mosaic, config.crop_scale)
    return SeededAugment(train, config.seed), torch.utils.data.Subset(evaluation, heldout)
