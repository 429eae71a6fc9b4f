"""Grouped GEMMs: the matmuls of a mixture of experts, kept grouped forward and backward.

A mixture-of-experts layer multiplies each token by the weights of the expert it was routed to.
With the tokens sorted by expert, that is ``lax.ragged_dot(x, w, group_sizes)``: ``x`` is
``[M, K]`` (M token-expert pairs), ``w`` is ``[G, K, N]`` (G experts) and the first
``group_sizes[0]`` rows of ``x`` meet ``w[0]``, the next ``group_sizes[1]`` ``w[1]``, and so on.
Its backward pass is two more grouped GEMMs: the input gradient ``g @ w[g]^T`` row group by
row group, and the weight gradient ``x_g^T @ g_g`` for each expert, a contraction over that
expert's tokens.

What XLA makes of ``lax.ragged_dot`` depends on the chip. A TPU runs it and its gradients with
kernels of XLA's own. A GPU gets none: XLA multiplies every token by every expert in one dense
GEMM over a masked copy of the tokens (G times the FLOPs), and the gradient of a ragged dot
with an f32 ``preferred_element_type`` is computed in f32. :func:`grouped_dot` keeps the three
GEMMs grouped, in the compute dtype with f32 accumulation, the weight gradient written in the
reduce dtype, and lowers each one for a CUDA GPU to JAX's Pallas (Mosaic GPU) kernels, chosen
when the program is lowered for its target (:func:`mpjax.jax_compat.gpu_chosen_primitive`):

- on Hopper (compute capability 9): ``ragged_dot_mgpu.ragged_dot`` forward, the same with
  ``transpose_rhs`` for the input gradient, ``transposed_ragged_dot_mgpu`` for the weights';
- on Blackwell (10): ``blackwell_ragged_dot_mgpu`` forward and for the input gradient (on a
  transposed copy of the weights); JAX ships no Blackwell kernel for the weight gradient, which
  runs in mpjax's (:mod:`mpjax.grouped.blackwell`, each group's tokens padded to a multiple of
  128 rows, float32 results);
- elsewhere (other GPUs, TPUs, the CPU), and wherever a kernel does not take the shapes or the
  dtype (:func:`kernel_refusal`), XLA's ``ragged_dot_general``.

The kernels take bf16 or f16 operands and accumulate in f32. JAX's write their operands'
dtype: a weight gradient on JAX's Hopper kernel is rounded to the compute dtype once, then
widened to the reduce dtype (XLA's path and mpjax's Blackwell kernel write it in the reduce
dtype). fp8 operands (:mod:`mpjax.grouped.fp8`) take mpjax's own fp8 kernels on Hopper
(:mod:`mpjax.grouped.kernels`), and on Blackwell mpjax's Blackwell kernels
(:mod:`mpjax.grouped.blackwell`, the tokens padded per expert), all three in fp8 with float32
results for the recipe's scales. Rows past ``sum(group_sizes)`` belong to no group
and come out zero, as from ``lax.ragged_dot``.

Mosaic GPU compiles its kernels for one GPU architecture per process: after a kernel compiled
for one (an H100 plan), a program lowered for another (a B200) takes XLA's path, with a
:class:`GroupedMatmulWarning` saying so; plan each architecture in a process of its own.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import jax_compat
from mpjax.grouped import blackwell as blackwell_kernels
from mpjax.grouped import kernels as grouped_kernels

__all__ = [
    "FORMS",
    "SCOPE",
    "GroupedMatmulWarning",
    "check_operands",
    "grouped_dot",
    "grouped_form",
    "grouped_gemm",
    "kernel_refusal",
    "scope_name",
]

FORMS = ("forward", "input_gradient", "weight_gradient")
"""The names of a ragged dot's three grouped GEMMs, ``forward`` (``x [M, K]`` and
``w [G, K, N]`` to ``[M, N]``), ``input_gradient`` (``g [M, N]`` and ``w`` to ``[M, K]``) and
``weight_gradient`` (``x`` and ``g`` to ``[G, K, N]``)."""

_KERNEL_DTYPES = frozenset(np.dtype(d) for d in (jnp.bfloat16, jnp.float16))
_FP8_DTYPES = frozenset(np.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2))
# The tiles the kernels run with: JAX's own choices in their benchmarks, which fit Hopper's and
# Blackwell's shared memory in bf16.
_HOPPER = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=8)
_BLACKWELL_TILE = (128, 128, 64)  # m, n, k; doubled in m and n by a 2-SM (collective) cluster

# The forward dimension numbers (``lax.ragged_dot``'s) and the same with the weights stored
# ``[G, N, K]`` (``transposed``): what :func:`grouped_form` recognizes.
_FORWARD = (((1,), (1,)), ((), ()))
_FORWARD_TRANSPOSED = (((1,), (2,)), ((), ()))


class GroupedMatmulWarning(UserWarning):
    """Warned when a grouped GEMM lowered for a GPU takes XLA's dense path although a kernel
    would take it: Mosaic GPU compiled kernels for another GPU architecture in this process."""


def grouped_form(dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int) -> bool | None:
    """Whether a ``ragged_dot_general`` with these dimension numbers (a
    ``lax.RaggedDotDimensionNumbers``) is a mixture-of-experts forward GEMM that
    :func:`grouped_dot` computes: ``[M, K]`` rows grouped along M, times ``[G, K, N]`` weights
    (False) or ``[G, N, K]`` ones (True, ``transposed``); None for any other form.

    >>> dims = lax.RaggedDotDimensionNumbers(((((1,), (1,)), ((), ()))), [0], [0])
    >>> grouped_form(dims, 2, 3)
    False
    """
    dot = tuple(tuple(tuple(axes) for axes in pair) for pair in dims_of(dimension_numbers))
    if lhs_ndim != 2 or rhs_ndim != 3:
        return None
    if tuple(dimension_numbers.lhs_ragged_dimensions) != (0,):
        return None
    if tuple(dimension_numbers.rhs_group_dimensions) != (0,):
        return None
    if dot == _FORWARD:
        return False
    if dot == _FORWARD_TRANSPOSED:
        return True
    return None


def dims_of(dimension_numbers: Any) -> Any:
    """The dot dimension numbers of a ``lax.RaggedDotDimensionNumbers``."""
    return dimension_numbers.dot_dimension_numbers


def check_operands(lhs: Any, rhs: Any, group_sizes: Any, where: str) -> None:
    """Refuses operands a grouped GEMM cannot take, naming ``where`` (the public call) and the
    argument: ``lhs`` not ``[M, K]``, ``rhs`` not ``[G, K, N]``, ``group_sizes`` not ``G``
    integers, and where the group sizes are known (not traced), a negative one or a sum past
    the rows of ``lhs``.

    Raises:
      TypeError: for group sizes that are not integers.
      ValueError: for the shapes or the sizes above.
    """
    lhs_shape, rhs_shape = tuple(jnp.shape(lhs)), tuple(jnp.shape(rhs))
    if len(lhs_shape) != 2:
        raise ValueError(f"{where}: lhs must be [tokens, K]; got shape {lhs_shape}.")
    if len(rhs_shape) != 3:
        raise ValueError(f"{where}: rhs must be [experts, K, N]; got shape {rhs_shape}.")
    if lhs_shape[1] != rhs_shape[1]:
        raise ValueError(
            f"{where}: lhs's K ({lhs_shape[1]}) must be rhs's K ({rhs_shape[1]}), the "
            f"contraction of lhs [tokens, K] with rhs [experts, K, N]."
        )
    sizes_shape = tuple(jnp.shape(group_sizes))
    dtype = jnp.result_type(group_sizes)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{where}: group_sizes must be integers; got {np.dtype(dtype).name}.")
    if sizes_shape != (rhs_shape[0],):
        raise ValueError(
            f"{where}: group_sizes must hold one size per expert of rhs ({rhs_shape[0]}); got "
            f"shape {sizes_shape}."
        )
    if jax_compat.is_tracer(group_sizes):
        return
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        raise ValueError(f"{where}: group_sizes must not be negative; got {sizes.tolist()}.")
    if int(sizes.sum()) > lhs_shape[0]:
        raise ValueError(
            f"{where}: group_sizes sum to {int(sizes.sum())}, more than the {lhs_shape[0]} rows "
            "of lhs. Each row belongs to at most one group; rows past the sum come out zero."
        )


# --- The three GEMMs as primitives, lowered per target ----------------------------------


def _shapes(form: str, lhs: tuple[int, ...], rhs: tuple[int, ...]) -> tuple[int, int, int]:
    """``(rows, K, N)`` of a grouped GEMM of ``form`` on operands of shapes ``lhs``, ``rhs``
    (rows: the grouped rows, the tokens)."""
    if form == "forward":  # x [M, K], w [G, K, N]
        return lhs[0], lhs[1], rhs[2]
    if form == "input_gradient":  # g [M, N], w [G, K, N]
        return lhs[0], rhs[1], rhs[2]
    return lhs[0], lhs[1], rhs[1]  # weight_gradient: x [M, K], g [M, N]


def _abstract(
    lhs: Any, rhs: Any, group_sizes: Any, *, form: str, out_dtype: Any, precision: Any
) -> Any:
    rows, k, n = _shapes(form, lhs.shape, rhs.shape)
    if form == "forward":
        shape: tuple[int, ...] = (rows, n)
    elif form == "input_gradient":
        shape = (rows, k)
    else:
        shape = (group_sizes.shape[0], k, n)
    return jax.ShapeDtypeStruct(shape, out_dtype)


def _xla(
    lhs: Any,
    rhs: Any,
    group_sizes: Any,
    *,
    form: str,
    out_dtype: Any,
    precision: Any = None,
    accumulate: Any = None,
) -> Any:
    """XLA's ragged dot of ``form``: its TPU kernels, its dense expansion on a GPU, the CPU's;
    written in ``out_dtype``, accumulated in ``accumulate`` where given (the CPU's), float32
    operands multiplied at ``precision`` (``lax.ragged_dot_general``'s)."""
    if form == "forward":
        dims = lax.RaggedDotDimensionNumbers(_FORWARD, [0], [0])
    elif form == "input_gradient":  # g [M, N] against w [G, K, N]'s N
        dims = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])
    else:  # x [M, K] and g [M, N], contracted over the grouped rows
        dims = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), [0], [])
    return lax.ragged_dot_general(
        lhs,
        rhs,
        group_sizes,
        dims,
        precision=precision,
        preferred_element_type=accumulate or out_dtype,
    ).astype(out_dtype)


