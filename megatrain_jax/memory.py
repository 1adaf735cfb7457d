"""Moved to ``megatrain_jax.plan`` (machine, sizes, decisions, build, refusal, report): these names
are re-exported for callers not yet updated. New code imports from ``megatrain_jax.plan``."""
from megatrain_jax.plan import apply_gpu_settings  # noqa: F401
from megatrain_jax.plan.build import Plan, make_plan  # noqa: F401
from megatrain_jax.plan.decisions import MODES  # noqa: F401
from megatrain_jax.plan.machine import (Machine, _jax_backend_ready, detect_machine, host_limit,  # noqa: F401
                                        memory_snapshot, target_machine)
from megatrain_jax.plan.report import plan_json, plan_table, scaling_rows, scaling_table  # noqa: F401
from megatrain_jax.plan.sizes import (GB, GPU_MARGIN, HOST_MARGIN, PREALLOCATE_ABOVE, RATES, XLA_FRACTION,  # noqa: F401
                                      GiB, Row, residual_bytes_per_block)
from megatrain_jax.plan.sizes import Shapes as _Shapes  # noqa: F401
