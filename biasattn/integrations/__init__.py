"""Where biasattn plugs into other code.

- :mod:`biasattn.integrations.transformers`: ``attn_implementation="biasattn"`` for Hugging Face models
  (``register()``; needs the ``hf`` extra).
- :mod:`biasattn.integrations.fx`: ``fuse_attention(module)`` rewrites naive
  ``softmax(q @ kᵀ * scale + mask) @ v`` in an FX graph into :func:`biasattn.attention`.

The submodules are imported on use, so ``import biasattn`` does not import transformers.
"""
