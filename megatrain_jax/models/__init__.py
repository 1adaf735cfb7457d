"""Built-in models: one file per decoder family (``llama``, ``qwen3``, ``phi3``, ``gemma2``, ``gemma3``,
``mixtral``, ``qwen3_moe``), each registering its ``Family`` object (``megatrain_jax/families.py``) that
``ModelConfig.family`` names; the generic decoder in ``common.py`` stacks a family's blocks, ``moe.py``
holds the mixture-of-experts layer two families share. Each model exposes a full NNX module and
``streamed_parts`` for the engine. This package imports no family (the registry loads them)."""
from megatrain_jax.models.common import (Decoder, abstract_model, init_host_store, init_model,
                                         streamed_parts)

Llama = Decoder  # the whole model of any family (the name predates the other families)

__all__ = ["Decoder", "Llama", "abstract_model", "init_host_store", "init_model", "streamed_parts"]
