"""Host optimizers (fused numba kernels and any optax transformation on the CPU device), learning-rate
schedules and clipping, built from ``OptimConfig``.

Every host optimizer has an exactly equivalent optax transformation (``as_optax``); the reference
trainer uses ``build_reference_tx``, which adds the global-norm clipping that the streamed engine applies
through ``grad_scale`` (``global_norm_scale``). The builders are in ``build.py``.
"""
from __future__ import annotations

from megatrain_jax.optim.build import (build_host_optimizer, build_reference_tx, build_schedule,  # noqa: F401
                                       model_state_bytes, state_bytes, state_bytes_per_param)
from megatrain_jax.optim.fused_adamw import set_num_threads
from megatrain_jax.optim.host import CompactAdamW, FusedAdamW, HostOptimizer, alloc_aligned, global_norm_scale
from megatrain_jax.optim.optax_flat import OptaxHostOptimizer
from megatrain_jax.optim.named import SHAPE_AWARE, NamedOptaxOptimizer, named_tx, resolved, state_label  # noqa: F401

__all__ = ["CompactAdamW", "FusedAdamW", "HostOptimizer", "NamedOptaxOptimizer", "OptaxHostOptimizer",
           "alloc_aligned", "build_host_optimizer", "build_reference_tx", "build_schedule", "global_norm_scale",
           "model_state_bytes", "named_tx", "set_num_threads", "state_bytes", "state_bytes_per_param"]
