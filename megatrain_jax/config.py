"""Configuration as data: dataclasses, YAML loading, ``key=value`` overrides and validation.

One base YAML per run, overrides on the command line (MaxText style). Validation happens before
anything is allocated or written, and every failure is a ``UserError`` naming the field and the fix.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatrain_jax.errors import UserError


@dataclass
class ModelConfig:
    """A decoder of one of the registered families (``megatrain_jax/models/registry.py``): llama
    (Llama 2/3, Qwen2/2.5 with qkv_bias, Mistral), qwen3, phi3, gemma2, gemma3, and the
    mixture-of-experts mixtral, qwen3_moe."""

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: same as num_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 344
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3.1 frequency scaling: {rope_type: llama3, factor, low_freq_factor,
    #                                  high_freq_factor, original_max_position_embeddings}, or {rope_type: linear,
    #                                  factor} (Gemma 3's global layers); None: plain RoPE
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None  # causal sliding-window attention (Mistral): a token sees itself and the
    #                                   W - 1 before it, on the layers layer_types marks sliding (all, by default);
    #                                   None: full causal attention
    init_std: float = 0.02
    init: str = "normal"  # normal: nnx initialisers, equal to the in-memory model | fast: uniform with the same std,
    #                      drawn by a parallel host kernel (seconds for 7B instead of ~35 s; benchmarks, smoke runs)
    from_hf: str | None = None  # Hugging Face checkpoint directory to load instead of random init; its
    #                            config.json overrides the architecture fields above (see megatrain_jax/hf/)
    pad_token_id: int | None = None  # padding_idx as transformers': its looked-up rows get no gradient (from_hf: its)
    family: str = "llama"  # llama | qwen3 | phi3 | gemma2 | gemma3 | mixtral | qwen3_moe (models/registry.py); from_hf sets it
    layer_types: list | None = None  # per layer: sliding_attention | full_attention; None: the family's pattern
    #                                 (gemma2: every 2nd layer full, from layer 1; gemma3: every 6th; others: all
    #                                 sliding when sliding_window is set)
    attn_softcap: float | None = None  # attention logits c * tanh(s / c) (Gemma 2: 50); None: off
    final_softcap: float | None = None  # output logits c * tanh(z / c) (Gemma 2: 30); None: off
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) (Gemma); None: 1/sqrt(head_dim)
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3: 10000); None: rope_theta
    # ---- mixture of experts (families mixtral, qwen3_moe; models/moe.py); None/defaults for dense families
    num_experts: int | None = None  # experts per layer; None: a dense MLP
    experts_per_token: int | None = None  # top-k: experts each token is routed to
    moe_intermediate_size: int | None = None  # each expert's MLP width; None: intermediate_size
    norm_topk_prob: bool = True  # renormalise the k chosen router weights to sum to 1 (Mixtral: always)
    moe_impl: str = "dense"  # expert computation: dense (every expert on every token, weighted by the router; the
    #                         faster on CPU and H100 with JAX 0.11) | sorted (tokens sorted by expert, ragged_dot)
    router_aux_loss_coef: float = 0.0  # > 0: add coef x the router's load-balancing loss over the step's whole
    #                                   batch (transformers' load_balancing_loss_func; from_hf: config.json's
    #                                   router_aux_loss_coef when its output_router_logits is true); 0: off
    mlp_only_layers: list | None = None  # qwen3_moe: indices of dense-MLP layers (intermediate_size) between the
    #                                     sparse ones (transformers' mlp_only_layers / decoder_sparse_step); None: none
    seq_tile: int | str = "auto"  # tokens per sequence tile of a block's norms, projections and MLP (attention sees
    #                              the whole sequence), so its working set stops growing with the sequence: 0 untiled;
    #                              auto: the memory plan tiles where the untiled block would not fit the GPU

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def seq_tile_tokens(self) -> int:
        """The blocks' sequence tile in tokens (0: untiled; ``auto`` is untiled until the memory plan
        resolves it, ``plan.options.seq_tile``)."""
        t = self.seq_tile
        return t if isinstance(t, int) and not isinstance(t, bool) else 0

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def _family(self):
        from megatrain_jax.models.registry import get_family

        return get_family(self.family)

    def resolved_layer_types(self) -> list[str]:
        """Each layer's attention type: ``layer_types``, else the family's default pattern."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return self._family().layer_types(self)

    def layer_window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        return self.sliding_window if self.resolved_layer_types()[i] == "sliding_attention" else None

    @property
    def attention_scale(self) -> float | None:
        """The attention's score scale when it is not 1/sqrt(head_dim) (None otherwise)."""
        return None if self.query_pre_attn_scalar is None else float(self.query_pre_attn_scalar) ** -0.5

    def block_params(self) -> int:
        """Parameters of one transformer block (per family: norms, q/k norms, biases)."""
        return self._family().block_params(self)

    def non_embedding_params(self) -> int:
        """Parameters that the 6·N·T model-FLOPs convention counts (blocks and final norm)."""
        n = self.num_layers * self.block_params() + self.hidden_size
        if self.mlp_only_layers:  # MoE with dense layers: block_params() is a sparse block's
            from megatrain_jax.models.moe import dense_layer_saving

            n -= len(self.mlp_only_layers) * dense_layer_saving(self)
        return n

    def total_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        return self.non_embedding_params() + emb * (1 if self.tie_embeddings else 2)

    def active_non_embedding_params(self) -> int:
        """``non_embedding_params`` counting only the ``experts_per_token`` experts a token uses (MoE);
        the same as ``non_embedding_params`` for a dense model."""
        if not self.num_experts:
            return self.non_embedding_params()
        from megatrain_jax.models.moe import inactive_block_params

        sparse = self.num_layers - len(self.mlp_only_layers or ())
        return self.non_embedding_params() - sparse * inactive_block_params(self)

    def active_params(self) -> int:
        """``total_params`` counting only the experts a token uses (MoE; e.g. OLMoE-1B-7B: ~1.3B of ~6.9B)."""
        return self.total_params() - (self.non_embedding_params() - self.active_non_embedding_params())


