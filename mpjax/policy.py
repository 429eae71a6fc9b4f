"""Precision policies: which dtype parameters are stored in, computed in, and returned in.

A :class:`Policy` is an immutable, hashable value (like ``jmp.Policy``), so it can be a static
argument to :func:`jax.jit` or be captured by a jitted function. :func:`get_policy` turns every
accepted spelling of a policy (preset names, jmp's ``"p=f32,c=bf16,o=f32"`` grammar, dtypes,
``jmp.Policy``) into a :class:`Policy`; every public mpjax function that takes a policy goes
through it.
"""

from __future__ import annotations

import dataclasses
import difflib
import reprlib
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from mpjax.fp8 import Fp8Recipe, check_compute_dtype, fp8_recipe
from mpjax.jax_compat import MATMUL_PRECISIONS

try:
    import jmp
except ImportError:  # only Policy.to_jmp needs it: the jmp extra
    jmp = None

T = TypeVar("T")

# Names accepted wherever a dtype is spelled as a string. The short forms and ``full``/``half``
# are jmp's. Unlike jmp, ``half`` always means float16: a policy string means the same thing on
# every backend (jmp picks bfloat16 on TPU).
_DTYPE_NAMES: dict[str, np.dtype] = {
    "float32": np.dtype(jnp.float32),
    "f32": np.dtype(jnp.float32),
    "fp32": np.dtype(jnp.float32),
    "full": np.dtype(jnp.float32),
    "bfloat16": np.dtype(jnp.bfloat16),
    "bf16": np.dtype(jnp.bfloat16),
    "float16": np.dtype(jnp.float16),
    "f16": np.dtype(jnp.float16),
    "fp16": np.dtype(jnp.float16),
    "half": np.dtype(jnp.float16),
    "float64": np.dtype(jnp.float64),
    "f64": np.dtype(jnp.float64),
    "fp64": np.dtype(jnp.float64),
    "float8_e4m3fn": np.dtype(jnp.float8_e4m3fn),
    "float8_e5m2": np.dtype(jnp.float8_e5m2),
}

# Short names used by ``str(policy)``; every one of them parses back.
_SHORT_NAMES: dict[np.dtype, str] = {
    np.dtype(jnp.float32): "f32",
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float16): "f16",
    np.dtype(jnp.float64): "f64",
}

_KEYS: dict[str, str] = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
    "r": "reduce_dtype",
    "reduce": "reduce_dtype",
    "d": "dispatch_dtype",
    "dispatch": "dispatch_dtype",
}
_FP8_KEY = "fp8"
_F32_MATMUL_KEY = "f32_matmul"
#: The precision of the f32 matmuls of a policy that names none: true float32 on every platform.
DEFAULT_F32_MATMUL_PRECISION = "highest"

_FIELD_TO_KEY = {
    "param_dtype": "params",
    "compute_dtype": "compute",
    "output_dtype": "output",
    "reduce_dtype": "reduce",
    "dispatch_dtype": "dispatch",
}

# A storage dtype needs enough mantissa for optimizer updates to land; 8-bit (and narrower)
# floats need per-tensor scaling, which a plain cast cannot provide.
_MIN_PARAM_BITS = 16


def short_dtype_name(dtype: Any) -> str:
    """The short name of a dtype as policies print it (``"bf16"``, ``"f32"``), else its name.

    >>> short_dtype_name(jnp.bfloat16)
    'bf16'
    """
    dtype = np.dtype(dtype)
    return _SHORT_NAMES.get(dtype, dtype.name)


def is_floating(x: Any) -> bool:
    """Whether ``x`` is a floating-point dtype, or a value whose ``dtype`` is one.

    ``x`` may be a dtype or scalar type (``jnp.bfloat16``, ``np.dtype("float32")``), or
    anything with a ``dtype`` attribute (a jax or numpy array, a tracer, a
    ``jax.ShapeDtypeStruct``, an abstract value). Anything else, Python scalars and PRNG key
    dtypes included, is not floating. The one predicate mpjax uses for "is this floating".

    >>> is_floating(jnp.bfloat16), is_floating(jnp.ones(2)), is_floating(np.arange(2))
    (True, True, False)
    >>> is_floating(jax.ShapeDtypeStruct((2,), jnp.float16)), is_floating(1.0)
    (True, False)
    """
    dtype: Any = x if isinstance(x, (np.dtype, type)) else getattr(x, "dtype", None)
    if dtype is None:
        return False
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False