def _xla_cpu(
    lhs: Any, rhs: Any, group_sizes: Any, *, form: str, out_dtype: Any, precision: Any = None
) -> Any:
    """XLA's path on the CPU, accumulated in f32 as a GPU's and a TPU's are: XLA's CPU may
    accumulate a bf16 result in bf16."""
    return _xla(
        lhs,
        rhs,
        group_sizes,
        form=form,
        out_dtype=out_dtype,
        precision=precision,
        accumulate=jnp.float32,
    )


def kernel_refusal(
    major: int,
    form: str,
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    dtype: Any,
    rhs_dtype: Any = None,
) -> str | None:
    """Why no kernel takes a grouped GEMM of ``form`` on a GPU of compute capability ``major``
    (9: Hopper, 10: Blackwell), or None if one does: the operands' dtypes (``dtype``, and
    ``rhs_dtype`` where it differs), a dimension the kernel's tiles do not divide, no kernel
    for that GPU. bf16 and f16 operands take JAX's kernels (mpjax's for the weight gradient on
    Blackwell, :mod:`mpjax.grouped.blackwell`); fp8 ones mpjax's on Hopper
    (:mod:`mpjax.grouped.kernels`) and on Blackwell (:mod:`mpjax.grouped.blackwell`).

    >>> kernel_refusal(9, "forward", (4096, 1024), (8, 1024, 2048), jnp.bfloat16) is None
    True
    >>> kernel_refusal(9, "forward", (4096, 1000), (8, 1000, 2048), jnp.bfloat16)
    'K=1000 is not a multiple of 64'
    """
    dtype = np.dtype(dtype)
    rhs_dtype = dtype if rhs_dtype is None else np.dtype(rhs_dtype)
    rows, k, n = _shapes(form, tuple(lhs_shape), tuple(rhs_shape))
    # What each kernel contracts (red) and writes (out) per grouped row.
    red, out = (n, k) if form == "input_gradient" else (k, n)
    red_name, out_name = ("N", "K") if form == "input_gradient" else ("K", "N")
    if dtype in _FP8_DTYPES or rhs_dtype in _FP8_DTYPES:
        if major == 10 and dtype in _FP8_DTYPES and rhs_dtype in _FP8_DTYPES:
            # Blackwell: mpjax's kernels on tokens padded per group (see _blackwell_fp8).
            if rows == 0:
                return "there are no tokens"
            tile = blackwell_kernels.TILE
            return _untiled([(red, tile, red_name), (out, tile, out_name)])
        else:
            return _fp8_refusal(
                major, form, rows, (red, red_name), (out, out_name), dtype, rhs_dtype
            )
    if dtype not in _KERNEL_DTYPES or rhs_dtype != dtype:
        names = dtype.name if rhs_dtype == dtype else f"{dtype.name} and {rhs_dtype.name}"
        return f"the kernels take bfloat16, float16 or float8 operands, not {names}"
    checks: list[tuple[int, int, str]]
    if major == 9 and form == "weight_gradient":
        checks = [(k, 128, "K"), (n, 128, "N"), (rows, 8, "the tokens")]
    elif major == 9:
        checks = [(red, 64, red_name), (out, 128, out_name), (rows, 8, "the tokens")]
        if rows < 128:
            return f"{rows} tokens are fewer than the kernel's block of 128"
    elif major == 10 and form == "weight_gradient":  # mpjax's kernel, on padded groups
        checks = [(k, blackwell_kernels.TILE, "K"), (n, blackwell_kernels.TILE, "N")]
        if rows == 0:
            return "there are no tokens"
    elif major == 10:
        tile_m, tile_n, tile_k = _BLACKWELL_TILE
        checks = [
            (rows, 2 * tile_m, "the tokens"),
            (out, 2 * tile_n, out_name),
            (red, tile_k, red_name),
        ]
    else:
        return f"JAX has no grouped-GEMM kernel for compute capability {major}"
    return _untiled(checks)


