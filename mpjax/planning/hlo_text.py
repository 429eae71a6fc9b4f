"""The text form of HLO, as ``Compiled.as_text()`` and XLA's dumps print it, parsed into
computations and instructions.

Optimized GPU HLO is where the text gets irregular: tuple results (``(bf16[8,4]{1,0},
s8[4194304]{0})`` for a cuBLAS call and its workspace), operands written ``%name`` or
``bf16[8,4]{1,0} %name`` depending on the XLA version, ``/*index=5*/`` comments in long lists,
and attributes holding nested braces or JSON (``backend_config={...}``). This parser splits a
line by bracket depth, outside string literals, instead of by regular expression, so none of
these trips it. It reads only what a line says: it does not check that the module is valid.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

__all__ = ["HloComputation", "HloInstruction", "HloModule", "HloShape", "parse_module"]

_OPEN, _CLOSE = "([{", ")]}"
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_COMPUTATION = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_OPCODE = re.compile(r"\s*(?P<op>[a-z][a-z0-9\-]*)\(")
# Attributes that name the computations an instruction runs (fusion bodies, loop bodies,
# branches, reducers).
_CALLING_ATTRIBUTES = (
    "calls",
    "to_apply",
    "body",
    "condition",
    "branch_computations",
    "true_computation",
    "false_computation",
    "called_computations",
)


@dataclasses.dataclass(frozen=True)
class HloShape:
    """One array in an instruction's result: its HLO element type and dimensions.

    Attributes:
      dtype: the element type as HLO writes it (``"bf16"``, ``"f8e4m3fn"``, ``"s8"``).
      dims: the dimensions; a bounded dynamic dimension (``<=8``) counts as its bound.
    """

    dtype: str
    dims: tuple[int, ...]

    @property
    def size(self) -> int:
        """The number of elements."""
        n = 1
        for d in self.dims:
            n *= d
        return n


@dataclasses.dataclass(frozen=True)
class HloInstruction:
    """One instruction: ``[ROOT] name = type opcode(operands), key=value, ...``.

    Attributes:
      name: the instruction's name, without ``%``.
      shapes: the arrays of its result, in order: one for an array result, the leaves of a
        tuple result (nested tuples flattened); empty for a ``token``-only result.
      is_tuple: whether the result is a tuple.
      opcode: ``"fusion"``, ``"custom-call"``, ``"dot"``...
      operands: the operands' instruction names (none for ``parameter`` and ``constant``,
        whose parentheses hold a number or a literal).
      operand_shapes: the operands' types where the line writes them inline (``bf16[2]{0}
        %x``), else None, one per operand.
      attributes: ``(key, value)`` pairs after the operands, values as written.
      root: whether it is its computation's ``ROOT``.
      literal: a ``constant``'s value as written (``"4"``); empty for other instructions.
    """

    name: str
    shapes: tuple[HloShape, ...]
    is_tuple: bool
    opcode: str
    operands: tuple[str, ...]
    operand_shapes: tuple[HloShape | None, ...]
    attributes: tuple[tuple[str, str], ...]
    root: bool = False
    literal: str = ""

    def attribute(self, key: str) -> str | None:
        """The value of attribute ``key`` as written, or None if the line has none."""
        for k, v in self.attributes:
            if k == key:
                return v
        return None

    def backend_config(self) -> dict[str, Any]:
        """The ``backend_config`` JSON as a dict; empty when absent or not JSON."""
        text = self.attribute("backend_config")
        if not text or not text.startswith("{"):
            return {}
        try:
            config = json.loads(text)
        except json.JSONDecodeError:
            return {}
        return config if isinstance(config, dict) else {}

    def called_computations(self) -> tuple[str, ...]:
        """The names of the computations this instruction calls (``calls=``, ``body=``,
        ``to_apply=``, branches...), in the order written."""
        names: list[str] = []
        for key in _CALLING_ATTRIBUTES:
            value = self.attribute(key)
            if value:
                names += [n.strip().lstrip("%") for n in value.strip("{}").split(",") if n.strip()]
        return tuple(names)

    @property
    def custom_call_target(self) -> str | None:
        """For a ``custom-call``, its target (``"__cublas$lt$matmul"``), else None."""
        value = self.attribute("custom_call_target")
        return value.strip('"') if value is not None else None


@dataclasses.dataclass(frozen=True)
class HloComputation:
    """A computation: its name and its instructions in text order."""

    name: str
    instructions: tuple[HloInstruction, ...]
    is_entry: bool = False

    def __getitem__(self, name: str) -> HloInstruction:
        for inst in self.instructions:
            if inst.name == name:
                return inst
        raise KeyError(name)

    def get(self, name: str) -> HloInstruction | None:
        try:
            return self[name]
        except KeyError:
            return None

    def operand_shape(self, inst: HloInstruction, index: int) -> HloShape | None:
        """The first array of operand ``index`` of ``inst``: its inline type, or the result of
        the instruction it names in this computation; None if neither is known."""
        if index >= len(inst.operands):
            return None
        inline = inst.operand_shapes[index]
        if inline is not None:
            return inline
        source = self.get(inst.operands[index])
        return source.shapes[0] if source is not None and source.shapes else None


@dataclasses.dataclass(frozen=True)
class HloModule:
    """A parsed module: its computations by name, the entry computation's name."""

    computations: dict[str, HloComputation]
    entry: str

    @property
    def entry_computation(self) -> HloComputation:
        return self.computations[self.entry]


