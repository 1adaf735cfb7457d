"""Built-in models: one module per decoder family (``llama``, ``qwen3``, ``phi3``, ``gemma``), found
through ``registry.py`` by ``ModelConfig.family``; the generic decoder in ``common.py`` stacks a
family's blocks. Each model exposes a full NNX module and ``streamed_parts`` for the engine."""
from megatrain_jax.models.common import (Decoder, abstract_model, init_host_store, init_model,
                                         streamed_parts)
from megatrain_jax.models.llama import Llama

__all__ = ["Decoder", "Llama", "abstract_model", "init_host_store", "init_model", "streamed_parts"]
