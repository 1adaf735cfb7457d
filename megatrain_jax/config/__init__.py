"""Configuration as data: dataclasses (``schema``), YAML loading and ``key=value`` overrides (``load``),
and validation (``validate``). One base YAML per run, overrides on the command line (MaxText style);
validation happens before anything is allocated or written, and every failure is a ``UserError``
naming the field and the fix.
"""
from megatrain_jax.config.load import load_config  # noqa: F401
from megatrain_jax.config.schema import (OPTIMIZER_FIELDS, Config, DataConfig, ModelConfig,  # noqa: F401
                                         OptimConfig, ScheduleConfig, TrainConfig)
from megatrain_jax.config.validate import validate, validate_model  # noqa: F401
