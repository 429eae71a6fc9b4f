"""What the precision doctor recommends from its measures: the modules to keep in float32
(values that overflow their dtype, the non-finite birth, too much precision lost), the routers
to keep in float32 (a mixture of experts sending tokens to other experts than float32 would),
the loss scales that keep float16 gradients in range, and which matmuls are fit for fp8 with
delayed scaling.
"""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np

from mpjax.doctor.diagnosis_report import (
    Fp8Matmul,
    LossScaleAdvice,
    LossScaleCandidate,
    RoutingRow,
)
from mpjax.doctor.range_stats import DTYPES, RangeStats, bounds

__all__ = [
    "float16_gradients",
    "fp8_fitness",
    "keep_in_float32",
    "loss_scale_advice",
    "routing_changes",
]

# A matmul is fit for fp8 with delayed scaling when its operands' amax moves by at most this
# factor between batches: a scale set from earlier batches then neither overflows nor wastes
# more than one binade of the format's range.
FP8_STABLE_RATIO = 2.0
# The loss scales whose effect on float16 gradients is measured: 2**0 ... 2**LOSS_SCALE_MAX_LOG2.
LOSS_SCALE_MAX_LOG2 = 32
# Below this share of flushed gradient values, a loss scale is in the recommended range.
FLUSH_TOLERANCE = 1e-3


def keep_in_float32(per_site, sites, birth, errors, max_error) -> tuple[list[str], list[str]]:
    """The modules to keep in float32 and why: values that overflow the dtype they are
    computed in, the non-finite birth, an error entering above ``max_error``."""
    why: dict[str, list[str]] = collections.defaultdict(list)
    for index, parts in per_site.items():
        s = sites[index]
        if s.dtype not in DTYPES:
            continue
        stats = RangeStats.merge(parts)
        share = stats.shares(s.dtype).overflow
        if share > 0:
            b = bounds(s.dtype)
            text = (
                f"its {s.primitive} ({'backward' if s.backward else 'forward'}) runs in {s.dtype} "
                f"and reaches {stats.amax:.3g} in the float32 run, past {s.dtype}'s "
                f"{float(jnp.finfo(jnp.dtype(s.dtype)).max):.5g} ({100 * share:.3g}% of the "
                f"{s.primitive}'s values overflow from {float(b.overflow):.6g} up)"
            )
            if text not in why[s.module]:
                why[s.module].append(text)
    if birth is not None:
        why[birth.module].append(f"the first non-finite value is born there: {birth}")
    for row in errors:
        if row.local > max_error:
            why[row.module].append(
                f"its {row.primitive} at {row.location} loses {row.local:.3g} relative error "
                f"on exact inputs (more than max_error={max_error:g})"
            )
    order = [m for m in dict.fromkeys(s.module for s in sites) if m in why]
    reasons = [f"keep {m or '<root>'!r} in float32: " + "; ".join(why[m]) for m in order]
    return reasons, order


def float16_gradients(per_site, sites) -> RangeStats | None:
    """The ranges (float32 run) of the gradient values that run in float16 under the policy,
    those a loss scale scales into float16's range (casts to float16 included); None when no
    gradient runs in float16. Gradients computed in float32 (a norm's backward) never overflow
    under the scale, whatever their size: they are left out."""
    parts = [
        stats
        for index, found in per_site.items()
        if sites[index].backward and sites[index].dtype == "float16"
        for stats in found
    ]
    return RangeStats.merge(parts) if parts else None


def loss_scale_advice(stats: RangeStats) -> LossScaleAdvice:
    """The loss scales that keep the gradient values (``stats``: of the float32 run, those
    that run in float16, :func:`float16_gradients`) in float16's range, each scale
    ``2**0 ... 2**LOSS_SCALE_MAX_LOG2`` measured."""
    candidates = tuple(
        LossScaleCandidate(k, stats.shares("float16", k)) for k in range(LOSS_SCALE_MAX_LOG2 + 1)
    )
    safe = [c for c in candidates if c.shares.overflow == 0]
    if not safe:
        c = candidates[0]
        return LossScaleAdvice(
            candidates,
            None,
            None,
            f"loss scale: none keeps the gradients in float16; even 2**0 overflows "
            f"{100 * c.shares.overflow:.3g}% of them (largest {stats.amax:.3g}): keep the "
            "modules that overflow in float32 first",
        )
    good = [c for c in safe if c.shares.flush <= FLUSH_TOLERANCE]
    chosen = good or [safe[-1]]
    low, high = chosen[0], chosen[-1]
    return LossScaleAdvice(
        candidates,
        low.log2_scale,
        high.log2_scale,
        f"loss scale for float16 gradients: 2**{low.log2_scale} to 2**{high.log2_scale}: "
        f"2**{high.log2_scale} overflows none of the {stats.finite:,} float16 gradient values and "
        f"flushes {100 * high.shares.flush:.3g}%, 2**{low.log2_scale} flushes "
        f"{100 * low.shares.flush:.3g}% (unscaled: {100 * candidates[0].shares.flush:.3g}% "
        f"flushed); 2**{high.log2_scale + 1} would overflow "
        + (
            f"{100 * candidates[high.log2_scale + 1].shares.overflow:.3g}%"
            if high.log2_scale < LOSS_SCALE_MAX_LOG2
            else "(not measured)"
        ),
    )


