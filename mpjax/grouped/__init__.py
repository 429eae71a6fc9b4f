"""Grouped GEMMs: the matmuls of a mixture of experts, each token against its own expert.

- :mod:`mpjax.grouped.kernels`: mpjax's own Mosaic GPU kernels, for the grouped GEMMs JAX has
  no kernel for (fp8 operands on Hopper).
- :mod:`mpjax.grouped.blackwell`: mpjax's Blackwell kernels, for the weight gradient (a
  contraction over each expert's tokens, which JAX ships no kernel for) and for fp8.
- :mod:`mpjax.grouped.matmul`: a ragged dot's three GEMMs kept grouped forward and backward,
  each lowered to the kernel chosen for the target GPU, or to XLA's ragged dot.
- :mod:`mpjax.grouped.fp8`: the same GEMMs in fp8, scaled per expert or per row.
- :mod:`mpjax.grouped.capacity`: the same GEMMs in a block format (MXFP8, NVFP4), as batched
  block-scaled GEMMs over each expert's first rows, the rows past its capacity dropped.

The casting engine binds a ragged dot through them under a policy; :func:`mpjax.ragged_dot`
(:mod:`mpjax.experts`) calls them directly.
"""
