"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE (two families in one module).

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
up_proj/down_proj``); ``hf_name`` returns those names with ``*`` for the expert index, and
``megatrain_jax.hf`` maps each slice of the stack to its tensor on import and export.

Two expert computations (``ModelConfig.moe_impl``), both static-shape and capacity-free (no token
is ever dropped): ``sorted`` sorts the ``T * k`` (token, expert) pairs by expert and runs the three
projections as grouped matmuls over the contiguous groups (``jax.lax.ragged_dot`` with the group
sizes); ``dense`` (the default) runs every expert on every token and weights the results by the
(mostly zero) router weights (``E / k`` times the FLOPs, no gather/scatter, plain matmuls). With
JAX 0.11.2 ``ragged_dot`` lowers as a product over every group with masks on CPU *and* on GPU (the
Pallas/Triton lowering is not in the wheel), so ``dense`` is the faster of the two on both: 1.4x
(8 experts, top-2) to 5x (32, top-8) on the CPU, 1.9x (Mixtral-like) to 10x (OLMoE's 64 experts,
top-8) on an H100 (``experiments/bench_moe.py``; docs/families.md has the numbers).

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

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.config import ModelConfig
from megatrain_jax.config.validate import MOE_IMPLS  # noqa: F401 (checked there)
from megatrain_jax.errors import UserError
import megatrain_jax.models.hfconfig as hfconfig
from megatrain_jax.models.hfnames import default_hf_name
from megatrain_jax.models.common import MLP, Attention, Aux, RMSNorm, dense_block_params
from megatrain_jax.models.registry import Family, register



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


def router_aux_loss(coef: float, num_experts: int):
    """``stats`` summed over every sparse layer and token -> ``coef`` times transformers'
    ``load_balancing_loss_func``: ``E * sum_e (counts_e / rows) * (probs_e / rows)``."""
    def fn(stats: dict[str, jax.Array]) -> jax.Array:
        rows = stats["rows"]
        return coef * num_experts * jnp.sum(stats["counts"] * stats["probs"]) / (rows * rows)

    return fn


def aux_loss_of(cfg: ModelConfig):
    """The family record's ``aux_loss``: the router loss when ``router_aux_loss_coef`` > 0."""
    if not cfg.router_aux_loss_coef:
        return None
    return router_aux_loss(float(cfg.router_aux_loss_coef), int(cfg.num_experts))


def experts_sorted(x: jax.Array, weights: jax.Array, idx: jax.Array, wg: jax.Array, wu: jax.Array,
                   wd: jax.Array) -> jax.Array:
    """Sorted dispatch: the T*k (token, expert) pairs sorted by expert, each projection one grouped
    matmul (``ragged_dot``) over the contiguous groups, then un-sorted and weighted. x: (T, H)."""
    t, k = idx.shape
    e = wg.shape[0]
    flat = idx.reshape(-1)  # pair p = token p // k, slot p % k
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)  # (T*k, H), grouped by expert
    h = jax.nn.silu(jax.lax.ragged_dot(xs, wg, sizes)) * jax.lax.ragged_dot(xs, wu, sizes)
    ys = jax.lax.ragged_dot(h, wd, sizes)  # (T*k, H)
    inv = jnp.argsort(order)  # back to (token, slot) order
    y = jnp.take(ys, inv, axis=0).reshape(t, k, -1)
    return jnp.einsum("tkh,tk->th", y, weights)


def experts_dense(x: jax.Array, weights: jax.Array, idx: jax.Array, wg: jax.Array, wu: jax.Array,
                  wd: jax.Array) -> jax.Array:
    """Every expert on every token, the outputs weighted by the router weights (zero for the experts
    not chosen). x: (T, H)."""
    e = wg.shape[0]
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(idx, e, dtype=weights.dtype))  # (T, E)
    h = jax.nn.silu(jnp.einsum("th,ehf->tef", x, wg)) * jnp.einsum("th,ehf->tef", x, wu)
    y = jnp.einsum("tef,efh->teh", h, wd)
    return jnp.einsum("teh,te->th", y, combine)


class Experts(nnx.Module):
    """The experts' stacked SwiGLU weights: gate_proj, up_proj (E, H, F), down_proj (E, F, H)."""

    def __init__(self, e: int, h: int, f: int, std: float, rngs: nnx.Rngs):
        init = nnx.initializers.normal(std)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, h, f), jnp.float32))
        self.up_proj = nnx.Param(init(rngs.params(), (e, h, f), jnp.float32))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, h), jnp.float32))


