"""Seeing what runs in which dtype: reports of a traced function and plans of a compiled one.

- :mod:`mpjax.inspection.describe`: ``describe``, the one report entry point (the integrations
  register what they describe).
- :mod:`mpjax.inspection.report`: ``PrecisionReport``, what rules resolved to module by module,
  with each module's matmul dtypes.
- :mod:`mpjax.inspection.matmuls`: ``inspect_matmuls`` (the jaxpr's matmuls), ``hlo_dots`` and
  ``hlo_op_counts`` (the compiled HLO's).
- :mod:`mpjax.inspection.plan`: ``plan``, what a GPU (H100, A100, H200, B200, GB200, B300) or a
  TPU (v4, v5e, v5p, v6e, TPU7x, or a slice of them) would run, compiled without one: matmuls, fused attention, memory
  per device, and on a TPU XLA's estimated time; ``plan_mesh`` gives a TPU slice's devices to
  shard for.
- :mod:`mpjax.inspection.plan_rows`: the parts of a plan read from the optimized HLO (GEMMs,
  attention, scatters) and from XLA's memory analysis, with :mod:`mpjax.inspection.hlo_text`
  parsing the HLO.
- :mod:`mpjax.inspection.plan_devices`: a target's compile-only devices, ``plan_unavailable``
  (why there are none here, with what to install) and ``plan_mesh``.
- :mod:`mpjax.inspection.plan_arguments`: the arguments a plan compiles, kept on the target's
  compile-only devices with the shardings they were given (or refused, when they cannot be).
- :mod:`mpjax.inspection.plan_loops`: XLA's estimate of a step that scans, with each loop's
  body counted its trip count times (from a compile of the step with its scans unrolled).
- :mod:`mpjax.inspection.deviceless`: the compile-only devices of JAX's CUDA plugin and of
  libtpu, and the deviceless compile a plan reads, whatever the installed jaxlib's version.
- :mod:`mpjax.inspection.plan_collectives`: what a sharded step sends between devices, by
  kind, dtype, bytes and the module each collective serves.
- :mod:`mpjax.inspection.compile_only`: ``compile_only``, tracing mpjax steps for devices this
  process lacks (an ahead-of-time compile of one's own).
- :mod:`mpjax.inspection.matmul_gains`: ``matmul_gains``, which modules' GEMMs run faster in
  fp8 or a block format on a target by its roofline, and the rules that keep the others bf16.
- :mod:`mpjax.inspection.targets`: the chips a plan compiles for and their published figures
  (memory, bandwidth, peak matmul rates), and the GPU descriptions in ``gpu_targets/``.

A new plan target (another accelerator) goes in :mod:`mpjax.inspection.targets`, and what its
HLO needs read in :mod:`mpjax.inspection.plan_rows`.
"""
