"""Hugging Face import and export, the native ``mt`` format, and the ``convert`` / ``export`` commands.

Modules: ``safetensors_io`` (files read and written tensor by tensor), ``config`` (``config.json``
<-> ``ModelConfig`` through the family registry), ``names`` (tensor names; each family's map lives
beside it in ``megatrain_jax/models/``), ``importer`` (checkpoint -> host store), ``exporter`` (host
store -> ``transformers`` directory), ``mt`` (the per-group format), ``commands`` (the CLI).
Supported architectures and what each family maps: docs/families.md.

``model.from_hf`` wins over the YAML for the architecture fields (sizes, heads, RoPE, norms, tied
embeddings, biases): they are overwritten in place on the ``ModelConfig`` from ``config.json``, with
a warning for every value the user set explicitly that disagrees.
"""
from megatrain_jax.atomic import check_output
from megatrain_jax.hf.commands import convert_main, export_checkpoint, export_main
from megatrain_jax.hf.config import (STRUCTURAL, hf_config_to_model_config, read_hf_config, resolve_hf_model_config,
                                     supported)
from megatrain_jax.hf.exporter import SHARD_BYTES, export_hf
from megatrain_jax.hf.importer import INDEX, index_checkpoint, load_hf_into_store, model_from_store
from megatrain_jax.hf.mt import MT_CONFIG, MT_HF_CONFIG, hf_to_mt, load_mt, mt_to_hf, read_mt_config, save_mt
from megatrain_jax.hf.names import hf_name, hf_tensors, model_layouts
from megatrain_jax.hf.safetensors_io import SafetensorsWriter, TensorInfo, copy_cast, read_safetensors_header, \
    read_tensor
from megatrain_jax.models.hfnames import HFWarning


def check_export_dir(path: str, out_dir: str | None = None) -> None:
    """``train.export``'s directory, checked before training: what ``export_hf(..., overwrite=True)``
    at the end of the run will accept, and never the run's own ``out_dir`` or a directory holding it."""
    if out_dir is not None:
        import os

        real, run = os.path.realpath(path), os.path.realpath(out_dir)
        if real == run or run.startswith(real.rstrip(os.sep) + os.sep):
            from megatrain_jax.errors import UserError

            raise UserError("train.export", f"{path} is or contains train.out_dir ({out_dir}); the export would "
                            "replace the run", "export to a directory of its own, e.g. <out_dir>/export")
    check_output(path, "hf", overwrite=True, field="train.export")


__all__ = ["HFWarning", "INDEX", "MT_CONFIG", "MT_HF_CONFIG", "SHARD_BYTES", "STRUCTURAL", "SafetensorsWriter",
           "TensorInfo", "check_export_dir", "check_output", "convert_main", "copy_cast", "export_checkpoint",
           "export_hf", "export_main", "hf_config_to_model_config", "hf_name", "hf_tensors", "hf_to_mt",
           "index_checkpoint", "load_hf_into_store", "load_mt", "model_from_store", "model_layouts", "mt_to_hf",
           "read_hf_config", "read_mt_config", "read_safetensors_header", "read_tensor", "resolve_hf_model_config",
           "save_mt", "supported"]
