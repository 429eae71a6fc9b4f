"""Plain-text tables, the format of every mpjax report (matmuls, precision, autocast)."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    footer: Sequence[str] | None = None,
    right: frozenset[int] = frozenset(),
) -> str:
    """Formats ``rows`` under ``header`` in aligned columns, with a dashed rule under the header
    (and above ``footer``, when given). Columns whose index is in ``right`` align right.

    >>> print(format_table(("name", "n"), [("a", "1"), ("bb", "22")], right=frozenset({1})))
    name   n
    ----  --
    a      1
    bb    22
    """
    table = [tuple(header), *map(tuple, rows)] + ([tuple(footer)] if footer else [])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(row):
        cells = (
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        )
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    lines = [line(header), rule, *map(line, rows)]
    if footer:
        lines += [rule, line(footer)]
    return "\n".join(lines)