def _untiled(checks: Sequence[tuple[int, int, str]]) -> str | None:
    """The first of ``(size, multiple, name)`` whose size the multiple does not divide, said."""
    for size, multiple, name in checks:
        if size % multiple:
            label = f"{name}={size}" if len(name) == 1 else f"{name} ({size})"
            return f"{label} is not a multiple of {multiple}"
    return None


def _fp8_refusal(
    major: int,
    form: str,
    rows: int,
    red: tuple[int, str],
    out: tuple[int, str],
    dtype: np.dtype,
    rhs_dtype: np.dtype,
) -> str | None:
    """:func:`kernel_refusal` for fp8 operands: mpjax's Hopper kernels."""
    if dtype not in _FP8_DTYPES or rhs_dtype not in _FP8_DTYPES:
        return f"an fp8 grouped GEMM takes two fp8 operands, not {dtype.name} and {rhs_dtype.name}"
    if major != 9:
        return (
            f"mpjax's fp8 grouped-GEMM kernels are for Hopper (compute capability 9), not {major}"
        )
    if dtype != rhs_dtype and not jax_compat.mosaic_mixed_fp8_wgmma():
        return f"this JAX's Mosaic GPU multiplies no {dtype.name} by {rhs_dtype.name}"
    block = grouped_kernels.BLOCK
    if form != "weight_gradient" and rows < block:
        return f"{rows} tokens are fewer than the kernel's block of {block}"
    checks = [(red[0], block, red[1]), (out[0], block, out[1])]
    if form != "weight_gradient":
        checks.append((rows, 8, "the tokens"))
    return _untiled(checks)


