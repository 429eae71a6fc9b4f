"""Reports of a traced function: what ran in which dtype, read from its jaxpr.

- :mod:`mpjax.inspection.describe`: ``describe``, the one report entry point (the integrations
  register what they describe).
- :mod:`mpjax.inspection.report`: ``PrecisionReport``, what rules resolved to module by module,
  with each module's matmul dtypes.
- :mod:`mpjax.inspection.matmuls`: ``inspect_matmuls`` (the jaxpr's matmuls, forward and
  backward), ``hlo_dots`` and ``hlo_op_counts`` (the matmuls of a function compiled here).

What a compiled function would run on a target this machine lacks (an H100, a TPU pod) is
:mod:`mpjax.planning`, which reads from here (the jaxpr's matmuls, the function checks); nothing
here imports from it.
"""
