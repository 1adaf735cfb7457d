"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): the pre-norm block of a sparse mixture
of experts with

- **attention sinks**: per query head a learned logit that joins each row's softmax denominator and
  attends to nothing (``self_attn.sinks``, (heads,)). cuDNN's kernel has no such input, so these
  layers run the project's own XLA attention (``attention.py``: the plain path for short sequences,
  the blockwise online-softmax one beyond, where a sink starts each row's running softmax);
- **sliding-window (128) and full attention on alternating layers** (``model.layer_types``; the
  default pattern: even layers sliding), one compiled template per kind;
- **YaRN RoPE** (``models/common.py``: ``yarn_frequencies``; cos and sin times its attention factor);
- **biases** on q/k/v/o (``model.qkv_bias`` is true and brings the o_proj bias), the router and the
  experts;
- **the router**: a linear map with bias to E logits, top-k of the *logits*, softmax over those k
  (transformers' ``GptOssTopKRouter``);
- **the clamped SwiGLU** experts: ``(clip(up, -7, 7) + 1) * g * sigmoid(1.702 g)`` with
  ``g = min(gate, 7)``, computed through ``grouped_experts.routed_experts`` (its ``act`` and per-expert
  ``biases``).

Checkpoint layout: the experts are fused as ``mlp.experts.gate_up_proj`` (E, H, 2F), gate and up
interleaved (even / odd columns), with ``gate_up_proj_bias`` (E, 2F), and ``down_proj`` (E, F, H) with
``down_proj_bias`` (E, H), all ``(in, out)`` like our kernels. We keep the experts stacked as
``gate_proj``/``up_proj`` (E, H, F), ``down_proj`` (E, F, H) and the biases ``gate_bias``/``up_bias``
(E, F), ``down_bias`` (E, H); the names ``...gate_up_proj[0::2]`` / ``[1::2]`` (``hf/names.py``) make
the importer de-interleave and the exporter interleave again. The released checkpoints hold the
experts' matrices in MXFP4 (``*_blocks``/``*_scales``, ``hf/mxfp4.py``): dequantized exactly into the
fp32 master on import. Exports are bf16 (or fp32) safetensors that ``transformers`` loads.

The router's load-balancing loss (``output_router_logits``) is the MoE families' one (``moe.py``):
transformers takes it of the softmax over all E logits, as ``router_stats`` does.

Not supported (one ``UserError`` each, naming it): ``attention_bias: false``, other ``swiglu_alpha`` /
``swiglu_limit`` than the release's 1.702 / 7.0, ``attention_dropout`` > 0, a quantization other than
MXFP4, a RoPE scaling other than YaRN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import megatrain_jax.hf.config as hfc
from megatrain_jax.attention import attention
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import register
from megatrain_jax.models.common import Attention, Aux, RMSNorm, linear
from megatrain_jax.models.grouped_experts import routed_experts
from megatrain_jax.models.llama import no_gemma_fields
from megatrain_jax.models.moe import MoEBlock, MoEFamily, aux_coef, router_stats

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
ARCH = "GptOssForCausalLM"


def clamped_swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gpt-oss's expert activation (transformers' ``GptOssExperts._apply_gate``): the gate clamped
    from above, up from both sides, ``(up + 1) * gate * sigmoid(alpha * gate)``. ``where`` rather than
    ``minimum``: at the limit itself the gradient passes, as torch's ``clamp`` lets it."""
    gate = jnp.where(gate > SWIGLU_LIMIT, SWIGLU_LIMIT, gate).astype(gate.dtype)
    up = jnp.where(up > SWIGLU_LIMIT, SWIGLU_LIMIT, jnp.where(up < -SWIGLU_LIMIT, -SWIGLU_LIMIT, up)).astype(up.dtype)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * SWIGLU_ALPHA))


