"""The Llama family: Llama 2/3 (incl. Llama 3.1 RoPE scaling), Qwen2/2.5 (q/k/v biases), Mistral
(sliding window). Pre-norm blocks: x + attn(norm(x)), then + mlp(norm(x)), SwiGLU MLP.

Hugging Face: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``; tensor names
follow the module tree (``registry.py``). Q/K weights are *not* permuted: the ``transformers``
format already uses the rotate-half RoPE layout that ``apply_rope`` implements.

This module also re-exports the generic decoder (``Llama`` is ``common.Decoder``, which builds any
family's blocks from ``cfg.family``) and its helpers, where older code imports them from.
"""
from __future__ import annotations

from flax import nnx

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
import megatrain_jax.models.hfconfig as hfconfig
from megatrain_jax.models.hfnames import HFWarning, default_hf_name
from megatrain_jax.models.common import (Attention, Aux, Decoder, Embed, Head, MLP, RMSNorm, abstract_model,  # noqa: F401
                                         apply_rope, dense_block_params, dot_product_attention, init_host_store,
                                         init_model, init_part, llama3_scale_frequencies, make_aux, over_tiles,
                                         part_names, rope_tables, streamed_parts)
from megatrain_jax.models.registry import Family, register

Llama = Decoder  # the whole model of any family (the name predates the other families)


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)).

    Subclasses (Qwen3, Phi-3) change the class attributes: ``QK_NORM`` (per-head q/k norm class)
    and ``FUSED`` (one qkv_proj and one gate_up_proj kernel)."""

    QK_NORM = None
    FUSED = False
    SEQ_TILING = True  # honours model.seq_tile (the plan checks this before it tiles a family's blocks)

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rngs, window=cfg.layer_window(layer), bias=cfg.qkv_bias,
                                   qk_norm=self.QK_NORM, fused=self.FUSED, scale=cfg.attention_scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, rngs, fused=self.FUSED)
        self.seq_tile = cfg.seq_tile_tokens  # static: part of the template, the same for every layer

    def __call__(self, x, aux: Aux):
        if 0 < self.seq_tile < x.shape[1]:
            return self._tiled(x, aux)
        x = x + self.self_attn(self.input_layernorm(x), aux)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _tiled(self, x, aux: Aux):
        """The same block with norms, projections and the MLP over sequence tiles (``over_tiles``);
        attention alone sees the whole sequence."""
        attn = self.self_attn
        q, k, v = over_tiles(lambda m, xt, c, s: m[1].project(m[0](xt), c, s), (self.input_layernorm, attn),
                             self.seq_tile, x, *attn.rope(aux))
        o = attn.attend(q, k, v, aux)

        def post(m, ot, xt):
            h = xt + m[0](ot)
            return h + m[2](m[1](h))

        return over_tiles(post, (attn.o_proj, self.post_attention_layernorm, self.mlp), self.seq_tile, o, x)


# ------------------------------------------------------------------------------- Hugging Face

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def layer_windows(hf: dict, arch: str) -> list[int | None]:
    """Each layer's attention window as ``transformers`` builds it (None: full causal attention).
    Mistral: ``sliding_window`` on every layer. Qwen2: ``layer_types`` if given, else sliding on
    layers from ``max_window_layers`` on, and only with ``use_sliding_window``."""
    window = int(hf["sliding_window"]) if hf.get("sliding_window") else None
    layers = int(hf.get("num_hidden_layers") or 0)
    if arch != "Qwen2ForCausalLM":
        return [window if arch == "MistralForCausalLM" else None] * layers  # Llama has no window
    if not hf.get("use_sliding_window", False) or window is None:
        return [None] * layers
    types = hf.get("layer_types") or ["sliding_attention" if i >= int(hf.get("max_window_layers", layers)) else
                                      "full_attention" for i in range(layers)]
    return [window if t == "sliding_attention" else None for t in types]


def sliding_window(hf: dict, arch: str) -> int | None:
    """The one attention window of every layer (None: full causal attention). A mix of windowed
    and full layers (some Qwen2 configs) cannot be expressed by the llama family: None, and the
    importer warns."""
    windows = set(layer_windows(hf, arch))
    return windows.pop() if len(windows) == 1 else None


def config_from_hf(hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
    hfconfig.check_act(hf, where, ("hidden_act", "hidden_activation"), ("silu", "swish"), "silu", "SwiGLU (silu)")
    if arch == "LlamaForCausalLM" and hf.get("attention_bias"):
        raise UserError("model.from_hf", f"attention_bias in {where} (a bias on q/k/v and o_proj) is not supported",
                        "use a checkpoint without attention biases (Qwen2-style q/k/v-only biases are supported)")
    if hf.get("mlp_bias"):
        raise UserError("model.from_hf", f"mlp_bias in {where} is not supported", "use a checkpoint without MLP biases")
    theta, scaling = hfconfig.rope_from_hf(hf, where)
    return hfconfig.base_from_hf(hf, base, where, "llama", rope_theta=theta, rope_scaling=scaling,
                                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                                 qkv_bias=arch == "Qwen2ForCausalLM", sliding_window=sliding_window(hf, arch))


def config_to_hf(cfg: ModelConfig, arch: str, out: dict) -> None:
    out["hidden_act"] = "silu"
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False)
    if arch == "MistralForCausalLM":  # explicit null: transformers' default is 4096
        out["sliding_window"] = cfg.sliding_window
    if arch == "Qwen2ForCausalLM" and cfg.sliding_window is not None:  # every layer windowed
        out.update(use_sliding_window=True, sliding_window=cfg.sliding_window, max_window_layers=0)
    if arch == "Qwen2ForCausalLM":  # (a source's mixed layers, imported as full attention, are kept as they were)
        out.setdefault("use_sliding_window", False)
        out.setdefault("sliding_window", None)
        out.setdefault("max_window_layers", cfg.num_layers)


def export_architecture(cfg: ModelConfig) -> str:
    return ("Qwen2ForCausalLM" if cfg.qkv_bias else
            "MistralForCausalLM" if cfg.sliding_window is not None else "LlamaForCausalLM")


def check_export(cfg: ModelConfig, arch: str) -> None:
    if cfg.qkv_bias and arch != "Qwen2ForCausalLM":
        raise UserError("architecture", f"{arch} has no q/k/v biases but the model does", "export as Qwen2ForCausalLM")
    if cfg.sliding_window is not None and arch == "LlamaForCausalLM":
        raise UserError("architecture", f"LlamaForCausalLM has no sliding window but the model has "
                        f"sliding_window={cfg.sliding_window}", "export as MistralForCausalLM")


def export_extras(cfg: ModelConfig, arch: str, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2 always has q/k/v biases: zeros for a model without them."""
    if arch != "Qwen2ForCausalLM" or cfg.qkv_bias:
        return []
    d = cfg.dim_per_head
    return [(f"model.layers.{layer}.self_attn.{proj}.bias", (n * d,))
            for proj, n in (("q_proj", cfg.num_heads), ("k_proj", cfg.kv_heads), ("v_proj", cfg.kv_heads))]