def _zero_past_groups(out: Any, group_sizes: Any) -> Any:
    """The kernels leave the rows past ``sum(group_sizes)`` unwritten: zero, as XLA's."""
    rows = lax.broadcasted_iota(jnp.int32, out.shape, 0)
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


def _hopper(
    lhs: Any, rhs: Any, group_sizes: Any, *, form: str, out_dtype: Any, precision: Any = None
) -> Any:
    from jax.experimental.pallas.ops.gpu import (  # only where a CUDA lowering needs it
        ragged_dot_mgpu,
        transposed_ragged_dot_mgpu,
    )

    if form == "weight_gradient":
        out = transposed_ragged_dot_mgpu.transposed_ragged_dot(
            lhs, rhs, group_sizes=group_sizes, **_HOPPER
        )
        return out.astype(out_dtype)
    out = ragged_dot_mgpu.ragged_dot(
        lhs,
        rhs,
        group_sizes=group_sizes,
        transpose_rhs=form == "input_gradient",
        block_m=_HOPPER["block_m"],
        block_n=_HOPPER["block_n"],
        block_k=_HOPPER["block_k"],
        max_concurrent_steps=_HOPPER["max_concurrent_steps"],
        grid_block_n=_HOPPER["grid_block_n"],
    )
    return _zero_past_groups(out, group_sizes).astype(out_dtype)


