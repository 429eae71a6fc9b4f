"""Plain-text tables, the format of every mpjax report (matmuls, precision, autocast, memory),
and the byte counts they show."""

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


def human_bytes(n: int) -> str:
    """A byte count as people read it: ``B`` below a KiB, then KiB, MiB or GiB to one decimal.

    >>> human_bytes(512), human_bytes(3 * 1024**2)
    ('512 B', '3.0 MiB')
    """
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
