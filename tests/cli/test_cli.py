"""The command line's own surface: --version, `tokcomp methods`, and help that shows every default and lists the
method families rather than every preset."""
import argparse
import re

import pytest
import timm

import timm_tokcomp
from timm_tokcomp.cli import build_parser, main
from timm_tokcomp.methods import METHODS, TAG_FORMS


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"tokcomp (timm_tokcomp) {timm_tokcomp.__version__}"


def test_methods_lists_every_method_tag_form_and_parameter(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    words = set(out.replace(",", " ").split())
    assert set(METHODS) <= words and set(TAG_FORMS) <= words
    assert all(set(cls.param_names()) <= words for cls in METHODS.values())
    models = " ".join(out[out.index("models:"):].split())
    assert "Eva (timm.models.eva)" in models and "vit_small_patch16_dinov3.lvd1689m.tome_r16" in models
    for name in re.findall(r"[\w.]+\.tome_r\d+", models):  # every example a name timm lists
        assert name in timm.list_models(name.split(".")[0], pretrained=True), name


def _commands():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("command", sorted(_commands()))
def test_help_shows_every_default_and_no_preset_list(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "3000")  # no line breaks inside a default such as crop-flip
    parser = _commands()[command]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings != ["-h", "--help"]:
            shown = ", ".join(map(str, action.default)) if isinstance(action.default, tuple) else str(action.default)
            assert f"default {shown}" in text or f"default: {shown}" in text, (command, action.dest)
    assert "atm_g105" not in text  # the operating points are listed by `tokcomp methods` only


@pytest.mark.parametrize("argv", [
    ["bench", "deit_tiny_patch16_224", "--methods", "none,tome_x", "--no-progress"],
    ["calibrate", "deit_tiny_patch16_224", "--target-ratio", "0.8", "--data", "/no/such/folder", "--no-progress"],
    ["finetune", "deit_tiny_patch16_224", "--data", "/no/such/folder", "--out", "unused", "--no-progress"],
])
def test_an_error_is_the_only_line_even_with_random_weights(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tokcomp: error:"), err


def test_the_random_weights_note_follows_the_result(capsys):
    assert main(["bench", "deit_tiny_patch16_224", "--methods", "none,tome_r8", "--batch-size", "2", "--no-timing",
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "tome_r8" in captured.out and captured.err.strip().splitlines()[-1].startswith("note: no --checkpoint")
    assert "no timing" in captured.out and "latency" not in captured.out.splitlines()[0]  # nothing was timed


def test_the_model_is_given_first_or_as_timm_spells_it_and_once(tmp_path, capsys):
    assert main(["train-tocom", "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "give MODEL (a timm architecture, or open_clip:ARCH): first, or as --model / -m" in capsys.readouterr().err
    assert main(["train-tocom", "deit_tiny_patch16_224", "--model", "vit_tiny_patch16_224", "--data", str(tmp_path),
                 "--out", str(tmp_path / "o")]) == 2
    assert "give MODEL once" in capsys.readouterr().err
    assert main(["train-tocom", "-m", "test_vit", "--data", str(tmp_path / "none"), "--out",
                 str(tmp_path / "o"), "--steps", "0"]) == 2  # -m parses; the bad setting is refused
    assert "argument --steps: must be an integer >= 1, got 0" in capsys.readouterr().err


def _subcommands():
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


# one concept, one visible spelling across every command (timm's where timm has one); old spellings are hidden
CONCEPTS = {
    "timed rounds": (r"rounds", {"--rounds"}),
    "execution mode": (r"^--(modes?|backend)$", {"--modes"}),
    "LoRA rank": (r"rank", {"--lora-rank"}),
    "stopping early": (r"^--stop-after", {"--stop-after-steps", "--stop-after-epochs"}),
    "one batch size": (r"^--batch-size$|^-b$", {"--batch-size", "-b"}),
    "the model": (r"^--model$|^-m$", {"--model", "-m"}),
    "learning rate": (r"^--lr", {"--lr", "--lr-base"}),
}


def test_every_command_spells_each_concept_one_way():
    """Read from every subcommand's parser: the visible spellings of each concept (deprecated ones are hidden), the
    learning rates' two meanings under timm's two names, a stop flag's unit in its name, no --dtype in any help."""
    visible = {}
    for name, command in _subcommands().items():
        for action in command._actions:
            if action.help != argparse.SUPPRESS:
                for option in action.option_strings:
                    visible.setdefault(option, []).append((name, action))
    for concept, (pattern, spellings) in CONCEPTS.items():
        found = {option for option in visible if re.search(pattern, option)}
        assert found == spellings, (concept, found)
    for name, action in visible["--lr-base"]:
        assert "per 256 images" in action.help
    for name, action in visible["--lr"]:
        assert "per 256" not in action.help
    for option in ("--stop-after-steps", "--stop-after-epochs"):
        for name, action in visible[option]:
            assert option.rsplit("-", 1)[-1].rstrip("s") in action.help
    assert "--dtype" not in visible and "--timing-rounds" not in visible and "--max-rounds" not in visible
    for name, command in _subcommands().items():
        if any(a.dest == "model" and not a.option_strings for a in command._actions):
            assert command.format_usage().split()[3].lstrip("([") == "MODEL", name  # first, however it is given


@pytest.mark.parametrize("old,new", [("--timing-rounds", "--rounds"), ("--backend", "--modes")])
def test_an_old_spelling_still_works_with_a_note(old, new, tmp_path, capsys):
    argv = ["bench", "-m", "deit_tiny_patch16_224", "--methods", "none", "-b", "2", "--latency-runs", "0",
            "--no-progress", "--results-file", str(tmp_path / "r.csv")]
    value = {"--timing-rounds": "1", "--backend": "eager"}[old]
    assert main(argv + [old, value] + (["--rounds", "1"] if old == "--backend" else [])) == 0
    err = capsys.readouterr().err
    assert f"note: {old} is deprecated and goes in the next release: use {new}" in err
    assert (tmp_path / "r.csv").is_file()


def test_an_old_spelling_leaves_the_new_flags_default():
    for argv in (["tune", "x", "--data", "d", "--out", "o"], ["bench"], ["train-tocom", "x", "--data", "d", "--out", "o"]):
        args = build_parser().parse_args(argv)
        assert getattr(args, "max_rounds", 30) == 30 and getattr(args, "timing_rounds", 5) == 5
        assert getattr(args, "backend", "eager") == "eager" and getattr(args, "rank", 2) == 2
        assert getattr(args, "lr", 0.03) == 0.03


def test_timms_torchcompile_is_the_compile_mode():
    args = build_parser().parse_args(["bench", "--torchcompile"])
    assert args.backend == "compile"
    assert build_parser().parse_args(["tune", "x", "--data", "d", "--out", "o", "--torchcompile"]).modes == "compile"
    assert build_parser().parse_args(["train-tocom", "x", "--rank", "4", "--lr", "0.1", "--stop-after", "3",
                                      "--data", "d", "--out", "o"]).rank == 4


def test_precision_is_spelled_as_timm_spells_it_and_the_old_flag_still_works(tmp_path, capsys):
    import csv

    common = ["bench", "deit_tiny_patch16_224", "--methods", "none,tome_r8", "--batch-size", "2", "--no-timing",
              "--no-progress"]
    assert main(common + ["--amp", "--out", str(tmp_path / "a.csv")]) == 0
    assert {r["dtype"] for r in csv.DictReader(open(tmp_path / "a.csv"))} == {"bf16"}
    assert "--dtype is deprecated" not in capsys.readouterr().err
    assert main(common + ["--dtype", "bf16", "--out", str(tmp_path / "b.csv")]) == 0
    assert {r["dtype"] for r in csv.DictReader(open(tmp_path / "b.csv"))} == {"bf16"}
    assert "note: --dtype is deprecated: --dtype bf16 is --amp" in capsys.readouterr().err
    assert main(common + ["--amp", "--dtype", "fp16"]) == 2
    assert "not both" in capsys.readouterr().err


def test_ctrl_c_is_one_line_saying_what_was_kept_and_exit_130(tmp_path, capsys, monkeypatch):
    import timm_tokcomp.commands.speed
    from timm_tokcomp.cli import main

    def interrupted(*args, on_rows=None, **kwargs):
        if on_rows is not None:
            (tmp_path / "speed.csv.partial").write_text("mode,batch\n")  # what on_rows writes after a step
        raise KeyboardInterrupt

    monkeypatch.setattr(timm_tokcomp.commands.speed, "run_speed", interrupted)
    argv = ["speed", "--methods", "tome_r8", "--batches", "1", "--no-progress"]
    assert main(argv + ["--out", str(tmp_path / "speed.csv")]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"tokcomp: interrupted; the rows measured so far are in {tmp_path / 'speed.csv.partial'}" in err
    assert main(argv) == 130 and capsys.readouterr().err == "tokcomp: interrupted; nothing was written\n"
