"""Plain-text tables for the terminal: every column as wide as its widest cell, so no cell runs into the next."""
from typing import List, Sequence

GAP = "  "


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1, rule: bool = False) -> List[str]:
    """The table's lines: the header, a rule of dashes under it if `rule`, then one line per row. Columns are two
    spaces apart; the first `left` columns are left-aligned (names), the others right-aligned (numbers)."""
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells, as the header has")
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return GAP.join(str(c).ljust(w) if i < left else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    head = line(header)
    return [head] + (["-" * len(head)] if rule else []) + [line(row) for row in rows]
