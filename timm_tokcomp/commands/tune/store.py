"""tune.csv: the rows written after every step and read back, and a resume that refuses other settings."""
import csv
import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple, get_args

from ...files.outputs import replacing
from ...files.userfiles import fail, read_json
from .rows import TuneRow


SHOWN_ONLY = ("data", "random_weights", "time_budget")  # recorded for the reader; a resume compares data_sha256
# (not how the path was spelled) and weights_sha256, and may be given more time
_RESUME_NAMES = {"weights_sha256": "other weights (--checkpoint / --pretrained, or another module)",
                 "data_sha256": "other images in --data"}


def resume_rows(out: str, settings: Dict[str, Any]) -> Dict[Tuple[int, str], TuneRow]:
    """The rows of a killed run in out, keyed by (batch, candidate); ValueError when it ran other settings."""
    config = Path(out) / "tune_config.json"
    if not config.is_file():
        return {}
    saved = read_json(config)
    differing = sorted(k for k in settings if k not in SHOWN_ONLY and saved.get(k) != json.loads(json.dumps(settings[k])))
    if "weights_sha256" in differing and (saved.get("random_weights") or settings.get("random_weights")):
        raise ValueError(f"--resume: {out} was measured on random weights (no --checkpoint or --pretrained), drawn "
                         f"from a fixed seed, and this run's differ from them (timm or torch initialise them "
                         f"differently here, or one run had weights); resume with the weights of that run, tune "
                         f"weights that stay the same (--checkpoint FILE or --pretrained), or start again with "
                         f"--overwrite (without --resume)")
    if differing:
        named = ", ".join(_RESUME_NAMES.get(k, k) for k in differing)
        raise ValueError(f"--resume: {out} holds a run measured with other settings ({named}); give the same ones, or "
                         f"replace that run with --overwrite (without --resume), or choose another --out")
    return {(r.batch, r.candidate): r for r in read_rows(Path(out) / "tune.csv")}


def write_rows(rows: Sequence[TuneRow], path: Path) -> None:
    with replacing(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(TuneRow)])
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))


def read_rows(path: Path) -> List[TuneRow]:
    """The rows of a tune.csv (empty if there is none); ValueError naming the file when it is not one."""
    if not path.is_file():
        return []
    types = {fl.name: fl.type for fl in fields(TuneRow)}
    rows = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != list(types):
                raise ValueError(f"is not a tune.csv of this version (columns {reader.fieldnames})")
            for line in reader:
                if None in line or None in line.values():
                    raise ValueError(f"line {reader.line_num} has {'more' if None in line else 'fewer'} cells than "
                                     f"the header")
                try:
                    values = {k: _parse(types[k], v) for k, v in line.items()}
                except (TypeError, ValueError) as e:
                    raise ValueError(f"line {reader.line_num}: {e}") from None
                rows.append(TuneRow(**values))
    except (ValueError, csv.Error) as e:  # UnicodeDecodeError is a ValueError: not a text file
        raise fail("--resume", path, f"cannot be read as tune's CSV: {e}") from None
    return rows


def _parse(kind: Any, text: str) -> Any:
    """A CSV cell as the TuneRow field type kind (int, bool, str, Optional[int / float])."""
    if kind is bool:
        if text not in ("True", "False"):
            raise ValueError(f"expected True or False, got {text!r}")
        return text == "True"
    if kind in (int, str):
        return kind(text)
    if text == "":
        return None
    return int(text) if int in get_args(kind) else float(text)