def fp8_fitness(results, sites, indices) -> tuple[Fp8Matmul, ...]:
    """Per matmul site (``sites[i]`` for ``i`` in ``indices``), its fitness for fp8 from how
    its operands' amax (``values["dots"]`` of each batch's ``(trace, values)`` in ``results``)
    moves across the batches."""
    counter: collections.Counter = collections.Counter()
    found = []
    for row, index in enumerate(indices):
        s = sites[index]
        rank = counter[s.module, s.backward]
        counter[s.module, s.backward] += 1
        amax = tuple(tuple(float(v) for v in values["dots"][row]) for _, values in results)
        per_operand = np.array(amax)  # batches x 2
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = per_operand.max(axis=0) / per_operand.min(axis=0)
        ratio = float(np.nanmax(np.where(per_operand.max(axis=0) > 0, ratios, 1.0)))
        name = f"{s.module or '<root>'}#{rank} ({'backward' if s.backward else 'forward'})"
        if len(results) < 2:
            fit, why = False, f"fp8: {name}: one batch; fitness needs the amax of several"
        else:
            fit = ratio <= FP8_STABLE_RATIO
            verdict = "fit for" if fit else "not fit for"
            why = (
                f"fp8: {name} is {verdict} delayed scaling: its operands' amax moves by "
                f"{ratio:.3g}x across {len(results)} batches (fit: at most {FP8_STABLE_RATIO:g}x)"
            )
        found.append(Fp8Matmul(s.module, rank, s.backward, amax, ratio, fit, why))
    return tuple(found)


def routing_changes(results, sites, routing) -> tuple[RoutingRow, ...]:
    """Per routing decision (``routing``: the evaluation's ``(top_k site, logits site)``
    pairs), the largest share of tokens over the batches (``values["routing"]``) that chose
    other experts than in float32, and whether to route its logits in float32: when some did
    and the logits' matmul runs narrower than float32 in a module a rule can name."""
    rows = []
    for k, (index, logits) in enumerate(routing):
        s = sites[index]
        flipped = max(float(values["routing"][k]) for _, values in results)
        where = f"the top_k in {s.module or '<root>'!r} ({s.location})"
        source = sites[logits] if logits is not None else None
        narrow = source is not None and np.dtype(source.dtype).itemsize < 4
        recommend = bool(flipped > 0 and narrow and source is not None and source.module)
        share = f"{100 * flipped:.3g}% of the tokens"
        if source is None:
            why = f"routing: {where} chose other experts than float32 for {share}"
        elif recommend:
            why = (
                f"route {source.module!r} in float32 (mpjax.router_policy): {where} sends "
                f"{share} to other experts than float32 does; its logits' matmul runs in "
                f"{source.dtype}"
            )
        elif flipped > 0 and narrow:
            why = (
                f"routing: {where} sends {share} to other experts than float32 does; its "
                f"logits' matmul runs in {source.dtype} at the root, which no rule can name: "
                "give the router a module (or a named scope) of its own"
            )
        elif flipped > 0:
            why = (
                f"routing: {where} sends {share} to other experts than float32 does, though "
                f"its logits' matmul ({source.module or '<root>'!r}) runs in {source.dtype}: "
                "the rounding of the router's inputs moves them, which a rule for the router "
                "does not change"
            )
        else:
            why = (
                f"routing: {where} sends every token to the experts float32 does (its logits' "
                f"matmul in {source.dtype})"
            )
        rows.append(
            RoutingRow(
                module=s.module,
                location=s.location,
                flipped=flipped,
                logits_module=None if source is None else source.module,
                logits_dtype=None if source is None else source.dtype,
                recommend=recommend,
                why=why,
            )
        )
    return tuple(rows)