def _blackwell(
    lhs: Any, rhs: Any, group_sizes: Any, *, form: str, out_dtype: Any, precision: Any = None
) -> Any:
    from jax.experimental.pallas.ops.gpu import (  # only where a CUDA lowering needs it
        blackwell_matmul_mgpu,
        blackwell_ragged_dot_mgpu,
    )

    tile_m, tile_n, tile_k = _BLACKWELL_TILE
    config = blackwell_ragged_dot_mgpu.TuningConfig(
        tile_m=tile_m,
        tile_n=tile_n,
        tile_k=tile_k,
        max_concurrent_steps=4,
        collective=True,
        grid_tile_width=8,
        grid_minor_dim=blackwell_matmul_mgpu.MatmulDimension.N,
    )
    if form == "weight_gradient":  # mpjax's kernel: each group on blocks of its own
        x, starts, blocks = grouped_kernels.pad_groups(lhs, group_sizes)
        g, _, _ = grouped_kernels.pad_groups(rhs, group_sizes)
        return blackwell_kernels.transposed_ragged_dot(x, g, starts, blocks).astype(out_dtype)
    if form == "input_gradient":  # no transposed operand: the weights copied [G, N, K]
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = blackwell_ragged_dot_mgpu.ragged_dot_kernel(lhs, rhs, group_sizes, config)
    return _zero_past_groups(out, group_sizes).astype(out_dtype)


def _hopper_fp8(
    lhs: Any, rhs: Any, group_sizes: Any, *, form: str, out_dtype: Any, precision: Any = None
) -> Any:
    """mpjax's fp8 kernels (:mod:`mpjax.grouped.kernels`): both operands with the contraction
    contiguous, as Hopper's fp8 ``wgmma`` reads them."""
    if form == "weight_gradient":  # the tokens contiguous, each group on a block of its own
        x, starts, blocks = grouped_kernels.pad_groups(lhs, group_sizes)
        g, _, _ = grouped_kernels.pad_groups(rhs, group_sizes)
        return grouped_kernels.transposed_ragged_dot(x.T, g.T, starts, blocks).astype(out_dtype)
    if form == "forward":  # the weights copied [G, N, K]
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = grouped_kernels.ragged_dot(lhs, rhs, group_sizes)
    return _zero_past_groups(out, group_sizes).astype(out_dtype)


