"""The documentation as a reader meets it: every Python block of README.md and docs/*.md runs, every command block
either runs here or says what it needs, and the mkdocs site (docs/ and the API pages) builds with warnings as
errors, so a renamed function breaks the tests and not the reader.

A Python block runs as a reader without the network runs it: a fresh interpreter in an empty folder, offline
(HF_HUB_OFFLINE=1). A file it reads that the page's commands make (a tune preset, a calibration, a folder of the
repository's hub_cards/) it names on a '# needs:' line, and the tests make it."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

pytestmark = [pytest.mark.slow]  # every snippet in a fresh interpreter, the site build
ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
NEEDS = re.compile(r"^# needs: (.+)$", re.M)
COMMAND_LANGUAGES = ("bash", "sh", "shell", "console")
# What a block marked "# needs: ..." may need, and why the tests cannot give it.
KNOWN_NEEDS = ("data", "gpu", "network", "minutes")  # minutes: longer than a test may run


def blocks(language: Tuple[str, ...]) -> List[Tuple[str, int, str]]:
    """(page, first line, code) of every fenced block in one of `language`, over all pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1).strip() in language:
                found.append((str(page.relative_to(ROOT)), text[:m.start()].count("\n") + 1, m.group(2)))
    return found


def _ids(items):
    return [f"{page}:{line}" for page, line, _ in items]


PYTHON = blocks(("python",))
COMMANDS = blocks(COMMAND_LANGUAGES)


def test_every_fence_names_its_language():
    """An unlabelled fence would be neither run nor marked: every block says python, bash or text."""
    untagged = [f"{page}:{line}" for page, line, _ in blocks(("",))]
    assert not untagged, f"fenced blocks without a language (use python, bash or text): {untagged}"


# files a snippet may say it needs ('# needs: PATH (what makes it)') that the page's own commands would make; the
# tests make them here: a preset of the kind those commands write, or the repository's folder the page names
PRESET_STAND_INS = {"tuned/preset_b64.json": ("tome", {"r": 8}), "tuned/preset.json": ("tome", {"r": 8}),
                    "atm_preset.json": ("atm", {"theta_min": 0.87})}


def make_needed_files(needs: List[str], folder: Path) -> None:
    """The files the snippet's '# needs:' lines name, made in folder; AssertionError for one the tests cannot make."""
    from timm_tokcomp.deployment.presets import PRESET_FORMAT

    for need in needs:
        path = need.split()[0]
        if any(need.startswith(k) for k in KNOWN_NEEDS):
            continue
        if path in PRESET_STAND_INS:
            method, params = PRESET_STAND_INS[path]
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(json.dumps({"format": PRESET_FORMAT, "method": method, "params": params}))
        elif path.startswith("hub_cards/") and (ROOT / path).is_dir():
            shutil.copytree(ROOT / path, folder / path)
        else:
            raise AssertionError(f"'# needs: {need}': not a need the tests know ({KNOWN_NEEDS}, a preset of "
                                 f"{sorted(PRESET_STAND_INS)}, or a folder of hub_cards/)")


@pytest.fixture
def reader_folder(tmp_path, monkeypatch):
    """A fresh, empty working folder, as a reader's: what a snippet needs it says, and make_needed_files makes."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    return tmp_path


# what a fresh interpreter runs before a snippet: the seed is fixed; it imports torch only, so a snippet that forgets
# `import timm_tokcomp` fails as it would for a reader
SNIPPET_PRELUDE = """\
import torch as _torch
_torch.manual_seed(0)
"""
# a reader without the network (the Hub unreachable): a snippet must run offline as written
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.mark.parametrize("page,line,code", PYTHON, ids=_ids(PYTHON))
def test_python_snippet_runs(page, line, code, reader_folder):
    """Each block on its own, as a reader pastes it into a fresh interpreter in an empty folder, offline: its own
    imports and inputs, and the files its '# needs:' lines name (made by the page's commands)."""
    needs = NEEDS.findall(code)
    if "gpu" in "".join(needs) and not torch.cuda.is_available():
        pytest.skip(f"{page}:{line} needs a GPU ({needs[0]})")
    make_needed_files(needs, reader_folder)
    script = reader_folder / "snippet.py"
    script.write_text(SNIPPET_PRELUDE + code)
    run = subprocess.run([sys.executable, str(script)], cwd=reader_folder, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, **OFFLINE))
    assert run.returncode == 0, f"{page}:{line} failed in a fresh interpreter:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"


