"""The Llama family: Llama 2/3 (incl. Llama 3.1 RoPE scaling), Qwen2/2.5 (q/k/v biases), Mistral
(sliding window). Pre-norm blocks: x + attn(norm(x)), then + mlp(norm(x)), SwiGLU MLP.

Hugging Face: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``; tensor names
follow the module tree (``hf/names.py``). Q/K weights are *not* permuted: the ``transformers``
format already uses the rotate-half RoPE layout that ``apply_rope`` implements.

``LlamaFamily`` is the base of the families that differ from Llama by a few fields (``qwen3.py``,
``phi3.py``, the mixture-of-experts ``mixtral.py`` and ``qwen3_moe.py``): they extend its block and
its family object, overriding the hooks of ``from_hf_config`` (``check_hf``, ``fields_from_hf``),
``to_hf_config`` (``super()`` then their keys), ``block_params`` and ``validate``.

This module also re-exports the generic decoder (``Llama`` is ``common.Decoder``, which builds any
family's blocks from ``cfg.family``) and its helpers, where older code imports them from.
"""
from __future__ import annotations

import warnings

from flax import nnx

import megatrain_jax.hf.config as hfc
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import Family, architecture_of, register
from megatrain_jax.models.common import (Attention, Aux, Decoder, Embed, Head, MLP, RMSNorm, abstract_model,  # noqa: F401
                                         apply_rope, dense_block_params, dot_product_attention, init_host_store,
                                         init_model, init_part, llama3_scale_frequencies, make_aux, over_tiles,
                                         part_names, rope_tables, streamed_parts)

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

LLAMA, QWEN2, MISTRAL = "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"
ARCHS = (LLAMA, QWEN2, MISTRAL)


def layer_windows(hf: dict, arch: str) -> list[int | None]:
    """Each layer's attention window as ``transformers`` builds it (None: full causal attention).
    Mistral: ``sliding_window`` on every layer. Qwen2: ``layer_types`` if given, else sliding on
    layers from ``max_window_layers`` on, and only with ``use_sliding_window``."""
    window = int(hf["sliding_window"]) if hf.get("sliding_window") else None
    layers = int(hf.get("num_hidden_layers") or 0)
    if arch != QWEN2:
        return [window if arch == MISTRAL else None] * layers  # Llama has no window
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


def no_gemma_fields(cfg: ModelConfig) -> None:
    for name in ("attn_softcap", "final_softcap", "rope_local_theta"):
        if getattr(cfg, name) is not None:
            raise UserError(f"model.{name}", f"the {cfg.family} family has no {name}",
                            "set it to null, or use model.family gemma2/gemma3")


def no_qkv_bias(cfg: ModelConfig) -> None:
    if cfg.qkv_bias:
        raise UserError("model.qkv_bias", f"the {cfg.family} family has no q/k/v biases", "set model.qkv_bias: false")


