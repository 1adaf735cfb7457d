"""A Llama-family decoder as Flax NNX modules: Llama 2/3, Qwen2/2.5 (qkv bias), Mistral.

The model is three kinds of parts, and that split is what the streaming engine sees:
``Embed`` (tokens -> hidden), a stack of identical ``Block``s (hidden -> hidden), and ``Head``
(final RMSNorm + LM head, or the tied embedding). Each ``Block`` is called as
``block(hidden, aux)`` where ``aux`` carries what every layer shares (RoPE tables, the document
mask); that is the signature of a layer template (see ``templates.py``).

Weights are kept in ``param_dtype`` (fp32 master); compute happens in the dtype of the incoming
weights and hidden state, so the same module serves fp32 and bf16 compute. Kernels are stored
``(in, out)`` (the Flax convention); the Hugging Face converter transposes.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.attention import attention
from megatrain_jax.config import ModelConfig

Aux = dict[str, Any]


def rope_tables(positions: jax.Array, head_dim: int, theta: float,
                scaling: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape (B, S, head_dim // 2) in fp32 for integer positions (B, S)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is not None:
        inv_freq = llama3_scale_frequencies(inv_freq, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, S, D/2)
    return jnp.cos(angles), jnp.sin(angles)


def llama3_scale_frequencies(inv_freq: jax.Array, scaling: dict) -> jax.Array:
    """Llama 3.1 RoPE scaling (as ``transformers``' ``_compute_llama3_parameters``): long
    wavelengths are divided by ``factor``, short ones kept, the band between interpolated."""
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"unsupported rope_scaling {scaling!r}; only rope_type llama3 is implemented")
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


def make_aux(positions: jax.Array, cfg: ModelConfig, segment_ids: jax.Array | None = None) -> Aux:
    """Per-sequence inputs every block shares: RoPE tables and (optionally) document segment ids."""
    cos, sin = rope_tables(positions, cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling)
    aux = {"cos": cos, "sin": sin}
    if segment_ids is not None:
        aux["segment_ids"] = segment_ids
    return aux


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face Llama layout). x: (B, S, N, D); cos/sin: (B, S, D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


def _linear(din: int, dout: int, bias: bool, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=bias, kernel_init=nnx.initializers.normal(std),
                      bias_init=nnx.initializers.zeros_init(), param_dtype=jnp.float32, rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE; causal, optionally inside document boundaries."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.dim_per_head
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, d
        self.window = cfg.sliding_window
        self.q_proj = _linear(h, cfg.num_heads * d, cfg.qkv_bias, cfg.init_std, rngs)
        self.k_proj = _linear(h, cfg.kv_heads * d, cfg.qkv_bias, cfg.init_std, rngs)
        self.v_proj = _linear(h, cfg.kv_heads * d, cfg.qkv_bias, cfg.init_std, rngs)
        self.o_proj = _linear(cfg.num_heads * d, h, False, cfg.init_std, rngs)

    def __call__(self, x: jax.Array, aux: Aux) -> jax.Array:
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.kv_heads, self.head_dim)
        q, k = apply_rope(q, aux["cos"], aux["sin"]), apply_rope(k, aux["cos"], aux["sin"])
        out = dot_product_attention(q, k, v, aux.get("segment_ids"), window=self.window)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim))


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                          window: int | None = None) -> jax.Array:
    """Causal GQA attention, inside document boundaries when ``segment_ids`` is given, through the
    one entry point that picks cuDNN / padded cuDNN / XLA / blockwise per shape (``attention.py``)."""
    return attention(q, k, v, causal=True, segment_ids=segment_ids, window=window)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(h, f, False, cfg.init_std, rngs)
        self.up_proj = _linear(h, f, False, cfg.init_std, rngs)
        self.down_proj = _linear(f, h, False, cfg.init_std, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, aux: Aux) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), aux)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        self.embedding = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32))

    def __call__(self, tokens: jax.Array, dtype=None) -> jax.Array:
        table = self.embedding[...]
        if dtype is not None:
            table = table.astype(dtype)
        return jnp.take(table, tokens, axis=0)


class Head(nnx.Module):
    """Final RMSNorm and the LM head (absent when embeddings are tied: the head uses Embed's table)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied = cfg.tie_embeddings
        if not self.tied:
            init = nnx.initializers.normal(cfg.init_std)
            self.lm_head = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), jnp.float32))

    def output_matrix(self, embedding: jax.Array | None = None) -> jax.Array:
        """(H, V) matrix mapping normed hidden states to logits."""
        return embedding.T if self.tied else self.lm_head[...]

    def __call__(self, x: jax.Array, embedding: jax.Array | None = None) -> jax.Array:
        w = self.output_matrix(embedding).astype(x.dtype)
        return jnp.einsum("bsh,hv->bsv", self.norm(x), w, preferred_element_type=jnp.float32)


