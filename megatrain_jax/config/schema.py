"""The run's settings as dataclasses: ``model``, ``optim``, ``data``, ``train`` (every field commented)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatrain_jax.errors import UserError
from megatrain_jax.families import get_family
from megatrain_jax.placements import GRAD_HOLDS  # noqa: F401 - train.grad_hold's values (config.validate reads them)

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # model.lora.targets: q_proj .. down_proj
LORA_BASE_DTYPES = ("bfloat16", "int8", "float32")  # model.lora.base_dtype


@dataclass
class LoraConfig:
    """LoRA adapters on a frozen, streamed base (``models/lora.py``, ``engine/lora.py``): each targeted
    projection computes ``x W + (alpha / rank) * dropout(x) A B``; only A and B train."""

    rank: int = 16
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank (peft's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter's input only (peft's lora_dropout)
    targets: list = field(default_factory=lambda: list(LORA_TARGETS))  # of q k v o gate up down
    base_dtype: str = "bfloat16"  # the frozen base in host memory: bfloat16 | int8 (per-output-channel symmetric,
    #                              dequantised on the device after the transfer) | float32 (small models, tests)

    @property
    def scale(self) -> float:
        return float(self.alpha) / float(self.rank)

@dataclass
class ModelConfig:
    """A decoder of one of the registered families (``megatrain_jax/families.py``; one file each under
    ``megatrain_jax/models/``): llama (Llama 2/3, Qwen2/2.5 with qkv_bias, Mistral), qwen3, phi3,
    gemma2, gemma3, and the mixture-of-experts mixtral, qwen3_moe. One flat dataclass for every
    family (the fields a family does not use stay at their defaults; its ``validate`` refuses them)."""

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
    family: str = "llama"  # llama | qwen3 | phi3 | gemma2 | gemma3 | mixtral | qwen3_moe (families.py); from_hf sets it
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
    moe_impl: str = "auto"  # expert computation: auto (each expert only for its tokens, grouped matmuls, the GPU
    #                        kernel where there is one) | sorted (the same, portable XLA matmuls) | dense (every
    #                        expert on every token: E/k times the work; the tests' reference)
    router_aux_loss_coef: float = 0.0  # > 0: add coef x the router's load-balancing loss over the step's whole
    #                                   batch (transformers' load_balancing_loss_func; from_hf: config.json's
    #                                   router_aux_loss_coef when its output_router_logits is true); 0: off
    mlp_only_layers: list | None = None  # qwen3_moe: indices of dense-MLP layers (intermediate_size) between the
    #                                     sparse ones (transformers' mlp_only_layers / decoder_sparse_step); None: none
    # ---- sigmoid-routed MoE with shared experts (glm4_moe, deepseek_v3; models/sigmoid_moe.py); neutral elsewhere
    n_shared_experts: int = 0  # shared SwiGLU experts beside the routed ones (one MLP of n x moe_intermediate_size)
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by this
    n_group: int = 1  # expert groups: a token picks topk_group groups (by their 2 best scores), then top-k inside them
    topk_group: int = 1
    router_bias_update_rate: float = 0.0  # auxiliary-loss-free balancing of the router's correction bias; 0: frozen
    #                                       (the bias is kept as the checkpoint has it, never trained by gradient)
    partial_rotary_factor: float = 1.0  # glm4_moe: RoPE on this fraction of each head's dimensions (0.5)
    qk_norm: bool = False  # glm4_moe: per-head RMSNorm on q and k (config.json's use_qk_norm)
    q_lora_rank: int | None = None  # deepseek_v3 (multi-head latent attention): q's low-rank width; None: plain q_proj
    kv_lora_rank: int | None = None  # deepseek_v3: the compressed kv width (its latent)
    qk_rope_head_dim: int | None = None  # deepseek_v3: the rotary part of each q/k head (head_dim = nope + rope)
    v_head_dim: int | None = None  # deepseek_v3: each value head's width
    seq_tile: int | str = "auto"  # tokens per sequence tile of a block's norms, projections and MLP (attention sees
    #                              the whole sequence), so its working set stops growing with the sequence: 0 untiled;
    #                              auto: the memory plan tiles where the untiled block would not fit the GPU
    lora: LoraConfig | None = None  # LoRA adapters on a frozen base ({rank, alpha, dropout, targets, base_dtype});
    #                                 null: full training

    def __post_init__(self):
        if isinstance(self.lora, dict):  # from YAML / --set / a checkpoint's config
            self.lora = lora_from_dict(self.lora)

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
        return self._family().non_embedding_params(self)

    def total_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        return self.non_embedding_params() + emb * (1 if self.tie_embeddings else 2)

    def active_non_embedding_params(self) -> int:
        """``non_embedding_params`` counting only the ``experts_per_token`` experts a token uses (MoE);
        the same as ``non_embedding_params`` for a dense model."""
        return self._family().active_non_embedding_params(self)

    def flops_per_token(self) -> float:
        """Model FLOPs of one training token (the family's: 6 x the non-embedding parameters it uses)."""
        return self._family().flops_per_token(self)

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
    "muon": {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "eps": 1e-8, "b1": 0.9, "b2": 0.999, "adam_lr": None,
             "ns_dtype": "bfloat16"},
    "optax": {"optax_name": None, "optax_kwargs": None},
}


