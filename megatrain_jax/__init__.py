"""megatrain-jax: full-precision LLM training on one GPU with host-resident weights and optimizer state."""
__version__ = "0.1.0"