class LlamaFamily(Family):
    name = "llama"
    architectures = ARCHS
    model_types = ("llama", "qwen2", "mistral")
    block = Block
    act_keys = ("hidden_act", "hidden_activation")  # where config.json names the MLP activation (in order)
    rope_scalings = ("llama3", "linear")  # the rope_scaling types it imports

    # ---- Hugging Face config.json

    def from_hf_config(self, hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
        self.check_hf(hf, where, arch)
        theta, scaling = hfc.rope_from_hf(hf, where, allowed=self.rope_scalings)
        return hfc.base_from_hf(hf, base, where, self.name, rope_theta=theta, rope_scaling=scaling,
                                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                                **self.fields_from_hf(hf, base, where, arch))

    def check_hf(self, hf: dict, where: str, arch: str) -> None:
        """Refuse (``UserError``) what the family cannot run, before anything is read."""
        hfc.check_act(hf, where, self.act_keys, ("silu", "swish"), "silu", "SwiGLU (silu)")
        if arch == LLAMA and hf.get("attention_bias"):
            raise UserError("model.from_hf", f"attention_bias in {where} (a bias on q/k/v and o_proj) is not supported",
                            "use a checkpoint without attention biases (Qwen2-style q/k/v-only biases are supported)")
        if hf.get("mlp_bias"):
            raise UserError("model.from_hf", f"mlp_bias in {where} is not supported", "use a checkpoint without MLP biases")

    def fields_from_hf(self, hf: dict, base: ModelConfig, where: str, arch: str) -> dict:
        """The family's ``ModelConfig`` fields beyond the common sizes, RoPE and tied embeddings."""
        return dict(qkv_bias=arch == QWEN2, sliding_window=sliding_window(hf, arch))

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        out.update(hfc.base_to_hf(cfg))
        out["hidden_act"] = "silu"
        if arch == LLAMA:
            out.update(attention_bias=False, mlp_bias=False)
        if arch == MISTRAL:  # explicit null: transformers' default is 4096
            out["sliding_window"] = cfg.sliding_window
        if arch == QWEN2 and cfg.sliding_window is not None:  # every layer windowed
            out.update(use_sliding_window=True, sliding_window=cfg.sliding_window, max_window_layers=0)
        if arch == QWEN2:  # (a source's mixed layers, imported as full attention, are kept as they were)
            out.setdefault("use_sliding_window", False)
            out.setdefault("sliding_window", None)
            out.setdefault("max_window_layers", cfg.num_layers)

    # ---- export and import (Llama's three architectures; the families extending it have none of these)

    def export_architecture(self, cfg: ModelConfig) -> str:
        if cfg.qkv_bias and QWEN2 in self.architectures:
            return QWEN2
        if cfg.sliding_window is not None and MISTRAL in self.architectures:
            return MISTRAL
        return self.architectures[0]

    def check_export(self, cfg: ModelConfig, arch: str) -> None:
        if cfg.qkv_bias and arch != QWEN2:
            raise UserError("architecture", f"{arch} has no q/k/v biases but the model does", "export as Qwen2ForCausalLM")
        if cfg.sliding_window is not None and arch == LLAMA:
            raise UserError("architecture", f"LlamaForCausalLM has no sliding window but the model has "
                            f"sliding_window={cfg.sliding_window}", "export as MistralForCausalLM")

    def export_extras(self, cfg: ModelConfig, arch: str, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """Qwen2 always has q/k/v biases: zeros for a model without them."""
        if arch != QWEN2 or cfg.qkv_bias:
            return []
        d = cfg.dim_per_head
        return [(f"model.layers.{layer}.self_attn.{proj}.bias", (n * d,))
                for proj, n in (("q_proj", cfg.num_heads), ("k_proj", cfg.kv_heads), ("v_proj", cfg.kv_heads))]

    def on_import(self, hf: dict, cfg: ModelConfig, seq_len: int | None, say) -> None:
        arch = architecture_of(hf, "config.json")
        if arch not in ARCHS:
            return
        windows = set(layer_windows(hf, arch))
        if len(windows) > 1:
            window = max(w for w in windows if w is not None)
            if seq_len is None or seq_len > window:
                warnings.warn(f"model.from_hf: the checkpoint mixes full and sliding-window (sliding_window={window}) "
                              "layers, which megatrain-jax does not implement: every layer uses full causal attention, "
                              "so the windowed layers attend further back than in the original model", hfc.HFWarning,
                              stacklevel=4)
            else:
                say(f"hf import: the windowed layers (sliding_window={window}) are treated as full attention "
                    f"(identical for sequences of up to {window} tokens)")
        elif cfg.sliding_window is not None:
            longer = seq_len is None or seq_len > cfg.sliding_window
            say(f"hf import: sliding_window={cfg.sliding_window}: each token attends to itself and the "
                f"{cfg.sliding_window - 1} before it" + ("" if longer else f" (all of a {seq_len}-token sequence)"))

    # ---- sizes and validation

    def block_params(self, cfg: ModelConfig) -> int:
        return dense_block_params(cfg, qkv_bias=cfg.qkv_bias)

    def validate(self, cfg: ModelConfig) -> None:
        if cfg.layer_types is not None and len(set(cfg.layer_types)) > 1:
            raise UserError("model.layer_types", "the llama family uses model.sliding_window on every layer",
                            "set layer_types to null (or use a family with mixed layers, e.g. gemma2)")
        no_gemma_fields(cfg)


register(LlamaFamily())