@dataclass
class ScheduleConfig:
    kind: str = "constant"  # constant | cosine | warmup_cosine | linear
    warmup_steps: int = 0
    decay_steps: int = 0  # 0: train.steps
    end_lr_ratio: float = 0.1


# optim.name -> the optimizer-specific fields it uses, with the value each takes when left null. A field
# given for an optimizer that does not use it is refused (validate). lr, weight_decay, clip_norm and the
# schedule apply to every optimizer; kernel=fused and moments are AdamW's (optim/named.py builds them).
OPTIMIZER_FIELDS: dict[str, dict[str, Any]] = {
    "adamw": {"b1": 0.9, "b2": 0.95, "eps": 1e-8},
    "lion": {"b1": 0.9, "b2": 0.99},
    "adafactor": {"eps": 1e-30, "decay_rate": 0.8, "factored": True, "min_dim_size_to_factor": 128,
                  "multiply_by_parameter_scale": True, "momentum": None},
    "sgd": {"momentum": None, "nesterov": False},
    "muon": {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "eps": 1e-8, "b1": 0.9, "b2": 0.999},
    "optax": {"optax_name": None, "optax_kwargs": None},
}


@dataclass
class OptimConfig:
    """The optimizer. Fields left null take the named optimizer's value (``OPTIMIZER_FIELDS``)."""

    name: str = "adamw"  # adamw | lion | adafactor | sgd | muon | optax (any optax optimizer: optax_name)
    kernel: str = "fused"  # fused (numba AdamW, in place) | optax (any optax transformation on the CPU device)
    lr: float = 1e-3
    weight_decay: float = 0.0  # decoupled (adamw, lion, adafactor, muon: also its Adam part); sgd: added to the gradient
    clip_norm: float | None = 1.0  # global-norm clipping; None disables it
    moments: str = "float32"  # Adam moments on the host: float32 (exact optax) | bfloat16 | int8 (blockwise 8-bit)
    b1: float | None = None  # adamw 0.9 | lion 0.9 | muon (its Adam for non-matrix params) 0.9
    b2: float | None = None  # adamw 0.95 | lion 0.99 | muon (its Adam) 0.999
    eps: float | None = None  # adamw 1e-8 | adafactor 1e-30 | muon 1e-8
    momentum: float | None = None  # sgd: null (none) | muon: 0.95 (its beta) | adafactor: null (none)
    nesterov: bool | None = None  # sgd false | muon true
    ns_steps: int | None = None  # muon: Newton-Schulz iterations, 5
    factored: bool | None = None  # adafactor: factor the second moment of matrices, true
    decay_rate: float | None = None  # adafactor: second-moment decay exponent, 0.8
    min_dim_size_to_factor: int | None = None  # adafactor: factor only dimensions at least this large, 128
    multiply_by_parameter_scale: bool | None = None  # adafactor: lr relative to each parameter's RMS, true
    optax_name: str | None = None  # name=optax: an optax optimizer function, e.g. "adabelief" (learning_rate=lr)
    optax_kwargs: dict | None = None  # name=optax: its other keyword arguments, e.g. {b1: 0.9}
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class DataConfig:
    path: str = "data/tinyshakespeare.txt"  # a .txt file, or a prepared token file prefix
    tokenizer: str = "byte"  # byte | path to a tokenizer.json
    seq_len: int = 128
    seed: int = 0
    doc_masking: bool = False  # attention does not cross document boundaries in packed sequences


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16  # sequences per optimizer step
    micro_batches: int | str = 1  # micro-batches per step (layer-major accumulation), or "auto": the memory plan
    #                              picks the fewest that fit the GPU
    compute_dtype: str = "bfloat16"  # bfloat16 | float32
    seed: int = 0
    log_every: int = 10
    out_dir: str = "runs/default"
    engine: str = "streamed"  # streamed | reference (the plain in-memory trainer)
    loss_chunk: int = 1024  # tokens per cross-entropy chunk (logits never exist all at once)
    ckpt_every: int = 0  # 0: only at the end / on signal
    keep_last: int = 2
    keep_every: int = 0
    max_bad_steps: int = 5
    final_checkpoint: bool = True  # save a training checkpoint when the run ends (12 bytes/param on disk)
    export: str | None = None  # directory for a Hugging Face export at the end of training
    export_dtype: str = "bfloat16"
    # ---- memory (see memory.py: the plan decides what "auto" means, and refuses what cannot fit)
    host_memory_gb: float | None = None  # None: the machine's limit (cgroup memory.max, else MemTotal)
    gpu_memory_gb: float | None = None  # None: the whole device; a smaller budget shapes the plan to it
    stream_copy: str = "auto"  # host: a bf16 copy on the host streams (2 B/param); device: the fp32 master
    #                            streams and is cast on the GPU (no host copy, twice the PCIe bytes); auto: device
    #                            where the plan predicts the doubled transfer hides behind compute (or the copy
    #                            does not fit), else host
    grad_hold: str = "auto"  # where gradients wait for the clipping norm: auto | gpu_fp32 | gpu_bf16 | pinned_host
    activations: str = "auto"  # boundary activations: auto | device | pinned_host
    grad_slabs: int | str = "auto"  # pinned 128 MiB gradient slabs: auto (24 where the host has room, down to 6)
    #                                 | N. More slabs keep the host optimizer fed (speed), fewer save host memory
    devices: int | str = "all"  # GPUs of this host to use: all | N
    update_on: str = "auto"  # where the optimizer step runs: host (numba kernels, the gradient crosses PCIe) |
    #                          device (the master and state cross PCIe, the GPU updates each block as the next
    #                          forward fetches it; needs stream_copy=device, the fused kernel, one GPU) | auto
    #                          (the plan decides)
    keep_residuals: int | str = "auto"  # the last N blocks keep their forward's matmul outputs on the GPU, so
    #                                     the backward does not recompute them: auto (as many as the GPU room the
    #                                     plan leaves holds; one GPU) | N | 0
    trace_step: int = 0  # > 0: record that step's per-layer timeline (host->GPU, compute, GPU->host, host
    #                      optimizer) to out_dir/timeline_step<N>.{png,json} and log where compute waited


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------- loading