class GptOssAttention(Attention):
    """GQA attention with q/k/v/o biases and a learned sink logit per query head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, window: int | None = None):
        super().__init__(cfg, rngs, window=window, bias=True)
        self.o_proj = linear(cfg.num_heads * cfg.dim_per_head, cfg.hidden_size, True, cfg.init_std, rngs)
        self.sinks = nnx.Param(nnx.initializers.normal(cfg.init_std)(rngs.params(), (cfg.num_heads,), jnp.float32))

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, aux: Aux) -> jax.Array:
        b, s, n, d = q.shape
        out = attention(q, k, v, causal=True, segment_ids=aux.get("segment_ids"), window=self.window,
                        sinks=self.sinks[...])
        return out.reshape(b, s, n * d)


class GptOssExperts(nnx.Module):
    """Stacked expert weights (E, H, F) / (E, F, H) and their biases (E, F) / (E, H)."""

    def __init__(self, e: int, h: int, f: int, std: float, rngs: nnx.Rngs):
        init = nnx.initializers.normal(std)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, h, f), jnp.float32))
        self.up_proj = nnx.Param(init(rngs.params(), (e, h, f), jnp.float32))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, h), jnp.float32))
        self.gate_bias = nnx.Param(jnp.zeros((e, f), jnp.float32))
        self.up_bias = nnx.Param(jnp.zeros((e, f), jnp.float32))
        self.down_bias = nnx.Param(jnp.zeros((e, h), jnp.float32))


class GptOssMoE(nnx.Module):
    """Router (linear with bias; top-k of the logits, softmax over the k) + the clamped-SwiGLU experts."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, stats: bool = False):
        h, e, f = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
        self.top_k, self.impl, self.stats = cfg.experts_per_token, cfg.moe_impl, stats
        self.router = nnx.Linear(h, e, use_bias=True, kernel_init=nnx.initializers.normal(cfg.init_std),
                                 bias_init=nnx.initializers.zeros_init(), param_dtype=jnp.float32, rngs=rngs)
        self.experts = GptOssExperts(e, h, f, cfg.init_std, rngs)

    def __call__(self, x: jax.Array):
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        logits = self.router(flat)
        top, idx = jax.lax.top_k(logits, self.top_k)
        weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(logits.dtype)
        idx = idx.astype(jnp.int32)
        ex = self.experts
        wg, wu, wd, bg, bu, bd = (p[...].astype(x.dtype) for p in (ex.gate_proj, ex.up_proj, ex.down_proj,
                                                                    ex.gate_bias, ex.up_bias, ex.down_bias))
        out = routed_experts(flat, weights, idx, wg, wu, wd, impl=self.impl, act=clamped_swiglu,
                             biases=(bg, bu, bd)).reshape(b, s, h)
        if self.stats:
            return out, router_stats(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), idx)
        return out


class GptOssBlock(MoEBlock):
    """x + attn(norm(x)), then + moe(norm(x)); with ``router_aux_loss_coef`` > 0 it returns
    ``(hidden, router_stats)`` (``emits_stats``)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, rngs, window=cfg.layer_window(layer))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.emits_stats = bool(cfg.router_aux_loss_coef)
        self.mlp = GptOssMoE(cfg, rngs, stats=self.emits_stats)


# ------------------------------------------------------------------------------- sizes


def attention_params(cfg: ModelConfig) -> int:
    """q/k/v/o with biases, the sinks, the two norms."""
    h, d = cfg.hidden_size, cfg.dim_per_head
    q, kv = cfg.num_heads * d, cfg.kv_heads * d
    return 2 * h * q + 2 * h * kv + q + 2 * kv + h + cfg.num_heads + 2 * h


def expert_params(cfg: ModelConfig) -> int:
    """One expert: gate, up, down and their biases."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    return 3 * h * f + 2 * f + h


# ------------------------------------------------------------------------------- the family


