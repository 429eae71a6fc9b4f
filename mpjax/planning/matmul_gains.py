"""Which matmuls gain from fp8 or a block format on a target, by its roofline, and the rules
that keep the others in bf16.

A narrower GEMM runs at a higher peak, but its operands must be quantized first: a pass that
reads each operand in the compute dtype and writes it in the narrow format, bandwidth-bound.
On a small GEMM that pass costs more than the faster GEMM saves (torchao measured fp8 at 0.80x
bf16 for a 1024x2048x1024 GEMM on an H100), so a recipe should reach only the matmuls big
enough to gain. :func:`matmul_gains` reads every GEMM of a function, forward and backward, with
the module whose region it runs in, and times each both ways on the target's published figures:

- in the compute dtype: ``max(flops / peak, bytes / bandwidth)``, operands and output in it;
- narrow: ``max(flops / narrow peak, bytes / bandwidth)`` with the operands in the format and
  the output in the compute dtype, plus quantizing both operands (one read in the compute
  dtype, one write in the format, its scales included). Every GEMM pays for both operands:
  tensorwise scaling reuses the forward's quantized operands in the backward GEMMs, so for it
  the model errs towards bf16.

A module gains when its GEMMs together run faster narrow. :meth:`MatmulGains.rules` gives the
rules (module path: its policy without the recipe) that keep the others in bf16, to pass to
:class:`mpjax.Rules` ahead of the default.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from mpjax import jax_compat
from mpjax.casting.regions import innermost
from mpjax.fp8 import Fp8Recipe, fp8_recipe
from mpjax.inspection.matmuls import check_function, gradient_jaxpr, walk_jaxpr
from mpjax.planning.targets import Target, parse_target
from mpjax.policy import Policy
from mpjax.table import format_table

__all__ = ["GemmGain", "MatmulGains", "ModuleGain", "matmul_gains"]

_NARROW_COMPUTE = frozenset(np.dtype(d) for d in (jnp.bfloat16, jnp.float16))
# Bytes per element of each format's operands, scales included (MXFP8: an e8m0 byte per 32
# values; NVFP4: half a byte, and an e4m3 byte per 16), and the peak its GEMMs run at.
_OPERAND_BYTES = {"fp8": 1.0, "mxfp8": 1.0 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
_PEAK_KEY = {"fp8": "fp8", "mxfp8": "fp8", "nvfp4": "fp4"}


@dataclasses.dataclass(frozen=True)
class GemmGain:
    """One GEMM of the function, timed on the target both ways.

    Attributes:
      path: the module whose region it runs in (``""`` for the root).
      backward: whether it is a gradient GEMM.
      shape: ``(batch, m, n, k)``: the product of its batch, lhs-kept, rhs-kept and contracted
        sizes.
      compute_seconds: its roofline time in the compute dtype.
      narrow_seconds: in the narrow format, quantizing both operands included.
    """

    path: str
    backward: bool
    shape: tuple[int, int, int, int]
    compute_seconds: float
    narrow_seconds: float

    @property
    def flops(self) -> int:
        return 2 * math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class ModuleGain:
    """A module's GEMMs together: how much faster they would run narrow (``gain`` above 1) or
    slower (below), and why."""

    path: str
    policy: Policy | None  # None at the root of a function that runs in no region
    gemms: tuple[GemmGain, ...]

    @property
    def compute_seconds(self) -> float:
        return sum(g.compute_seconds for g in self.gemms)

    @property
    def narrow_seconds(self) -> float:
        return sum(g.narrow_seconds for g in self.gemms)

    @property
    def gain(self) -> float:
        return self.compute_seconds / self.narrow_seconds

    @property
    def reason(self) -> str:
        largest = max(self.gemms, key=lambda g: g.flops)
        b, m, n, k = largest.shape
        size = f"{m}x{k}x{n}" + (f" (x{b})" if b > 1 else "")
        verdict = "gains" if self.gain > 1 else "loses"
        return (
            f"{verdict}: {len(self.gemms)} GEMMs up to {size}, {self.narrow_seconds * 1e6:.1f} us "
            f"narrow against {self.compute_seconds * 1e6:.1f} us ({self.gain:.2f}x)"
        )


class MatmulGains(tuple):
    """A tuple of :class:`ModuleGain`, one per module with GEMMs, for one target and recipe;
    ``str`` is a table."""

    target: Target
    recipe: Fp8Recipe

    def rules(self, threshold: float = 1.0) -> dict[str, Policy]:
        """The rules that keep every module gaining ``threshold`` or less in its policy without
        the recipe (bf16 GEMMs): ``{path: policy}``, for :class:`mpjax.Rules` before the
        narrow default. The root (``""``) is left out: the default applies there."""
        return {
            m.path: m.policy.with_fp8(None)
            for m in self
            if m.gain <= threshold and m.path and m.policy is not None
        }

    def __str__(self) -> str:
        header = ("module", "GEMMs", "bf16 us", f"{self.recipe.scaling} us", "gain", "verdict")
        rows = [
            (
                m.path or "<root>",
                str(len(m.gemms)),
                f"{m.compute_seconds * 1e6:.1f}",
                f"{m.narrow_seconds * 1e6:.1f}",
                f"{m.gain:.2f}x",
                "narrow" if m.gain > 1 else "keep bf16",
            )
            for m in self
        ]
        title = f"{self.recipe.scaling} on {self.target.name}, by the roofline:\n"
        return title + (format_table(header, rows) if rows else "no GEMMs")


def _format(recipe: Fp8Recipe) -> str:
    return recipe.scaling if recipe.block_scaled else "fp8"


def _time(target: Target, flops: float, bytes_moved: float, peak: float) -> float:
    return max(flops / peak, bytes_moved / target.chip.hbm_bandwidth)


def _gemm(
    eqn: Any, target: Target, recipe: Fp8Recipe, path: str, backward: bool
) -> GemmGain | None:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    if {np.dtype(lhs.dtype), np.dtype(rhs.dtype)} - _NARROW_COMPUTE:
        return None
    dims = jax_compat.dot_params(eqn).dimension_numbers
    if not recipe.applies_to(dims):
        return None
    (lc, rc), (lb, _) = dims
    batch = math.prod(lhs.shape[a] for a in lb)
    k = math.prod(lhs.shape[a] for a in lc)
    m = math.prod(lhs.shape) // (batch * k)
    n = math.prod(rhs.shape) // (batch * k)
    fmt = _format(recipe)
    size = np.dtype(lhs.dtype).itemsize
    flops = 2.0 * batch * m * n * k
    operands, out = batch * (m * k + k * n), batch * m * n
    peaks = target.chip.peak_flops
    compute = _time(target, flops, size * (operands + out), peaks["bf16"])
    narrow_peak = peaks.get(_PEAK_KEY[fmt], peaks.get("fp8", peaks["bf16"]))
    if recipe.block_scaled and not target.chip.block_scaled_gemms:
        narrow_peak = peaks["bf16"]  # emulated: dequantized, then a bf16 GEMM
    narrow = _time(target, flops, _OPERAND_BYTES[fmt] * operands + size * out, narrow_peak)
    quantize = (size + _OPERAND_BYTES[fmt]) * operands / target.chip.hbm_bandwidth
    return GemmGain(path, backward, (batch, m, n, k), compute, narrow + quantize)


def matmul_gains(
    fn: Callable[..., Any], /, target: str = "h100", recipe: Fp8Recipe | str = "mxfp8"
) -> Callable[..., MatmulGains]:
    """Which modules' matmuls run faster on ``target`` under ``recipe``, by the roofline:
    ``matmul_gains(loss, "b200", "mxfp8")(params, batch)``. Curried like
    :func:`mpjax.inspect_matmuls`.

    ``fn`` is traced (nothing runs) and differentiated with respect to its floating array
    arguments, so each matmul's three GEMMs count. Trace the model under its bf16 (or f16)
    policy, a wrapped model or an autocast function: the GEMMs with bf16/f16 operands are the
    ones a narrow recipe would take, each in the region of its module; a matmul with batch
    dimensions (attention's) counts only under a ``batched`` recipe.

    Args:
      fn: the function, taking arrays or ``jax.ShapeDtypeStruct``.
      target: an :func:`mpjax.plan` target (``"h100"``, ``"b200"``...); its chip's published
        peaks and memory bandwidth time the GEMMs. A chip without fp8 GEMMs runs fp8 at the
        bf16 rate, and a block format on a chip without block-scaled GEMMs is emulated: both
        lose everywhere.
      recipe: the narrow recipe: an :class:`mpjax.Fp8Recipe` or its string (``"current"``,
        ``"rowwise"``, ``"mxfp8"``, ``"nvfp4"``).

    Returns:
      A function of ``fn``'s arguments returning the :class:`MatmulGains` of each module,
      whose :meth:`~MatmulGains.rules` keep the modules that do not gain in bf16.

    Raises:
      TypeError: for a ``fn`` that is not callable or a recipe of another type.
      ValueError: for an unknown target or recipe.
    """
    check_function("matmul_gains", fn)
    parsed = parse_target(target, caller="matmul_gains")
    recipe = fp8_recipe(recipe)

    def gains(*args: Any, **kwargs: Any) -> MatmulGains:
        closed = gradient_jaxpr(fn, args, kwargs)
        by_module: dict[str, list[GemmGain]] = collections.defaultdict(list)
        policies: dict[str, Policy | None] = {}
        for eqn, _, scopes, backward in walk_jaxpr(closed.jaxpr):
            if eqn.primitive.name != "dot_general":
                continue
            region = innermost(scopes)
            if region is not None and region.policy is None:
                continue  # full precision: no recipe reaches it
            path = "" if region is None else region.path
            gemm = _gemm(eqn, parsed, recipe, path, backward)
            if gemm is not None:
                by_module[path].append(gemm)
                policies[path] = None if region is None else region.policy
        report = MatmulGains(
            ModuleGain(path, policies[path], tuple(gemms)) for path, gemms in by_module.items()
        )
        report.target, report.recipe = parsed, recipe
        return report

    return gains