def is_low_precision(x: Any) -> bool:
    """Whether ``x`` (a dtype, or a value with one) is floating and narrower than float32:
    what bfloat16 and float16 params and states are, and what mpjax's optimizer wrappers
    widen to float32 to compute with.

    >>> is_low_precision(jnp.bfloat16), is_low_precision(jnp.ones(2)), is_low_precision(1.0)
    (True, False, False)
    """
    if not is_floating(x):
        return False
    dtype = x if isinstance(x, (np.dtype, type)) else x.dtype
    return jnp.finfo(dtype).bits < 32


def _valid_names() -> str:
    return ", ".join(_DTYPE_NAMES)


def _did_you_mean(text: str, names: Any) -> str:
    """``" Did you mean 'a' or 'b'?"`` for the names closest to a misspelled ``text``, or
    ``""`` when none is close.

    >>> _did_you_mean("mixed_bfloa16", ["mixed_bfloat16", "mixed_float16", "float32"])
    " Did you mean 'mixed_bfloat16' or 'mixed_float16'?"
    """
    close = difflib.get_close_matches(text, list(names), n=2, cutoff=0.6)
    return f" Did you mean {' or '.join(repr(name) for name in close)}?" if close else ""


def _to_dtype(value: Any, role: str) -> np.dtype:
    """Normalizes a dtype-like ``value`` (a name, numpy/jax dtype or scalar type) to np.dtype."""
    if isinstance(value, str):
        name = value.strip()
        if name not in _DTYPE_NAMES:
            raise ValueError(
                f"Unknown dtype name {value!r} for {role}.{_did_you_mean(name, _DTYPE_NAMES)} "
                f"Valid names: {_valid_names()}."
            )
        return _DTYPE_NAMES[name]
    if value is None:  # np.dtype(None) is float64: never what a caller passing None meant
        raise TypeError(
            f"{role} must be a floating dtype (for example jnp.bfloat16) or one of the names "
            f"{_valid_names()}; got None."
        )
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(
            f"{role} must be a floating dtype (for example jnp.bfloat16) or one of the names "
            f"{_valid_names()}; got {value!r} of type {type(value).__name__}."
        ) from None
    return dtype


def _check_floating(dtype: np.dtype, role: str) -> None:
    if not is_floating(dtype):
        raise ValueError(
            f"{role} must be a floating-point dtype, got {dtype.name}. "
            f"Valid names: {_valid_names()}."
        )
    if dtype.itemsize > 8:  # NumPy's extended precision (np.longdouble): JAX has no such arrays
        raise ValueError(
            f"{role} must be a dtype JAX computes in, got {dtype.name} (NumPy's extended "
            f"precision). Valid names: {_valid_names()}."
        )


def storage_dtype(value: Any, role: str) -> np.dtype:
    """Parses a dtype to store training values in (params, optimizer state): a name (``"bf16"``)
    or a numpy/jax dtype, floating and at least 16 bits wide.

    Args:
      value: the dtype-like to parse.
      role: what the dtype is for, named in error messages (``"param_dtype"``, ``"dtype"``).

    Raises:
      ValueError: for an unknown name, a non-floating dtype or one narrower than 16 bits.
      TypeError: for a value that is not a dtype at all (``None`` included).

    >>> storage_dtype("bf16", "dtype")
    dtype(bfloat16)
    """
    dtype = _to_dtype(value, role)
    _check_floating(dtype, role)
    if jnp.finfo(dtype).bits < _MIN_PARAM_BITS:
        raise ValueError(
            f"{role} {dtype.name} is too narrow to store training values in: use float32, "
            "bfloat16 or float16 (8-bit floats need per-tensor scaling, which a storage cast "
            "cannot provide)."
        )
    return dtype