def test_the_snippet_runner_sees_a_missing_import(reader_folder):
    """The runner is a fresh interpreter: a snippet using a registered name without importing timm_tokcomp fails."""
    code = "import timm\ntimm.create_model('deit_tiny_patch16_224.tome_r16')\n"
    with pytest.raises(AssertionError, match="Invalid pretrained tag"):
        test_python_snippet_runs("x.md", 1, code, reader_folder)


def test_the_snippet_runner_is_offline_and_in_an_empty_folder(reader_folder):
    """pretrained=True fails there as it fails for a reader without the network; a repository path the snippet does
    not say it needs is not there."""
    code = "import timm\ntimm.create_model('deit_tiny_patch16_224', pretrained=True)\n"
    with pytest.raises(AssertionError, match="failed in a fresh interpreter"):
        test_python_snippet_runs("x.md", 1, code, reader_folder)
    code = "import timm_tokcomp.tocom as t\nt.load('hub_cards/deit_tiny_patch16_224-tocom')\n"
    with pytest.raises(AssertionError, match="failed in a fresh interpreter"):
        test_python_snippet_runs("x.md", 1, code, reader_folder)
    test_python_snippet_runs("x.md", 1, "# needs: hub_cards/deit_tiny_patch16_224-tocom (the repository's)\n"
                             + code, reader_folder)


# folders only the package's developers have: a page names what the data is instead
DEVELOPER_PATHS = ("../shared",)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_point_to_nothing_only_the_developers_have(page):
    found = [path for path in DEVELOPER_PATHS if path in page.read_text()]
    assert not found, f"{page.name} points readers to {found}, which they do not have: say what the data is"


@pytest.fixture
def clone_folder(reader_folder):
    """A reader's folder beside a clone: the command blocks run the repository's examples/ scripts."""
    for shipped in ("hub_cards", "examples"):
        (reader_folder / shipped).symlink_to(ROOT / shipped)
    return reader_folder


@pytest.mark.parametrize("page,line,code", COMMANDS, ids=_ids(COMMANDS))
def test_command_block_runs_or_says_what_it_needs(page, line, code, clone_folder):
    """A command block marked '# needs: data / gpu / network / minutes' names what it needs; every other block runs
    here, in a fresh folder, and succeeds."""
    needs = NEEDS.findall(code)
    if needs:
        unknown = [n for n in needs if not any(n.startswith(k) for k in KNOWN_NEEDS)]
        assert not unknown, f"{page}:{line}: '# needs:' names {unknown}; say one of {KNOWN_NEEDS}"
        pytest.skip(f"{page}:{line} needs {'; '.join(needs)}")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=clone_folder, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"{page}:{line} failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """mkdocs build --strict: broken links and anchors between pages, and API entries whose objects are gone, fail."""
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs, mkdocstrings) is not installed")
    pytest.importorskip("mkdocstrings", reason="the docs extra (mkdocs, mkdocstrings) is not installed")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def test_the_site_builds_with_warnings_as_errors(site):
    api = (site / "api" / "index.html").read_text()
    assert 'id="timm_tokcomp.core.apply"' in api and 'id="timm_tokcomp.tocom.attach"' in api


def test_the_readme_links_reach_pages_and_headings(site):
    """The README is not part of the site, so mkdocs does not check its links: every docs/ link must name a page and,
    where it has one, a heading of that page."""
    links = re.findall(r"\]\((docs/[^)#]*)(?:#([^)]*))?\)", (ROOT / "README.md").read_text())
    assert links
    for page, anchor in links:
        assert (ROOT / page).is_file(), f"README links to {page}, which does not exist"
        if page.endswith(".md") and anchor:
            html = (site / Path(page).relative_to("docs").with_suffix("") / "index.html").read_text()
            assert f'id="{anchor}"' in html, f"README links to {page}#{anchor}, a heading that page does not have"


def test_readme_stays_short():
    """The README is the first ten minutes; everything else lives in docs/."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail to docs/"


