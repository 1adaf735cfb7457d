"""Validation before anything is allocated or written: every failure is a ``UserError`` naming the field
and the fix."""
from __future__ import annotations

import dataclasses
import inspect
import math

from megatrain_jax.config.eval_fields import check_eval_fields
from megatrain_jax.config.lora import check_lora_model, check_lora_run
from megatrain_jax.config.schema import (GRAD_HOLDS, OPTIMIZER_FIELDS, Config, DataConfig, ModelConfig, OptimConfig,
                                         TrainConfig)
from megatrain_jax.config.objective import check_objective
from megatrain_jax.errors import UserError
from megatrain_jax.families import families, get_family

FAMILY_FIELDS = ("n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "router_bias_update_rate",
                 "partial_rotary_factor", "qk_norm", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
MOE_IMPLS = ("auto", "sorted", "dense")  # model.moe_impl: models/grouped_experts.py's expert computations
OPTAX_FIX = "name an optax optimizer function, e.g. lion, adafactor, adabelief"  # the fix of every optim.optax_name error; public: optim/named.py refuses with it too


def validate(cfg: Config) -> None:
    """Check cross-field constraints; raise ``UserError`` naming the field and the fix. The checks run in
    this order (the first failing one is reported)."""
    m, t, o, d = cfg.model, cfg.train, cfg.optim, cfg.data
    _validate_shape(m, t, d)
    validate_model(m)
    _validate_train_counts(t)
    _validate_choices(m, t, o)
    _validate_engine(cfg)
    _validate_optim_choices(o, t)
    _validate_numbers(m, t, o)
    _validate_schedule_and_data(cfg)
    check_eval_fields(cfg)


def _validate_shape(m: ModelConfig, t: TrainConfig, d: DataConfig) -> None:
    """The model's and the batch's sizes are positive; the heads divide the hidden size and each other
    (an even head dimension, for RoPE); the sliding window is positive; rope_scaling is a known kind."""
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
    kinds = ("llama3", "linear") + tuple(get_family(m.family).extra.get("rope_scalings", ()))  # yarn: deepseek_v3
    if m.rope_scaling is not None and (not isinstance(m.rope_scaling, dict)
                                       or m.rope_scaling.get("rope_type", m.rope_scaling.get("type")) not in kinds):
        raise UserError("model.rope_scaling", f"{m.rope_scaling!r} is not supported",
                        "use null, {rope_type: linear, factor}, {rope_type: llama3, factor, low_freq_factor, "
                        "high_freq_factor, original_max_position_embeddings} or {rope_type: yarn, factor, "
                        "original_max_position_embeddings[, beta_fast, beta_slow, truncate]}")


def _validate_train_counts(t: TrainConfig) -> None:
    """The train section's counts that may be ``auto``: each an integer in its range (not a bool)."""
    if t.micro_batches != "auto" and (isinstance(t.micro_batches, bool) or not isinstance(t.micro_batches, int)
                                      or t.micro_batches <= 0):
        raise UserError("train.micro_batches", f"must be a positive integer or auto, got {t.micro_batches!r}",
                        "set it to a positive integer that divides train.batch_size, or auto")
    if t.grad_slabs != "auto" and (isinstance(t.grad_slabs, bool) or not isinstance(t.grad_slabs, int)
                                   or t.grad_slabs < 2):
        raise UserError("train.grad_slabs", f"must be auto or an integer >= 2, got {t.grad_slabs!r}",
                        "set train.grad_slabs=auto (or e.g. 6 to save host memory, 24 for speed)")
    if t.early_state_groups != "auto" and (isinstance(t.early_state_groups, bool)
                                           or not isinstance(t.early_state_groups, int) or t.early_state_groups < 0):
        raise UserError("train.early_state_groups", f"must be auto or an integer >= 0, got {t.early_state_groups!r}",
                        "set train.early_state_groups=auto (or a number of groups, 0 to fetch each in the forward)")
    if t.keep_residuals != "auto" and (isinstance(t.keep_residuals, bool) or not isinstance(t.keep_residuals, int)
                                       or t.keep_residuals < 0):
        raise UserError("train.keep_residuals", f"must be auto or an integer >= 0, got {t.keep_residuals!r}",
                        "set train.keep_residuals=auto (or a number of blocks, 0 to recompute every block)")
    if t.boundary_every != "auto" and (isinstance(t.boundary_every, bool) or not isinstance(t.boundary_every, int)
                                       or t.boundary_every < 1):
        raise UserError("train.boundary_every", f"must be auto or an integer >= 1, got {t.boundary_every!r}",
                        "set train.boundary_every=auto (or 1 to keep every block's input)")
    if t.activations_gpu_blocks != "auto" and (isinstance(t.activations_gpu_blocks, bool)
                                               or not isinstance(t.activations_gpu_blocks, int)
                                               or t.activations_gpu_blocks < 0):
        raise UserError("train.activations_gpu_blocks", f"must be auto or an integer >= 0, got "
                        f"{t.activations_gpu_blocks!r}", "set train.activations_gpu_blocks=auto (or 0 to park every input)")
    if t.devices != "all" and (isinstance(t.devices, bool) or not isinstance(t.devices, int) or t.devices <= 0):
        raise UserError("train.devices", f"must be a positive integer or all, got {t.devices!r}",
                        "set train.devices=all or a number of GPUs")


def _validate_choices(m: ModelConfig, t: TrainConfig, o: OptimConfig) -> None:
    """The fields with a fixed set of values hold one of them; the memory budgets are positive."""
    for name, value, allowed in [("optim.moments", o.moments, ("float32", "bfloat16", "int8")),
                                 ("model.init", m.init, ("normal", "fast")),
                                 ("train.stream_copy", t.stream_copy, ("auto", "host", "device")),
                                 ("train.fetch", t.fetch, ("auto", "full", "split")),
                                 ("train.host_state", t.host_state, ("replicated", "sharded")),
                                 ("train.grad_hold", t.grad_hold, ("auto",) + GRAD_HOLDS),
                                 ("train.stream_io", t.stream_io, ("auto", True, False)),
                                 ("train.activations", t.activations, ("auto", "device", "pinned_host")),
                                 ("train.update_on", t.update_on, ("auto", "host", "device"))]:
        if value not in allowed:
            raise UserError(name, f"{value!r} is not supported", f"use one of: {', '.join(str(a).lower() if isinstance(a, bool) else a for a in allowed)}")
    for name, value in [("train.host_memory_gb", t.host_memory_gb), ("train.gpu_memory_gb", t.gpu_memory_gb)]:
        if value is not None and not value > 0:
            raise UserError(name, f"must be positive, got {value}", f"set {name} to a size in GB, or null for the machine's")


def _validate_engine(cfg: Config) -> None:
    """The micro-batches divide the batch; the compute dtype and the engine are known; the reference
    engine takes no LoRA (``config/lora.py``), no timeline and no export."""
    t = cfg.train
    if t.micro_batches != "auto" and t.batch_size % t.micro_batches:
        raise UserError("train.micro_batches", f"batch_size {t.batch_size} does not divide into {t.micro_batches} micro-batches",
                        "make train.batch_size a multiple of train.micro_batches")
    if t.compute_dtype not in ("bfloat16", "float32"):
        raise UserError("train.compute_dtype", f"{t.compute_dtype!r} is not supported", "use bfloat16 or float32")
    if t.engine not in ("streamed", "reference"):
        raise UserError("train.engine", f"{t.engine!r} is not an engine", "use streamed or reference")
    check_lora_run(cfg)
    check_objective(cfg)  # train.objective and its constants (a preference objective: the streamed engine)
    for name, value in (("train.trace_step", t.trace_step), ("train.export", t.export)):
        if t.engine == "reference" and value:  # the reference keeps no host store and no per-layer timeline
            raise UserError(name, "is not available with train.engine=reference",
                            f"set train.engine=streamed, or remove {name}")


def _validate_optim_choices(o: OptimConfig, t: TrainConfig) -> None:
    """The optimizer kernel and name are known and fit together and with the update placement; then
    the optimizer's own fields (``_validate_optimizer``)."""
    if o.kernel not in ("fused", "optax"):
        raise UserError("optim.kernel", f"{o.kernel!r} is not a kernel", "use auto, fused or optax")
    if o.name not in OPTIMIZER_FIELDS:
        raise UserError("optim.name", f"{o.name!r} is not an optimizer",
                        "use adamw, lion, adafactor, sgd, muon or optax (with optim.optax_name)")
    if t.update_on == "device" and t.stream_copy == "host" and t.compute_dtype == "bfloat16":
        raise UserError("train.update_on", "device updates the fp32 master on the GPU, so no host bf16 copy can stream",
                        "set train.stream_copy=device (or auto), or train.update_on=host")
    if o.kernel == "fused" and o.name != "adamw":
        raise UserError("optim.kernel", f"the fused kernel implements adamw only, not {o.name}",
                        "set optim.kernel=auto (or optax)")
    _validate_optimizer(o)


def _check_number(name, v, ok, rule) -> None:
    """``v`` (unless None) is a finite real number (not a bool) that satisfies ``ok``."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v)):
        raise UserError(name, f"must be {rule}, got {v!r}", f"set {name} to a finite number {rule}")


def _validate_numbers(m: ModelConfig, t: TrainConfig, o: OptimConfig) -> None:
    """The real-valued fields are finite and in range, the rope_scaling factors too (llama3: high
    frequency factor above low)."""
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
        ("train.stall_timeout_s", t.stall_timeout_s, lambda x: x >= 0, ">= 0 (0: off; null: auto)"),
        ("train.host_memory_gb", t.host_memory_gb, lambda x: x > 0, "> 0 (or null)"),
        ("train.gpu_memory_gb", t.gpu_memory_gb, lambda x: x > 0, "> 0 (or null)"),
    ]:
        _check_number(name, v, ok, rule)
    if m.rope_scaling is not None and m.rope_scaling.get("rope_type", m.rope_scaling.get("type")) == "linear":
        _check_number("model.rope_scaling.factor", m.rope_scaling.get("factor", "missing"), lambda x: x > 0, "> 0")
    elif m.rope_scaling is not None and m.rope_scaling.get("rope_type") == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            _check_number(f"model.rope_scaling.{key}", m.rope_scaling.get(key, "missing"), lambda x: x > 0, "> 0")
    elif m.rope_scaling is not None:  # llama3 frequency scaling (models/common.py divides by factor and by high - low)
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            _check_number(f"model.rope_scaling.{key}", m.rope_scaling.get(key, "missing"), lambda x: x > 0, "> 0")
        if not m.rope_scaling["high_freq_factor"] > m.rope_scaling["low_freq_factor"]:
            raise UserError("model.rope_scaling.high_freq_factor",
                            f"must be > low_freq_factor {m.rope_scaling['low_freq_factor']}, "
                            f"got {m.rope_scaling['high_freq_factor']}", "use e.g. low_freq_factor: 1, high_freq_factor: 4")


def _validate_schedule_and_data(cfg: Config) -> None:
    """The export dtype and schedule kind are known, the warmup leaves room for the decay, and the byte
    tokenizer fits the vocabulary."""
    m, t, o, d = cfg.model, cfg.train, cfg.optim, cfg.data
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
    if o.moments != "float32" and o.kernel != "fused" and (o.name, o.moments) != ("lion", "int8"):
        raise UserError("optim.moments", f"{o.moments} moments are implemented by the fused AdamW kernel and "
                        "int8 Lion only", "set optim.moments=float32, or optim.name=adamw with optim.kernel=fused, "
                        "or optim.name=lion with optim.moments=int8")
    unit = lambda x: 0 <= x < 1  # noqa: E731
    for f, ok, rule in [("b1", unit, "in [0, 1)"), ("b2", unit, "in [0, 1)"), ("eps", lambda x: x > 0, "> 0"),
                        ("momentum", unit, "in [0, 1)"), ("decay_rate", lambda x: 0 < x <= 1, "in (0, 1]")]:
        v = getattr(o, f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or not ok(v)):
            raise UserError(f"optim.{f}", f"must be {rule}, got {v!r}", f"set optim.{f} to a number {rule}, or null")
    if o.adam_lr is not None and (isinstance(o.adam_lr, bool) or not isinstance(o.adam_lr, (int, float))
                                  or not math.isfinite(o.adam_lr) or o.adam_lr <= 0):
        raise UserError("optim.adam_lr", f"must be > 0, got {o.adam_lr!r}", "set optim.adam_lr > 0, or null (optim.lr)")
    if o.ns_dtype is not None and o.ns_dtype not in ("bfloat16", "float32"):
        raise UserError("optim.ns_dtype", f"{o.ns_dtype!r} is not a Newton-Schulz dtype", "use bfloat16 or float32")
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
        check_optax(o)


def check_optax(o: OptimConfig) -> None:
    """``optim.name=optax``: ``optax_name`` names an optax optimizer taking ``learning_rate``;
    ``optax_kwargs`` are its arguments; a weight decay needs a function that takes one."""
    import optax  # only for name=optax: validating a config starts no JAX otherwise

    if not o.optax_name:
        raise UserError("optim.optax_name", "is required with optim.name=optax", OPTAX_FIX)
    fn = getattr(optax, str(o.optax_name), None)
    if not callable(fn) or isinstance(fn, type) or str(o.optax_name).startswith("_"):
        raise UserError("optim.optax_name", f"{o.optax_name!r} is not an optax optimizer", OPTAX_FIX)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise UserError("optim.optax_name", f"{o.optax_name!r} is not an optax optimizer", OPTAX_FIX) from None
    if "learning_rate" not in params:
        raise UserError("optim.optax_name", f"optax.{o.optax_name} takes no learning_rate", OPTAX_FIX)
    if o.weight_decay and "weight_decay" not in params:
        raise UserError("optim.weight_decay", f"optax.{o.optax_name} takes no weight_decay",
                        "set optim.weight_decay=0, or name an optimizer that decays weights")
    kw = o.optax_kwargs
    if kw is None:
        return
    if not isinstance(kw, dict):
        raise UserError("optim.optax_kwargs", f"must be a mapping, got {kw!r}", "write e.g. {b1: 0.9}")
    for k in kw:
        if k in ("learning_rate", "weight_decay"):
            raise UserError(f"optim.optax_kwargs.{k}", "is set by its own field",
                            f"use optim.{'lr' if k == 'learning_rate' else k} instead")
        if k not in params:
            raise UserError(f"optim.optax_kwargs.{k}", f"optax.{o.optax_name} takes no argument {k!r}",
                            f"use one of: {', '.join(p for p in params if p not in ('learning_rate', 'weight_decay'))}")


def validate_model(m: ModelConfig) -> None:
    """The family and its feature fields (also called on configs read from checkpoints)."""
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
    _only_where_used(m, fam)
    if fam.validate is not None:
        fam.validate(m)
    check_lora_model(m, fam)


def _only_where_used(m: ModelConfig, fam) -> None:
    """Fields of a few families (``Family.extra["fields"]``) stay at their defaults on every other one."""
    own = fam.extra.get("fields", ())
    for f in dataclasses.fields(ModelConfig):
        if f.name in FAMILY_FIELDS and f.name not in own and getattr(m, f.name) != f.default:
            users = ", ".join(n for n, other in families().items() if f.name in other.extra.get("fields", ()))
            raise UserError(f"model.{f.name}", f"the {m.family} family does not use it",
                            f"remove model.{f.name} (it belongs to the {users} families)")


def _validate_moe(m: ModelConfig, fam) -> None:
    """The mixture-of-experts fields: only on MoE families, sizes positive, top-k <= experts."""
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
