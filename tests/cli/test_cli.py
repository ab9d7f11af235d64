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


def test_train_tocom_takes_the_model_first_and_still_reads_the_old_flag(tmp_path, capsys):
    assert main(["train-tocom", "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "the model is required" in capsys.readouterr().err
    assert main(["train-tocom", "deit_tiny_patch16_224", "--model", "deit_tiny_patch16_224", "--data", str(tmp_path),
                 "--out", str(tmp_path / "o")]) == 2
    assert "give the model once" in capsys.readouterr().err
    assert main(["train-tocom", "--model", "test_vit", "--data", str(tmp_path / "none"), "--out",
                 str(tmp_path / "o"), "--steps", "0"]) == 2  # the old spelling parses; the bad setting is refused
    assert "--steps must be an integer >= 1" in capsys.readouterr().err


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
    import timm_tokcomp.speed
    from timm_tokcomp.cli import main

    def interrupted(*args, on_rows=None, **kwargs):
        if on_rows is not None:
            (tmp_path / "speed.csv.partial").write_text("mode,batch\n")  # what on_rows writes after a step
        raise KeyboardInterrupt

    monkeypatch.setattr(timm_tokcomp.speed, "run_speed", interrupted)
    argv = ["speed", "--methods", "tome_r8", "--batches", "1", "--no-progress"]
    assert main(argv + ["--out", str(tmp_path / "speed.csv")]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"tokcomp: interrupted; the rows measured so far are in {tmp_path / 'speed.csv.partial'}" in err
    assert main(argv) == 130 and capsys.readouterr().err == "tokcomp: interrupted; nothing was written\n"
