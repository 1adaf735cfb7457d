"""Mixture-of-experts decoders: what the families ``mixtral.py`` and ``qwen3_moe.py`` share (the MoE
layer, the sparse block, the parameter counts, and ``MoEFamily``, Llama's family with experts).

Both are the pre-norm Llama block whose MLP is a sparse mixture of SwiGLU experts: a router
(``mlp/gate``, a bias-free ``(H, E)`` linear) scores ``E`` experts per token, the top ``k`` are
kept, and the token's output is the weighted sum of those experts' MLPs. Routing follows
``transformers``: softmax over all ``E`` router logits in fp32, top-k of the probabilities, then
(Mixtral always, Qwen3-MoE with ``norm_topk_prob``) renormalised over the chosen ``k``; the weights
are cast to the compute dtype.

The experts' weights are stacked inside the block's group: ``mlp/experts/gate_proj`` and
``up_proj`` ``(E, H, F)``, ``down_proj`` ``(E, F, H)`` (each expert ``(in, out)`` like our kernels),
so a block streams as one group like any other. Hugging Face checkpoints hold one tensor per expert
(Mixtral: ``block_sparse_moe.experts.{e}.w1/w3/w2``; Qwen3-MoE: ``mlp.experts.{e}.gate_proj/
up_proj/down_proj``); ``MoEFamily.hf_name`` returns those names with ``*`` for the expert index, and
``megatrain_jax.hf`` maps each slice of the stack to its tensor on import and export.

The experts run through ``grouped_experts.routed_experts`` (``ModelConfig.moe_impl``): each expert
only for the tokens routed to it, as grouped matmuls with one custom VJP, exact and dropless
(``auto``, the default; ``sorted`` forces the portable XLA matmuls), or every expert on every token
(``dense``, E/k times the work: the tests' reference).

Qwen3-MoE also has Qwen3's per-head q/k RMSNorm, and may make some layers dense
(``ModelConfig.mlp_only_layers``: transformers' ``mlp_only_layers`` and ``decoder_sparse_step``):
those blocks have a plain SwiGLU MLP of ``intermediate_size`` (``Qwen3MoeMLP``), a second layer
kind with its own compiled template.

**Router load-balancing loss** (``ModelConfig.router_aux_loss_coef`` > 0; transformers adds it
when ``output_router_logits`` is true): ``coef * E * sum_e f_e * P_e`` with ``f_e`` the fraction
of (token, slot) top-k choices that picked expert ``e`` and ``P_e`` its mean router probability,
both over *every* sparse layer's tokens of the step together (transformers'
``load_balancing_loss_func`` with ``attention_mask=None``). Each sparse block then returns its
per-expert sums (``router_stats``) next to the hidden state; the engine adds them over layers,
micro-batches and devices and differentiates ``router_aux_loss`` of the total
(``templates.AuxLoss``), so the gradients are those of the whole batch's loss exactly.

Not supported (``UserError`` naming the field): Mixtral's ``router_jitter_noise``, attention biases.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import megatrain_jax.hf.config as hfc
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.models.grouped_experts import experts_dense, routed_experts  # noqa: F401  (re-exported)
from megatrain_jax.models.common import MLP, Attention, Aux, RMSNorm, dense_block_params
from megatrain_jax.models.llama import LlamaFamily, no_gemma_fields, no_qkv_bias
from megatrain_jax.templates import shareable


# ------------------------------------------------------------------------------- the MoE layer


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights (T, k) in the logits' dtype, expert ids (T, k) int32) as transformers' TopKRouter."""
    return route_probs(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), k, normalize, logits.dtype)


def route_probs(probs: jax.Array, k: int, normalize: bool, dtype) -> tuple[jax.Array, jax.Array]:
    """``route`` from the fp32 router probabilities (T, E)."""
    top, idx = jax.lax.top_k(probs, k)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(dtype), idx.astype(jnp.int32)


def router_stats(probs: jax.Array, idx: jax.Array) -> dict[str, jax.Array]:
    """One sparse layer's contribution to the load-balancing loss, as sums over its T tokens (fp32):
    ``counts`` (E,) top-k selections per expert (no gradient), ``probs`` (E,) router probabilities
    per expert, ``rows`` the token count."""
    e = probs.shape[-1]
    counts = jnp.zeros((e,), jnp.float32).at[idx.reshape(-1)].add(1.0)
    return {"counts": jax.lax.stop_gradient(counts), "probs": jnp.sum(probs, axis=0),
            "rows": jnp.asarray(probs.shape[0], jnp.float32)}


@functools.lru_cache(maxsize=64)
def router_aux_loss(coef: float, num_experts: int):
    """``stats`` summed over every sparse layer and token -> ``coef`` times transformers'
    ``load_balancing_loss_func``: ``E * sum_e (counts_e / rows) * (probs_e / rows)``. One function per
    (coef, E): trainers of equal models share their compiled kernels (engine/kernels.py: ``program_key``)."""
    def fn(stats: dict[str, jax.Array]) -> jax.Array:
        rows = stats["rows"]
        return coef * num_experts * jnp.sum(stats["counts"] * stats["probs"]) / (rows * rows)

    return shareable(fn)


