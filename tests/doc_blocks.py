"""The ```python blocks of a page (README.md, docs/*.md) and the chains a reader runs them in.

A reader copies one block. So every block runs alone, its imports and its inputs in it, unless
it says plainly that it continues the one before it: its first line is the comment

    # Continues the example above.

or the same with the names it uses from there, ``# Continues the example above (model, x).``.
Such a block joins the chain of the block before it (that block and whatever it continued) and
runs in that chain's namespace; any other block starts a chain of its own, in a fresh
namespace. tests/test_docs.py, tests/test_readme.py and tests/test_precision_doctor_guide.py
run the chains; the names a block uses and binds are read statically (``symtable``, the
compiler's own scope analysis), so a block that forgot an import fails without running.
"""

from __future__ import annotations

import builtins
import re
import symtable
from typing import NamedTuple

MARKER = "# Continues the example above."
_MARKER = re.compile(r"# Continues the example above(?: \((?P<names>[^()\n]+)\))?\.")
# What a reader could take for the marker: a comment that says a block continues another.
_LOOKS_LIKE_MARKER = re.compile(
    r"^[ \t]*#[ \t]*continu\w*[ \t]+(the[ \t]+)?(example|block|code|snippet)", re.I | re.M
)
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
# Names every module has before its first line runs.
_MODULE_NAMES = frozenset({"__name__", "__doc__", "__builtins__", "__spec__", "__loader__"})


class Block(NamedTuple):
    page: str  # the page as messages name it: "README.md", "docs/linen.md"
    number: int  # 1 for the page's first ```python block
    line: int  # the page's line of the block's first line of code
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}: block {self.number} (line {self.line})"

    @property
    def continues(self) -> bool:
        """Whether the block says it continues the one before it."""
        return _MARKER.fullmatch(self.code.split("\n", 1)[0]) is not None

    @property
    def names_continued(self) -> tuple[str, ...]:
        """The names the marker says the block uses from the chain: ``(model, x)``."""
        match = _MARKER.fullmatch(self.code.split("\n", 1)[0])
        if match is None or match["names"] is None:
            return ()
        return tuple(re.findall(r"[A-Za-z_]\w*", match["names"]))

    def source(self) -> str:
        """The code padded so that a traceback names the page's own line numbers."""
        return "\n" * (self.line - 1) + self.code


def python_blocks(text: str, page: str) -> list[Block]:
    """Each ```python block of a page's ``text``, in order."""
    return [
        Block(page, number, text.count("\n", 0, m.start(1)) + 1, m.group(1))
        for number, m in enumerate(_BLOCK.finditer(text), 1)
    ]


def chains(blocks: list[Block]) -> list[list[Block]]:
    """The blocks grouped as a reader runs them: a block that starts with the marker joins the
    chain of the block before it, any other block starts a new chain. A marker on a page's
    first block, or a comment that looks like the marker but is not it (misspelt, or not the
    first line), is a ValueError naming the block."""
    grouped: list[list[Block]] = []
    for block in blocks:
        lines = block.code.split("\n")
        for i, line in enumerate(lines):
            if _LOOKS_LIKE_MARKER.match(line) and not (i == 0 and block.continues):
                raise ValueError(
                    f"{block.where}: {line.strip()!r} is not the continuation marker: a block "
                    f"that continues the one before it starts with the line {MARKER!r} (or "
                    "'# Continues the example above (the names it uses).'), and any other "
                    "block runs alone"
                )
        if block.continues:
            if not grouped:
                raise ValueError(
                    f"{block.where} starts with {MARKER!r}, but no block comes before it on "
                    "the page: the first block must run alone (its imports and inputs in it)"
                )
            grouped[-1].append(block)
        else:
            grouped.append([block])
    return grouped


def _tables(table: symtable.SymbolTable):
    yield table
    for child in table.get_children():
        yield from _tables(child)


def bound_names(code: str) -> set[str]:
    """The names ``code`` binds in its module's namespace: assignments (targets of ``=``,
    ``for``, ``with``, ``except ... as``, ``:=``, match patterns and, where the compiler inlines
    them, comprehensions), imports, ``def`` and ``class``, and names a function declares
    ``global`` and assigns."""
    bound = set()
    for table in _tables(symtable.symtable(code, "<block>", "exec")):
        for symbol in table.get_symbols():
            if table.get_type() == "module":  # a str enum from Python 3.13
                if symbol.is_assigned() or symbol.is_imported():
                    bound.add(symbol.get_name())
            elif symbol.is_declared_global() and (symbol.is_assigned() or symbol.is_imported()):
                bound.add(symbol.get_name())
    return bound


def used_names(code: str) -> set[str]:
    """The names ``code`` reads from its module's namespace (or the builtins): at module level,
    and in any function, lambda, comprehension or class body where the name is not local."""
    used = set()
    for table in _tables(symtable.symtable(code, "<block>", "exec")):
        for symbol in table.get_symbols():
            if symbol.is_referenced() and symbol.is_global():
                used.add(symbol.get_name())
    return used


def undefined_names(code: str, defined: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The names ``code`` reads that neither it, ``defined`` (what the blocks it continues
    bind), the builtins nor every module's own names (``__name__``) define, sorted."""
    known = bound_names(code) | set(defined) | _MODULE_NAMES
    return sorted(n for n in used_names(code) - known if not hasattr(builtins, n))
