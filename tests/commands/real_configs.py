"""Every command on the real configuration of each family's smallest released architecture (random weights; the
images at the size the family's transform gives), for tests/commands/test_real_*.py. A toy model smaller than any
released one can skip the path a real one takes (nn.MultiheadAttention's fused path needs an even head count;
SAM's windows need a grid larger than a window): these runs take the real paths. A command that does not serve a
family refuses it with one error line, before any work."""
from dataclasses import dataclass
from typing import Dict, List, Tuple

import pytest

COMMANDS = ("bench", "speed", "tune", "calibrate", "analyze", "export")


@dataclass(frozen=True)
class RealConfig:
    """model: the MODEL arguments; methods: two tags the family serves; refused: command -> what its error says;
    classifier: False for a feature model, which bench counts and times on random inputs (no accuracy)."""

    model: Tuple[str, ...]
    methods: Tuple[str, str] = ("tome_r2", "evit_r2")
    refused: Tuple[Tuple[str, str], ...] = ()
    classifier: bool = True


def arguments(command: str, config: RealConfig, data: str, out: str) -> List[str]:
    """The command's arguments for the least work that still runs every stage of it."""
    first, second = config.methods
    small = {
        "bench": ["--methods", f"none,{first}", "--no-timing", "-b", "2", "--out", f"{out}/bench.csv",
                  *(["--data", data, "--limit", "2"] if config.classifier else [])],
        "speed": ["--methods", first, "--batches", "1", "--rounds", "3", "--out", f"{out}/speed.csv"],
        "tune": ["--methods", f"{first},{second}", "--data", data, "--limit", "6", "--prune-images", "2",
                 "--batches", "2", "--rounds", "3", "--out", f"{out}/tune"],
        "calibrate": ["--method", "dymu", "--r", "2", "--data", data, "--limit", "2", "-b", "2",
                      "--out", f"{out}/dymu.json"],
        "analyze": ["--methods", f"{first},{second}", "--data", data, "--limit", "2", "-b", "2", "--overlays", "0",
                    "--out", f"{out}/analyze"],
        "export": ["--method", first, "--out", f"{out}/model.onnx"],
    }[command]
    return [command, *config.model, *small, *(["--no-progress"] if command in ("bench", "tune", "analyze") else [])]


def run_command(command: str, config: RealConfig, data, tmp_path, capsys) -> Tuple[int, str]:
    """Run it in this process: (exit status, what it printed to stderr)."""
    from timm_tokcomp.cli import main

    if command == "analyze":
        pytest.importorskip("sklearn")
    if command == "export":
        pytest.importorskip("onnxruntime")
    try:
        code = main(arguments(command, config, str(data), str(tmp_path)))
    except SystemExit as e:  # argparse's refusal of a flag the command does not take
        code = e.code
    return code, capsys.readouterr().err


def check(command: str, config: RealConfig, code: int, err: str) -> None:
    """The command ran (exit 0), or refused the family as `config.refused` says: exit 2, one error line."""
    refused: Dict[str, str] = dict(config.refused)
    if command in refused:
        lines = [line for line in err.splitlines() if line.startswith("tokcomp: error:")]
        assert code == 2 and len(lines) == 1 and refused[command] in lines[0], err[-2000:]
        assert "Traceback" not in err
    else:
        assert code == 0, err[-3000:]
