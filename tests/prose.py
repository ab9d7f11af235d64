"""The prose of a Markdown page, as a reader reads it (tables, code blocks, headings, HTML and image lines aside),
cut into sentences: for tests/test_docs.py's readability check. `python tests/prose.py PAGE...` lists a page's
sentences over a length, longest first."""
import re
from typing import List

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
# a full stop after these does not end a sentence
ABBREVIATIONS = ("e.g", "i.e", "vs", "etc", "cf", "approx", "no", "fig", "eq", "al", "ca", "incl")
END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z0-9`(\"*_\[])")
# sentence-looking text in a date (2026-12-06) or a dated clause: "since 2026-...", "as of 2026-..."
DATED = re.compile(r"\b(since|as of|until|from|before|after)\s+(\d{4}-\d{2}-\d{2}|(january|february|march|april|may|"
                   r"june|july|august|september|october|november|december)\s+\d{4})", re.I)


def paragraphs(markdown: str) -> List[str]:
    """The page's prose paragraphs and list items, one string each (markup stripped, inline code one word)."""
    text = FENCE.sub("\n", markdown)
    text = re.sub(r"<!--.*?-->", "\n", text, flags=re.S)
    found: List[str] = []
    current: List[str] = []

    def flush():
        if current:
            found.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(("|", "#", "<", "![", ":::", "---")):
            flush()
            continue
        item = re.match(r"^\s*(?:[-*+]|\d+[.)])\s+(.*)$", line)
        if item:
            flush()
            stripped = item.group(1)
        elif stripped.startswith(">"):
            stripped = stripped.lstrip("> ")
        current.append(stripped)
    flush()
    cleaned = []
    for p in found:
        p = LINK.sub(r"\1", p)
        p = INLINE_CODE.sub("CODE", p)
        p = re.sub(r"[*_]{1,2}(?=\S)|(?<=\S)[*_]{1,2}", "", p)
        if re.search(r"[A-Za-z]{2,}", p):
            cleaned.append(" ".join(p.split()))
    return cleaned


def sentences(markdown: str) -> List[str]:
    """Every sentence of the page's prose."""
    out = []
    for p in paragraphs(markdown):
        start = 0
        for m in END.finditer(p):
            before = p[start:m.start()].rstrip("\"')]")
            word = before.rsplit(" ", 1)[-1].rstrip(".").lower()
            if word in ABBREVIATIONS or re.fullmatch(r"[a-z]", word):
                continue
            out.append(p[start:m.start()].strip())
            start = m.end()
        if p[start:].strip():
            out.append(p[start:].strip())
    return out


def words(sentence: str) -> int:
    return len(sentence.split())


if __name__ == "__main__":
    import sys
    from pathlib import Path

    for page in sys.argv[1:]:
        found = sentences(Path(page).read_text())
        counts = [words(s) for s in found]
        print(f"{page}: {len(found)} sentences, {sum(counts) / max(1, len(counts)):.1f} words on average")
        for s in sorted(found, key=words, reverse=True):
            if words(s) > 30:
                print(f"  {words(s)}: {s}")