def _unquoted(text: str, start: int = 0):
    """``(index, character, bracket depth after it)`` for each character of ``text`` from
    ``start`` that is not inside a string literal."""
    depth, quoted, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
            continue
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        yield i, ch, depth


def _split(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` where no bracket is open and no string literal runs."""
    parts, start = [], 0
    for i, ch, depth in _unquoted(text):
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at ``text[start]``, strings skipped."""
    for i, ch, depth in _unquoted(text, start):
        if ch in _CLOSE and depth == 0:
            return i
    raise ValueError(f"unbalanced brackets in HLO: {text[start : start + 80]!r}")


def _shapes(type_text: str) -> tuple[HloShape, ...]:
    return tuple(
        HloShape(
            dtype,
            tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip()),
        )
        for dtype, dims in _ARRAY.findall(type_text)
    )


def _instruction(name: str, rest: str, root: bool) -> HloInstruction | None:
    rest = _COMMENT.sub("", rest).strip()
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    type_text, tail = rest[:end], rest[end:]
    match = _OPCODE.match(tail)
    if match is None:
        return None
    open_at = match.end() - 1
    close_at = _closing(tail, open_at)
    opcode = match["op"]
    operands: list[str] = []
    inline: list[HloShape | None] = []
    if opcode not in ("parameter", "constant"):
        for part in _split(tail[open_at + 1 : close_at]):
            part = part.strip()
            if not part:
                continue
            words = part.split()
            operands.append(words[-1].lstrip("%"))
            shapes = _shapes(" ".join(words[:-1]))
            inline.append(shapes[0] if shapes else None)
    attributes = []
    for part in _split(tail[close_at + 1 :]):
        key, eq, value = part.strip().partition("=")
        if eq:
            attributes.append((key.strip(), value.strip()))
    return HloInstruction(
        name=name,
        shapes=_shapes(type_text),
        is_tuple=type_text.startswith("("),
        opcode=opcode,
        operands=tuple(operands),
        operand_shapes=tuple(inline),
        attributes=tuple(attributes),
        root=root,
        literal=tail[open_at + 1 : close_at].strip() if opcode == "constant" else "",
    )


def parse_module(text: str) -> HloModule:
    """Parses the text of an HLO module into its computations.

    Args:
      text: a module as ``jax.jit(f).lower(...).compile().as_text()`` or an XLA dump writes
        it; lines outside computations (the ``HloModule`` header, stack-frame tables) are
        skipped.

    Returns:
      An :class:`HloModule`.

    Raises:
      ValueError: if ``text`` holds no computation.

    >>> module = parse_module('''
    ... ENTRY %main (a: f32[2,3]) -> (f32[3,2], s8[16]) {
    ...   %a = f32[2,3]{1,0} parameter(0)
    ...   ROOT %t = (f32[3,2]{1,0}, s8[16]{0}) custom-call(f32[2,3]{1,0} %a), custom_call_target="x"
    ... }''')
    >>> t = module.entry_computation["t"]
    >>> t.shapes[0], t.is_tuple, t.operands, t.custom_call_target
    (HloShape(dtype='f32', dims=(3, 2)), True, ('a',), 'x')
    """
    computations: dict[str, HloComputation] = {}
    entry = None
    current: tuple[str, bool, list[HloInstruction]] | None = None
    for line in text.splitlines():
        if current is not None:
            # A computation ends at a bare brace, or one with its attributes (a TPU7x's
            # SparseCore computations close with `}, execution_thread="sparsecore"`).
            if line.strip() == "}" or line.startswith("}, "):
                name, is_entry, instructions = current
                computations[name] = HloComputation(name, tuple(instructions), is_entry)
                current = None
                continue
            match = _INSTRUCTION.match(line)
            if match:
                inst = _instruction(match["name"], match["rest"], bool(match["root"]))
                if inst is not None:
                    current[2].append(inst)
            continue
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("(")[0]:
            current = (header["name"], bool(header["entry"]), [])
            if header["entry"]:
                entry = header["name"]
    if not computations:
        raise ValueError("no HLO computation in the text")
    if entry is None:  # a module printed without the ENTRY marker: XLA prints the entry last
        entry = list(computations)[-1]
    return HloModule(computations, entry)