def _blackwell_fp8(
    lhs: Any, rhs: Any, group_sizes: Any, *, form: str, out_dtype: Any, precision: Any = None
) -> Any:
    """fp8 operands on Blackwell: mpjax's kernels (:mod:`mpjax.grouped.blackwell`), all three
    GEMMs in fp8 on the tokens padded per group, written in float32 for the recipe's scales."""
    if form == "weight_gradient":
        return _blackwell(lhs, rhs, group_sizes, form=form, out_dtype=out_dtype)
    padded, starts, blocks = grouped_kernels.pad_groups(lhs, group_sizes)
    groups = blackwell_kernels.tile_groups(starts, blocks, padded.shape[0])
    # The input gradient contracts the weights [G, K, N] over N: read transposed.
    transpose = form == "input_gradient"
    out = blackwell_kernels.ragged_dot(padded, rhs, groups, transpose_rhs=transpose)
    return grouped_kernels.unpad_groups(out, group_sizes, starts, lhs.shape[0]).astype(out_dtype)


# The compute capability Mosaic GPU compiled kernels for in this process (see the docstring).
_mosaic_capability: list[tuple[int, int]] = []


def _choose(target: jax_compat.GpuTarget, avals: Sequence[Any], params: dict) -> Any:
    lhs, rhs = avals[0], avals[1]
    major = target.capability[0]
    form = params["form"]
    if kernel_refusal(major, form, lhs.shape, rhs.shape, lhs.dtype, rhs.dtype) is not None:
        return None
    if _mosaic_capability and _mosaic_capability[0] != target.capability:
        warnings.warn(
            f"mpjax.grouped.matmul: Mosaic GPU compiled grouped-GEMM kernels for compute "
            f"capability {_mosaic_capability[0]} in this process, and cannot compile them for "
            f"{target.capability} too: this {form} GEMM takes XLA's dense path. "
            "Compile for each GPU architecture in a process of its own.",
            GroupedMatmulWarning,
            stacklevel=2,
        )
        return None
    if not _mosaic_capability:
        _mosaic_capability.append(target.capability)
    if np.dtype(lhs.dtype) in _FP8_DTYPES:
        return _hopper_fp8 if major == 9 else _blackwell_fp8
    return _hopper if major == 9 else _blackwell


grouped_matmul_p = jax_compat.gpu_chosen_primitive(
    "grouped_matmul", _abstract, _xla, _choose, cpu=_xla_cpu
)
"""The primitive of the three grouped GEMMs (params ``form``, one of :data:`FORMS`,
``out_dtype`` and ``precision``): XLA's ``ragged_dot_general``, or on a CUDA GPU the kernel
chosen for it."""


def scope_name(form: str, rows: int, k: int, n: int) -> str:
    """The named scope around a grouped GEMM: its form and sizes, which the compiled program's
    op names carry, so that a plan reads a grouped GEMM's FLOPs off any kernel or dense GEMM
    it became (the parenthesis keeps it out of module paths, as JAX's own scopes).

    >>> scope_name("forward", 4096, 1024, 2048)
    'grouped_matmul(forward, 4096x1024x2048)'
    """
    return f"grouped_matmul({form}, {rows}x{k}x{n})"


SCOPE = re.compile(r"grouped_matmul\((?P<form>\w+), (?P<rows>\d+)x(?P<k>\d+)x(?P<n>\d+)\)")
"""What :func:`scope_name` writes, as a regular expression with the groups ``form``, ``rows``,
``k`` and ``n``."""