class SparseMoE(nnx.Module):
    """Router + stacked SwiGLU experts; ``impl``: dense | sorted (static: part of the graph).
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
        fn = experts_sorted if self.impl == "sorted" else experts_dense
        out = fn(flat, weights, idx, wg, wu, wd).reshape(b, s, h)
        return (out, router_stats(probs, idx)) if self.stats else out


class MixtralBlock(nnx.Module):
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


class Qwen3MoeBlock(MixtralBlock):
    QK_NORM = RMSNorm


# ------------------------------------------------------------------------------- parameter counts


def _expert_size(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * (cfg.moe_intermediate_size or cfg.intermediate_size)


def block_params(cfg: ModelConfig, qk_norm: bool) -> int:
    """A sparse block: attention, norms, router and all ``num_experts`` experts (what the host
    stores and streams; the largest block when some layers are dense)."""
    no_mlp = dense_block_params(cfg, qk_norm=qk_norm) - 3 * cfg.hidden_size * cfg.intermediate_size
    return no_mlp + cfg.hidden_size * cfg.num_experts + cfg.num_experts * _expert_size(cfg)


def dense_layer_saving(cfg: ModelConfig) -> int:
    """How many fewer parameters a dense layer (``mlp_only_layers``) has than a sparse one."""
    return block_params(cfg, qk_norm=True) - dense_block_params(cfg, qk_norm=True)


def inactive_block_params(cfg: ModelConfig) -> int:
    """Parameters of one sparse block that a token does not use: the experts it is not routed to."""
    return (cfg.num_experts - cfg.experts_per_token) * _expert_size(cfg)


# ------------------------------------------------------------------------------- Hugging Face

_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _hf_name(group: str, leaf: str, mixtral: bool) -> tuple[str, bool]:
    if group.startswith("block_") and leaf.startswith("mlp/"):
        prefix = f"model.layers.{int(group[6:])}." + ("block_sparse_moe" if mixtral else "mlp")
        if leaf == "mlp/gate/kernel":
            return prefix + ".gate.weight", True
        kind = leaf.split("/")[-1]
        if leaf.startswith("mlp/experts/") and kind in _MIXTRAL_EXPERT:  # stacked: one tensor per expert
            return f"{prefix}.experts.*.{_MIXTRAL_EXPERT[kind] if mixtral else kind}.weight", True
    return default_hf_name(group, leaf)


AUX_COEF_DEFAULT = 0.001  # transformers' MixtralConfig and Qwen3MoeConfig default router_aux_loss_coef


def _refuse_common(hf: dict, where: str) -> None:
    hfconfig.check_act(hf, where, ("hidden_act",), ("silu", "swish"), "silu", "SwiGLU (silu)")
    if hf.get("attention_bias"):
        hfconfig.refuse(where, "attention_bias (biases on q/k/v and o_proj)", "use a checkpoint without attention biases")


def _aux_coef(hf: dict, base: ModelConfig, where: str) -> float:
    """transformers trains with ``router_aux_loss_coef`` x the load-balancing loss when
    ``output_router_logits`` is true; otherwise the YAML's ``model.router_aux_loss_coef`` (default 0)."""
    if not hf.get("output_router_logits"):
        return base.router_aux_loss_coef
    coef = hf.get("router_aux_loss_coef", AUX_COEF_DEFAULT)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        raise UserError("model.from_hf", f"router_aux_loss_coef={coef!r} in {where} is not a number >= 0",
                        "fix config.json")
    return float(coef)


def mlp_only_layers_from_hf(hf: dict, n: int, where: str) -> list[int] | None:
    """Qwen3-MoE's dense layers as transformers picks them: layer ``i`` is sparse unless it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``. None: every layer sparse."""
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise UserError("model.from_hf", f"decoder_sparse_step={step!r} in {where} is not a positive integer",
                        "fix config.json")
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise UserError("model.from_hf", f"mlp_only_layers={only!r} in {where} is not a list of layer indices",
                        "fix config.json")
    dense = [i for i in range(n) if i in only or (i + 1) % step != 0]
    if n and len(dense) == n:
        raise UserError("model.from_hf", f"decoder_sparse_step={step} and mlp_only_layers={only} in {where} make "
                        "every layer dense (no experts)", "load it as a dense model (Qwen3ForCausalLM)")
    return dense or None


