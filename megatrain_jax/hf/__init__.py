"""Hugging Face import and export, the native ``mt`` format, and the ``convert`` / ``export`` commands.

Modules: ``safetensors_io`` (files read and written tensor by tensor), ``config`` (``config.json``
<-> ``ModelConfig`` through the family registry, and the pieces of it every family shares), ``names``
(tensor names by the module tree; a family's own map is in its file under ``megatrain_jax/models/``),
``importer`` (checkpoint -> host store), ``exporter`` (host
store -> ``transformers`` directory), ``merge`` (a LoRA run's base with its adapter merged in: ``export
--merge-lora``), ``mt`` (the per-group format), ``commands`` (the CLI), ``hub``
(``model.from_hf: ORG/NAME[@REVISION]`` through ``huggingface_hub``: its cache, token and offline setting).
Supported architectures and what each family maps: docs/families.md.

``model.from_hf`` wins over the YAML for the architecture fields (sizes, heads, RoPE, norms, tied
embeddings, biases): they are overwritten in place on the ``ModelConfig`` from ``config.json``, with
a warning for every value the user set explicitly that disagrees.
"""
from typing import Iterable

from megatrain_jax.atomic import check_output, check_place, check_train_export
from megatrain_jax.hf.commands import convert_main, export_checkpoint, export_main
from megatrain_jax.hf.config import (STRUCTURAL, HFWarning, hf_config_to_model_config, read_hf_config,
                                     resolve_hf_model_config, supported)
from megatrain_jax.hf.exporter import SHARD_BYTES, export_hf
from megatrain_jax.hf.importer import INDEX, index_checkpoint, load_hf_into_store, model_from_store
from megatrain_jax.hf.mt import MT_CONFIG, MT_HF_CONFIG, hf_to_mt, load_mt, mt_to_hf, read_mt_config, save_mt
from megatrain_jax.hf.names import hf_name, hf_tensors, model_layouts
from megatrain_jax.hf.safetensors_io import SafetensorsWriter, TensorInfo, copy_cast, read_safetensors_header, \
    read_tensor


def check_export_dir(path: str, out_dir: str | None = None, inputs: Iterable[str | None] = ()) -> None:
    """``train.export``'s directory, checked before training (``atomic.check_train_export``): what
    ``export_hf(..., overwrite=True, own_run=out_dir)`` at the end of the run will accept, and never
    the run's own ``out_dir`` or a directory holding it."""
    check_train_export(path, out_dir, inputs)


__all__ = ["HFWarning", "INDEX", "MT_CONFIG", "MT_HF_CONFIG", "SHARD_BYTES", "STRUCTURAL", "SafetensorsWriter",
           "TensorInfo", "check_export_dir", "check_output", "check_place", "convert_main", "copy_cast", "export_checkpoint",
           "export_hf", "export_main", "hf_config_to_model_config", "hf_name", "hf_tensors", "hf_to_mt",
           "index_checkpoint", "load_hf_into_store", "load_mt", "model_from_store", "model_layouts", "mt_to_hf",
           "read_hf_config", "read_mt_config", "read_safetensors_header", "read_tensor", "resolve_hf_model_config",
           "save_mt", "supported"]