def grouped_gemm(
    form: str, lhs: Any, rhs: Any, group_sizes: Any, out_dtype: Any, precision: Any = None
) -> Any:
    """One of a ragged dot's three GEMMs (``form``, one of :data:`FORMS`) on operands already
    in the dtype it multiplies in, written in ``out_dtype``, inside its named scope
    (:func:`scope_name`): on a CUDA GPU, the kernel chosen for it where one takes it. No
    derivative: the building block of :func:`grouped_dot` and of fp8's
    (:mod:`mpjax.grouped.fp8`)."""
    rows, k, n = _shapes(form, lhs.shape, rhs.shape)
    with jax.named_scope(scope_name(form, rows, k, n)):
        return grouped_matmul_p.bind(
            lhs,
            rhs,
            group_sizes.astype(jnp.int32),
            form=form,
            out_dtype=np.dtype(out_dtype),
            precision=precision,
        )


# --- The grouped GEMM with its backward pass ---------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _grouped(lhs, rhs, group_sizes, compute, reduce, lhs_dtype, rhs_dtype, precision):
    del reduce, lhs_dtype, rhs_dtype
    x, w = lhs.astype(compute), rhs.astype(compute)
    return grouped_gemm("forward", x, w, group_sizes, compute, precision)


def _grouped_fwd(lhs, rhs, group_sizes, compute, reduce, lhs_dtype, rhs_dtype, precision):
    del reduce, lhs_dtype, rhs_dtype
    x, w = lhs.astype(compute), rhs.astype(compute)
    return grouped_gemm("forward", x, w, group_sizes, compute, precision), (x, w, group_sizes)


def _grouped_bwd(compute, reduce, lhs_dtype, rhs_dtype, precision, residuals, g):
    x, w, group_sizes = residuals
    g = g.astype(compute)
    dx = grouped_gemm("input_gradient", g, w, group_sizes, compute, precision).astype(lhs_dtype)
    dw = grouped_gemm("weight_gradient", x, g, group_sizes, reduce, precision).astype(rhs_dtype)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    compute: Any,
    reduce: Any = None,
    transposed: bool = False,
    precision: Any = None,
) -> jax.Array:
    """``lax.ragged_dot(lhs, rhs, group_sizes)`` with all three GEMMs grouped: ``lhs`` and
    ``rhs`` cast to ``compute``, the result in ``compute``; forward and input gradient in
    ``compute``, the weight gradient written in ``reduce`` (``compute`` if None); on a CUDA
    GPU, JAX's grouped-GEMM kernels where one takes the shapes (see the module docstring).

    Args:
      lhs: ``[M, K]``, the token rows, sorted by group.
      rhs: ``[G, K, N]``, one matrix per group (expert); ``[G, N, K]`` with ``transposed``.
      group_sizes: ``[G]`` integers, the rows of each group in order. Rows past their sum
        come out zero.
      compute: the dtype the GEMMs multiply in.
      reduce: the dtype the weight gradient is written in (f32 under a mixed policy).
      transposed: ``rhs`` is stored ``[G, N, K]`` (PyTorch's ``Linear`` layout).
      precision: how float32 operands are multiplied, as ``lax.ragged_dot``'s ``precision``
        (a policy's ``f32_matmul_precision``); the kernels take no float32 operands.

    Returns:
      ``[M, N]`` in ``compute``.

    >>> x, w = jnp.ones((6, 4)), jnp.ones((2, 4, 3))
    >>> grouped_dot(x, w, jnp.array([2, 3]), compute=jnp.bfloat16)[:, 0].tolist()
    [4.0, 4.0, 4.0, 4.0, 4.0, 0.0]
    """
    if transposed:
        rhs = jnp.swapaxes(rhs, 1, 2)
    compute = np.dtype(compute)
    reduce = compute if reduce is None else np.dtype(reduce)
    lhs_dtype, rhs_dtype = np.dtype(jnp.result_type(lhs)), np.dtype(jnp.result_type(rhs))
    return _grouped(lhs, rhs, group_sizes, compute, reduce, lhs_dtype, rhs_dtype, precision)
