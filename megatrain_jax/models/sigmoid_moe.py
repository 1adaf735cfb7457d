"""Sigmoid-routed mixtures of experts with shared experts: what the families ``glm4_moe.py``
(GLM-4.5, GLM-4.5-Air) and ``deepseek_v3.py`` (DeepSeek-V3/R1, Kimi-K2, Moonlight) share.

**The router** (transformers' ``Glm4MoeTopkRouter`` / ``DeepseekV3TopkRouter``, DeepSeek's
``noaux_tc``): fp32 logits of a bias-free ``(H, E)`` linear (``mlp/gate/kernel``, checkpoint
``mlp.gate.weight``), sigmoid scores; the *choice* adds the correction bias
(``mlp/gate/e_score_correction_bias``, ``mlp.gate.e_score_correction_bias``): the experts are split
into ``n_group`` groups, each group scored by the sum of its two best biased scores, the best
``topk_group`` groups kept, and the top ``k`` biased scores inside them chosen. The weights are the
*unbiased* sigmoid scores of the chosen experts, divided by their sum (+1e-20) when
``norm_topk_prob``, times ``routed_scaling_factor``. The bias only picks experts: it gets no gradient
(``stop_gradient``), it is a frozen leaf (``frozen_leaves``: no update path decays it or gives it a
moment), and it is stored and exported as the checkpoint has it. DeepSeek's auxiliary-loss-free
balancing (updating the bias from the experts' loads after each step,
``model.router_bias_update_rate``) is refused: the engine does not collect each layer's loads.

**The layer**: the routed experts (``grouped_experts.routed_experts``, stacked ``mlp/experts/*``,
one checkpoint tensor per expert) plus ``n_shared_experts`` shared experts, one SwiGLU MLP of width
``n_shared_experts x moe_intermediate_size`` on every token (``mlp.shared_experts.*``). The first
``first_k_dense_replace`` layers have a dense SwiGLU MLP of ``intermediate_size`` instead
(``ModelConfig.mlp_only_layers`` = those layers: a second compiled kind).

The multi-token-prediction layers of a release (``num_nextn_predict_layers``: tensors of layer
``num_hidden_layers``) are not trained: dropped on import with a one-line note, and an export
writes ``num_nextn_predict_layers: 0``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import megatrain_jax.hf.config as hfc
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.models.common import MLP, Aux, RMSNorm, linear
from megatrain_jax.models.grouped_experts import routed_experts
from megatrain_jax.models.llama import no_gemma_fields
from megatrain_jax.models.moe import Experts, MoEFamily

SIGMOID_FIELDS = ("n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "router_bias_update_rate")


def sigmoid_route(logits: jax.Array, bias: jax.Array, k: int, n_group: int, topk_group: int, normalize: bool,
                  scale: float) -> tuple[jax.Array, jax.Array]:
    """(weights (T, k) fp32, expert ids (T, k) int32) of fp32 router logits (T, E), as transformers'
    ``DeepseekV3TopkRouter``: the bias (E,) and the groups decide which experts, the sigmoid scores
    how much."""
    t, e = logits.shape
    scores = jax.nn.sigmoid(logits)
    choice = scores + jax.lax.stop_gradient(bias)
    if n_group > 1:
        per = e // n_group
        grouped = choice.reshape(t, n_group, per)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # (T, G): each group's two best
        _, groups = jax.lax.top_k(group_scores, topk_group)
        keep = jnp.sum(jax.nn.one_hot(groups, n_group, dtype=jnp.int32), axis=1) > 0  # (T, G)
        choice = jnp.where(jnp.repeat(keep, per, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(choice), k)
    weights = jnp.take_along_axis(scores, idx, axis=1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale, idx.astype(jnp.int32)


class Router(nnx.Module):
    """``kernel`` (H, E) and the correction bias (E,), both fp32 in the store."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, e = cfg.hidden_size, cfg.num_experts
        self.kernel = nnx.Param(nnx.initializers.normal(cfg.init_std)(rngs.params(), (h, e), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
        self.top_k, self.n_group, self.topk_group = cfg.experts_per_token, cfg.n_group, cfg.topk_group
        self.normalize, self.scale = cfg.norm_topk_prob, float(cfg.routed_scaling_factor)

    def __call__(self, flat: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = jnp.dot(flat.astype(jnp.float32), self.kernel[...].astype(jnp.float32))
        return sigmoid_route(logits, self.e_score_correction_bias[...].astype(jnp.float32), self.top_k,
                             self.n_group, self.topk_group, self.normalize, self.scale)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)) of width ``f`` (the shared experts)."""

    def __init__(self, h: int, f: int, std: float, rngs: nnx.Rngs):
        self.gate_proj = linear(h, f, False, std, rngs)
        self.up_proj = linear(h, f, False, std, rngs)
        self.down_proj = linear(f, h, False, std, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class SigmoidMoE(nnx.Module):
    """Router + routed experts (grouped) + shared experts."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, f = cfg.hidden_size, cfg.moe_intermediate_size or cfg.intermediate_size
        self.impl = cfg.moe_impl
        self.gate = Router(cfg, rngs)
        self.experts = Experts(cfg.num_experts, h, f, cfg.init_std, rngs)
        if cfg.n_shared_experts:
            self.shared_experts = SwiGLU(h, f * cfg.n_shared_experts, cfg.init_std, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        weights, idx = self.gate(flat)
        ex = self.experts
        wg, wu, wd = (p[...].astype(x.dtype) for p in (ex.gate_proj, ex.up_proj, ex.down_proj))
        out = routed_experts(flat, weights.astype(x.dtype), idx, wg, wu, wd, impl=self.impl).reshape(b, s, h)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out


class SigmoidMoEBlock(nnx.Module):
    """x + attn(norm(x)), then + mlp(norm(x)): the sparse layer, or a dense SwiGLU MLP on the first
    ``first_k_dense_replace`` layers. A subclass sets ``attention(cfg, rngs, layer)``."""

    SEQ_TILING = False

    def attention(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int) -> nnx.Module:
        raise NotImplementedError

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention(cfg, rngs, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, rngs) if layer in (cfg.mlp_only_layers or ()) else SigmoidMoE(cfg, rngs)

    def __call__(self, x, aux: Aux):
        x = x + self.self_attn(self.input_layernorm(x), aux)
        return x + self.mlp(self.post_attention_layernorm(x))


# ------------------------------------------------------------------------------- the family


def first_dense(hf: dict, n: int, where: str) -> list[int] | None:
    """``first_k_dense_replace`` -> the dense layers (None: every layer sparse)."""
    k = hf.get("first_k_dense_replace", 0) or 0
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
        raise UserError("model.from_hf", f"first_k_dense_replace={k!r} in {where} is not a layer count below "
                        f"num_hidden_layers={n}", "fix config.json (a model with every layer dense is not a MoE)")
    return list(range(k)) or None


def first_k_dense(cfg: ModelConfig) -> int:
    """The dense layers as a count of first layers (what config.json can say)."""
    dense = sorted(cfg.mlp_only_layers or [])
    return len(dense)


def _int(hf: dict, key: str, where: str, default=None) -> int:
    v = hf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UserError("model.from_hf", f"{key}={v!r} in {where} is not a count", "fix config.json")
    return v


class SigmoidMoEFamily(MoEFamily):
    """What GLM-4.5 and DeepSeek-V3 share: config.json's router, shared-expert and dense-layer keys,
    the router's tensor names, the parameter counts and the validation. A subclass gives
    ``attention_params(cfg)`` (one block's attention, norms excluded) and its attention fields."""

    extra = {"moe": True, "fields": SIGMOID_FIELDS}
    experts_keys = ("n_routed_experts", "num_local_experts")
    mtp_key = "num_nextn_predict_layers"

    # ---- Hugging Face

    def check_hf(self, hf: dict, where: str, arch: str) -> None:
        hfc.check_act(hf, where, self.act_keys, ("silu", "swish"), "silu", "SwiGLU (silu)")
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "?") if isinstance(hf["quantization_config"], dict) else "?"
            hfc.refuse(where, f"a quantized checkpoint (quantization_config: {method})",
                       "dequantize it to bfloat16 first (DeepSeek's fp8_cast_bf16.py for the fp8 releases)")
        if hf.get("output_router_logits"):
            hfc.refuse(where, "output_router_logits (a load-balancing loss transformers does not define for this "
                       "router)", "set output_router_logits to false")

    def fields_from_hf(self, hf: dict, base: ModelConfig, where: str, arch: str) -> dict:
        n = int(hf.get("num_hidden_layers") or 0)
        e = next((hf[k] for k in self.experts_keys if hf.get(k) is not None), None)
        k = hf.get("num_experts_per_tok")
        if e is None or not k:
            hfc.refuse(where, "a config without n_routed_experts / num_experts_per_tok", "use a MoE checkpoint")
        n_group, topk_group = _int(hf, "n_group", where, 1) or 1, _int(hf, "topk_group", where, 1) or 1
        return dict(num_experts=int(e), experts_per_token=int(k),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]),
                    n_shared_experts=_int(hf, "n_shared_experts", where, 0),
                    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                    n_group=n_group, topk_group=topk_group, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                    mlp_only_layers=first_dense(hf, n, where), router_aux_loss_coef=0.0,
                    router_bias_update_rate=base.router_bias_update_rate)

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        hfc_base = hfc.base_to_hf(cfg)
        out.update(hfc_base)
        out.update(hidden_act="silu", n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size,
                   n_shared_experts=cfg.n_shared_experts, routed_scaling_factor=cfg.routed_scaling_factor,
                   n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                   first_k_dense_replace=first_k_dense(cfg), output_router_logits=False)
        out[self.mtp_key] = 0  # no multi-token-prediction layers are exported
        for key in ("num_experts", "num_local_experts", "router_aux_loss_coef"):
            out.pop(key, None)

    def hf_name(self, group: str, leaf_path: str) -> tuple[str, bool] | None:
        if group.startswith("block_") and leaf_path == "mlp/gate/e_score_correction_bias":
            return f"model.layers.{int(group[6:])}.mlp.gate.e_score_correction_bias", False
        return super().hf_name(group, leaf_path)

    def check_export(self, cfg: ModelConfig, arch: str) -> None:
        """Its one architecture takes every model of the family (Llama's refusals do not apply)."""

    def drops_tensor(self, name: str, cfg: ModelConfig) -> bool:
        """The multi-token-prediction layers: ``model.layers.{L}...`` and beyond."""
        parts = name.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
            and int(parts[2]) >= cfg.num_layers

    def on_import(self, hf: dict, cfg: ModelConfig, seq_len: int | None, say) -> None:
        mtp = hf.get(self.mtp_key) or 0
        if mtp:
            n = cfg.num_layers
            layers = f"model.layers.{n}" + (f"-{n + mtp - 1}" if mtp > 1 else "")
            say(f"hf import: {mtp} multi-token-prediction layer{'s' if mtp > 1 else ''} ({self.mtp_key}; "
                f"{layers}) dropped: megatrain-jax trains the {n} decoder layers")

    # ---- sizes

    def attention_params(self, cfg: ModelConfig) -> int:
        raise NotImplementedError

    def sparse_block_params(self, cfg: ModelConfig) -> int:
        h, e = cfg.hidden_size, cfg.num_experts
        f = cfg.moe_intermediate_size or cfg.intermediate_size
        return (self.attention_params(cfg) + 2 * h + h * e + e + e * 3 * h * f
                + 3 * h * f * cfg.n_shared_experts)

    def dense_block_params(self, cfg: ModelConfig) -> int:
        return self.attention_params(cfg) + 2 * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size

    def block_params(self, cfg: ModelConfig) -> int:
        """The largest block (a sparse one, unless every expert is tiny)."""
        if not cfg.num_experts:
            return self.dense_block_params(cfg)
        return max(self.sparse_block_params(cfg), self.dense_block_params(cfg) if cfg.mlp_only_layers else 0)

    def non_embedding_params(self, cfg: ModelConfig) -> int:
        dense = len(cfg.mlp_only_layers or ())
        return ((cfg.num_layers - dense) * self.sparse_block_params(cfg) + dense * self.dense_block_params(cfg)
                + cfg.hidden_size)

    def active_non_embedding_params(self, cfg: ModelConfig) -> int:
        sparse = cfg.num_layers - len(cfg.mlp_only_layers or ())
        f = cfg.moe_intermediate_size or cfg.intermediate_size
        idle = (cfg.num_experts - cfg.experts_per_token) * 3 * cfg.hidden_size * f
        return self.non_embedding_params(cfg) - sparse * idle

    def frozen_leaves(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The correction bias: never trained by gradient, and not decayed either."""
        return ("mlp/gate/e_score_correction_bias",)

    def aux_loss(self, cfg: ModelConfig):
        return None

    # ---- validation

    def validate(self, cfg: ModelConfig) -> None:
        no_gemma_fields(cfg)
        if cfg.sliding_window is not None or cfg.layer_types is not None:
            raise UserError("model.sliding_window", f"the {cfg.family} family has no sliding-window layers",
                            "set model.sliding_window and model.layer_types to null")
        if cfg.num_experts is None or cfg.experts_per_token is None:
            raise UserError("model.num_experts", f"the {cfg.family} family needs model.num_experts and "
                            "model.experts_per_token", "set both (GLM-4.5-Air: 128 and 8)")
        if cfg.router_aux_loss_coef:
            raise UserError("model.router_aux_loss_coef", f"the {cfg.family} router has no load-balancing loss "
                            "(its correction bias balances the experts)", "set model.router_aux_loss_coef: 0")
        if cfg.router_bias_update_rate:
            raise UserError("model.router_bias_update_rate", "updating the router's correction bias from the "
                            "experts' loads (auxiliary-loss-free balancing) is not implemented: the bias stays as "
                            "the checkpoint has it (frozen: no weight decay moves it)", "set model.router_bias_update_rate: 0")
        dense = cfg.mlp_only_layers
        if dense is not None and sorted(dense) != list(range(len(dense))):
            raise UserError("model.mlp_only_layers", f"the {cfg.family} family's dense layers are the first ones "
                            f"(first_k_dense_replace), got {dense!r}", "list 0 .. k-1, or null for none")
        if dense is not None and len(dense) >= cfg.num_layers:
            raise UserError("model.mlp_only_layers", "makes every layer dense (no experts left)",
                            "leave some layers sparse")
        for name, v, low in (("n_shared_experts", cfg.n_shared_experts, 0), ("n_group", cfg.n_group, 1),
                             ("topk_group", cfg.topk_group, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise UserError(f"model.{name}", f"must be an integer >= {low}, got {v!r}", f"fix model.{name}")
        e, g = cfg.num_experts, cfg.n_group
        if e % g or (g > 1 and e // g < 2):
            raise UserError("model.n_group", f"{g} groups do not split num_experts={e} into groups of >= 2",
                            "use a divisor of num_experts (1: no groups)")
        if cfg.topk_group > g:
            raise UserError("model.topk_group", f"{cfg.topk_group} is more than n_group={g}", "set topk_group <= n_group")
        if cfg.experts_per_token > cfg.topk_group * (e // g):
            raise UserError("model.experts_per_token", f"top-{cfg.experts_per_token} does not fit in {cfg.topk_group} "
                            f"group(s) of {e // g} experts", "raise topk_group or lower experts_per_token")
        if not cfg.routed_scaling_factor > 0:
            raise UserError("model.routed_scaling_factor", f"must be > 0, got {cfg.routed_scaling_factor!r}",
                            "set it to 1.0 (GLM-4.5) or the checkpoint's value")
