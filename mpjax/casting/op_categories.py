"""Autocast's op categories: which dtype each JAX primitive runs in under :func:`mpjax.autocast`.

PyTorch's CUDA autocast lists (``torch.autocast``) mapped to JAX primitive names. The table is
data: :func:`mpjax.autocast` takes ``categories={"tanh": "f32"}`` to override or extend it per
primitive. Only floating-point inputs are ever cast; integers, booleans, PRNG keys and complex
values pass unchanged, and float64 values are never narrowed.

Categories:

- ``"lower"``: floating inputs are cast to the policy's compute dtype and the op returns it
  (matmuls, convolutions, attention). ``preferred_element_type`` is set to the compute dtype as
  well, so the backward matmuls JAX derives also take compute-dtype operands; GPUs accumulate
  bf16/f16 matmuls in f32 anyway. If an input is float64 the op runs as ``"promote"``.
- ``"f32"``: floating inputs narrower than float32 are cast up; the op runs in the widest of f32
  and its inputs (PyTorch's f32 list: exp, log, powers, reciprocals, rsqrt, reductions, special
  functions, linear algebra; softmax, log-softmax, logsumexp, norms, distances, cosine
  similarity and losses are made of these). Elementwise ops whose results feed only f32 ops
  (the ``x * x`` of a norm, the ``a - b`` of a distance) run in f32 too, so the value never
  exists in f16 where it would overflow.
- ``"promote"``: the op runs in the widest floating dtype among its inputs (weakly typed scalars,
  such as the ``2.0`` of ``x * 2.0``, adapt instead of widening). This is the default for
  elementwise and structural ops: they run in the dtype of their inputs.
- ``"keep"``: inputs are passed as they come, with no cast (ops whose operands are independent,
  such as ``sort`` keys and values, ``optimization_barrier``, multi-operand collectives, and
  deliberate low-precision ops such as fp8 ``scaled_dot``).
- ``"original"``: inputs are cast back to the dtypes the function was traced with, so the op runs
  exactly as written (ops whose params fix dtypes: ``bitcast_convert_type``, the generic
  ``reduce``/``reduce_window`` with their own computations, callbacks, FFI calls). Unknown
  primitives run this way too, with a warning.

Higher-order primitives (``jit``, ``scan``, ``while``, ``cond``, ``remat``, custom derivatives,
``shard_map``) are not categorized: autocast recurses into them.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from mpjax import jax_compat as compat
from mpjax.policy import is_floating

LOWER = "lower"
F32 = "f32"
PROMOTE = "promote"
KEEP = "keep"
ORIGINAL = "original"
CATEGORIES = (LOWER, F32, PROMOTE, KEEP, ORIGINAL)

_BF16 = np.dtype(jnp.bfloat16)
# PyTorch autocasts only these: float64 is never narrowed and fp8 is always deliberate.
ELIGIBLE = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))

_LOWER = (
    "dot_general",
    "conv_general_dilated",
    "ragged_dot_general",
    # cuDNN fused attention (jax.nn.dot_product_attention(..., implementation="cudnn")).
    "dot_product_attention_fwd",
    "dot_product_attention_fwd_wrapper",
)

_F32 = (
    # PyTorch's f32 list: exp, log, log1p, expm1, pow, reciprocal, rsqrt, erfinv, acos, asin,
    # cosh, sinh, tan. ``x ** 2``, ``jnp.square`` and ``jnp.reciprocal`` are integer_pow/square
    # in JAX: powers overflow f16 (a value of 300 squared is past 65504) and 1/x of small x too.
    "exp",
    "exp2",
    "log",
    "log2",
    "log1p",
    "expm1",
    "pow",
    "integer_pow",
    "polynomial",
    "square",
    "rsqrt",
    "logistic",
    "erf_inv",
    "acos",
    "asin",
    "cosh",
    "sinh",
    "tan",
    # Reductions: sums and products accumulate error in bf16; max makes softmax's x - max exact.
    "reduce_sum",
    "reduce_prod",
    "reduce_max",
    "cumsum",
    "cumprod",
    "cumlogsumexp",
    # Special functions and random gamma have no accurate bf16 implementations.
    "lgamma",
    "digamma",
    "igamma",
    "igammac",
    "igamma_grad_a",
    "polygamma",
    "zeta",
    "bessel_i0e",
    "bessel_i1e",
    "regularized_incomplete_beta",
    "random_gamma",
    # Linear algebra and FFT have no bf16/f16 kernels.
    "cholesky",
    "cholesky_update",
    "eig",
    "eigh",
    "qr",
    "svd",
    "lu",
    "triangular_solve",
    "householder_product",
    "hessenberg",
    "tridiagonal",
    "tridiagonal_solve",
    "schur",
    "geqrf",
    "geqp3",
    "ormqr",
    "symmetric_product",
    "fft",
)

F32_FOR_RANGE = frozenset({"integer_pow", "square"})
"""The f32 ops that are f32 for float16's range alone (powers: 300 squared is past 65504).

