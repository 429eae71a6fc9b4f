"""A model's stack of blocks, found from its module paths, and the rules that keep the blocks
at either end of it in another policy.

Narrow formats hurt most at the ends of a network: NVIDIA's NVFP4 recipe kept the first 2 and
the last 8 of 62 blocks in bf16 (the last 4 were enough at 1.2B params), with the embeddings
and the head. :func:`edge_block_rules` gives those rules for any model whose blocks are named
with an index, in the path syntax of its library: Flax linen (``h0``, ``Block_3``,
``layers_2``), NNX (``blocks/3``) and Equinox (``blocks[3]``). :func:`mpjax.matmul_gains`
gives the other half of the choice: the modules a narrow format does not speed up.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from mpjax.policy import Policy, PolicyLike, get_policy

__all__ = ["LayerStack", "edge_block_rules", "layer_stack"]

# A path's components, each with the text of the path up to its end: names between '/' or '.',
# and Equinox's bracketed indices.
_COMPONENT = re.compile(r"\[\d+\]|[^/.\[\]]+")
# A component naming one block of a stack: an index alone (NNX's lists, Equinox's brackets) or a
# name ending in one (linen's h0, Block_3, layers_2).
_INDEXED = re.compile(r"\[(?P<bracket>\d+)\]|(?P<bare>\d+)|(?P<stem>.*?[^\d_])_?(?P<index>\d+)")


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The blocks of a model's stack, in index order.

    Attributes:
      name: where the stack is, as the blocks' paths spell it with the index left out
        (``"h"``, ``"blocks/"``, ``"layers[]"``).
      blocks: each block's path, index 0 first: the keys that rules for a block use.
    """

    name: str
    blocks: tuple[str, ...]


def _paths(modules: Any) -> list[str]:
    """Module paths from ``modules``: path strings, ``(path, class)`` pairs (Equinox's
    ``module_paths``), or a linen variables or params mapping (its nested keys, under
    ``"params"`` when there is one)."""
    if isinstance(modules, Mapping):
        tree = modules.get("params", modules)
        paths: list[str] = []

        def walk(node: Any, prefix: str) -> None:
            for key, child in node.items():
                if isinstance(child, Mapping):
                    path = f"{prefix}/{key}" if prefix else str(key)
                    paths.append(path)
                    walk(child, path)

        walk(tree, "")
        return paths
    if isinstance(modules, str) or not isinstance(modules, Iterable):
        raise TypeError(
            "layer_stack() takes module paths (strings or (path, class) pairs, as "
            "mpjax.equinox.module_paths(model) gives) or a linen variables mapping; got "
            f"{modules!r} of type {type(modules).__name__}."
        )
    return [entry[0] if isinstance(entry, tuple) else str(entry) for entry in modules]


def layer_stack(modules: Any) -> LayerStack:
    """The stack of blocks in ``modules``: of the runs of sibling paths that differ only in an
    index, the shallowest, and of those the longest.

    Args:
      modules: the model's module paths (strings, or ``(path, class)`` pairs), or a linen
        model's variables (or params).

    Raises:
      ValueError: when no two modules differ only in an index.
      TypeError: for anything else.

    >>> layer_stack(["embed", "blocks[0].attn", "blocks[1].attn", "blocks[2]", "head"])
    LayerStack(name='blocks[]', blocks=('blocks[0]', 'blocks[1]', 'blocks[2]'))
    """
    stacks: dict[str, dict[int, str]] = {}
    depth: dict[str, int] = {}
    for path in _paths(modules):
        for level, match in enumerate(_COMPONENT.finditer(path)):
            indexed = _INDEXED.fullmatch(match.group())
            if indexed is None:
                continue
            number = indexed["bracket"] or indexed["bare"] or indexed["index"]
            stem = indexed["stem"] or ("[]" if indexed["bracket"] else "")
            name = path[: match.start()] + stem
            stacks.setdefault(name, {})[int(number)] = path[: match.end()]
            depth[name] = level
    runs = {name: blocks for name, blocks in stacks.items() if len(blocks) > 1}
    if not runs:
        raise ValueError(
            "layer_stack(): no stack of blocks among the model's modules: no two of them differ "
            "only in an index (h0 and h1, blocks/0 and blocks/1, blocks[0] and blocks[1]). "
            "Write the rules for the blocks by path."
        )
    name = min(runs, key=lambda n: (depth[n], -len(runs[n])))
    return LayerStack(name, tuple(runs[name][i] for i in sorted(runs[name])))


def edge_block_rules(
    modules: Any, first: int = 1, last: int = 1, policy: PolicyLike = "mixed_bfloat16"
) -> dict[re.Pattern[str], Policy]:
    """Rules ``{block: policy}`` for the ``first`` and ``last`` blocks of the model's stack
    (:func:`layer_stack`), for :class:`mpjax.Rules` before a narrow default:
    ``mpjax.Rules({**edge_block_rules(variables, 1, 2), "head": ...}, default=...)``. Each key
    is a regular expression matching the block's path and every path inside it.

    Args:
      modules: the model's module paths, or a linen model's variables (:func:`layer_stack`).
      first, last: how many blocks to keep at each end (0 or more).
      policy: the kept blocks' policy.

    Raises:
      ValueError: for a negative count, counts that keep every block (nothing would be left in
        the narrow format), or a model without a stack.
      TypeError: for a count that is not an int.

    >>> rules = edge_block_rules([f"h{i}/mlp" for i in range(12)], first=1, last=2)
    >>> [key.pattern for key in rules], {str(policy) for policy in rules.values()}
    (['h0(?:[/.].*)?', 'h10(?:[/.].*)?', 'h11(?:[/.].*)?'], {'p=f32,c=bf16,o=f32'})
    """
    for argument, count in (("first", first), ("last", last)):
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"edge_block_rules({argument}=...) must be an int; got {count!r}.")
        if count < 0:
            raise ValueError(f"edge_block_rules({argument}=...) must be 0 or more; got {count}.")
    try:
        kept = get_policy(policy)
    except (TypeError, ValueError) as error:
        raise type(error)(f"edge_block_rules(policy=...): {error}") from None
    stack = layer_stack(modules)
    if first + last >= len(stack.blocks):
        raise ValueError(
            f"edge_block_rules(first={first}, last={last}) keeps every one of the "
            f"{len(stack.blocks)} blocks of {stack.name!r}: none would run in the narrow "
            "format. Keep fewer."
        )
    ends = stack.blocks[:first] + stack.blocks[len(stack.blocks) - last :]
    return {_block_and_inside(block): kept for block in ends}


def _block_and_inside(block: str) -> re.Pattern[str]:
    """The key of a rule for ``block`` and every module inside it (``h1`` and ``h1/attn``,
    ``layers[1].attn``; not ``h10``)."""
    return re.compile(re.escape(block) + r"(?:[/.].*)?", re.DOTALL)
