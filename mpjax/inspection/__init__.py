"""Seeing what runs in which dtype: reports of a traced function and plans of a compiled one.

- :mod:`mpjax.inspection.describe`: ``describe``, the one report entry point (the integrations
  register what they describe).
- :mod:`mpjax.inspection.report`: ``PrecisionReport``, what rules resolved to module by module,
  with each module's matmul dtypes.
- :mod:`mpjax.inspection.matmuls`: ``inspect_matmuls`` (the jaxpr's matmuls), ``hlo_dots`` and
  ``hlo_op_counts`` (the compiled HLO's).
- :mod:`mpjax.inspection.gpu_plan`: ``gpu_plan``, what an H100 (A100, H200) would run, compiled
  without one from the target descriptions in ``gpu_targets/``; it reads HLO text with
  :mod:`mpjax.inspection.hlo_text`.

A new plan target (another accelerator) goes here, beside :mod:`mpjax.inspection.gpu_plan`.
"""
