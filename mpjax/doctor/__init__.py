"""The precision doctor: where a model's numbers leave a dtype's range under a policy, and
what to do about it.

- :mod:`mpjax.doctor.diagnosis`: ``diagnose`` and its ``Doctor``, which run a function side by
  side under a policy and in float32.
- :mod:`mpjax.doctor.side_by_side`: the jaxpr evaluated as it runs and exactly, measured per
  equation; :mod:`mpjax.doctor.range_stats`: the range statistics it measures.
- :mod:`mpjax.doctor.diagnosis_report`: ``DiagnosisReport``, its rows, table, JSON and plots;
  :mod:`mpjax.doctor.recommendations`: the modules to keep in float32, the loss-scale range and
  fp8 fitness it advises.
- :mod:`mpjax.doctor.layer_stack`: a model's stack of blocks, and the rules that keep the
  blocks at its ends out of a narrow format.
- :mod:`mpjax.doctor.monitor`: ``PrecisionMonitor``, the same ranges measured inside a jitted
  train step every N steps.
"""
