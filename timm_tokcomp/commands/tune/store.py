"""tune.csv: the rows written after every step and read back, and a resume that refuses other settings."""
import csv
import io
import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, get_args

from ...files.outputs import replacing, write_text
from ...files.bounded import json_bounds, read_text
from ...files.userfiles import fail, read_json
from .rows import NOT_REACHED, Choice, TuneRow


SHOWN_ONLY = ("data", "random_weights", "time_budget")  # recorded for the reader; a resume compares data_sha256
# (not how the path was spelled) and weights_sha256, and may be given more time
_RESUME_NAMES = {"weights_sha256": "other weights (--checkpoint / --pretrained, or another module)",
                 "data_sha256": "other images in --data"}


def resume_rows(out: str, settings: Dict[str, Any]) -> Dict[Tuple[int, str], TuneRow]:
    """The rows of a killed run in out, keyed by (batch, candidate); ValueError when it ran other settings."""
    saved = _same_run(out, settings)
    if saved is None:
        return {}
    return {(r.batch, r.candidate): r for r in read_rows(Path(out) / "tune.csv")}


def _same_run(out: str, settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The tune_config.json of the run in out (None: there is none), refused when it ran other settings."""
    config = Path(out) / "tune_config.json"
    if not config.exists():
        return None
    saved = read_json(config, "--resume")
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
    return saved


def mark_finished(out: str, settings: Dict[str, Any], choices: Sequence[Choice], answer: Sequence[str]) -> None:
    """Record in out's tune_config.json that the run finished with every setting decided, with its choices and
    answer: a resume of it then measures and writes nothing (finished_run)."""
    record = {"choices": [{"batch": c.batch, "candidate": c.row.candidate if c.row else None, "reason": c.reason}
                          for c in choices], "answer": list(answer)}
    write_text(Path(out) / "tune_config.json", json.dumps(dict(settings, finished=record), indent=2) + "\n")


def finished_run(out: str, settings: Dict[str, Any]) -> Optional[Tuple[Dict[str, Any], List[TuneRow], List[Choice],
                                                                        List[str]]]:
    """(the saved settings, rows, choices, answer) of a run in out that finished with every setting decided
    (mark_finished, and no row left for a resume), or None: a resume then continues it. Refused, naming the file,
    when it ran other settings or its record is not one tune wrote."""
    saved = _same_run(out, settings)
    record = saved.get("finished") if saved else None
    if record is None:
        return None
    rows = read_rows(Path(out) / "tune.csv")
    if any(r.status.startswith(NOT_REACHED) for r in rows):
        return None
    by_key = {(r.batch, r.candidate): r for r in rows}
    config = Path(out) / "tune_config.json"
    try:
        choices = [Choice(c["batch"], None if c["candidate"] is None else by_key[(c["batch"], c["candidate"])],
                          c["reason"]) for c in record["choices"]]
        answer = record["answer"]
        if sorted(c.batch for c in choices) != sorted(settings["batches"]) or not all(
                isinstance(line, str) for line in answer + [c.reason for c in choices]):
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise fail("--resume", config, "records a finished run that does not agree with its tune.csv (a choice "
                                       "names a row it lacks, or a batch size of another run)") from None
    return saved, rows, choices, answer


def write_rows(rows: Sequence[TuneRow], path: Path) -> None:
    with replacing(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(TuneRow)])
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))


def read_rows(path: Path) -> List[TuneRow]:
    """The rows of a tune.csv (empty if there is none); ValueError naming the file when it is not one."""
    if not path.exists():  # a FIFO or device of that name is refused by read_text, naming what it is
        return []
    types = {fl.name: fl.type for fl in fields(TuneRow)}
    text = read_text(path, "--resume", "tune.csv")  # a regular text file, bounded
    rows = []
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
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
            problem = json_bounds(values["params"])  # JSON the choice reads back
            if problem is not None:
                raise ValueError(f"line {reader.line_num}: its params {problem}")
            rows.append(TuneRow(**values))
    except (ValueError, csv.Error) as e:
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