What it may change: under a *bfloat16* compute dtype, which has float32's range, these ops run
as ``promote`` ops, in their inputs' dtype (a GELU's cube in bf16 keeps no f32 copy of the
MLP's activation for the backward pass). What it may not: anything under any other compute
dtype. Under float16 they need float32's range; in a region computing in float32 (a module a
rule keeps in float32: the norms, the softmax, the losses) every floating op runs in float32,
whatever arrives (:func:`category_in_region`).
"""

_PROMOTE = (
    # Elementwise arithmetic and math.
    "abs",
    "acosh",
    "add",
    "add_any",
    "asinh",
    "atan",
    "atan2",
    "atanh",
    "cbrt",
    "ceil",
    "clamp",
    "complex",
    "conj",
    "cos",
    "div",
    "erf",
    "erfc",
    "floor",
    "imag",
    "is_finite",
    "max",
    "min",
    "mul",
    "neg",
    "nextafter",
    "real",
    "reduce_precision",
    "rem",
    "round",
    "sign",
    "sin",
    "sqrt",
    "sub",
    "tanh",
    # tanh's derivative, 1 - tanh(x)**2, as one primitive from jax 0.12 (bounded by 1).
    "one_minus_square",
    # Comparisons, logic and bit ops (integer and boolean values are never cast).
    "and",
    "eq",
    "eq_to",
    "ge",
    "gt",
    "le",
    "le_to",
    "lt",
    "lt_to",
    "ne",
    "not",
    "or",
    "xor",
    "clz",
    "population_count",
    "shift_left",
    "shift_right_arithmetic",
    "shift_right_logical",
    "mulhi",
    # Casts, constants and structure.
    "convert_element_type",
    "iota",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "transpose",
    "rev",
    "pad",
    "concatenate",
    "select_n",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "scatter",
    "scatter-add",
    "scatter_add",
    "scatter-sub",
    "scatter_sub",
    "scatter-mul",
    "scatter_mul",
    "scatter-min",
    "scatter_min",
    "scatter-max",
    "scatter_max",
    "split",
    "tile",
    "copy",
    "copy_p",
    "stop_gradient",
    "stack",
    "unstack",
    "zeros_like",
    "empty",
    "empty2",
    "create_token",
    "after_all",
    # Other reductions and selections: exact in any dtype.
    "reduce_min",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "argmax",
    "argmin",
    "cummax",
    "cummin",
    "top_k",
    "approx_top_k",
    "reduce_window_sum",
    "reduce_window_max",
    "reduce_window_min",
    "select_and_gather_add",
    "select_and_scatter_add",
    # Sharding annotations, checkpoint names, single-operand collectives.
    "sharding_constraint",
    "reshard",
    "mesh_cast",
    "layout_constraint",
    "name",
    "pvary",
    "psum_invariant",
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "ppermute",
    "reduce_scatter",
    "axis_index",
    "pbroadcast",
    "pbroadcast_dynamic",
    "reduced_vary_cast",
    "vary_unreduced_cast",
    "unreduced_pmax",
    "unreduced_pmin",
    "relayout",
    # PRNG (keys and bits are never cast).
    "random_seed",
    "random_bits",
    "random_split",
    "random_fold_in",
    "random_wrap",
    "random_unwrap",
    "random_clone",
    "threefry2x32",
    "threefry4x32",
    "philox2x32",
    "philox4x32",
    "iota_2x32_shape",
    "rng_bit_generator",
    "rng_uniform",
)

_KEEP = (
    "sort",
    "optimization_barrier",
    "psum",
    "pmax",
    "pmin",
    "device_put",
    "debug_callback",
    "debug_print",
    "inspect_sharding",
    "scaled_dot",
    "scaled_matmul",
    "scaled_matmul_wrapper",
    # mpjax's grouped GEMMs (mpjax.grouped.matmul), bound in the dtypes they were cast to.
    "grouped_matmul",
    "dot_product_attention_bwd",
    "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_fwd",
    "dot_product_attention_fp8_fwd_wrapper",
    "dot_product_attention_fp8_bwd",
    "dot_product_attention_fp8_bwd_wrapper",
    # A Pallas kernel (mpjax.dot_product_attention's on TPUs) is written for the dtypes it is
    # traced with, as a cuDNN call is.
    "pallas_call",
)

_ORIGINAL = (
    "bitcast_convert_type",
    "reduce",
    "reduce_window",
    "select_and_scatter",
    "pure_callback",
    "io_callback",
    "ffi_call",
    "custom_partitioning",
    "platform_index",
)


def _table() -> dict[str, str]:
    table: dict[str, str] = {}
    for category, names in (
        (LOWER, _LOWER),
        (F32, _F32),
        (PROMOTE, _PROMOTE),
        (KEEP, _KEEP),
        (ORIGINAL, _ORIGINAL),
    ):
        for name in names:
            table[name] = category
    return table


DEFAULT_OP_CATEGORIES: Mapping[str, str] = types.MappingProxyType(_table())
"""Primitive name -> autocast category (read-only); see :mod:`mpjax.casting.op_categories`.

