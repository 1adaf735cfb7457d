"""The memory plan: what a run needs, where each buffer lives, and the engine's options."""
from megatrain_jax.plan.options import EngineOptions  # noqa: F401
