"""What a step's loops cost: XLA's estimate of a step that scans, with each loop's body
counted its trip count times.

XLA's cost model counts the body of a while loop once, whatever its trip count: the estimate of
a step that scans its layers (``nn.scan``, ``nnx.scan``, ``jax.lax.scan``) leaves out all but
one layer. :func:`loop_costs` finds the step's scans in its jaxpr and compiles the step once
more with each of them unrolled (the scan's ``unroll`` set to its trip count, nested scans
included): the same program without the loops, whose estimate counts every iteration. The
plan's memory, collectives and kernels still come from the step as it runs, scanned; only the
estimate comes from the unrolled compile.

Why not the cost of one more copy of the body: XLA's TPU cost model does not add up that way
across jax's unrolling. A scan over 8 layers of a two-matmul MLP, planned for a v5p, is
estimated at 0.17 ms, 0.40, 0.73 and 0.87 ms with ``unroll`` 1, 2, 4 and 8 (its Python-loop
twin: 0.88 ms): the body unrolled twice costs 2.7 times a layer of the unrolled step, for the
stacking of the copies' outputs and the slicing of the stacked operands; counted eight times,
that estimate would be twice the unrolled one.

A ``while_loop``, whose trip count is known only when it runs, is not modelled: the step then
gets no estimate. Loops XLA makes itself (a matmul split over collective permutes) are not in
the jaxpr and still count once (the plan's summary says when its FLOPs fall short).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from mpjax import jax_compat
from mpjax.planning import deviceless

__all__ = ["PlanLoop", "loop_costs", "loop_lines"]


@dataclasses.dataclass(frozen=True)
class PlanLoop:
    """A loop of a planned step, as the estimate counts it.

    Attributes:
      name: its name stack, as JAX prints it (``"transpose(jvp(Transformer))"`` for a backward
        pass); empty where it was traced outside any name.
      trips: the iterations it runs; None for a ``while_loop``, whose count is known only when
        it runs.
      counted: the iterations of it that XLA's cost model counts in the step as compiled: the
        copies of the body its code holds (one, or its ``unroll`` plus the remainder).
      modelled: whether the estimate counts every iteration (from the step compiled with its
        scans unrolled).
      why: why not, where it is not modelled for a reason other than a ``while_loop``'s (the
        unrolled step's compile error, or a figure of XLA's cost model that is no time).
    """

    name: str
    trips: int | None
    counted: int
    modelled: bool
    why: str = ""


def loop_costs(
    traced: Any, step: deviceless.DevicelessCompile, compiler_options: Mapping[str, Any]
) -> tuple[dict[str, float] | None, tuple[PlanLoop, ...]]:
    """XLA's cost analysis of the step ``traced`` (a ``jax.stages.Traced``) with each loop's
    body counted its trip count times, and the step's loops.

    ``step`` is the step's own deviceless compile. Where a scan's compiled code holds fewer
    copies of its body than it runs iterations, the step is compiled once more with every such
    scan unrolled (nested ones included), with the same input and output shardings and
    ``compiler_options``, and that compile's cost analysis is returned. The cost is None where
    a loop is not modelled (a ``while_loop``) or the unrolled step did not compile; it is the
    step's own where nothing loops.

    Args:
      traced: the step, traced for the target's devices (``jax.jit(fn).trace(*args)``).
      step: what :func:`mpjax.planning.deviceless.deviceless_compile` gave for it.
      compiler_options: the XLA options it was compiled with.
    """
    found = jax_compat.loops(traced.jaxpr)
    whiles = [loop for loop in found if loop.length is None]
    scans = [
        loop
        for loop in found
        if loop.length is not None
        and jax_compat.scan_copies(loop.length, loop.unroll) < loop.length
    ]
    if whiles:
        return None, tuple(PlanLoop(loop.name, None, 1, False) for loop in whiles)
    if not scans:
        return step.cost, ()
    unrolled = jax_compat.unrolled(traced.jaxpr, {loop.path: loop.length or 1 for loop in scans})
    cost, why = None, ""
    if step.cost:
        try:
            cost = _compile(unrolled, traced, step, compiler_options)
        except jax.errors.JaxRuntimeError as error:  # out of memory, unrolled: no estimate
            why = (
                f"the step with them unrolled did not compile: {str(error).strip().splitlines()[0]}"
            )
    return cost, tuple(
        PlanLoop(
            loop.name,
            loop.length,
            jax_compat.scan_copies(loop.length or 1, loop.unroll),
            cost is not None,
            why,
        )
        for loop in scans
    )


def _compile(
    jaxpr: Any,
    traced: Any,
    step: deviceless.DevicelessCompile,
    compiler_options: Mapping[str, Any],
) -> dict[str, float]:
    """XLA's cost analysis of ``jaxpr`` compiled as the step was: its flat inputs and outputs
    sharded as the step's compile placed them, donated where the step donates them. The jaxpr
    was traced for the target already (inside :func:`mpjax.compile_only`, with no host
    callback), and is compiled as it is."""
    avals = traced.jaxpr.in_avals
    donated = tuple(i for i, a in enumerate(jax.tree.leaves(traced.args_info)) if a.donated)
    inputs = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=a.weak_type)
        for a, s in zip(avals, step.input_shardings, strict=True)
    ]
    jitted = jax.jit(
        jax_compat.jaxpr_function(jaxpr),
        in_shardings=step.input_shardings,
        out_shardings=list(step.output_shardings),
        donate_argnums=donated,
        keep_unused=True,
    )
    lowered = jitted.lower(*inputs)
    return deviceless.deviceless_compile(lowered, dict(compiler_options)).cost or {}


def loop_lines(loops: tuple[PlanLoop, ...]) -> list[str]:
    """The plan summary's lines on the step's loops: how the estimate counts them, or why there
    is none."""
    whiles = [loop for loop in loops if loop.trips is None]
    scans = [loop for loop in loops if loop.trips is not None]
    lines = []
    if whiles:
        names = ", ".join(dict.fromkeys(loop.name or "(no name)" for loop in whiles))
        lines.append(
            f"no time estimate: the step runs a while_loop ({names}) whose trip count is known "
            "only when it runs, and XLA's cost model counts a loop's body once"
        )
    elif scans and scans[0].modelled:
        trips = ", ".join(str(t) for t in dict.fromkeys(loop.trips for loop in scans))
        lines.append(
            f"the estimate counts every iteration of the step's {len(scans)} scan"
            f"{'s' * (len(scans) != 1)} ({trips} iterations), from a compile of the step with "
            "them unrolled; memory, collectives and kernels are the scanned step's"
        )
    elif scans:
        lines.append(
            f"no time estimate: XLA's cost model counts a loop's body once, and for the step's "
            f"{len(scans)} scan{'s' * (len(scans) != 1)} {scans[0].why}"
        )
    return lines