def aux_loss_of(cfg: ModelConfig):
    """``MoEFamily.aux_loss``: the router loss when ``router_aux_loss_coef`` > 0."""
    if not cfg.router_aux_loss_coef:
        return None
    return router_aux_loss(float(cfg.router_aux_loss_coef), int(cfg.num_experts))


class Experts(nnx.Module):
    """The experts' stacked SwiGLU weights: gate_proj, up_proj (E, H, F), down_proj (E, F, H)."""

    def __init__(self, e: int, h: int, f: int, std: float, rngs: nnx.Rngs):
        init = nnx.initializers.normal(std)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, h, f), jnp.float32))
        self.up_proj = nnx.Param(init(rngs.params(), (e, h, f), jnp.float32))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, h), jnp.float32))


class SparseMoE(nnx.Module):
    """Router + stacked SwiGLU experts; ``impl``: auto | sorted | dense (models/grouped_experts.py).
    ``stats``: also return the layer's ``router_stats`` (for the load-balancing loss)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, normalize: bool, stats: bool = False):
        h, e = cfg.hidden_size, cfg.num_experts
        f = cfg.moe_intermediate_size or cfg.intermediate_size
        self.top_k, self.normalize, self.impl, self.stats = cfg.experts_per_token, normalize, cfg.moe_impl, stats
        self.gate = nnx.Linear(h, e, use_bias=False, kernel_init=nnx.initializers.normal(cfg.init_std),
                               param_dtype=jnp.float32, rngs=rngs)
        self.experts = Experts(e, h, f, cfg.init_std, rngs)

    def __call__(self, x: jax.Array):
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        logits = self.gate(flat)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, idx = route_probs(probs, self.top_k, self.normalize, logits.dtype)
        ex = self.experts
        wg, wu, wd = (p[...].astype(x.dtype) for p in (ex.gate_proj, ex.up_proj, ex.down_proj))
        out = routed_experts(flat, weights, idx, wg, wu, wd, impl=self.impl).reshape(b, s, h)
        return (out, router_stats(probs, idx)) if self.stats else out


class MoEBlock(nnx.Module):
    """x + attn(norm(x)), then + moe(norm(x)) (or a dense MLP on Qwen3-MoE's ``mlp_only_layers``).

    With ``router_aux_loss_coef`` > 0 a sparse block returns ``(hidden, router_stats)``
    (``emits_stats``: the contract of ``templates.from_nnx``)."""

    QK_NORM = None

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rngs, window=cfg.layer_window(layer), qk_norm=self.QK_NORM,
                                   scale=cfg.attention_scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = layer not in (cfg.mlp_only_layers or ())
        self.emits_stats = sparse and bool(cfg.router_aux_loss_coef)
        if sparse:
            self.mlp = SparseMoE(cfg, rngs, normalize=cfg.norm_topk_prob, stats=self.emits_stats)
        else:
            self.mlp = MLP(cfg, rngs)  # Qwen3MoeMLP(intermediate_size)

    def __call__(self, x, aux: Aux):
        x = x + self.self_attn(self.input_layernorm(x), aux)
        y = self.mlp(self.post_attention_layernorm(x))
        if self.emits_stats:
            y, stats = y
            return x + y, stats
        return x + y


# ------------------------------------------------------------------------------- parameter counts


def expert_size(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * (cfg.moe_intermediate_size or cfg.intermediate_size)


def block_params(cfg: ModelConfig, qk_norm: bool) -> int:
    """A sparse block: attention, norms, router and all ``num_experts`` experts (what the host
    stores and streams; the largest block when some layers are dense)."""
    no_mlp = dense_block_params(cfg, qk_norm=qk_norm) - 3 * cfg.hidden_size * cfg.intermediate_size
    return no_mlp + cfg.hidden_size * cfg.num_experts + cfg.num_experts * expert_size(cfg)


def dense_layer_saving(cfg: ModelConfig) -> int:
    """How many fewer parameters a dense layer (``mlp_only_layers``) has than a sparse one."""
    return block_params(cfg, qk_norm=True) - dense_block_params(cfg, qk_norm=True)


def inactive_block_params(cfg: ModelConfig) -> int:
    """Parameters of one sparse block that a token does not use: the experts it is not routed to."""
    return (cfg.num_experts - cfg.experts_per_token) * expert_size(cfg)


# ------------------------------------------------------------------------------- the family

AUX_COEF_DEFAULT = 0.001  # transformers' MixtralConfig and Qwen3MoeConfig default router_aux_loss_coef
MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def aux_coef(hf: dict, base: ModelConfig, where: str) -> float:
    """transformers trains with ``router_aux_loss_coef`` x the load-balancing loss when
    ``output_router_logits`` is true; otherwise the YAML's ``model.router_aux_loss_coef`` (default 0)."""
    if not hf.get("output_router_logits"):
        return base.router_aux_loss_coef
    coef = hf.get("router_aux_loss_coef", AUX_COEF_DEFAULT)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        raise UserError("model.from_hf", f"router_aux_loss_coef={coef!r} in {where} is not a number >= 0",
                        "fix config.json")
    return float(coef)


class MoEFamily(LlamaFamily):
    """Llama's family with a sparse MLP: what Mixtral and Qwen3-MoE share. A subclass sets
    ``experts_keys`` (config.json's expert count, first found wins), ``moe_prefix`` (the MLP's name
    in the checkpoint) and ``expert_names`` (our expert projections -> the checkpoint's)."""

    extra = {"moe": True}  # config validation: the expert fields are allowed
    act_keys = ("hidden_act",)
    experts_keys: tuple[str, ...] = ("num_experts", "num_local_experts")
    moe_prefix = "mlp"
    expert_names = {k: k for k in MIXTRAL_EXPERT}

    def check_hf(self, hf: dict, where: str, arch: str) -> None:
        hfc.check_act(hf, where, self.act_keys, ("silu", "swish"), "silu", "SwiGLU (silu)")
        if hf.get("attention_bias"):
            hfc.refuse(where, "attention_bias (biases on q/k/v and o_proj)", "use a checkpoint without attention biases")

    def fields_from_hf(self, hf: dict, base: ModelConfig, where: str, arch: str) -> dict:
        coef = aux_coef(hf, base, where)
        e = next((hf[k] for k in self.experts_keys if hf.get(k) is not None), None)
        if e is None or int(hf.get("num_experts_per_tok") or 0) <= 0:
            hfc.refuse(where, f"a config without {self.experts_keys[0]} / num_experts_per_tok", "use a MoE checkpoint")
        return dict(router_aux_loss_coef=coef, num_experts=int(e), experts_per_token=int(hf["num_experts_per_tok"]))

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        super().to_hf_config(cfg, arch, out)
        on = bool(cfg.router_aux_loss_coef)  # trained with the load-balancing loss: transformers adds it too
        out.update(num_experts_per_tok=cfg.experts_per_token, output_router_logits=on)
        if on:
            out["router_aux_loss_coef"] = cfg.router_aux_loss_coef
        else:
            out.setdefault("router_aux_loss_coef", AUX_COEF_DEFAULT)  # unused without output_router_logits

    def hf_name(self, group: str, leaf_path: str) -> tuple[str, bool] | None:
        """The router and the stacked experts (one checkpoint tensor per expert: ``*``)."""
        if group.startswith("block_") and leaf_path.startswith("mlp/"):
            prefix = f"model.layers.{int(group[6:])}.{self.moe_prefix}"
            if leaf_path == "mlp/gate/kernel":
                return prefix + ".gate.weight", True
            kind = leaf_path.split("/")[-1]
            if leaf_path.startswith("mlp/experts/") and kind in self.expert_names:
                return f"{prefix}.experts.*.{self.expert_names[kind]}.weight", True
        return None

    # ---- sizes, the router loss, validation

    def block_params(self, cfg: ModelConfig) -> int:
        return block_params(cfg, qk_norm=self.block.QK_NORM is not None)

    def non_embedding_params(self, cfg: ModelConfig) -> int:
        n = super().non_embedding_params(cfg)
        if cfg.mlp_only_layers:  # dense layers: block_params() is a sparse block's
            n -= len(cfg.mlp_only_layers) * dense_layer_saving(cfg)
        return n

    def active_non_embedding_params(self, cfg: ModelConfig) -> int:
        if not cfg.num_experts:
            return self.non_embedding_params(cfg)
        sparse = cfg.num_layers - len(cfg.mlp_only_layers or ())
        return self.non_embedding_params(cfg) - sparse * inactive_block_params(cfg)

    def aux_loss(self, cfg: ModelConfig):
        return aux_loss_of(cfg)

    def validate(self, cfg: ModelConfig) -> None:
        no_qkv_bias(cfg)
        if cfg.layer_types is not None and len(set(cfg.layer_types)) > 1:
            raise UserError("model.layer_types", f"the {cfg.family} family uses model.sliding_window on every layer",
                            "set layer_types to null")
        no_gemma_fields(cfg)
        if cfg.num_experts is None or cfg.experts_per_token is None:
            raise UserError("model.num_experts", f"the {cfg.family} family needs model.num_experts and "
                            "model.experts_per_token", "set both (e.g. num_experts: 8, experts_per_token: 2)")
        dense = cfg.mlp_only_layers
        if dense is not None:
            if (not isinstance(dense, (list, tuple)) or len(set(dense)) != len(dense)
                    or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.num_layers for i in dense)):
                raise UserError("model.mlp_only_layers", f"must list distinct layer indices in [0, {cfg.num_layers}), "
                                f"got {dense!r}", "fix the list, or null for every layer sparse")
            if len(dense) == cfg.num_layers:
                raise UserError("model.mlp_only_layers", "makes every layer dense (no experts left)",
                                "use family qwen3 for a dense model, or leave some layers sparse")