class Llama(nnx.Module):
    """The whole decoder, for the in-memory reference trainer and for inference."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.cfg = cfg
        self.embed = init_part(cfg, seed, "embed")
        self.layers = nnx.List([init_part(cfg, seed, f"block_{i}") for i in range(cfg.num_layers)])
        self.head = init_part(cfg, seed, "head")

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, dtype=jnp.float32, remat: bool = False) -> jax.Array:
        """Logits (B, S, V) in fp32. ``remat`` recomputes each block in the backward."""
        x = self.final_hidden(tokens, positions, segment_ids, dtype, remat)
        emb = self.embed.embedding[...].astype(dtype) if self.cfg.tie_embeddings else None
        return self.head(x, emb)

    def final_hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
                     segment_ids: jax.Array | None = None, dtype=jnp.float32, remat: bool = False) -> jax.Array:
        """The last block's output (B, S, H), before the final norm."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        aux = make_aux(positions, self.cfg, segment_ids)
        x = self.embed(tokens, dtype)
        call = nnx.remat(_call_block) if remat else _call_block
        for layer in self.layers:
            x = call(layer, x, aux)
        return x


def _call_block(layer: Block, x: jax.Array, aux: Aux) -> jax.Array:
    return layer(x, aux)


def init_part(cfg: ModelConfig, seed: int, name: str) -> nnx.Module:
    """One part (``embed``, ``block_i`` or ``head``) with its own RNG stream.

    Each part's key depends only on (seed, name), so the host store can be initialised one part
    at a time (never the whole model in memory at once) and still equal ``init_model``.
    """
    base = jax.random.key(seed)
    if name == "embed":
        return Embed(cfg, nnx.Rngs(params=jax.random.fold_in(base, 1 << 20)))
    if name == "head":
        return Head(cfg, nnx.Rngs(params=jax.random.fold_in(base, (1 << 20) + 1)))
    index = int(name.split("_")[1])
    return Block(cfg, nnx.Rngs(params=jax.random.fold_in(base, index)))


def part_names(cfg: ModelConfig) -> list[str]:
    return ["embed"] + [f"block_{i}" for i in range(cfg.num_layers)] + ["head"]


def init_model(cfg: ModelConfig, seed: int) -> Llama:
    return Llama(cfg, seed)


def abstract_model(cfg: ModelConfig) -> Llama:
    """The model's structure with ``ShapeDtypeStruct`` leaves: templates without allocating weights."""
    return nnx.eval_shape(lambda: Llama(cfg, 0))


def streamed_parts(model: Llama) -> "StreamedModel":
    """Split a ``Llama`` into the engine's parts, through the same door a user's NNX model uses."""
    from megatrain_jax.templates import StreamedModel, from_nnx

    cfg = model.cfg
    embed_graph, embed_state = nnx.split(model.embed)
    head_graph, head_state = nnx.split(model.head)

    def embed_fn(w, tokens):
        return nnx.merge(embed_graph, w)(tokens)

    def head_fn(w, hidden, embed_w):
        head = nnx.merge(head_graph, w)
        emb = embed_w["embedding"] if embed_w is not None else None
        return head.norm(hidden), head.output_matrix(emb).astype(hidden.dtype)

    def aux_fn(positions, segment_ids=None):
        return make_aux(positions, cfg, segment_ids)

    return StreamedModel(embed_fn=embed_fn, blocks=from_nnx(list(model.layers)), head_fn=head_fn,
                         aux_fn=aux_fn, embed_weights=nnx.to_pure_dict(embed_state),
                         head_weights=nnx.to_pure_dict(head_state), tied=cfg.tie_embeddings)


def init_host_store(cfg: ModelConfig, seed: int, bf16_stream: bool):
    """Abstract parts plus a host store initialised part by part (peak memory: one part).

    Returns ``(parts, store)``; equal to ``streamed_parts(init_model(cfg, seed))`` in value.
    """
    from megatrain_jax.hoststore import HostStore
    from megatrain_jax.templates import Layout

    parts = streamed_parts(abstract_model(cfg))
    store = HostStore({n: Layout(t) for n, t in parts.host_trees().items()}, bf16_stream)
    if cfg.init == "fast":
        store.fill_fast(seed, cfg.init_std)
        return parts, store
    for name in part_names(cfg):
        module = init_part(cfg, seed, name)
        store.load_group(name, nnx.to_pure_dict(nnx.state(module)))
        del module
    return parts, store
