"""Image datasets: an ImageFolder tree, a folder with labels.csv (`file,label`), or (for label-free
work such as calibration) a plain folder of images."""
import csv
from pathlib import Path
from typing import Callable, List, Tuple, Union

from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder


class LabeledImages(Dataset):
    """Images listed in `root/<labels>` (default labels.csv; header `file,label`, 0-based class indices);
    files are looked up in `root/images/` if that folder exists, else in `root`."""

    def __init__(self, root: Union[str, Path], transform: Callable, labels: str = "labels.csv") -> None:
        root = Path(root)
        self.image_dir = root / "images" if (root / "images").is_dir() else root
        with open(root / labels, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or not {"file", "label"} <= set(reader.fieldnames):
                raise ValueError(f"{root / labels} must have a header with columns 'file' and 'label'")
            self.samples: List[Tuple[str, int]] = [(row["file"], int(row["label"])) for row in reader]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        name, label = self.samples[i]
        with Image.open(self.image_dir / name) as img:
            return self.transform(img.convert("RGB")), label


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


class UnlabeledImages(Dataset):
    """Every image file directly in `root`, sorted by name; the label is -1."""

    def __init__(self, root: Union[str, Path], transform: Callable) -> None:
        self.files = sorted(p for p in Path(root).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        with Image.open(self.files[i]) as img:
            return self.transform(img.convert("RGB")), -1


def open_images(path: Union[str, Path], transform: Callable) -> Dataset:
    """Images whose labels are not needed: a labelled dataset as open_dataset reads it, or a plain
    folder of image files."""
    path = Path(path)
    if path.is_dir() and not (path / "labels.csv").is_file() and not any(p.is_dir() for p in path.iterdir()):
        dataset = UnlabeledImages(path, transform)
        if len(dataset) == 0:
            raise ValueError(f"--data: {path} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
        return dataset
    return open_dataset(path, transform)


def open_dataset(path: Union[str, Path], transform: Callable) -> Dataset:
    """A labelled image dataset from a labels.csv folder, a labels file itself (`<folder>/<name>.csv`, e.g.
    one split of a folder), or an ImageFolder tree (class subfolders)."""
    path = Path(path)
    if path.suffix == ".csv" and path.is_file():
        return LabeledImages(path.parent, transform, labels=path.name)
    if not path.is_dir():
        raise FileNotFoundError(f"--data: {path} is not a folder")
    if (path / "labels.csv").is_file():
        return LabeledImages(path, transform)
    if not any(p.is_dir() for p in path.iterdir()):
        raise ValueError(f"--data: {path} has neither labels.csv nor class subfolders (ImageFolder layout)")
    return ImageFolder(str(path), transform=transform)
