"""Every use of JAX internals in mpjax, in one place.

Autocast and inspection read jaxprs: equation params, name stacks, the binding convention of
primitives, none of it covered by JAX's compatibility promise. Everything version dependent is
here, behind small functions with stable signatures, so a JAX upgrade touches this package
only; the rest of mpjax re-expresses higher-order primitives with public APIs from what they
return, and imports them from here (``from mpjax import jax_compat as compat``), whichever
private module holds them:

- ``_jaxprs``: equations, atoms, name stacks, binding, matmul precisions, the params of
  higher-order primitives, abstract values, a step's loops;
- ``_lowering``: how mpjax lowers operations (XLA's CPU dots, block-scaled GEMMs on the CPU,
  primitives whose CUDA lowering is a kernel chosen for the target GPU);
- ``_devices``: what a trace knows of its devices (the mesh and platform of a traced value),
  Pallas's TPU flash attention and interpreter, the compile-only devices' environment.

Supported: jax 0.8.1 to 0.12 (``tests/test_jax_compat.py`` pins what each function returns;
CI runs it on the oldest and the newest). The differences handled here:

* The grouped-GEMM kernels' lowering reads the target GPU off the lowering context's backend
  (:func:`gpu_chosen_primitive`), which a compile without the hardware gives as compile-only
  devices that know their compute capability.
* jax 0.11 made ``ClosedJaxpr`` an alias of ``Jaxpr``, described the scan's operands by flat
  trees ``ft_in``/``ft_out`` instead of counts, made the jit param ``inline`` a ``jax.Inline``
  and renamed ``closed_call`` and ``call`` to ``eval_jaxpr``.
* jax 0.10 moved ``DropVar`` and ``jaxprs_in_params`` to ``jax.extend.core``, and 0.10.2
  renamed the shard_map param ``manual_axes`` to ``newly_manual_axes``; 0.9.2 made
  ``Primitive.get_bind_params`` return params only.
* XLA's Triton GEMMs take dots on two float8 types from jax 0.10.2 on (:func:`mixed_fp8_dots`),
  Mosaic GPU's Hopper ``wgmma`` from 0.12 (:func:`mosaic_mixed_fp8_wgmma`);
  XLA's CPU runtime lacks some bf16 x bf16 -> f32 dots (:func:`widen_narrow_dots_on_cpu`);
  block-scaled GEMMs on the CPU, absent from jax 0.8.1 and in bf16 in 0.12 (:func:`emulate_block_scaled_matmuls_on_cpu`).
* The axes a value varies over inside a ``shard_map`` (:func:`varying_axes`): the type's
  ``vma`` in jax 0.8.1, its ``manual_axis_type.varying`` in 0.12.
* Pallas's TPU flash attention (:func:`pallas_flash_attention`) and
  ``force_tpu_interpret_mode`` (:func:`pallas_tpu_interpreted`) are the same in 0.8.1 and 0.12.
* A step's loops (:func:`loops`, :func:`unrolled`): the ``scan`` param ``unroll`` and how
  ``lax.scan`` lowers it (:func:`scan_copies`) are the same in 0.8.1 and 0.12.
* The CUDA plugin of jax 0.8 needs ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` to start without a GPU
  (set as mpjax is imported). The other differences of the CUDA plugin and libtpu in compiling
  without the hardware, through public APIs, are in :mod:`mpjax.planning.deviceless`.

A param that is missing raises :class:`UnsupportedJaxError` naming it: an unknown JAX is never
read by guesswork.
"""

from mpjax.jax_compat._devices import (  # noqa: F401
    PALLAS_BLOCK,
    _compile_only_environment,
    manual_axes,
    pallas_flash_attention,
    pallas_interpreter_runs_sharded,
    pallas_tpu_interpreted,
    partitioned_axes,
    traced_mesh,
    traced_platform,
    varying_axes,
)
from mpjax.jax_compat._jaxprs import (  # noqa: F401
    CALL_PRIMITIVES,
    MATMUL_PRECISIONS,
    DotParams,
    JitParams,
    Loop,
    RaggedDotParams,
    RematParams,
    ScanParams,
    ShardMapParams,
    UnsupportedJaxError,
    WhileParams,
    bind_equation,
    call_jaxpr,
    checkpoint_name_of,
    closed,
    cond_branches,
    cond_platforms,
    current_scope_names,
    dot_params,
    is_backward,
    is_dropvar,
    is_literal,
    is_ref,
    is_tracer,
    jaxpr_function,
    jit_params,
    loops,
    name_stack,
    precision_left_default,
    precision_name,
    preferred_element_type,
    ragged_dot_params,
    ref_like,
    remat_params,
    retyped,
    scan_copies,
    scan_params,
    scope_names,
    shard_map_params,
    source_location,
    sub_jaxprs,
    takes_precision,
    trace_at,
    traced_at,
    unrolled,
    weakly_typed,
    while_params,
    with_precision,
)
from mpjax.jax_compat._lowering import (  # noqa: F401
    BLOCK_SCALED_MATMUL,
    GpuTarget,
    emulate_block_scaled_matmuls_on_cpu,
    gpu_chosen_primitive,
    lowering_platform,
    mixed_fp8_dots,
    mosaic_gpu_interpretable,
    mosaic_gpu_interpreted,
    mosaic_mixed_fp8_wgmma,
    widen_narrow_dots_on_cpu,
)
