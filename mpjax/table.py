"""Plain-text tables, the format of every mpjax report (matmuls, precision, autocast, memory),
and the byte counts, FLOPs and times they show."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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


def flops_text(n: int) -> str:
    """A FLOP count to three digits, with its SI prefix.

    >>> flops_text(2 * 1024**3), flops_text(512)
    ('2.15G', '512')
    """
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def seconds_text(s: float) -> str:
    """A time to three digits, in milliseconds from 1 ms, else in microseconds.

    >>> seconds_text(0.0025), seconds_text(1.43e-6)
    ('2.5 ms', '1.43 us')
    """
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def shape_text(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    """An array's dtype and shape, ``"bfloat16[1024, 512]"``, or its dtype alone for a scalar."""
    return f"{dtype.name}{list(shape)}" if shape else dtype.name
