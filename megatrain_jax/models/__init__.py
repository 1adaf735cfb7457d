"""Built-in models. Each exposes a full NNX module and ``streamed_parts`` for the engine."""
from megatrain_jax.models.llama import Llama, init_model, streamed_parts

__all__ = ["Llama", "init_model", "streamed_parts"]