def on_import(hf: dict, cfg: ModelConfig, seq_len: int | None, say) -> None:
    import warnings

    windows = set(layer_windows(hf, hfconfig_arch(hf)))
    if len(windows) > 1:
        window = max(w for w in windows if w is not None)
        if seq_len is None or seq_len > window:
            warnings.warn(f"model.from_hf: the checkpoint mixes full and sliding-window (sliding_window={window}) "
                          "layers, which megatrain-jax does not implement: every layer uses full causal attention, so "
                          "the windowed layers attend further back than in the original model", HFWarning, stacklevel=4)
        else:
            say(f"hf import: the windowed layers (sliding_window={window}) are treated as full attention "
                f"(identical for sequences of up to {window} tokens)")
    elif cfg.sliding_window is not None:
        longer = seq_len is None or seq_len > cfg.sliding_window
        say(f"hf import: sliding_window={cfg.sliding_window}: each token attends to itself and the "
            f"{cfg.sliding_window - 1} before it" + ("" if longer else f" (all of a {seq_len}-token sequence)"))


def hfconfig_arch(hf: dict) -> str:
    from megatrain_jax.models.registry import architecture_of

    return architecture_of(hf, "config.json")


def validate(cfg: ModelConfig) -> None:
    if cfg.layer_types is not None and len(set(cfg.layer_types)) > 1:
        raise UserError("model.layer_types", "the llama family uses model.sliding_window on every layer",
                        "set layer_types to null (or use a family with mixed layers, e.g. gemma2)")
    _no_gemma_fields(cfg)


def _no_gemma_fields(cfg: ModelConfig) -> None:
    for name in ("attn_softcap", "final_softcap", "rope_local_theta"):
        if getattr(cfg, name) is not None:
            raise UserError(f"model.{name}", f"the {cfg.family} family has no {name}",
                            "set it to null, or use model.family gemma2/gemma3")


register(Family(
    name="llama", architectures=ARCHS, model_types=("llama", "qwen2", "mistral"), block=Block,
    block_params=lambda cfg: dense_block_params(cfg, qkv_bias=cfg.qkv_bias),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, validate=validate,
    export_architecture=export_architecture, check_export=check_export, export_extras=export_extras,
    on_import=on_import, hf_name=default_hf_name))