def check_f32_matmul_precision(value: Any, role: str = "f32_matmul_precision") -> str:
    """Checks the name of a precision for float32 matmuls (one of ``"highest"``, ``"high"``,
    ``"default"``, ``"bf16_3x"``, ``"tf32"``, ``"bf16"``; see :class:`Policy`).

    Raises:
      ValueError: for another string; TypeError: for a value that is not a string.

    >>> check_f32_matmul_precision("tf32")
    'tf32'
    """
    if not isinstance(value, str):
        raise TypeError(
            f"{role} must be one of the names {', '.join(MATMUL_PRECISIONS)}; got {value!r} of "
            f"type {type(value).__name__}."
        )
    if value not in MATMUL_PRECISIONS:
        raise ValueError(
            f"{role}: unknown precision {value!r}. Valid names: {', '.join(MATMUL_PRECISIONS)} "
            "(highest: true float32 on every platform)."
        )
    return value


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: storage, compute and output dtypes, the precision of float32
    matmuls, and optionally fp8 matmuls.

    Args:
      param_dtype: dtype parameters are stored in (the optimizer's dtype). Must be a floating
        dtype of at least 16 bits.
      compute_dtype: dtype matmuls and convolutions run in.
      output_dtype: dtype a module or function returns.
      fp8: None, or an :class:`mpjax.Fp8Recipe` (or its string form, ``"current"``): the
        matmuls this policy lowers to the compute dtype run with fp8 operands instead (e4m3
        forward, e5m2 gradients, per-tensor scales; :mod:`mpjax.fp8`), their results in the
        compute dtype. The compute dtype must then be bfloat16, float16 or float32.
      f32_matmul_precision: how the matmuls and convolutions that run with float32 operands
        under this policy multiply them (those of an f32 compute dtype, of a module a rule
        keeps in f32, of :func:`mpjax.full_precision`), where the code left their precision
        unset. ``"highest"`` (the default) is true float32 on every platform; the others
        trade accuracy for speed, like ``torch.set_float32_matmul_precision``:

        - ``"highest"``: ``lax.Precision.HIGHEST``. TPU: six bf16 passes (float32 accuracy);
          GPU: float32 FMAs, no TF32; CPU: float32.
        - ``"high"``: ``lax.Precision.HIGH``. TPU: three bf16 passes (bf16_3x); GPU: TF32
          in cuBLAS GEMMs and float32 in XLA's Triton GEMMs (XLA's choice per GEMM); CPU:
          float32.
        - ``"bf16_3x"``: ``lax.DotAlgorithmPreset.BF16_BF16_F32_X3``, three bf16 passes on
          TPU, GPU and CPU alike (convolutions: ``Precision.HIGH``).
        - ``"tf32"``: ``lax.DotAlgorithmPreset.TF32_TF32_F32``, one TF32 pass: GPUs from
          Ampere on only; XLA refuses it on TPU and CPU (convolutions: the default).
        - ``"bf16"``: ``lax.DotAlgorithmPreset.BF16_BF16_F32``, one bf16 pass on every
          platform (convolutions: the default).
        - ``"default"``: the precision is left to JAX and XLA (``jax_default_matmul_precision``
          if set): one bf16 pass on TPU, TF32 on Ampere and later GPUs, float32 on CPU.

        A precision the code writes (``precision=`` of ``jnp.dot``, ``lax.dot_general``, a
        Flax layer) is kept, except ``lax.Precision.DEFAULT``, which is the default.
      reduce_dtype: the dtype the gradients of the values this policy casts down to the
        compute dtype (params stored wider than it) are computed and summed in: a
        weight-gradient matmul writes it, a bias's or an embedding table's gradient sums the
        cotangents over the batch in it. Data parallelism sums those gradients over devices
        where they are computed, so this is also the dtype they cross the network in, as
        ``reduce_dtype`` of PyTorch FSDP2's ``MixedPrecisionPolicy``. None (the default) means
        the param dtype: float32 under ``"mixed_bfloat16"``, no rounding of a gradient to the
        compute dtype on its way to its float32 param. ``bfloat16`` halves the bytes a
        gradient reduction sends, each sum then rounding to 8 bits of mantissa. At least 16
        bits wide: XLA neither writes matmul results nor sums over devices in 8 bits.
      dispatch_dtype: the dtype a mixture of experts' tokens travel in to their experts under
        expert parallelism (:func:`mpjax.dispatch_tokens`); None (the default) means the
        compute dtype. An 8-bit float (``float8_e4m3fn``) sends each token as 8-bit values
        with a float32 scale of its own, DeepSeek-V3's dispatch: about half the bytes of
        bfloat16. The results come back (:func:`mpjax.combine_tokens`), and every gradient
        travels, in the compute dtype. At least 8 bits wide.
    Dtypes may be given as numpy/jax dtypes or scalar types, or as names (``"bf16"``,
    ``"float32"``...); they are stored as ``numpy.dtype``.

    Casting methods touch only floating-point array leaves (jax and numpy arrays, tracers
    included); integers, booleans, complex numbers, PRNG keys, ``None``, strings, Python scalars
    and weakly typed scalars are returned unchanged, identically inside and outside
    :func:`jax.jit`.

    >>> import jax.numpy as jnp
    >>> policy = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    >>> policy
    Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)
    >>> str(policy)
    'p=f32,c=bf16,o=f32'
    >>> get_policy("float32").with_f32_matmul_precision("tf32")
    Policy(param_dtype=float32, compute_dtype=float32, output_dtype=float32, f32_matmul_precision='tf32')
    >>> policy.cast_to_compute({"w": jnp.ones(2), "step": 3})["w"].dtype
    dtype(bfloat16)
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype
    fp8: Fp8Recipe | None = None
    f32_matmul_precision: str = DEFAULT_F32_MATMUL_PRECISION
    reduce_dtype: np.dtype = None  # type: ignore[assignment]  # None: the param dtype
    dispatch_dtype: np.dtype = None  # type: ignore[assignment]  # None: the compute dtype

    if TYPE_CHECKING:  # the generated __init__ takes any dtype spelling; __post_init__ converts

        def __init__(
            self,
            param_dtype: DTypeLike,
            compute_dtype: DTypeLike,
            output_dtype: DTypeLike,
            fp8: Fp8Recipe | str | None = None,
            f32_matmul_precision: str = DEFAULT_F32_MATMUL_PRECISION,
            reduce_dtype: DTypeLike | None = None,
            dispatch_dtype: DTypeLike | None = None,
        ) -> None: ...

    def __post_init__(self):
        # In field order, so the first bad field is the one named.
        object.__setattr__(self, "param_dtype", storage_dtype(self.param_dtype, "param_dtype"))
        for field in ("compute_dtype", "output_dtype"):
            dtype = _to_dtype(getattr(self, field), field)
            _check_floating(dtype, field)
            object.__setattr__(self, field, dtype)
        if self.fp8 is not None:
            object.__setattr__(self, "fp8", fp8_recipe(self.fp8))
            try:
                check_compute_dtype(self.compute_dtype)
            except ValueError as error:
                raise ValueError(f"Policy(fp8=...): {error}") from None
        check_f32_matmul_precision(self.f32_matmul_precision, "Policy(f32_matmul_precision=...)")
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", self.param_dtype)
        else:
            reduce = _to_dtype(self.reduce_dtype, "reduce_dtype")
            _check_floating(reduce, "reduce_dtype")
            if jnp.finfo(reduce).bits < _MIN_PARAM_BITS:
                raise ValueError(
                    f"Policy(reduce_dtype={reduce.name}): gradients cannot be reduced in 8 "
                    "bits. XLA writes a matmul's result and sums it over devices in at least "
                    "16 (its CPU backend sums float8 in float16), and an 8-bit sum of a "
                    "thousand cotangents keeps three significant bits at best. Use bfloat16 "
                    "(half the bytes of float32) or float32."
                )
            object.__setattr__(self, "reduce_dtype", reduce)
        if self.dispatch_dtype is None:
            object.__setattr__(self, "dispatch_dtype", self.compute_dtype)
        else:
            dispatch = _to_dtype(self.dispatch_dtype, "dispatch_dtype")
            _check_floating(dispatch, "dispatch_dtype")
            if jnp.finfo(dispatch).bits < 8:
                raise ValueError(
                    f"Policy(dispatch_dtype={dispatch.name}): tokens cannot travel in fewer "
                    "than 8 bits: XLA's all-to-all sends whole bytes. Use float8_e4m3fn (half "
                    "the bytes of bfloat16), float8_e5m2 or the compute dtype."
                )
            object.__setattr__(self, "dispatch_dtype", dispatch)

    @property
    def needs_loss_scaling(self) -> bool:
        """Whether training under this policy needs loss scaling. True when the compute or the
        param dtype is float16.

        float16's narrow exponent range lets small gradients underflow to zero. bfloat16 has
        float32's exponent range and needs no loss scaling, nor does float32. Pick the loss
        scale from it: ``mpjax.loss_scaling(tx, "dynamic" if policy.needs_loss_scaling else
        "none")``.

        >>> get_policy("mixed_float16").needs_loss_scaling, get_policy("bf16").needs_loss_scaling
        (True, False)
        """
        return np.dtype(jnp.float16) in (self.compute_dtype, self.param_dtype)

    def cast_to_param(self, tree: T) -> T:
        """Casts the floating-point array leaves of ``tree`` to ``param_dtype``."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts the floating-point array leaves of ``tree`` to ``compute_dtype``."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts the floating-point array leaves of ``tree`` to ``output_dtype``."""
        return cast_floating(tree, self.output_dtype)

    def with_param_dtype(self, dtype: Any) -> Policy:
        """Returns a copy of this policy with ``param_dtype`` replaced (and ``reduce_dtype``
        with it where it was the param dtype)."""
        reduce: Any = None if self.reduce_dtype == self.param_dtype else self.reduce_dtype
        return dataclasses.replace(self, param_dtype=dtype, reduce_dtype=reduce)

    def with_compute_dtype(self, dtype: Any) -> Policy:
        """Returns a copy of this policy with ``compute_dtype`` replaced (and
        ``dispatch_dtype`` with it where it was the compute dtype)."""
        dispatch: Any = None if self.dispatch_dtype == self.compute_dtype else self.dispatch_dtype
        return dataclasses.replace(self, compute_dtype=dtype, dispatch_dtype=dispatch)

    def with_dispatch_dtype(self, dtype: Any) -> Policy:
        """Returns a copy of this policy whose mixture of experts' tokens travel to their
        experts in ``dtype`` (see ``dispatch_dtype`` above; None: the compute dtype).

        >>> str(get_policy("mixed_bfloat16").with_dispatch_dtype("float8_e4m3fn"))
        'p=f32,c=bf16,o=f32,d=float8_e4m3fn'
        """
        return dataclasses.replace(self, dispatch_dtype=dtype)

    def with_output_dtype(self, dtype: Any) -> Policy:
        """Returns a copy of this policy with ``output_dtype`` replaced."""
        return dataclasses.replace(self, output_dtype=dtype)

    def with_reduce_dtype(self, dtype: Any) -> Policy:
        """Returns a copy of this policy whose gradients are reduced in ``dtype`` (see
        ``reduce_dtype`` above; None: the param dtype).

        >>> str(get_policy("mixed_bfloat16").with_reduce_dtype("bf16"))
        'p=f32,c=bf16,o=f32,r=bf16'
        """
        return dataclasses.replace(self, reduce_dtype=dtype)

    def with_fp8(self, fp8: Fp8Recipe | str | None) -> Policy:
        """Returns a copy of this policy with ``fp8`` replaced (None: no fp8 matmuls)."""
        return dataclasses.replace(self, fp8=None if fp8 is None else fp8_recipe(fp8))

    def with_f32_matmul_precision(self, precision: str) -> Policy:
        """Returns a copy of this policy whose float32 matmuls run at ``precision`` (see
        ``f32_matmul_precision`` above).

        >>> str(get_policy("float32").with_f32_matmul_precision("bf16_3x"))
        'p=f32,c=f32,o=f32,f32_matmul=bf16_3x'
        """
        precision = check_f32_matmul_precision(precision, "with_f32_matmul_precision(precision)")
        return dataclasses.replace(self, f32_matmul_precision=precision)

    def __str__(self) -> str:
        names = (short_dtype_name(d) for d in self._dtypes())
        text = "p={},c={},o={}".format(*names)
        if self.reduce_dtype != self.param_dtype:
            text += f",r={short_dtype_name(self.reduce_dtype)}"
        if self.dispatch_dtype != self.compute_dtype:
            text += f",d={short_dtype_name(self.dispatch_dtype)}"
        if self.fp8 is not None:
            text += f",{_FP8_KEY}={self.fp8}"
        if self.f32_matmul_precision != DEFAULT_F32_MATMUL_PRECISION:
            text += f",{_F32_MATMUL_KEY}={self.f32_matmul_precision}"
        return text

    def __repr__(self) -> str:
        p, c, o = (d.name for d in self._dtypes())
        fp8 = "" if self.reduce_dtype == self.param_dtype else f", reduce_dtype={self.reduce_dtype}"
        if self.dispatch_dtype != self.compute_dtype:
            fp8 += f", dispatch_dtype={self.dispatch_dtype}"
        fp8 += "" if self.fp8 is None else f", fp8={str(self.fp8)!r}"
        if self.f32_matmul_precision != DEFAULT_F32_MATMUL_PRECISION:
            fp8 += f", f32_matmul_precision={self.f32_matmul_precision!r}"
        return f"Policy(param_dtype={p}, compute_dtype={c}, output_dtype={o}{fp8})"

    def _dtypes(self) -> tuple[np.dtype, np.dtype, np.dtype]:
        return self.param_dtype, self.compute_dtype, self.output_dtype

    @classmethod
    def from_jmp(cls, policy: JmpStylePolicy) -> Policy:
        """Converts a ``jmp.Policy`` (or any object with the three dtype attributes) to an
        mpjax :class:`Policy`; jmp itself is not needed.

        A jmp policy only casts; it has no precision for float32 matmuls. The policy returned
        has the default, ``"highest"``: run through mpjax, its float32 matmuls are true float32.

        Raises:
          TypeError: if ``policy`` lacks ``param_dtype``, ``compute_dtype`` or
            ``output_dtype``.
          ValueError: if one of them is not a valid dtype for its role.

        >>> class JmpLike:
        ...     param_dtype, compute_dtype, output_dtype = jnp.float32, jnp.bfloat16, jnp.float32
        >>> Policy.from_jmp(JmpLike())
        Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)
        """
        if not isinstance(policy, JmpStylePolicy):
            raise TypeError(
                "Policy.from_jmp(policy): policy must be a jmp.Policy or an object with "
                "param_dtype, compute_dtype and output_dtype attributes (use get_policy for "
                f"strings and dtypes); got {policy!r} of type {type(policy).__name__}."
            )
        return cls(policy.param_dtype, policy.compute_dtype, policy.output_dtype)

    def to_jmp(self) -> Any:
        """Returns the equivalent ``jmp.Policy``.

        jmp only casts: ``f32_matmul_precision`` has no place in a ``jmp.Policy`` and is left
        out (code run under jmp multiplies at the precision it writes, else JAX's default), so
        ``Policy.from_jmp(policy.to_jmp()) == policy`` for the default ``"highest"`` only.

        Raises:
          ImportError: if jmp is not installed (``pip install "mpjax[jmp]"``).
          ValueError: for a policy with fp8 matmuls or a reduce dtype other than its param
            dtype, which jmp cannot express.
        """
        if self.reduce_dtype != self.param_dtype:
            raise ValueError(
                f"Policy {self} reduces gradients in {self.reduce_dtype.name}, which a "
                "jmp.Policy cannot express (code run under jmp computes them in the compute "
                "dtype); convert the policy without it: "
                "policy.with_reduce_dtype(None).to_jmp()."
            )
        if self.dispatch_dtype != self.compute_dtype:
            raise ValueError(
                f"Policy {self} sends a mixture of experts' tokens in "
                f"{self.dispatch_dtype.name}, which a jmp.Policy cannot express; convert the "
                "policy without it: policy.with_dispatch_dtype(None).to_jmp()."
            )
        if self.fp8 is not None:
            raise ValueError(
                f"Policy {self} runs matmuls in fp8, which a jmp.Policy cannot express; "
                "convert the policy without it: policy.with_fp8(None).to_jmp()."
            )
        if jmp is None:
            raise ImportError(
                "Policy.to_jmp() needs jmp, which is not installed. Install it with: "
                'pip install "mpjax[jmp]"'
            )
        # jmp names dtypes by JAX's scalar types (jnp.float32), which it also prints.
        return jmp.Policy(
            param_dtype=getattr(jnp, self.param_dtype.name),
            compute_dtype=getattr(jnp, self.compute_dtype.name),
            output_dtype=getattr(jnp, self.output_dtype.name),
        )