class GptOssFamily(MoEFamily):
    name = "gpt_oss"
    architectures = (ARCH,)
    model_types = ("gpt_oss",)
    block = GptOssBlock
    extra = {"moe": True, "attention_sinks": True, "rope_scalings": ("yarn",)}
    rope_scalings = ("yarn",)

    # ---- Hugging Face config.json

    def check_hf(self, hf: dict, where: str, arch: str) -> None:
        if hf.get("attention_bias", True) is not True:
            hfc.refuse(where, "attention_bias: false (gpt-oss without q/k/v/o biases)",
                       "use a gpt-oss checkpoint with attention biases")
        for key, want in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
            if float(hf.get(key, want)) != want:
                hfc.refuse(where, f"{key}={hf[key]} (only {want}, the release's)", f"set {key} to {want}")
        if hf.get("attention_dropout"):
            hfc.refuse(where, f"attention_dropout={hf['attention_dropout']}", "set attention_dropout to 0")
        quant = hf.get("quantization_config")
        if quant and quant.get("quant_method") != "mxfp4":
            hfc.refuse(where, f"quantization {quant.get('quant_method')!r} (only the release's MXFP4 experts)",
                       "use the released MXFP4 checkpoint or a bf16/fp32 one")

    def fields_from_hf(self, hf: dict, base: ModelConfig, where: str, arch: str) -> dict:
        n = int(hf.get("num_hidden_layers") or 0)
        window = int(hf["sliding_window"]) if hf.get("sliding_window") else None
        types = hfc.layer_types_from_hf(hf, n, default_layer_types(n))
        if window is None and "sliding_attention" in types:
            hfc.refuse(where, "sliding_attention layers without a sliding_window", "set sliding_window (128)")
        e, k = hf.get("num_local_experts", hf.get("num_experts")), hf.get("num_experts_per_tok")
        if not e or not k:
            hfc.refuse(where, "a config without num_local_experts / num_experts_per_tok", "use a gpt-oss config.json")
        return dict(qkv_bias=True, sliding_window=window, layer_types=types, num_experts=int(e),
                    experts_per_token=int(k), moe_intermediate_size=None, norm_topk_prob=True,
                    router_aux_loss_coef=aux_coef(hf, base, where))

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        super().to_hf_config(cfg, arch, out)
        out.pop("num_experts", None)
        out.update(attention_bias=True, num_local_experts=cfg.num_experts, sliding_window=cfg.sliding_window,
                   layer_types=cfg.resolved_layer_types(), swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT,
                   attention_dropout=0.0)

    def hf_name(self, group: str, leaf_path: str) -> tuple[str, bool] | None:
        if not group.startswith("block_"):
            return None
        pre = f"model.layers.{int(group[6:])}."
        if leaf_path == "self_attn/sinks":
            return pre + "self_attn.sinks", False
        names = {"gate_proj": "gate_up_proj[0::2]", "up_proj": "gate_up_proj[1::2]", "down_proj": "down_proj",
                 "gate_bias": "gate_up_proj_bias[0::2]", "up_bias": "gate_up_proj_bias[1::2]",
                 "down_bias": "down_proj_bias"}
        if leaf_path.startswith("mlp/experts/") and leaf_path[12:] in names:
            return pre + "mlp.experts." + names[leaf_path[12:]], False
        return None  # the router (mlp.router.weight / .bias) and attention: the module tree's names

    def export_architecture(self, cfg: ModelConfig) -> str:
        return ARCH

    def check_export(self, cfg: ModelConfig, arch: str) -> None:
        pass

    def export_extras(self, cfg: ModelConfig, arch: str, layer: int) -> list:
        return []

    def on_import(self, hf: dict, cfg: ModelConfig, seq_len: int | None, say) -> None:
        if (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4":
            say("hf import: the experts' MXFP4 blocks and scales are dequantized exactly into the fp32 master")
        if cfg.sliding_window is not None:
            say(f"hf import: sliding_window={cfg.sliding_window} on the sliding_attention layers "
                f"({cfg.resolved_layer_types().count('sliding_attention')} of {cfg.num_layers})")

    # ---- sizes and validation

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        if cfg.sliding_window is None:
            return ["full_attention"] * cfg.num_layers
        return default_layer_types(cfg.num_layers)

    def block_params(self, cfg: ModelConfig) -> int:
        return attention_params(cfg) + cfg.hidden_size * cfg.num_experts + cfg.num_experts + \
            cfg.num_experts * expert_params(cfg)

    def non_embedding_params(self, cfg: ModelConfig) -> int:
        return cfg.num_layers * self.block_params(cfg) + cfg.hidden_size

    def active_non_embedding_params(self, cfg: ModelConfig) -> int:
        idle = (cfg.num_experts - cfg.experts_per_token) * expert_params(cfg)
        return self.non_embedding_params(cfg) - cfg.num_layers * idle

    def validate(self, cfg: ModelConfig) -> None:
        no_gemma_fields(cfg)
        if cfg.num_experts is None or cfg.experts_per_token is None:
            raise UserError("model.num_experts", "the gpt_oss family needs model.num_experts and "
                            "model.experts_per_token", "set both (gpt-oss-20b: 32 and 4)")
        if not cfg.qkv_bias:
            raise UserError("model.qkv_bias", "gpt-oss always has q/k/v/o biases", "set model.qkv_bias: true")
        if not cfg.norm_topk_prob:
            raise UserError("model.norm_topk_prob", "gpt-oss's router takes a softmax over the top-k logits "
                            "(weights sum to 1)", "set model.norm_topk_prob: true")
        if cfg.mlp_only_layers is not None:
            raise UserError("model.mlp_only_layers", "every gpt-oss layer is sparse", "set model.mlp_only_layers: null")
        if cfg.moe_intermediate_size is not None:
            raise UserError("model.moe_intermediate_size", "gpt-oss's expert width is model.intermediate_size",
                            "set model.moe_intermediate_size: null")
        if cfg.rope_scaling is not None and cfg.rope_scaling.get("rope_type") != "yarn":
            raise UserError("model.rope_scaling", f"gpt-oss uses YaRN RoPE, not {cfg.rope_scaling.get('rope_type')!r}",
                            "set model.rope_scaling to {rope_type: yarn, ...} or null")


def default_layer_types(n: int) -> list[str]:
    """transformers' GptOssConfig default: sliding on even layers, full on odd ones."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]


register(GptOssFamily())
