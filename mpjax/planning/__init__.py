"""Plans of a compiled function: what a GPU or a TPU would run, compiled without one.

- :mod:`mpjax.planning.plan`: ``plan`` and ``Plan``, what a GPU (H100, A100, H200, B200, GB200,
  B300) or a TPU (v4, v5e, v5p, v6e, TPU7x, or a slice of them) would run: matmuls, fused
  attention, memory per device, collectives, and on a TPU XLA's estimated time.
- :mod:`mpjax.planning.rows`: the parts of a plan read from the optimized HLO (GEMMs,
  attention, scatters) and from XLA's memory analysis.
- :mod:`mpjax.planning.grouped`: the grouped GEMMs of a mixture of experts, as kernels or as
  the dense GEMMs XLA expanded them into (with the FLOPs they waste).
- :mod:`mpjax.planning.traffic`: the bytes a GPU step's fusions that are no matmul read and
  write (norms, casts, quantizations, the optimizer), and their time at the memory bandwidth.
- :mod:`mpjax.planning.hlo_text`: the text form of optimized HLO, parsed into computations and
  instructions.
- :mod:`mpjax.planning.collectives`: what a sharded step sends between devices, by kind, dtype,
  bytes and the module each collective serves.
- :mod:`mpjax.planning.loops`: XLA's estimate of a step that scans, with each loop's body
  counted its trip count times (from a compile of the step with its scans unrolled).
- :mod:`mpjax.planning.devices`: a target's compile-only devices, ``plan_unavailable`` (why
  there are none here, with what to install) and ``plan_mesh``.
- :mod:`mpjax.planning.arguments`: the arguments a plan compiles, kept on the target's
  compile-only devices with the shardings they were given (or refused, when they cannot be).
- :mod:`mpjax.planning.deviceless`: the compile-only devices of JAX's CUDA plugin and of
  libtpu, and the deviceless compile a plan reads, whatever the installed jaxlib's version.
- :mod:`mpjax.planning.compile_only`: ``compile_only``, tracing mpjax steps for devices this
  process lacks (an ahead-of-time compile of one's own).
- :mod:`mpjax.planning.matmul_gains`: ``matmul_gains``, which modules' GEMMs run faster in fp8
  or a block format on a target by its roofline, and the rules that keep the others bf16.
- :mod:`mpjax.planning.targets`: the chips a plan compiles for and their published figures
  (memory, bandwidth, peak matmul rates), and XLA's GPU descriptions in ``gpu_targets/``.

Imports flow one way: planning reads traced functions through :mod:`mpjax.inspection` (the
jaxpr's matmuls, the function checks), and nothing in :mod:`mpjax.inspection` imports from here.
A new plan target (another accelerator) goes in :mod:`mpjax.planning.targets`, and what its HLO
needs read in :mod:`mpjax.planning.rows`.
"""
