"""Models built from Flax's stock layers, shared by the tests that compare mpjax with them."""

import flax.linen as nn
import jax.numpy as jnp


class Block(nn.Module):
    """A pre-norm transformer block from Flax's stock layers (width 16). ``dtype=None``
    everywhere unless a hand-written bf16 version is asked for."""

    dtype: object = None
    attention_fn: object = nn.dot_product_attention

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=2, dtype=self.dtype, attention_fn=self.attention_fn, name="attn"
        )(y)
        x = x + y
        y = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        y = nn.Dense(32, dtype=self.dtype, name="up")(y)
        y = nn.Dense(16, dtype=self.dtype, name="down")(nn.gelu(y))
        return x + y


class HandWrittenBlock(Block):
    """What users write today: every layer with ``dtype=bf16`` (pass ``dtype=jnp.bfloat16``) and
    the input cast by hand."""

    def __call__(self, x):
        return super().__call__(x.astype(jnp.bfloat16))