@dataclass
class OptimConfig:
    """The optimizer. Fields left null take the named optimizer's value (``OPTIMIZER_FIELDS``)."""

    name: str = "adamw"  # adamw | lion | adafactor | sgd | muon | optax (any optax optimizer: optax_name)
    kernel: str = "auto"  # auto (fused for adamw, optax for the others) | fused (numba AdamW, in place) |
    #                       optax (any optax transformation on the CPU device)
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
    ns_dtype: str | None = None  # muon: the iterations' matmul dtype, bfloat16 (Keller Jordan's) | float32
    adam_lr: float | None = None  # muon: the learning rate of its AdamW (embedding, head, norms); null: lr
    factored: bool | None = None  # adafactor: factor the second moment of matrices, true
    decay_rate: float | None = None  # adafactor: second-moment decay exponent, 0.8
    min_dim_size_to_factor: int | None = None  # adafactor: factor only dimensions at least this large, 128
    multiply_by_parameter_scale: bool | None = None  # adafactor: lr relative to each parameter's RMS, true
    optax_name: str | None = None  # name=optax: an optax optimizer function, e.g. "adabelief" (learning_rate=lr)
    optax_kwargs: dict | None = None  # name=optax: its other keyword arguments, e.g. {b1: 0.9}

    def __post_init__(self):
        self.kernel_auto = self.kernel == "auto"  # (not a field: Config.to_dict writes "auto" back for it)
        if self.kernel_auto:  # the kernel follows the optimizer: the fused one implements AdamW only
            self.kernel = "fused" if self.name == "adamw" else "optax"
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class DataConfig:
    path: str = "data/tinyshakespeare.txt"  # a .txt file, or a prepared token file prefix
    tokenizer: str = "byte"  # byte | path to a tokenizer.json
    seq_len: int = 128
    seed: int = 0
    doc_masking: bool = False  # attention does not cross document boundaries in packed sequences
    eval: str | None = None  # a held-out file to evaluate on (any format prepare takes: .txt, .jsonl, a prepared
    #                          prefix; preference objectives: a prefix of `prepare --preference`); null: none
    #                          (evaluate.py, preference_eval.py)
    eval_fraction: float | None = None  # hold out this share (0 < f < 1) of the training samples for evaluation, a
    #                                     seeded split with no sample in both (preference pairs: whole pairs); null:
    #                                     none


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
    stall_timeout_s: float | None = None  # a step running longer than this ends the run with an error instead of
    #                                       hanging (watchdog.py; the first step may always take an hour): null
    #                                       (auto: 20x the longest step, at least 10 minutes) | seconds | 0 (off)
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
    #                          | pinned_bf16 (XLA's pinned pool, beside parked activations) | host_fp32 | host_bf16
    #                          (ordinary host memory) | resweep (no hold: a second backward)
    stream_io: bool | str = "auto"  # true: the embedding and head are not resident on the GPU (rows gathered, head
    #                                 streamed in vocabulary chunks) | false | auto (the plan decides)
    boundary_every: int | str = "auto"  # keep every k-th block input for the backward (recompute between) | auto
    activations: str = "auto"  # boundary activations: auto | device | pinned_host
    activations_gpu_blocks: int | str = "auto"  # with pinned_host activations: the last N blocks keep their inputs
    #                                             on the GPU, the others park theirs | auto (as many as its free room
    #                                             holds, where that is faster or needs less host memory)
    grad_slabs: int | str = "auto"  # pinned 128 MiB gradient slabs: auto (24 where the host has room, down to 6)
    #                                 | N. More slabs keep the host optimizer fed (speed), fewer save host memory
    devices: int | str = "all"  # GPUs of this host to use: all | N
    fetch: str = "auto"  # with several GPUs, how each gets a streamed block: full (the whole block over its own
    #                      link) | split (its 1/N share over its link, the rest gathered from the others over NVLink)
    #                      | auto (split with several GPUs of one process, else full)
    host_state: str = "replicated"  # several processes (hosts): each keeps a whole replica of the fp32 master and
    #                                 optimizer state (replicated), or only its GPUs' 1/N shares of every group
    #                                 (sharded: host memory per process falls as 1/N; its GPUs update and fetch
    #                                 those shares: update_on=device, fetch=split, the fused AdamW, no stream_io)
    update_on: str = "auto"  # where the optimizer step runs: host (numba kernels, the gradient crosses PCIe) |
    #                          device (the master and state cross PCIe, the GPU updates each block as the next
    #                          forward fetches it; needs stream_copy=device, the fused kernel, one GPU) | auto
    #                          (the plan decides)
    early_state_groups: int | str = "auto"  # update_on=device: the first N groups of the forward have their master
    #                                        and optimizer state fetched during the backward (neither waits for the
    #                                        norm), so the forward moves only the others' (kept residuals left auto
    #                                        give way for its room); auto: 0 (its predicted gain is overstated:
    #                                        docs/design.md 7.7; the plan's note names the N it predicts fastest)
    keep_residuals: int | str = "auto"  # the last N blocks keep their forward's matmul outputs on the GPU, so
    #                                     the backward does not recompute them: auto (as many as the GPU room the
    #                                     plan leaves holds; one GPU) | N | 0
    # ---- preference tuning (objectives.py: TRL's formulas; data from `prepare --preference`)
    objective: str = "sft"  # sft (cross-entropy) | dpo | ipo | simpo | orpo
    beta: float = 0.1  # dpo, ipo, simpo: TRL's beta (ipo: its regularisation, the target margin 1 / (2 beta))
    gamma: float = 0.5  # simpo: the target reward margin (TRL's simpo_gamma)
    orpo_lambda: float = 0.1  # orpo: the odds-ratio term's weight (TRL's ORPOConfig.beta)
    label_smoothing: float = 0.0  # dpo, simpo: conservative DPO's label smoothing (0: plain)
    reference: str = "auto"  # dpo, ipo: the reference log-probabilities next to the data (PREFIX.reference.*):
    #                          auto (reused when made from the same weights and data, computed when absent,
    #                          refused when stale) | recompute (a forward pass of the initial weights replaces them)
    eval_every: int = 0  # evaluate on the eval set (data.eval / data.eval_fraction) every N steps; it is also
    #                      evaluated at the end of every run that has one. 0: only at the end
    eval_tokens: int | None = None  # tokens per evaluation (whole samples, the same each time); null: one step's
    trace_step: int = 0  # > 0: record that step's per-layer timeline (host->GPU, compute, GPU->host, host
    #                      optimizer) to out_dir/timeline_step<N>.{png,json} and log where compute waited


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if getattr(self.optim, "kernel_auto", False):  # a config built on this one (base:, --set optim.name=...)
            d["optim"]["kernel"] = "auto"  # resolves the kernel again for its own optimizer
        return d


def lora_from_dict(d: dict) -> LoraConfig:
    """``model.lora`` as written in YAML: unknown keys refused (its fields are checked with the rest of the
    config: ``config/lora.py``)."""
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    for key in d:
        if key not in known:
            raise UserError(f"model.lora.{key}", "unknown config key", f"use one of: {', '.join(sorted(known))}")
    lora = LoraConfig(**{k: v for k, v in d.items() if v is not None or k not in ("targets", "base_dtype")})
    return lora