def mlp_only_layers_to_hf(cfg: ModelConfig) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) for config.json: a step when one gives exactly our
    dense layers (the form checkpoints use), else step 1 and the list."""
    dense = sorted(cfg.mlp_only_layers or [])
    for step in range(2, cfg.num_layers + 1):
        if dense == [i for i in range(cfg.num_layers) if (i + 1) % step != 0]:
            return step, []
    return 1, dense


def _moe_fields(hf: dict, where: str, experts_key: tuple[str, ...]) -> dict:
    e = next((hf[k] for k in experts_key if hf.get(k) is not None), None)
    if e is None or int(hf.get("num_experts_per_tok") or 0) <= 0:
        hfconfig.refuse(where, f"a config without {experts_key[0]} / num_experts_per_tok", "use a MoE checkpoint")
    return dict(num_experts=int(e), experts_per_token=int(hf["num_experts_per_tok"]))


def mixtral_from_hf(hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
    _refuse_common(hf, where)
    if hf.get("router_jitter_noise"):
        raise UserError("model.from_hf", f"router_jitter_noise={hf['router_jitter_noise']} in {where} is not supported",
                        "set router_jitter_noise to 0 in config.json")
    theta, scaling = hfconfig.rope_from_hf(hf, where, allowed=("llama3", "linear"))
    window = int(hf["sliding_window"]) if hf.get("sliding_window") else None
    return hfconfig.base_from_hf(hf, base, where, "mixtral", rope_theta=theta, rope_scaling=scaling,
                                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)), sliding_window=window,
                                 moe_intermediate_size=None, norm_topk_prob=True,
                                 router_aux_loss_coef=_aux_coef(hf, base, where),
                                 **_moe_fields(hf, where, ("num_local_experts", "num_experts")))


def qwen3_moe_from_hf(hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
    _refuse_common(hf, where)
    theta, scaling = hfconfig.rope_from_hf(hf, where, allowed=("llama3", "linear"))
    window = int(hf["sliding_window"]) if hf.get("use_sliding_window") and hf.get("sliding_window") else None
    n = int(hf.get("num_hidden_layers") or 0)
    return hfconfig.base_from_hf(hf, base, where, "qwen3_moe", rope_theta=theta, rope_scaling=scaling,
                                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)), sliding_window=window,
                                 moe_intermediate_size=int(hf["moe_intermediate_size"]),
                                 norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                                 mlp_only_layers=mlp_only_layers_from_hf(hf, n, where),
                                 router_aux_loss_coef=_aux_coef(hf, base, where),
                                 **_moe_fields(hf, where, ("num_experts", "num_local_experts")))


def _to_hf_common(cfg: ModelConfig, out: dict) -> None:
    on = bool(cfg.router_aux_loss_coef)  # trained with the load-balancing loss: transformers adds it too
    out.update(hidden_act="silu", num_experts_per_tok=cfg.experts_per_token, output_router_logits=on)
    if on:
        out["router_aux_loss_coef"] = cfg.router_aux_loss_coef
    else:
        out.setdefault("router_aux_loss_coef", AUX_COEF_DEFAULT)  # unused without output_router_logits


def mixtral_to_hf(cfg: ModelConfig, arch: str, out: dict) -> None:
    _to_hf_common(cfg, out)
    out.update(num_local_experts=cfg.num_experts, sliding_window=cfg.sliding_window, router_jitter_noise=0.0)
    out.pop("num_experts", None)


def qwen3_moe_to_hf(cfg: ModelConfig, arch: str, out: dict) -> None:
    _to_hf_common(cfg, out)
    step, only = mlp_only_layers_to_hf(cfg)
    out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size,
               norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=step, mlp_only_layers=only, attention_bias=False,
               use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window)
    out.pop("num_local_experts", None)


# ------------------------------------------------------------------------------- validation


def _validate(cfg: ModelConfig) -> None:
    from megatrain_jax.models.llama import _no_gemma_fields

    if cfg.qkv_bias:
        raise UserError("model.qkv_bias", f"the {cfg.family} family has no q/k/v biases", "set model.qkv_bias: false")
    if cfg.layer_types is not None and len(set(cfg.layer_types)) > 1:
        raise UserError("model.layer_types", f"the {cfg.family} family uses model.sliding_window on every layer",
                        "set layer_types to null")
    _no_gemma_fields(cfg)
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


def mixtral_validate(cfg: ModelConfig) -> None:
    _validate(cfg)
    if not cfg.norm_topk_prob:
        raise UserError("model.norm_topk_prob", "Mixtral always renormalises the top-k router weights",
                        "set model.norm_topk_prob: true (or use family qwen3_moe)")
    if cfg.mlp_only_layers is not None:
        raise UserError("model.mlp_only_layers", "every Mixtral layer is sparse",
                        "set model.mlp_only_layers: null (dense layers: family qwen3_moe)")


# ModelConfig's parameter counts read these through the family (the config does not import the models)
_MOE_EXTRA = {"moe": True, "dense_layer_saving": dense_layer_saving, "inactive_block_params": inactive_block_params}

register(Family(
    name="mixtral", architectures=("MixtralForCausalLM",), model_types=("mixtral",), block=MixtralBlock,
    block_params=lambda cfg: block_params(cfg, qk_norm=False), config_from_hf=mixtral_from_hf,
    config_to_hf=mixtral_to_hf, validate=mixtral_validate, hf_name=lambda g, l: _hf_name(g, l, True),
    aux_loss=aux_loss_of, extra=_MOE_EXTRA))

register(Family(
    name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",), block=Qwen3MoeBlock,
    block_params=lambda cfg: block_params(cfg, qk_norm=True), config_from_hf=qwen3_moe_from_hf,
    config_to_hf=qwen3_moe_to_hf, validate=_validate, hf_name=lambda g, l: _hf_name(g, l, False),
    aux_loss=aux_loss_of, extra=_MOE_EXTRA))