:meta hide-value:
"""


def category_in_region(
    category: str, primitive: str, compute_dtype: Any, input_dtypes: Sequence[Any]
) -> str:
    """The category ``primitive`` (``category`` in the table) runs as in a region whose policy
    computes in ``compute_dtype``, given the dtypes of its floating inputs.

    - In a region computing in float32 or wider, a ``"promote"`` op whose inputs are autocast's
      dtypes (f16, bf16, f32) runs as ``"f32"``: a module kept in float32 computes every floating
      op in float32, whatever dtype its input arrived in. The module was traced in float32, so
      the casts its own code writes (Flax's norms cast their input up before squaring it)
      record nothing in the jaxpr, and a float16 input would otherwise be squared in float16.
    - Under a bfloat16 compute dtype, the powers of :data:`F32_FOR_RANGE` run as
      ``"promote"``.
    - Everything else runs as its table says.

    >>> category_in_region("promote", "mul", jnp.float32, [jnp.float16])
    'f32'
    >>> category_in_region("f32", "square", jnp.bfloat16, [jnp.bfloat16])
    'promote'
    >>> category_in_region("f32", "square", jnp.float16, [jnp.float16])
    'f32'
    """
    compute = np.dtype(compute_dtype)
    if compute.itemsize >= 4 and compute.kind == "f":
        eligible = all(np.dtype(d) in ELIGIBLE for d in input_dtypes)
        return F32 if category == PROMOTE and eligible else category
    if category == F32 and primitive in F32_FOR_RANGE and compute == _BF16:
        return PROMOTE
    return category


def merge_categories(overrides: Mapping[str, str] | None) -> Mapping[str, str]:
    """The default table with the user's ``{primitive name: category}`` overrides applied.

    Raises:
      TypeError: if ``overrides`` is not a mapping of strings to strings.
      ValueError: for a category name that is not one of :data:`CATEGORIES`.

    >>> merge_categories({"tanh": "f32"})["tanh"]
    'f32'
    """
    if overrides is None:
        return DEFAULT_OP_CATEGORIES
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "categories must be a mapping from primitive name to category, for example "
            f"{{'tanh': 'f32'}}; got {overrides!r} of type {type(overrides).__name__}."
        )
    merged = dict(DEFAULT_OP_CATEGORIES)
    for name, category in overrides.items():
        if not isinstance(name, str):
            raise TypeError(
                f"categories keys must be primitive names (str); got {name!r} of type "
                f"{type(name).__name__}."
            )
        if category not in CATEGORIES:
            raise ValueError(
                f"Unknown category {category!r} for primitive {name!r} in categories. Valid "
                f"categories: {', '.join(CATEGORIES)}."
            )
        merged[name] = category
    return types.MappingProxyType(merged)


def bias_adds(jaxpr: Any) -> dict[int, int]:
    """The equations that add a bias to a matmul's output: ``{equation: matmul operand}``.

    A bias add is an ``add`` of a ``dot_general``'s output and a smaller operand (a vector,
    reshaped or broadcast to the output's rank), as Flax's ``Dense`` and ``DenseGeneral``
    write it. An add of two full-size values (a residual connection) is not one.
    """
    matmul_outputs = {
        eqn.outvars[0]: eqn.outvars[0].aval.size
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "dot_general"
    }
    adds: dict[int, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "add" or len(eqn.invars) != 2:
            continue
        for k, atom in enumerate(eqn.invars):
            other = eqn.invars[1 - k]
            if compat.is_literal(atom) or atom not in matmul_outputs:
                continue
            if not is_floating(other.aval.dtype) or other.aval.size >= matmul_outputs[atom]:
                continue
            adds[i] = k
            break
    return adds