@runtime_checkable
class JmpStylePolicy(Protocol):
    """A policy object in jmp's style (``jmp.Policy``): the three dtypes as attributes."""

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any


PolicyLike = Policy | str | np.dtype | type | JmpStylePolicy
"""Anything :func:`get_policy` accepts: a Policy, a policy string, a dtype or a jmp.Policy."""


def _is_castable(x: Any) -> bool:
    """True for floating-point arrays with a dtype of their own.

    Tracers are instances of ``jax.Array``, so the same leaves are cast inside and outside jit.
    Weakly typed values are left alone: they are Python scalars, or what ``jit`` makes of one,
    and already take the dtype of whatever array they meet. Casting them inside jit only (as jmp
    does) would make a policy behave differently under jit.
    """
    if isinstance(x, jax.Array):
        return is_floating(x) and not jax.typeof(x).weak_type
    return isinstance(x, (np.ndarray, np.generic)) and is_floating(x)


def cast_floating(tree: T, dtype: Any) -> T:
    """Casts the floating-point array leaves of ``tree`` to ``dtype``; other leaves pass through.

    Numpy leaves stay numpy and jax leaves stay jax. Python scalars and weakly typed arrays are
    never cast (they adapt to the arrays they meet), so the result is the same inside and
    outside :func:`jax.jit`.

    >>> import numpy as np, jax.numpy as jnp
    >>> out = cast_floating({"x": np.ones(2), "n": np.arange(2), "s": 1.0}, jnp.float16)
    >>> out["x"].dtype, out["n"].dtype, out["s"]
    (dtype('float16'), dtype('int64'), 1.0)
    """
    dtype = _to_dtype(dtype, "dtype")
    _check_floating(dtype, "dtype")

    def cast(x):
        if _is_castable(x) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


