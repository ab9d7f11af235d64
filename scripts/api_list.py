"""Write docs/api.md's list of the public API: for every `::: dotted.name` directive of the page (what the site
renders in full), a table row with the object's name and the first sentence of its docstring, under the page's own
section headings, between the LIST markers, so the page reads in the repository too. tests/test_docs.py checks the
file equals what this writes.

    python scripts/api_list.py          # rewrite docs/api.md's list
"""
import importlib
import inspect
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
START, END = "<!-- api list: written by scripts/api_list.py -->", "<!-- end of the api list -->"
DIRECTIVE = re.compile(r"^::: ([\w.]+)$", re.M)


def summary(dotted: str) -> str:
    """The first sentence of the object's docstring, on one line."""
    module, _, name = dotted.rpartition(".")
    doc = inspect.getdoc(getattr(importlib.import_module(module), name)) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    end = re.search(r"(?<![ .(]e\.g)(?<!i\.e)\.(\s|$)", first)
    return (first[:end.start() + 1] if end else first).replace("|", "\\|")


def render(text: str) -> str:
    """text (the page) with its list rewritten from its directives."""
    if END in text:
        head, body = text.split(START)[0], text.split(END)[1]
    else:  # a page without a list yet: it goes after the introduction
        intro, sections = text.split("\n## ", 1)
        head, body = intro.rstrip("\n") + "\n\n", "\n\n## " + sections
    rows, heading = [], None
    for line in body.splitlines():
        if line.startswith("## "):
            heading = line[3:]
        m = DIRECTIVE.match(line)
        if m:
            if heading is not None:
                rows += ["", f"**{heading}**", "", "| object | what it does |", "| --- | --- |"]
                heading = None
            rows.append(f"| `{m.group(1)}` | {summary(m.group(1))} |")
    return head + START + "\n" + "\n".join(rows).lstrip("\n") + "\n" + END + body


if __name__ == "__main__":
    new = render(PAGE.read_text())
    changed = new != PAGE.read_text()
    PAGE.write_text(new)
    print(f"{PAGE}: {'rewritten' if changed else 'already current'}", file=sys.stderr)
