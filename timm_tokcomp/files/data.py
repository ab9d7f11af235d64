"""Image datasets: an ImageFolder tree, a folder with labels.csv (`file,label`), or (for label-free
work such as calibration) a plain folder of images. The one loader of image folders and labels files: every file
is checked at the door (it exists, it is an image; every label is a class index in range), and every error names
the flag and the file (userfiles.UserFileError)."""
import csv
import re
import warnings
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from ..utils.checks import env_int, integer, optional, shown
from .bounded import read_text, regular_file
from .userfiles import UserFileError, fail, inside

DEFAULT_MAX_IMAGE_PIXELS = 64_000_000  # 8000 x 8000: ~190 MB decoded as RGB; raise with TOKCOMP_MAX_IMAGE_PIXELS
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".pgm", ".bmp", ".webp", ".tif", ".tiff")
PathLike = Union[str, Path]


def max_image_pixels() -> int:
    """The most pixels an image may have (width x height, from its header): TOKCOMP_MAX_IMAGE_PIXELS, default
    DEFAULT_MAX_IMAGE_PIXELS. A small file can declare a huge image (a decompression bomb); it is refused by name
    before it is decoded. A bad value of the variable is refused naming the variable (checks.env_int), when a
    folder of images opens."""
    return env_int("TOKCOMP_MAX_IMAGE_PIXELS", DEFAULT_MAX_IMAGE_PIXELS, 1, "(pixels)")


def _open_checked(path: Path, flag: str, cap: int) -> Image.Image:
    """The image at path, a regular file (bounded.regular_file: a FIFO would hang), opened (its header read,
    nothing decoded) and within `cap` pixels."""
    regular_file(path, flag)
    over = f"megapixels), over the {cap / 1e6:g}-megapixel cap; raise TOKCOMP_MAX_IMAGE_PIXELS if you mean it"
    try:
        with warnings.catch_warnings():  # PIL's own bomb warning: the cap below says it with the file's name
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(path)
    except Image.DecompressionBombError as e:  # over PIL's own limit (twice its MAX_IMAGE_PIXELS)
        raise fail(flag, path, f"is a decompression bomb ({e}; {over[over.index('over'):]})") from None
    width, height = img.size
    if width * height > cap:
        img.close()
        raise fail(flag, path, f"is a {width} x {height} image ({width * height / 1e6:.0f} {over}")
    return img


def _check_image(path: Path, flag: str, cap: int) -> None:
    """Refuse a file PIL cannot identify as an image, or one over the pixel cap (its header only: cheap)."""
    try:
        _open_checked(path, flag, cap).close()
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag}: {path} not found") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        if isinstance(e, UserFileError):
            raise
        raise fail(flag, path, f"is not an image ({type(e).__name__}: {e})") from None


def _load_rgb(path: Path, flag: str, cap: int) -> Image.Image:
    """The image at path as RGB; a file that stops decoding (truncated) or is over the pixel cap is refused
    naming it."""
    try:
        with _open_checked(path, flag, cap) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        if isinstance(e, UserFileError):
            raise
        raise fail(flag, path, f"cannot be decoded as an image ({type(e).__name__}: {e})") from None


class _CheckedImages(Dataset):
    """(path, label) samples (the first `limit` of them, all for None) checked at the door: each a regular image
    file inside `base` once links are resolved (a link leading out is refused: nothing outside the folder is read),
    within the pixel cap; items are (transform(image), label)."""

    def __init__(self, samples: List[Tuple[Path, int]], base: Path, transform: Callable, flag: str,
                 limit: Optional[int] = None, source: Optional[Path] = None) -> None:
        samples = samples[:limit]  # only what will be read is checked
        self.cap = max_image_pixels()  # a bad TOKCOMP_MAX_IMAGE_PIXELS is named before any image
        root = base.resolve()
        for path, _ in samples:
            if not path.resolve().is_relative_to(root):
                raise fail(flag, source or path, f"{'names' if source else 'is'} "
                                                 f"{path.relative_to(base).as_posix()!r}, a symbolic link leading "
                                                 f"outside {base}: nothing outside the folder is read")
            _check_image(path, flag, self.cap)
        self.samples, self.base, self.transform, self.flag = samples, base, transform, flag

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        return self.transform(_load_rgb(path, self.flag, self.cap)), label

    @property
    def labels(self) -> List[int]:
        return [label for _, label in self.samples]

    @property
    def names(self) -> List[str]:
        """Each image's path relative to the folder its names are given in."""
        return [path.relative_to(self.base).as_posix() for path, _ in self.samples]


class LabeledImages(_CheckedImages):
    """Images listed in `root/<labels>` (default labels.csv; header `file,label`, 0-based class indices);
    files are looked up in `root/images/` if that folder exists, else in `root`, and must stay inside it (an
    absolute name, '..' or a link leading out is refused: userfiles.inside)."""

    def __init__(self, root: PathLike, transform: Callable, labels: str = "labels.csv", flag: str = "--data",
                 limit: Optional[int] = None) -> None:
        root = Path(root)
        self.image_dir = root / "images" if (root / "images").is_dir() else root
        rows = read_labels(root / labels, flag)[:limit]  # the names of what will be read are checked
        super().__init__([(inside(self.image_dir, name, root / labels, flag), label) for name, label in rows],
                         self.image_dir, transform, flag, source=root / labels)


