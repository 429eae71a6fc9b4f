"""The casting engine and what it needs: how every mpjax integration makes a function run
under a policy.

- :mod:`mpjax.casting.engine`: traces a function to a jaxpr and evaluates it equation by
  equation, each cast by its op category and its precision region's policy
  (``run_in_regions``, ``Interpreter``); autocast, the linen, NNX and Equinox integrations, the
  reports and the precision doctor all run on it.
- :mod:`mpjax.casting.regions`: precision regions, the named scopes a module's call opens
  (``region``, ``full_precision``).
- :mod:`mpjax.casting.op_categories`: which dtype each JAX primitive runs in
  (``DEFAULT_OP_CATEGORIES``).
- :mod:`mpjax.casting.trace_context`: what a trace in progress decided, and what traced code may
  ask of it (``tracing``, ``traced_compute_dtype``, ``observing``).
- :mod:`mpjax.casting.fp8_sites`: the delayed fp8 scaling state a run threads through its
  matmuls.
- :mod:`mpjax.casting.custom_rules`: the user's custom derivative rules, traced for the engine
  to run.
- :mod:`mpjax.casting.collectives`: ``all_gather_params`` and ``psum_gradients``, the
  collectives of code that writes its own (``jax.shard_map``) in a policy's dtypes.
- :mod:`mpjax.casting.gradient_reduction`: the matmuls, bias adds and lookups the engine binds
  so that the gradients of what a policy casts down are computed in its reduce dtype.

It sits above the core vocabulary (:mod:`mpjax.policy`, :mod:`mpjax.rules`, :mod:`mpjax.fp8`,
:mod:`mpjax.jax_compat`) and below everything that casts.
"""