#: The ``"mixed_bfloat16"`` preset: params f32, compute bf16, output f32.
MIXED_BFLOAT16 = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
#: The ``"mixed_float16"`` preset: params f32, compute f16, output f32 (f16 needs loss scaling).
MIXED_FLOAT16 = Policy(jnp.float32, jnp.float16, jnp.float32)
#: The ``"mixed_bfloat16_fp8"`` preset: ``mixed_bfloat16`` whose matmuls run in fp8 with
#: current scaling (:mod:`mpjax.fp8`).
MIXED_BFLOAT16_FP8 = MIXED_BFLOAT16.with_fp8("current")
#: The ``"mixed_bfloat16_fp8_rowwise"`` preset: ``mixed_bfloat16`` whose matmuls run in fp8
#: with a power-of-two scale per row of each operand (:func:`mpjax.fp8.rowwise_dot_general`).
MIXED_BFLOAT16_FP8_ROWWISE = MIXED_BFLOAT16.with_fp8("rowwise")
#: The ``"mixed_bfloat16_mxfp8"`` preset: ``mixed_bfloat16`` whose matmuls run in MXFP8, an
#: e8m0 scale per 32 values along the contraction (:mod:`mpjax.block_scaled`).
MIXED_BFLOAT16_MXFP8 = MIXED_BFLOAT16.with_fp8("mxfp8")
#: The ``"mixed_bfloat16_nvfp4"`` preset: ``mixed_bfloat16`` whose matmuls run in NVFP4 forward
#: (an e4m3 scale per 16 values and one per tensor) and MXFP8 backward.
MIXED_BFLOAT16_NVFP4 = MIXED_BFLOAT16.with_fp8("nvfp4")