class ImageTree(_CheckedImages):
    """An ImageFolder tree: root/<class name>/<image>, classes numbered in sorted order (as torchvision's)."""

    def __init__(self, root: PathLike, transform: Callable, flag: str = "--data", limit: Optional[int] = None) -> None:
        root = Path(root)
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        samples = [(p, i) for i, name in enumerate(self.classes) for p in sorted((root / name).rglob("*"))
                   if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
        if not samples:
            raise fail(flag, root, f"has class subfolders but no image files ({', '.join(IMAGE_SUFFIXES)})")
        super().__init__(samples, root, transform, flag, limit)


class UnlabeledImages(_CheckedImages):
    """Every image file directly in `root`, sorted by name; the label is -1."""

    def __init__(self, root: PathLike, transform: Callable, flag: str = "--data", limit: Optional[int] = None) -> None:
        files = sorted(p for p in Path(root).iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        super().__init__([(p, -1) for p in files], Path(root), transform, flag, limit)


_LABEL = re.compile(r"[0-9]{1,18}")  # ASCII digits only: int() also takes superscripts and stops at 4,300 digits


def read_labels(path: Path, flag: str = "--data") -> List[Tuple[str, int]]:
    """(file, class index) rows of a `file,label` CSV (a regular file of at most bounded.MAX_TEXT_BYTES); a label
    that is not a class index (ASCII digits, at most 18) is refused naming the file, its line and the value."""
    try:
        text = read_text(path, flag, "CSV with columns file,label", encoding="utf-8-sig")
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag}: {path} not found") from None
    reader = csv.DictReader(text.splitlines())
    if reader.fieldnames is None or not {"file", "label"} <= set(reader.fieldnames):
        raise fail(flag, path, "must have a header with columns 'file' and 'label'")
    rows = []
    for line, row in enumerate(reader, start=2):
        label = (row.get("label") or "").strip()
        if not _LABEL.fullmatch(label):
            raise fail(flag, path, f", line {line}: label {shown(label)} is not a class index (an integer >= 0 in "
                                   "ASCII digits, at most 18 of them; class names belong in an ImageFolder tree)")
        if not row.get("file"):
            raise fail(flag, path, f", line {line}: no file name")
        rows.append((row["file"], int(label)))
    return rows


def check_num_classes(dataset: Dataset, num_classes: int, flag: str = "--data") -> None:
    """Refuse labels the model cannot predict (>= num_classes); unlabelled datasets pass."""
    labels = getattr(dataset, "labels", [])
    top = max(labels, default=-1)
    if top >= num_classes:
        raise fail(flag, getattr(dataset, "root", ""), f"has class index {top}, but the model has {num_classes} "
                                                        f"classes (0..{num_classes - 1})")


def open_images(path: PathLike, transform: Callable, flag: str = "--data", limit: Optional[int] = None) -> Dataset:
    """Images whose labels are not needed: a labelled dataset as open_dataset reads it, or a plain
    folder of image files. limit: only the first `limit` images (None: all)."""
    path = Path(path)
    if path.is_dir() and not (path / "labels.csv").is_file() and not any(p.is_dir() for p in path.iterdir()):
        dataset = UnlabeledImages(path, transform, flag, LIMIT(limit))
        if len(dataset) == 0:
            raise fail(flag, path, f"holds no image files ({', '.join(IMAGE_SUFFIXES)})")
        return _rooted(dataset, path)
    return open_dataset(path, transform, flag, limit)


def open_dataset(path: PathLike, transform: Callable, flag: str = "--data", limit: Optional[int] = None) -> Dataset:
    """A labelled image dataset from a labels.csv folder, a labels file itself (`<folder>/<name>.csv`, e.g.
    one split of a folder), or an ImageFolder tree (class subfolders). limit: only the first `limit` images."""
    path, limit = Path(path), LIMIT(limit)
    if path.suffix == ".csv" and path.is_file():
        return _rooted(LabeledImages(path.parent, transform, labels=path.name, flag=flag, limit=limit), path)
    if not path.is_dir():
        raise FileNotFoundError(f"{flag}: {path} is not a folder")
    if (path / "labels.csv").is_file():
        return _rooted(LabeledImages(path, transform, flag=flag, limit=limit), path / "labels.csv")
    if not any(p.is_dir() for p in path.iterdir()):
        raise fail(flag, path, "has neither labels.csv nor class subfolders (ImageFolder layout)")
    return _rooted(ImageTree(path, transform, flag, limit), path)


LIMIT = optional(integer("--limit", 1, "(images)"))  # the first N images read (None: all); the flag's check too


def _rooted(dataset: Dataset, root: Optional[Path]) -> Dataset:
    dataset.root = root  # what an error about its labels names
    return dataset
