"""megatrain-jax: full-precision LLM training on one GPU with host-resident weights and optimizer state."""
__version__ = "0.1.0"


def __getattr__(name: str):
    """``megatrain_jax.stream(model)`` without importing the subpackage first (it imports JAX, so the
    package does not import it eagerly: the CLI reports config errors before JAX starts)."""
    if name == "stream":
        import importlib

        return importlib.import_module("megatrain_jax.stream")
    raise AttributeError(f"module 'megatrain_jax' has no attribute {name!r}")
