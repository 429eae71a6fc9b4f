"""Checks shared by the model tests: what a model run under ``mixed_bfloat16`` must satisfy,
whoever wrote the model.

A *subject* is a function ``apply(params, *inputs)`` (the model under test), the unwrapped f32
model as the same kind of function, the f32 params both take, and the inputs. The checks read
matmul dtypes from the jaxpr (``mpjax.inspect_matmuls``), never from compiled CPU HLO (XLA's CPU
backend upcasts bf16 dots).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mpjax

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
POLICY = "mixed_bfloat16"
MAX_RELATIVE_ERROR = 0.05  # relative L2 norm of (mixed - f32) / f32, per output leaf


def key(seed: int = 0) -> jax.Array:
    """A PRNG key for init: XLA compiles the "rbg" generator several times faster on CPU than
    the default threefry, which dominates the time of these tests otherwise."""
    return jax.random.key(seed, impl="rbg")


@dataclasses.dataclass
class Subject:
    """A model under test and its f32 reference, as functions of ``(params, *inputs)``.

    ``grad_inputs`` lists the indices of the inputs to differentiate along with the params
    (floating inputs; token ids are not differentiable).
    """

    apply: Callable[..., Any]
    reference: Callable[..., Any]
    params: Any
    inputs: tuple
    grad_inputs: tuple[int, ...] = ()

    def loss(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A scalar loss of ``fn``'s floating outputs, as a function of (params, *inputs)."""

        def loss(params, *inputs):
            leaves = [leaf for leaf in jax.tree.leaves(fn(params, *inputs)) if _floating(leaf)]
            return sum(jnp.mean(jnp.square(leaf.astype(jnp.float32))) for leaf in leaves)

        return loss

    def grad(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Gradient of ``loss(fn)`` w.r.t. the params and the ``grad_inputs``."""
        argnums = (0, *(1 + i for i in self.grad_inputs))
        return jax.grad(self.loss(fn), argnums=argnums)

    @functools.cached_property
    def matmuls(self) -> tuple:
        """(forward, backward) ``MatmulReport``s of the model under test."""
        return _matmuls(self, self.apply)

    @functools.cached_property
    def reference_matmuls(self) -> tuple:
        """(forward, backward) ``MatmulReport``s of the f32 model."""
        return _matmuls(self, self.reference)


def _floating(x: Any) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.floating)


def _is_int(dtype: np.dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_


def dtypes(tree: Any) -> set[np.dtype]:
    return {np.dtype(leaf.dtype) for leaf in jax.tree.leaves(tree)}


def _matmuls(subject: Subject, fn: Callable[..., Any]) -> tuple:
    forward = mpjax.inspect_matmuls(fn)(subject.params, *subject.inputs)
    backward = mpjax.inspect_matmuls(subject.grad(fn))(subject.params, *subject.inputs)
    return forward, backward


def split_by_kind(report) -> tuple[list, list]:
    """(floating matmuls, integer dots) of a report."""
    floating = [m for m in report if not (_is_int(m.lhs_dtype) and _is_int(m.rhs_dtype))]
    integer = [m for m in report if m not in floating]
    return floating, integer


def _in_router(matmul) -> bool:
    return matmul.module is not None and bool(mpjax.rules.ROUTER_PATHS.fullmatch(matmul.module))


def assert_floating_matmuls_bf16(subject: Subject, *, routers_in_f32: bool = False) -> None:
    """Every floating matmul of the forward pass and of the gradient has bf16 operands; with
    ``routers_in_f32`` (a wrapper, which applies the built-in router rule; autocast applies no
    built-in rule) those of a mixture of experts' router run f32 x f32 instead."""
    for name, report in zip(("forward", "backward"), subject.matmuls):
        floating, _ = split_by_kind(report)
        assert floating, f"{name}: no floating matmul found\n{report}"
        expected = {True: (F32, F32), False: (BF16, BF16)}
        wrong = [
            m for m in floating if m.operand_dtypes != expected[routers_in_f32 and _in_router(m)]
        ]
        counts = ", ".join(f"{n} {a} x {b}" for (a, b), n in report.operand_dtypes().items())
        assert not wrong, (
            f"{name}: {len(wrong)} of {len(floating)} floating matmuls do not run bf16 x bf16 "
            f"(f32 x f32 in a router) ({counts})\n{report}"
        )


def assert_integer_dots_stay_integer(subject: Subject) -> None:
    """The integer dots of the f32 model are still there, integer in and out, fwd and bwd."""
    for name, report, ref in zip(
        ("forward", "backward"), subject.matmuls, subject.reference_matmuls
    ):
        _, integer = split_by_kind(report)
        _, ref_integer = split_by_kind(ref)
        assert ref_integer, f"the f32 model has no integer dot to check\n{ref}"
        assert len(integer) == len(ref_integer), (
            f"{name}: {len(ref_integer)} integer dots in the f32 model, {len(integer)} here\n"
            f"{report}"
        )
        assert all(_is_int(m.out_dtype) for m in integer), f"{name}\n{report}"


def relative_errors(out: Any, ref: Any) -> list[float]:
    """Relative L2 norm of the difference, per floating leaf."""
    errors = []
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        if _floating(b):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            errors.append(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
    return errors


def assert_output_close_to_f32(subject: Subject) -> None:
    """Same tree and shapes as the f32 model, f32 floating leaves, within 5% (relative L2)."""
    out = jax.jit(subject.apply)(subject.params, *subject.inputs)
    ref = subject.reference(subject.params, *subject.inputs)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    assert [np.shape(a) for a in jax.tree.leaves(out)] == [
        np.shape(b) for b in jax.tree.leaves(ref)
    ]
    assert {np.dtype(a.dtype) for a in jax.tree.leaves(out) if _floating(a)} == {F32}
    errors = relative_errors(out, ref)
    assert errors and max(errors) < MAX_RELATIVE_ERROR, errors
    assert max(errors) > 0, "identical to the f32 model: nothing ran in bf16"


def assert_grads_f32_like_params(subject: Subject) -> None:
    """Gradients w.r.t. the params: f32, the params' tree structure and shapes."""
    grads = jax.eval_shape(subject.grad(subject.apply), subject.params, *subject.inputs)[0]
    assert jax.tree.structure(grads) == jax.tree.structure(subject.params)
    assert jax.tree.map(np.shape, grads) == jax.tree.map(np.shape, subject.params)
    assert dtypes(grads) == {F32}, jax.tree.map(lambda g: g.dtype, grads)


# --- Subjects from linen and NNX models. -------------------------------------------------------


def linen_subjects(model, wrapped, inputs, *, grad_inputs=(), **kwargs) -> dict[str, Subject]:
    """{"wrapper": ``wrapped`` (the model under ``linen.apply_policy``), "autocast":
    ``mpjax.autocast(model.apply)``}, both on the params of the unwrapped init; ``kwargs`` are
    static keyword arguments of the model's ``__call__``."""
    params = jax.jit(functools.partial(model.init, **kwargs))(key(), *inputs)["params"]

    def reference(params, *inputs):
        return model.apply({"params": params}, *inputs, **kwargs)

    def wrapper(params, *inputs):
        return wrapped.apply({"params": params}, *inputs, **kwargs)

    return _subjects(wrapper, reference, params, inputs, grad_inputs)


def _subjects(wrapper, reference, params, inputs, grad_inputs) -> dict[str, Subject]:
    shared = jax.jit(reference)  # one compiled f32 model for both subjects
    return {
        mode: Subject(apply, shared, params, tuple(inputs), tuple(grad_inputs))
        for mode, apply in (("wrapper", wrapper), ("autocast", mpjax.autocast(reference, POLICY)))
    }


def nnx_functional(model: nnx.Module, method: Callable[..., Any] | None = None):
    """``(params, *inputs) -> output`` for an NNX model (split/merge), and its params."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def apply(params, *inputs):
        module = nnx.merge(graphdef, params, rest)
        return module(*inputs) if method is None else method(module, *inputs)

    return apply, params


def nnx_subjects(
    build: Callable[[], nnx.Module], inputs, *, grad_inputs=(), method=None
) -> dict[str, Subject]:
    """``build()`` makes the model (the same values each call). {"wrapper": a copy under
    ``nnx.set_policy``, "autocast": ``mpjax.autocast`` of the f32 model}."""
    reference, params = nnx_functional(build(), method)
    model = build()
    mpjax.nnx.set_policy(model, POLICY)
    wrapper, _ = nnx_functional(model, method)
    return _subjects(wrapper, reference, params, inputs, grad_inputs)


def assert_linen_wrapper_init_is_f32_and_unchanged(wrapped, inputs, expected, **kwargs) -> None:
    """``wrapped.init`` creates ``expected``, the unwrapped model's params: same tree, f32,
    same values."""
    ours = jax.jit(functools.partial(wrapped.init, **kwargs))(key(), *inputs)["params"]
    assert jax.tree.structure(ours) == jax.tree.structure(expected)
    assert dtypes(ours) == {F32}, jax.tree.map(lambda p: p.dtype, ours)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), ours, expected)
    assert not any(jax.tree.leaves(changed)), changed


def assert_nnx_wrapper_keeps_params_f32_and_bit_identical(
    build, inputs, grad_inputs=(), method=None
) -> None:
    """After ``set_policy`` the Params are f32 and the f32 model's values, and they stay so
    across a stateful forward and backward pass (``nnx.jit`` + ``nnx.value_and_grad``)."""
    before = nnx.state(build(), nnx.Param)
    model = build()
    mpjax.nnx.set_policy(model, POLICY)
    call = (lambda m, *xs: m(*xs)) if method is None else method

    def loss(model, *inputs):
        out = call(model, *inputs)
        return sum(
            jnp.mean(jnp.square(leaf.astype(jnp.float32)))
            for leaf in jax.tree.leaves(out)
            if _floating(leaf)
        )

    argnums = (0, *(1 + i for i in grad_inputs))

    def assert_unchanged(when):
        after = nnx.state(model, nnx.Param)
        assert jax.tree.structure(after) == jax.tree.structure(before), when
        assert dtypes(after) == {F32}, (when, jax.tree.map(lambda p: p.dtype, after))
        changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), after, before)
        assert not any(jax.tree.leaves(changed)), (when, changed)

    assert_unchanged("after set_policy")
    _, grads = nnx.jit(nnx.value_and_grad(loss, argnums=argnums))(model, *inputs)
    assert_unchanged("after a forward and backward pass")
    param_grads = grads[0]
    assert jax.tree.structure(param_grads) == jax.tree.structure(before)
    assert dtypes(param_grads) == {F32}


def normal(*shape, seed=0, scale=1.0):
    # numpy data: eager jax.random calls compile one kernel per shape.
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def fan_in_normal(rngs: nnx.Rngs, *shape, fan_in=None):
    fan_in = shape[-2] if fan_in is None else fan_in
    return jax.random.normal(rngs.params(), shape) / math.sqrt(fan_in)


def assert_norm_computes_in_f32_alone(report) -> None:
    """The ``describe`` report of a ``dense`` into a ``norm`` under ``mixed_float16``: the norm a
    rule keeps in float32 computes every operation in float32 (its row and its table line),
    the Dense in float16 with its three f16 matmuls (forward and the two backward)."""
    norm, dense = report.row("norm"), report.row("dense")
    assert norm.policy.compute_dtype == jnp.float32
    assert [dtype for dtype, _ in norm.computes] == ["f32"]
    assert "f16" in dict(dense.computes) and dense.matmuls == (("f16,f16", 3),)
    line = next(line for line in report.table().splitlines() if line.startswith("norm "))
    assert line.split()[-2:] == ["f32", "-"]  # the ops, no matmuls
