"""Precision regions: the named scopes that tell autocast which policy a computation runs in.

A region is a ``jax.named_scope`` whose name carries a policy (and, for a Flax module, the
module's path): ``mpjax[p=f32,c=bf16,o=f32]Block_0/attn``. JAX records named scopes on every
equation of a jaxpr (forward and, under ``transform(...)`` markers, backward), so the casting
engine (:mod:`mpjax.autocast`) reads from each equation which policy applies to it: the
innermost region around it wins. :func:`full_precision` is the region where nothing is cast.

The Flax integrations (:mod:`mpjax.linen`, :mod:`mpjax.nnx`) resolve a policy for each module
and open its region around the module's call; autocast then casts at the operations, whatever
the module's own attributes say. The region names also show up in profiles and HLO op names.

Where a region ends (a module returns to a caller under another policy), its outputs go through
an *output boundary*: ``jax.ad_checkpoint.checkpoint_name`` with a name that carries the
region's output dtype, an identity that JAX keeps in the jaxpr. The engine casts there instead
of binding it. A cast written at trace time would not do: the model is traced in its own dtypes
(f32 for an f32 model), where a cast to f32 records nothing, yet the engine may compute that
value in bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from mpjax.policy import Policy, get_policy, is_floating

FULL_PRECISION_SCOPE = "mpjax_full_precision"
"""The ``jax.named_scope`` name that :func:`full_precision` opens; autocast leaves it alone."""

_REGION = re.compile(r"^mpjax\[(?P<policy>[^\]]*)\](?P<path>.*)$")
_OUTPUT = "mpjax_output:"


@dataclasses.dataclass(frozen=True)
class Region:
    """Where a computation is: its policy (None inside :func:`full_precision`) and the path of
    the module whose region it is (``""`` for the root or a region that names no module)."""

    policy: Policy | None
    path: str = ""


def scope_name(policy: Policy, path: str = "") -> str:
    """The named-scope name of the region of ``policy`` (for the module at ``path``).

    >>> scope_name(get_policy("mixed_bfloat16"), "block/attn")
    'mpjax[p=f32,c=bf16,o=f32]block/attn'
    """
    return f"mpjax[{policy}]{path}"


def region(policy: Policy, path: str = ""):
    """A context manager whose computations autocast runs under ``policy``."""
    return jax.named_scope(scope_name(policy, path))


def full_precision():
    """A context manager (or decorator) whose computations :func:`mpjax.autocast` leaves in
    their traced dtypes, those of the modules of a wrapped Flax model called inside included.

    Its float32 matmuls and convolutions run at true float32 (``lax.Precision.HIGHEST``, the
    default ``f32_matmul_precision`` of :class:`mpjax.Policy`) where the code left their
    precision unset, whatever the policy around it says: at JAX's default a TPU would run them
    as one bf16 pass and a recent GPU in TF32.

    It is ``jax.named_scope("mpjax_full_precision")``, so it can be written anywhere inside the
    autocast function or a wrapped Flax model, in library code included, and also outside
    autocast (it then does nothing but name a scope, and leaves the precision to JAX).

    >>> import jax, jax.numpy as jnp, mpjax
    >>> def f(x):
    ...     with full_precision():
    ...         y = x @ x
    ...     return y + x @ x
    >>> [m.lhs_dtype.name for m in mpjax.inspect_matmuls(mpjax.autocast(f))(jnp.ones((2, 2)))]
    ['float32', 'bfloat16']
    """
    return jax.named_scope(FULL_PRECISION_SCOPE)


@functools.lru_cache(maxsize=4096)
def _parse(name: str) -> Region | None:
    if name == FULL_PRECISION_SCOPE:
        return Region(None)
    match = _REGION.match(name)
    if match is None:
        return None
    return Region(get_policy(match.group("policy")), match.group("path"))


def is_region(name: str) -> bool:
    """Whether the named scope ``name`` is a precision region's (or :func:`full_precision`'s).

    >>> is_region("mpjax[p=f32,c=bf16,o=f32]block/attn"), is_region("attn")
    (True, False)
    """
    return _parse(name) is not None


def innermost(scopes: Sequence[str]) -> Region | None:
    """The region of a computation under the named scopes ``scopes`` (outermost first), or None.

    The innermost region wins, except that :func:`full_precision` covers everything inside it,
    the regions of modules called there included (as ``torch.autocast(enabled=False)`` does):
    such a computation is in a full-precision region with the path of its innermost module.

    >>> innermost(["model", "mpjax[float32]head", "dense"])
    Region(policy=Policy(param_dtype=float32, compute_dtype=float32, output_dtype=float32), path='head')
    >>> innermost([FULL_PRECISION_SCOPE, "mpjax[mixed_bfloat16]head"])
    Region(policy=None, path='head')
    """
    found = None
    for name in reversed(scopes):
        region = _parse(name)
        if region is None:
            continue
        if region.policy is None:
            return Region(None, found.path if found is not None else "")
        if found is None:
            found = region
    return found


# JAX's own named scopes inside a module's code (a cond's branches, a remat, a loop's body,
# an einsum's subscripts) and transformations (``transpose(jvp(...))``): not part of a path.
_JAX_SCOPE = re.compile(r"^(cond|branch_\d+_fun|checkpoint|remat|while|body|cond_fun|scan)$|\(|->")


def module_path_in_op_name(op_name: str) -> str:
    """The path of the innermost module region in a compiled operation's op name (HLO's
    ``metadata={op_name=...}``), or ``""`` outside any module's region.

    An op name joins scope names with ``/``, and a region's name holds its path, so the path
    is read after the last region's policy, up to the operation's own name or a scope of
    JAX's.

    >>> module_path_in_op_name("jit(step)/mpjax[p=f32,c=bf16,o=f32]h3/attn/proj/dot_general")
    'h3/attn/proj'
    >>> module_path_in_op_name("jit(step)/transpose(jvp(GPT))/mpjax[bfloat16]h0/cond/mul")
    'h0'
    >>> module_path_in_op_name("jit(step)/mpjax[bfloat16]wte/...d,vd->...v/dot_general")
    'wte'
    """
    start = op_name.rfind("mpjax[")
    if start < 0:
        return ""
    parts = op_name[op_name.find("]", start) + 1 :].split("/")[:-1]
    path = []
    for part in parts:
        if not part or _JAX_SCOPE.search(part):
            break
        path.append(part)
    return "/".join(path)


def output_boundary(tree, dtype: np.dtype):
    """Marks the floating array leaves of ``tree`` as a region's outputs, to be cast to
    ``dtype`` by the engine (see the module docstring); other leaves pass unchanged."""
    name = f"{_OUTPUT}{np.dtype(dtype).name}"

    def mark(x):
        if isinstance(x, jax.Array) and is_floating(x):
            return checkpoint_name(x, name)
        return x

    return jax.tree.map(mark, tree)


def boundary_dtype(name: str) -> np.dtype | None:
    """The output dtype an :func:`output_boundary` name carries, or None for another name.

    >>> boundary_dtype("mpjax_output:bfloat16")
    dtype(bfloat16)
    """
    if not name.startswith(_OUTPUT):
        return None
    return np.dtype(jnp.dtype(name[len(_OUTPUT) :]))