_PRESETS: dict[str, Policy] = {
    "mixed_bfloat16": MIXED_BFLOAT16,
    "mixed_float16": MIXED_FLOAT16,
    "mixed_bfloat16_fp8": MIXED_BFLOAT16_FP8,
    "mixed_bfloat16_fp8_rowwise": MIXED_BFLOAT16_FP8_ROWWISE,
    "mixed_bfloat16_mxfp8": MIXED_BFLOAT16_MXFP8,
    "mixed_bfloat16_nvfp4": MIXED_BFLOAT16_NVFP4,
}


def _parse(spec: str) -> Policy:
    text = spec.strip()
    if not text:
        raise ValueError(
            "Empty policy string. Use a preset (mixed_bfloat16, mixed_float16), a dtype name "
            f"({_valid_names()}) or jmp's grammar, for example 'p=f32,c=bf16,o=f32'."
        )
    if text in _PRESETS:
        return _PRESETS[text]
    if "=" not in text:
        if text not in _DTYPE_NAMES:
            close = _did_you_mean(text, [*_PRESETS, *_DTYPE_NAMES])
            raise ValueError(
                f"Unknown policy {spec!r}.{close} Use a preset ({', '.join(_PRESETS)}), a dtype "
                f"name ({_valid_names()}) or jmp's grammar, for example 'p=f32,c=bf16,o=f32'."
            )
        dtype = _DTYPE_NAMES[text]
        return Policy(dtype, dtype, dtype)

    fields: dict[str, np.dtype] = {}
    fp8: Fp8Recipe | None = None
    precision: str | None = None
    for part in text.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not key or not value:
            raise ValueError(
                f"Malformed entry {part.strip()!r} in policy {spec!r}: expected key=dtype "
                f"with key one of {', '.join(_KEYS)} and dtype one of {_valid_names()}, "
                f"{_FP8_KEY}=<recipe> (for example {_FP8_KEY}=current) or "
                f"{_F32_MATMUL_KEY}=<precision> (for example {_F32_MATMUL_KEY}=tf32)."
            )
        if key == _F32_MATMUL_KEY:
            if precision is not None:
                raise ValueError(f"Duplicate key {key!r} in policy {spec!r}.")
            precision = check_f32_matmul_precision(
                value, f"The {_F32_MATMUL_KEY}= entry of policy {spec!r}"
            )
            continue
        if key == _FP8_KEY:
            if fp8 is not None:
                raise ValueError(f"Duplicate key {key!r} in policy {spec!r}.")
            try:
                fp8 = fp8_recipe(value)
            except ValueError as error:
                raise ValueError(f"In policy {spec!r}: {error}") from None
            continue
        if key not in _KEYS:
            raise ValueError(
                f"Unknown key {key!r} in policy {spec!r}. Valid keys: "
                f"{', '.join([*_KEYS, _FP8_KEY, _F32_MATMUL_KEY])}."
            )
        field = _KEYS[key]
        if field in fields:
            raise ValueError(
                f"Duplicate key {key!r} in policy {spec!r}: the {_FIELD_TO_KEY[field]} dtype "
                "is given more than once."
            )
        fields[field] = _to_dtype(value, f"{_FIELD_TO_KEY[field]} dtype ({key}=) in {spec!r}")
    # jmp's defaults: params f32, compute follows params, output follows compute.
    param = fields.get("param_dtype", np.dtype(jnp.float32))
    compute = fields.get("compute_dtype", param)
    output = fields.get("output_dtype", compute)
    return Policy(
        param,
        compute,
        output,
        fp8,
        precision or DEFAULT_F32_MATMUL_PRECISION,
        fields.get("reduce_dtype"),
        fields.get("dispatch_dtype"),
    )


