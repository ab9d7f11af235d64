"""One way to check a value (docs/architecture.md): every typed flag of every command takes a check of
utils/checks.py as its argparse type, the check its command's Python call runs, so a bad value is refused while
the command line is read, in the words the Python call uses; no module words a range check by hand."""
import argparse
import re
from pathlib import Path

import pytest

import timm_tokcomp
from timm_tokcomp.cli import build_parser, main
from timm_tokcomp.commands import selfcheck
from timm_tokcomp.utils.checks import FlagType, check_int, flag_type, integer

PACKAGE = Path(timm_tokcomp.__file__).parent


def _typed_flags():
    """(command, action) for every option of every command that takes a value of a type (selfcheck's too)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = dict(sub.choices)
    commands["selfcheck"] = selfcheck.build_parser()
    return [(name, action) for name, command in commands.items() for action in command._actions
            if action.option_strings and action.type is not None]


TYPED = _typed_flags()


def test_every_typed_flag_takes_a_check_and_its_default_passes_it():
    assert len(INTEGER) >= 25
    assert len(TYPED) >= 60  # every command's numbers and lists
    bare = [f"{name} {action.option_strings[0]}" for name, action in TYPED if not isinstance(action.type, FlagType)]
    assert not bare, f"flags typed without a check of utils/checks.py: {bare}"
    for name, action in TYPED:
        if action.default not in (None, argparse.SUPPRESS):  # a default is read as the user's text would be
            action.type(action.default if isinstance(action.default, str) else str(action.default))


@pytest.mark.parametrize("command,action", TYPED, ids=[f"{n}{a.option_strings[0]}" for n, a in TYPED])
def test_a_value_that_is_no_number_is_refused_while_the_line_is_read(command, action, capsys):
    """'abc' for any typed flag: exit 2 before any work, argparse naming the flag, the check its range."""
    flag = action.option_strings[0]
    if command == "selfcheck":
        with pytest.raises(SystemExit) as e:
            selfcheck.main([flag, "abc"])
        code = e.value.code
    else:
        code = main([command, flag, "abc"])
    err = capsys.readouterr().err
    assert code == 2 and f"argument {flag}" in err and "must be" in err and "got 'abc'" in err, err


INTEGER = [(n, a) for n, a in TYPED if a.type.parse is int or getattr(a.type.parse, "kind", None) is int]


@pytest.mark.parametrize("command,action", INTEGER, ids=[f"{n}{a.option_strings[0]}" for n, a in INTEGER])
def test_every_integer_flag_has_an_upper_bound(command, action, capsys):
    """10**15 for any integer flag (or list of them): exit 2 before any work, naming the flag and its bound."""
    flag = action.option_strings[0]
    if command == "selfcheck":
        with pytest.raises(SystemExit) as e:
            selfcheck.main([flag, str(10**15)])
        code = e.value.code
    else:
        code = main([command, flag, str(10**15)])
    err = capsys.readouterr().err
    assert code == 2 and f"argument {flag}" in err and re.search(r"in \[-?\d+, [\d,]+\]", err), err


def test_a_flag_and_the_python_call_refuse_alike(tmp_path, capsys):
    """tune's --limit: the same check refuses -3 on the command line and in tune()."""
    from timm_tokcomp.commands.tune import tune

    assert main(["tune", "deit_tiny_patch16_224", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--limit", "-3"]) == 2
    assert "argument --limit: must be an integer >= 2 (images: the first --prune-images screen" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^--limit must be an integer >= 2 \(images: the first --prune-images"):
        tune("deit_tiny_patch16_224", str(tmp_path), limit=-3)
    assert not (tmp_path / "o").exists()


def test_a_missing_or_unknown_argument_is_one_line_that_says_where_the_usage_is(capsys):
    assert main([]) == 2
    assert capsys.readouterr().err == ("tokcomp: error: the following arguments are required: command (tokcomp --help "
                                       "shows the usage)\n")
    assert main(["bench", "--no-such-flag"]) == 2
    assert capsys.readouterr().err == ("tokcomp: error: unrecognized arguments: --no-such-flag (tokcomp --help "
                                       "shows the usage)\n")


def test_a_flag_type_parses_then_checks():
    limit = flag_type(integer("--limit", 1))
    assert limit("7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be an integer >= 1, got 0$"):
        limit("0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be an integer >= 1, got '1.5'$"):
        limit("1.5")  # text that does not parse reaches the check as it is
    with pytest.raises(argparse.ArgumentTypeError, match=r"^seed must be"):  # a name that is not a flag stays
        flag_type(lambda v: check_int("seed", v, 0))("-1")


# what utils/checks.py words; a module that words it by hand is a second way to check a value
HAND_WORDED = re.compile(r"must be (one of|an integer >=|a finite number|True or False)")


def test_no_module_words_a_check_by_hand():
    found = [f"{path.relative_to(PACKAGE)}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "checks.py" for n, line in enumerate(path.read_text().splitlines(), 1)
             if HAND_WORDED.search(line)]
    assert not found, f"range checks worded by hand (use utils/checks.py): {found}"
