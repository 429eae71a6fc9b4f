"""The optimizer side: optax transformations and the state they keep, independent of the
casting engine (it needs only JAX, optax and the policies).

- Loss scaling: :mod:`mpjax.optim.loss_scale` (``DynamicLossScale``, ``StaticLossScale``,
  ``NoOpLossScale``), :mod:`mpjax.optim.loss_scaling` (the ``loss_scaling`` transformation) and
  :mod:`mpjax.optim.loss_scaling_readers` (``scale_loss``, ``scaled_value_and_grad``,
  ``check_overflow``: what a training step reads of that state inside any optimizer state).
- Precision of what the optimizer keeps: :mod:`mpjax.optim.master_weights`
  (``master_weights``), :mod:`mpjax.optim.state_precision` (``state_precision``),
  :mod:`mpjax.optim.quantized_state` (``quantized_state``: 8-bit and 4-bit blockwise-quantized
  moments, on the formats, maps and layout of :mod:`mpjax.optim.quantization`),
  :mod:`mpjax.optim.low_precision_params` (``low_precision_params``), and
  :mod:`mpjax.optim.rounding` (``stochastic_round``).
- :mod:`mpjax.optim.memory`: ``memory_report``, the bytes each of those keeps per parameter.
- :mod:`mpjax.optim.gradient_checks`: what the wrappers check of what they receive.

A new optimizer-state format goes here, beside :mod:`mpjax.optim.state_precision` and
:mod:`mpjax.optim.quantized_state`.
"""