PURE_FLOAT16_NOTE = (
    "'fp16', 'f16', 'float16' and 'half' mean pure float16: float16 params, compute and output. "
    "AMP (PyTorch's autocast to float16) is 'mixed_float16' (p=f32,c=f16,o=f32)."
)
"""What :func:`mpjax.describe` says under its table where a module runs pure float16."""


def is_pure_float16(policy: Policy) -> bool:
    """Whether ``policy`` keeps its params in float16 and computes in it too."""
    f16 = np.dtype(jnp.float16)
    return policy.param_dtype == f16 and policy.compute_dtype == f16


def get_policy(spec: PolicyLike) -> Policy:
    """Returns the :class:`Policy` that ``spec`` names.

    Args:
      spec: one of

        - a :class:`Policy` (returned as is), or a ``jmp.Policy`` or any other object with
          ``param_dtype``, ``compute_dtype`` and ``output_dtype`` attributes
          (:class:`JmpStylePolicy`; converted);
        - a preset: ``"mixed_bfloat16"`` (params f32, compute bf16, output f32),
          ``"mixed_float16"`` (the same with f16), ``"mixed_bfloat16_fp8"``
          (``mixed_bfloat16`` with fp8 matmuls, current scaling), ``"mixed_bfloat16_fp8_rowwise"``
          (fp8 with a scale per row), ``"mixed_bfloat16_mxfp8"`` or ``"mixed_bfloat16_nvfp4"``
          (the block formats of Blackwell GPUs, :mod:`mpjax.block_scaled`);
        - a dtype name (``"float32"``, ``"bf16"``, ``"half"``...) for all three dtypes;
        - jmp's grammar, ``"p=f32,c=bf16,o=f32"`` or ``"params=float32,compute=bfloat16"``,
          with jmp's defaults: params f32, compute follows params, output follows compute.
          Spaces around commas and ``=`` are allowed. An ``fp8=<recipe>`` entry
          (``"p=f32,c=bf16,o=f32,fp8=current"``, ``fp8=rowwise``, ``fp8=mxfp8``,
          ``fp8=nvfp4``) adds fp8 or block-scaled matmuls (:class:`mpjax.Fp8Recipe`),
          an ``f32_matmul=<precision>`` entry (``"p=f32,f32_matmul=tf32"``) sets
          ``Policy.f32_matmul_precision``, an ``r=<dtype>`` (``reduce=``) entry
          (``"p=f32,c=bf16,o=f32,r=bf16"``) sets ``Policy.reduce_dtype``, a ``d=<dtype>``
          (``dispatch=``) entry (``"p=f32,c=bf16,o=f32,d=float8_e4m3fn"``)
          ``Policy.dispatch_dtype``;
        - a dtype object (``jnp.bfloat16``, ``np.dtype("float32")``) for all three dtypes.

    Raises:
      ValueError: for an empty string, unknown preset, key or dtype name, a duplicate key, a
        non-floating dtype, or a param dtype narrower than 16 bits.
      TypeError: for a value of any other type.

    >>> get_policy("mixed_bfloat16")
    Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)
    >>> get_policy("c=bf16")
    Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=bfloat16)
    """
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, str):
        return _parse(spec)
    if isinstance(spec, JmpStylePolicy):
        return Policy.from_jmp(spec)
    if isinstance(spec, (np.dtype, type)):
        dtype = _to_dtype(spec, "policy dtype")
        return Policy(dtype, dtype, dtype)
    raise TypeError(
        f"Cannot make a policy from {reprlib.repr(spec)} of type {type(spec).__name__}. Pass a Policy, "
        "a jmp.Policy, a dtype, or a string such as 'mixed_bfloat16' or 'p=f32,c=bf16,o=f32'."
    )
