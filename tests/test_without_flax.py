"""mpjax works with Flax unavailable: the optax side (policies, loss scaling, master weights)
imports and trains, and ``import mpjax`` gives the whole core, autocast included, with
``mpjax.linen``/``mpjax.nnx`` raising a clear ImportError. Each check runs in a subprocess that
blocks ``flax`` in ``sys.modules`` before importing anything."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter. sys.modules["flax"] = None makes every `import flax` (and
# `import flax.<anything>`) raise ImportError. The package is entered through a bare module
# object so that what is tested is these modules and the modules they import, not the
# package's __init__ (which also loads the Flax integrations when Flax is installed).
TRAIN_WITHOUT_FLAX = r"""
import pathlib, sys, types

sys.modules["flax"] = None
try:
    import flax.linen
except ImportError:
    pass
else:
    raise AssertionError("flax was importable: the block did not work")

package = types.ModuleType("mpjax")
package.__path__ = [str(pathlib.Path(sys.argv[1]) / "mpjax")]
sys.modules["mpjax"] = package

import jax, jax.numpy as jnp, numpy as np, optax
import mpjax.policy, mpjax.optim.loss_scaling_readers, mpjax.optim.master_weights
from mpjax.optim.loss_scale import DynamicLossScale
from mpjax.optim.loss_scaling import loss_scaling
from mpjax.optim.loss_scaling_readers import loss_scaling_info, scale_loss
from mpjax.optim.master_weights import master_weights

loaded = sorted(m for m in sys.modules if m.startswith("mpjax."))
assert loaded == ["mpjax.fp8", "mpjax.jax_compat", "mpjax.jax_compat._devices",
                  "mpjax.jax_compat._jaxprs", "mpjax.jax_compat._lowering",
                  "mpjax.optim", "mpjax.optim.gradient_checks",
                  "mpjax.optim.loss_scale", "mpjax.optim.loss_scaling",
                  "mpjax.optim.loss_scaling_readers", "mpjax.optim.master_weights",
                  "mpjax.policy"], loaded
assert not [m for m, v in sys.modules.items() if m.split(".")[0] == "flax" and v is not None]

policy = mpjax.policy.get_policy("float16")
assert policy.needs_loss_scaling
f16 = np.dtype(jnp.float16)
tx = master_weights(loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10)))
params = {"w": jnp.linspace(0.5, 1.5, 8).astype(f16)}
opt_state = tx.init(params)

@jax.jit
def step(params, opt_state, poison):
    loss = lambda p: jnp.sum(p["w"].astype(jnp.float32) ** 2)
    grads = jax.grad(lambda p: scale_loss(loss(p), opt_state))(params)
    grads = {"w": grads["w"] + poison.astype(f16)}
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

def same_bits(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

# An overflow step: skipped bit for bit, the scale halves.
new_params, new_state = step(params, opt_state, jnp.float32(jnp.inf))
info = loss_scaling_info(new_state)
assert not bool(info.applied) and int(info.skipped_steps) == 1
assert float(info.loss_scale) == 2.0**9
assert same_bits(new_params, params)
assert same_bits(new_state.master, opt_state.master)
assert same_bits(new_state.inner_state.inner_state, opt_state.inner_state.inner_state)

# A finite step: applied, the params move (in float16, onto the float32 master rounded), the
# scale stays.
params, opt_state = step(new_params, new_state, jnp.float32(0.0))
info = loss_scaling_info(opt_state)
assert bool(info.applied) and int(info.skipped_steps) == 1
assert float(info.loss_scale) == 2.0**9
assert params["w"].dtype == f16 and opt_state.master["w"].dtype == jnp.float32
assert same_bits(params["w"], opt_state.master["w"].astype(f16))
assert not same_bits(params, new_params)
print("trained without flax")
"""


def test_policy_loss_scaling_and_master_weights_train_with_flax_blocked():
    result = subprocess.run(
        [sys.executable, "-c", TRAIN_WITHOUT_FLAX, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "trained without flax", result.stdout + result.stderr


# `import mpjax` itself, with Flax blocked: the core works and the integrations say what is
# missing.
IMPORT_WITHOUT_FLAX = r"""
import sys

sys.modules["flax"] = None
import jax, jax.numpy as jnp, optax
import mpjax

assert not [m for m, v in sys.modules.items() if m.split(".")[0] == "flax" and v is not None]
assert "mpjax.linen" not in sys.modules and "mpjax.nnx" not in sys.modules
assert not {"linen", "nnx"} & set(mpjax.__all__)

fast = mpjax.autocast(lambda w, x: jnp.tanh(x @ w).sum())
w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
ops = mpjax.inspect_matmuls(jax.grad(fast))(w, x).operand_dtypes()
assert set(ops) == {("bfloat16", "bfloat16")}, ops
report = mpjax.describe(fast)(w, x)
assert report.to_dict()["rows"], report
assert mpjax.get_policy("mixed_float16").needs_loss_scaling
tx = mpjax.loss_scaling(optax.sgd(0.1), "static:8")
assert float(mpjax.loss_scaling_info(tx.init(w)).loss_scale) == 8.0

for name in ("linen", "nnx"):
    try:
        getattr(mpjax, name)
    except ImportError as error:
        assert 'pip install "mpjax[flax]"' in str(error), error
    else:
        raise AssertionError(f"mpjax.{name} without flax")
try:
    mpjax.describe(object())
except TypeError as error:
    assert "mpjax.autocast" in str(error), error
print("mpjax without flax")
"""


def test_import_mpjax_with_flax_blocked():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_FLAX],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "mpjax without flax", result.stdout + result.stderr