def _coerce(value: Any, typ: Any, name: str) -> Any:
    """Turn a YAML / command-line value into the dataclass field's type."""
    tname = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    optional = "None" in tname
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise UserError(name, "must not be empty", f"give a value of type {tname}")
    base = tname.replace("| None", "").replace("None |", "").strip()
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if base == "int":
            if isinstance(value, bool):
                raise ValueError
            f = float(value)
            if f != int(f):
                raise ValueError
            return int(f)
        if base == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base == "str":
            return str(value)
    except (TypeError, ValueError):
        article = "an" if base[:1] in "aeiou" else "a"
        raise UserError(name, f"{value!r} is not a valid {base}", f"give {article} {base}") from None
    return value


def _fill(cls: type, values: dict[str, Any], prefix: str) -> Any:
    if not isinstance(values, dict):
        raise UserError(prefix.rstrip("."), "must be a mapping", "write it as `key: value` lines")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in fields:
            close = ", ".join(sorted(fields))
            raise UserError(name, "unknown config key", f"use one of: {close}")
        f = fields[key]
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            kwargs[key] = _fill(f.default_factory, value or {}, name + ".")
        else:
            kwargs[key] = _coerce(value, f.type, name)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, raw: str) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise UserError(dotted, "is not a section", "override a leaf key such as train.steps=10")
    if raw == "":
        value = None
    else:
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw  # not YAML (e.g. "[1" or "a: b: c"): the literal text; _coerce checks its type
    node[keys[-1]] = value


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config, apply ``key=value`` overrides, validate, and return a ``Config``."""
    tree: dict[str, Any] = _read_tree(path, ()) if path is not None else {}
    for item in overrides:
        if "=" not in item:
            raise UserError(item, "override is not key=value", "write e.g. --set train.steps=10")
        key, raw = item.split("=", 1)
        if not all(k.strip() for k in key.split(".")):
            raise UserError(item, "override has an empty key", "write e.g. --set train.steps=10")
        _set_dotted(tree, key.strip(), raw.strip())
    cfg = _fill(Config, tree, "")
    validate(cfg)
    return cfg


def _read_tree(path: str, chain: tuple[str, ...], named_by: str | None = None) -> dict[str, Any]:
    """One config file as a dict, its ``base:`` (a path relative to it) merged underneath; ``chain``:
    the files that led here, so that a cycle of ``base:`` is one error, not a RecursionError."""
    if not os.path.isfile(path):
        where = f" (named by base: in {named_by})" if named_by else ""
        problem = "is a directory" if os.path.isdir(path) else "does not exist"
        raise UserError("CONFIG", f"file {path!r}{where} {problem}",
                        "fix that base: line" if named_by else "pass a YAML file such as configs/tiny.yaml")
    real = os.path.realpath(path)
    if real in chain:
        raise UserError("CONFIG", f"base: in {named_by} names {path}, which is already in the chain of bases "
                        f"({' -> '.join(chain + (real,))})", "remove the cycle of base: files")
    try:
        with open(path) as f:
            tree = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        what = getattr(e, "problem", None) or e.__class__.__name__
        raise UserError("CONFIG", f"{where}: not valid YAML ({what})", "fix the YAML syntax there") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError("CONFIG", f"{path} cannot be read ({e.__class__.__name__})", "pass a readable YAML text file") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise UserError("CONFIG", f"{path} holds a YAML {type(tree).__name__} at the top level, not a mapping",
                        "write it as sections of `key: value` lines (model:, optim:, data:, train:)")
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str) or not base.strip():
        raise UserError("base", f"in {path} must be one file name, got {base!r}",
                        "write e.g. `base: tiny.yaml` (one YAML file, relative to this one)")
    parent = os.path.join(os.path.dirname(path), base)
    merged = _fill(Config, _read_tree(parent, chain + (real,), path), "")
    validate(merged)
    out = merged.to_dict()
    _deep_update(out, tree)
    return out


def _deep_update(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = v


def validate(cfg: Config) -> None:
    """Check cross-field constraints; raise ``UserError`` naming the field and the fix."""
    m, t, o, d = cfg.model, cfg.train, cfg.optim, cfg.data
    for name, v in [("model.vocab_size", m.vocab_size), ("model.hidden_size", m.hidden_size),
                    ("model.num_layers", m.num_layers), ("model.num_heads", m.num_heads),
                    ("model.intermediate_size", m.intermediate_size), ("train.steps", t.steps),
                    ("train.batch_size", t.batch_size),
                    ("data.seq_len", d.seq_len), ("train.loss_chunk", t.loss_chunk)]:
        if v <= 0:
            raise UserError(name, f"must be positive, got {v}", "set it to a positive integer")
    if m.head_dim is None and m.hidden_size % m.num_heads:
        raise UserError("model.num_heads", f"{m.num_heads} heads do not divide hidden_size {m.hidden_size}",
                        "choose num_heads that divides model.hidden_size (or set model.head_dim)")
    if m.head_dim is not None and m.head_dim <= 0:  # 0 would silently mean hidden_size // num_heads
        raise UserError("model.head_dim", f"must be positive, got {m.head_dim}",
                        "set a positive even head dimension, or null for hidden_size // num_heads")
    if m.num_kv_heads is not None and m.num_kv_heads <= 0:  # 0 would silently mean "no GQA" (kv_heads uses `or`)
        raise UserError("model.num_kv_heads", f"must be positive, got {m.num_kv_heads}",
                        "choose num_kv_heads that divides model.num_heads (or null for num_kv_heads = num_heads)")
    if m.sliding_window is not None and m.sliding_window <= 0:
        raise UserError("model.sliding_window", f"must be positive, got {m.sliding_window}",
                        "set the number of tokens a token attends to (itself included), or null for full attention")
    if m.num_heads % m.kv_heads:
        raise UserError("model.num_kv_heads", f"{m.kv_heads} kv heads do not divide num_heads {m.num_heads}",
                        "choose num_kv_heads that divides model.num_heads")
    if m.dim_per_head % 2:
        raise UserError("model.head_dim", f"head dim {m.dim_per_head} is odd", "RoPE needs an even head dimension")
    if m.rope_scaling is not None and (not isinstance(m.rope_scaling, dict)
                                       or m.rope_scaling.get("rope_type", m.rope_scaling.get("type")) not in ("llama3", "linear")):
        raise UserError("model.rope_scaling", f"{m.rope_scaling!r} is not supported",
                        "use null, {rope_type: linear, factor} or {rope_type: llama3, factor, low_freq_factor, "
                        "high_freq_factor, original_max_position_embeddings}")
    validate_model(m)
    if t.micro_batches != "auto" and (isinstance(t.micro_batches, bool) or not isinstance(t.micro_batches, int)
                                      or t.micro_batches <= 0):
        raise UserError("train.micro_batches", f"must be a positive integer or auto, got {t.micro_batches!r}",
                        "set it to a positive integer that divides train.batch_size, or auto")
    if t.grad_slabs != "auto" and (isinstance(t.grad_slabs, bool) or not isinstance(t.grad_slabs, int)
                                   or t.grad_slabs < 2):
        raise UserError("train.grad_slabs", f"must be auto or an integer >= 2, got {t.grad_slabs!r}",
                        "set train.grad_slabs=auto (or e.g. 6 to save host memory, 24 for speed)")
    if t.keep_residuals != "auto" and (isinstance(t.keep_residuals, bool) or not isinstance(t.keep_residuals, int)
                                       or t.keep_residuals < 0):
        raise UserError("train.keep_residuals", f"must be auto or an integer >= 0, got {t.keep_residuals!r}",
                        "set train.keep_residuals=auto (or a number of blocks, 0 to recompute every block)")
    if t.devices != "all" and (isinstance(t.devices, bool) or not isinstance(t.devices, int) or t.devices <= 0):
        raise UserError("train.devices", f"must be a positive integer or all, got {t.devices!r}",
                        "set train.devices=all or a number of GPUs")
    for name, value, allowed in [("optim.moments", o.moments, ("float32", "bfloat16", "int8")),
                                 ("model.init", m.init, ("normal", "fast")),
                                 ("train.stream_copy", t.stream_copy, ("auto", "host", "device")),
                                 ("train.grad_hold", t.grad_hold, ("auto", "gpu_fp32", "gpu_bf16", "pinned_host")),
                                 ("train.activations", t.activations, ("auto", "device", "pinned_host")),
                                 ("train.update_on", t.update_on, ("auto", "host", "device"))]:
        if value not in allowed:
            raise UserError(name, f"{value!r} is not supported", f"use one of: {', '.join(allowed)}")
    for name, value in [("train.host_memory_gb", t.host_memory_gb), ("train.gpu_memory_gb", t.gpu_memory_gb)]:
        if value is not None and not value > 0:
            raise UserError(name, f"must be positive, got {value}", f"set {name} to a size in GB, or null for the machine's")
    if t.micro_batches != "auto" and t.batch_size % t.micro_batches:
        raise UserError("train.micro_batches", f"batch_size {t.batch_size} does not divide into {t.micro_batches} micro-batches",
                        "make train.batch_size a multiple of train.micro_batches")
    if t.compute_dtype not in ("bfloat16", "float32"):
        raise UserError("train.compute_dtype", f"{t.compute_dtype!r} is not supported", "use bfloat16 or float32")
    if t.engine not in ("streamed", "reference"):
        raise UserError("train.engine", f"{t.engine!r} is not an engine", "use streamed or reference")
    for name, value in (("train.trace_step", t.trace_step), ("train.export", t.export)):
        if t.engine == "reference" and value:  # the reference keeps no host store and no per-layer timeline
            raise UserError(name, "is not available with train.engine=reference",
                            f"set train.engine=streamed, or remove {name}")
    if o.kernel not in ("fused", "optax"):
        raise UserError("optim.kernel", f"{o.kernel!r} is not a kernel", "use fused or optax")
    if o.name not in OPTIMIZER_FIELDS:
        raise UserError("optim.name", f"{o.name!r} is not an optimizer",
                        "use adamw, lion, adafactor, sgd, muon or optax (with optim.optax_name)")
    if t.update_on == "device" and o.kernel != "fused":
        raise UserError("train.update_on", "device needs the fused AdamW kernel", "set optim.kernel=fused or train.update_on=host")
    if t.update_on == "device" and t.stream_copy == "host" and t.compute_dtype == "bfloat16":
        raise UserError("train.update_on", "device updates the fp32 master on the GPU, so no host bf16 copy can stream",
                        "set train.stream_copy=device (or auto), or train.update_on=host")
    if o.kernel == "fused" and o.name != "adamw":
        raise UserError("optim.kernel", f"the fused kernel implements adamw only, not {o.name}", "set optim.kernel=optax")
    _validate_optimizer(o)
    def _num(name, v, ok, rule):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v)):
            raise UserError(name, f"must be {rule}, got {v!r}", f"set {name} to a finite number {rule}")

    for name, v, ok, rule in [
        ("optim.lr", o.lr, lambda x: x > 0, "> 0"), ("optim.b1", o.b1, lambda x: 0 <= x < 1, "in [0, 1)"),
        ("optim.b2", o.b2, lambda x: 0 <= x < 1, "in [0, 1)"), ("optim.eps", o.eps, lambda x: x > 0, "> 0"),
        ("optim.weight_decay", o.weight_decay, lambda x: x >= 0, ">= 0"),
        ("optim.clip_norm", o.clip_norm, lambda x: x > 0, "> 0 (or null)"),
        ("optim.schedule.warmup_steps", o.schedule.warmup_steps, lambda x: x >= 0, ">= 0"),
        ("optim.schedule.decay_steps", o.schedule.decay_steps, lambda x: x >= 0, ">= 0"),
        ("optim.schedule.end_lr_ratio", o.schedule.end_lr_ratio, lambda x: 0 <= x <= 1, "in [0, 1]"),
        ("model.init_std", m.init_std, lambda x: x > 0, "> 0"), ("model.rope_theta", m.rope_theta, lambda x: x > 0, "> 0"),
        ("model.rms_norm_eps", m.rms_norm_eps, lambda x: x > 0, "> 0"),
        ("train.log_every", t.log_every, lambda x: x >= 1, ">= 1"),
        ("train.ckpt_every", t.ckpt_every, lambda x: x >= 0, ">= 0 (0: only at the end)"),
        ("train.keep_last", t.keep_last, lambda x: x >= 0, ">= 0 (0: keep all)"),
        ("train.keep_every", t.keep_every, lambda x: x >= 0, ">= 0 (0: none extra)"),
        ("train.trace_step", t.trace_step, lambda x: x >= 0, ">= 0 (0: no timeline)"),
        ("train.max_bad_steps", t.max_bad_steps, lambda x: x >= 1, ">= 1"),
        ("train.host_memory_gb", t.host_memory_gb, lambda x: x > 0, "> 0 (or null)"),
        ("train.gpu_memory_gb", t.gpu_memory_gb, lambda x: x > 0, "> 0 (or null)"),
    ]:
        _num(name, v, ok, rule)
    if m.rope_scaling is not None and m.rope_scaling.get("rope_type", m.rope_scaling.get("type")) == "linear":
        _num("model.rope_scaling.factor", m.rope_scaling.get("factor", "missing"), lambda x: x > 0, "> 0")
    elif m.rope_scaling is not None:  # llama3 frequency scaling (models/common.py divides by factor and by high - low)
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            _num(f"model.rope_scaling.{key}", m.rope_scaling.get(key, "missing"), lambda x: x > 0, "> 0")
        if not m.rope_scaling["high_freq_factor"] > m.rope_scaling["low_freq_factor"]:
            raise UserError("model.rope_scaling.high_freq_factor",
                            f"must be > low_freq_factor {m.rope_scaling['low_freq_factor']}, "
                            f"got {m.rope_scaling['high_freq_factor']}", "use e.g. low_freq_factor: 1, high_freq_factor: 4")
    if t.export_dtype not in ("bfloat16", "float32", "float16"):  # checked here, not after the whole run
        raise UserError("train.export_dtype", f"{t.export_dtype!r} is not an export dtype", "use bfloat16 or float32")
    if o.schedule.kind not in ("constant", "cosine", "warmup_cosine", "linear"):
        raise UserError("optim.schedule.kind", f"{o.schedule.kind!r} is not a schedule",
                        "use constant, cosine, warmup_cosine or linear")
    decay = o.schedule.decay_steps or t.steps
    if o.schedule.kind != "constant" and o.schedule.warmup_steps >= decay:  # as optim.build_schedule refuses it
        within = "optim.schedule.decay_steps" if o.schedule.decay_steps else "train.steps"
        raise UserError("optim.schedule.warmup_steps",
                        f"warmup ({o.schedule.warmup_steps} steps) leaves no room for the {o.schedule.kind} decay "
                        f"within {within}={decay}",
                        f"set optim.schedule.warmup_steps below {decay} (e.g. --set optim.schedule.warmup_steps="
                        f"{max(0, decay // 10)}), or raise {within}")
    if m.from_hf is None and d.tokenizer == "byte" and m.vocab_size < 256:
        raise UserError("model.vocab_size", f"{m.vocab_size} is smaller than the byte tokenizer's 256 ids",
                        "set model.vocab_size >= 256")


def _validate_optimizer(o: OptimConfig) -> None:
    """The named optimizer's own fields: each used by ``optim.name`` (else refused), each in range."""
    used = OPTIMIZER_FIELDS[o.name]
    for f in sorted({k for fields in OPTIMIZER_FIELDS.values() for k in fields}):
        if getattr(o, f) is not None and f not in used:
            users = [n for n, fields in OPTIMIZER_FIELDS.items() if f in fields]
            raise UserError(f"optim.{f}", f"optim.name={o.name} does not use it",
                            f"remove optim.{f} (or set it to null); it is for optim.name={' / '.join(users)}")
    if o.moments != "float32" and o.kernel != "fused":
        raise UserError("optim.moments", f"{o.moments} moments are implemented by the fused AdamW kernel only",
                        "set optim.moments=float32, or optim.name=adamw with optim.kernel=fused")
    unit = lambda x: 0 <= x < 1  # noqa: E731
    for f, ok, rule in [("b1", unit, "in [0, 1)"), ("b2", unit, "in [0, 1)"), ("eps", lambda x: x > 0, "> 0"),
                        ("momentum", unit, "in [0, 1)"), ("decay_rate", lambda x: 0 < x <= 1, "in (0, 1]")]:
        v = getattr(o, f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or not ok(v)):
            raise UserError(f"optim.{f}", f"must be {rule}, got {v!r}", f"set optim.{f} to a number {rule}, or null")
    for f in ("ns_steps", "min_dim_size_to_factor"):
        v = getattr(o, f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise UserError(f"optim.{f}", f"must be an integer >= 1, got {v!r}", f"set optim.{f} >= 1, or null")
    for f in ("nesterov", "factored", "multiply_by_parameter_scale"):
        v = getattr(o, f)
        if v is not None and not isinstance(v, bool):
            raise UserError(f"optim.{f}", f"must be true or false, got {v!r}", f"set optim.{f} to true or false")
    if o.name == "sgd" and o.nesterov and o.momentum is None:
        raise UserError("optim.nesterov", "Nesterov needs momentum", "set optim.momentum (e.g. 0.9) or remove optim.nesterov")
    if o.name == "optax":
        from megatrain_jax.optim.named import check_optax  # imports optax: only for name=optax

        check_optax(o)


def validate_model(m: ModelConfig) -> None:
    """The family and its feature fields (also called on configs read from checkpoints)."""
    from megatrain_jax.models.registry import get_family

    fam = get_family(m.family)  # UserError naming model.family and the families
    for name, v in [("model.attn_softcap", m.attn_softcap), ("model.final_softcap", m.final_softcap),
                    ("model.query_pre_attn_scalar", m.query_pre_attn_scalar),
                    ("model.rope_local_theta", m.rope_local_theta)]:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            raise UserError(name, f"must be a positive number or null, got {v!r}", f"set {name} > 0, or null to turn it off")
    if (pad := m.pad_token_id) is not None and (isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < m.vocab_size):
        raise UserError("model.pad_token_id", f"must be a token id in [0, {m.vocab_size}) or null, got {pad!r}",
                        "set it to the tokenizer's pad id, or null (no padding row)")
    if m.layer_types is not None:
        types = m.layer_types
        if (not isinstance(types, (list, tuple)) or len(types) != m.num_layers
                or any(t not in ("sliding_attention", "full_attention") for t in types)):
            raise UserError("model.layer_types", f"must list num_layers={m.num_layers} entries of sliding_attention or "
                            f"full_attention, got {types!r}", "fix the list, or null for the family's pattern")
        if m.sliding_window is None and "sliding_attention" in types:
            raise UserError("model.layer_types", "names sliding_attention layers but model.sliding_window is null",
                            "set model.sliding_window")
    t = m.seq_tile
    if t != "auto" and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
        raise UserError("model.seq_tile", f"must be auto or an integer >= 0, got {t!r}",
                        "set model.seq_tile=auto (or 0 for untiled blocks, or tokens per tile, e.g. 8192)")
    if isinstance(t, int) and t > 0 and not getattr(fam.block, "SEQ_TILING", False):
        raise UserError("model.seq_tile", f"the {m.family} family's blocks do not run over sequence tiles",
                        "set model.seq_tile=auto or 0 (tiling: llama, qwen3 and phi3 families)")
    _validate_moe(m, fam)
    if fam.validate is not None:
        fam.validate(m)


def _validate_moe(m: ModelConfig, fam) -> None:
    """The mixture-of-experts fields: only on MoE families, sizes positive, top-k <= experts."""
    from megatrain_jax.models.moe import MOE_IMPLS

    moe = bool(fam.extra.get("moe"))
    for name in ("num_experts", "experts_per_token", "moe_intermediate_size"):
        v = getattr(m, name)
        if v is None:
            continue
        if not moe:
            raise UserError(f"model.{name}", f"the {m.family} family is dense (no experts)",
                            "set it to null, or use model.family mixtral / qwen3_moe")
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise UserError(f"model.{name}", f"must be a positive integer, got {v!r}", f"set model.{name} > 0")
    if m.num_experts is not None and m.experts_per_token is not None and m.experts_per_token > m.num_experts:
        raise UserError("model.experts_per_token", f"{m.experts_per_token} is more than num_experts={m.num_experts}",
                        "route each token to at most num_experts experts")
    if m.moe_impl not in MOE_IMPLS:
        raise UserError("model.moe_impl", f"{m.moe_impl!r} is not supported", f"use one of: {', '.join(MOE_IMPLS)}")
    c = m.router_aux_loss_coef
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
        raise UserError("model.router_aux_loss_coef", f"must be a number >= 0, got {c!r}",
                        "set it to 0 (off) or a small positive weight (transformers: 0.001; Mixtral checkpoints: 0.02)")
    for name, v in (("router_aux_loss_coef", c), ("mlp_only_layers", m.mlp_only_layers)):
        if v and not moe:
            raise UserError(f"model.{name}", f"the {m.family} family is dense (no experts)",
                            f"remove model.{name}, or use model.family mixtral / qwen3_moe")