def test_every_docs_page_is_in_the_site_navigation():
    yaml = pytest.importorskip("yaml", reason="the docs extra (mkdocs brings PyYAML) is not installed")

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = {next(iter(item.values())) for item in config["nav"]}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == listed, f"pages not in mkdocs.yml's nav: {pages - listed}; nav entries without a page: {listed - pages}"


def test_docs_tools_are_in_the_test_extra():
    """The build runs in the tests, so command 2 (the test extra) must install it."""
    text = (ROOT / "pyproject.toml").read_text()
    test_extra = re.search(r"^test = \[(.*?)\]", text, re.M | re.S).group(1)
    assert "mkdocs" in test_extra and "mkdocstrings" in test_extra


def test_shutil_which_finds_the_cli():
    """The command blocks run `tokcomp` from the environment the tests run in."""
    assert shutil.which("tokcomp", path=str(Path(sys.executable).parent)), "the tokcomp script is not installed"


def test_the_api_list_is_what_the_docstrings_say():
    """docs/api.md reads in the repository: its list of the public API (one row per `:::` directive, the first
    sentence of each docstring) is what scripts/api_list.py writes now."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import api_list
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    text = (ROOT / "docs" / "api.md").read_text()
    assert api_list.render(text) == text, "docs/api.md's list is stale: run python scripts/api_list.py"
    assert text.count("\n| `timm_tokcomp.") == text.count("\n::: timm_tokcomp.") > 30


# sentences about the project's past rather than to the reader (issue "first hour"): each page says what was
# measured, on what, by which command
HISTORY = ("until this version", "the check now", "after the counting fix", "which was the default then",
           "checked outside this repository", "what runs before this option did", "with an older commit",
           "since the floor moved", "so we made one", "until this one is timed", "the floor before",
           "/etc/xdg/pip", "the only measure before", "in an earlier", "an earlier h100 run")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_speak_to_the_reader_not_about_the_projects_past(page):
    text = " ".join(page.read_text().lower().split())
    found = [phrase for phrase in HISTORY if phrase in text]
    assert not found, f"{page.name}: {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_prose_reads_in_short_sentences_without_dates_of_changes(page):
    """Plain technical writing: a page's prose (tables, code and headings aside) averages at most 22 words a
    sentence, none over 50; no sentence dates a change ("since 2026-11-28": CHANGELOG.md keeps the history)."""
    from prose import DATED, sentences, words

    found = sentences(page.read_text())
    long = [s for s in found if words(s) > 50]
    average = sum(map(words, found)) / max(1, len(found))
    assert not long and average <= 22, f"{page.name}: {average:.1f} words a sentence; over 50: {long[:3]}"
    dated = [s for s in found if DATED.search(s)]
    assert not dated, f"{page.name}: {dated}"


def test_the_prose_reader_cuts_sentences_as_a_reader_does():
    from prose import sentences

    page = ("Intro text, e.g. a list vs. a table. Second one.\n\n| a | b |\n| --- | --- |\n\n```bash\nx. Y. Z.\n```\n"
            "- An item with `code. Inside` it. Another sentence!\n# Heading. Not prose")
    assert sentences(page) == ["Intro text, e.g. a list vs. a table.", "Second one.", "An item with CODE it.",
                               "Another sentence!"]


def test_the_onnx_export_list_names_every_method_and_only_those_that_export():
    from timm_tokcomp.methods import METHODS, method_class

    text = " ".join((ROOT / "docs" / "deployment.md").read_text().split())
    exports = text.split("- Exports: ")[1].split(" Not `atm`")[0]
    refused = text.split(" Not `atm`")[1].split("These are refused")[0]
    named = set(re.findall(r"`(\w+)`", exports)) & set(METHODS)
    assert named == {m for m in METHODS if method_class(m).exportable()}
    assert {"atm"} | (set(re.findall(r"`(\w+)`", refused)) & set(METHODS)) == \
        {m for m in METHODS if not method_class(m).exportable()}
