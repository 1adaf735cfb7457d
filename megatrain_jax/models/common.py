"""What every decoder family shares: norms, RoPE, a configurable attention, the gated MLPs, the
embedding and head, and the generic decoder that stacks a family's blocks.

The model is three kinds of parts, and that split is what the streaming engine sees: ``Embed``
(tokens -> hidden), a stack of blocks (hidden -> hidden), and ``Head`` (final norm + LM head, or
the tied embedding). Each block is called as ``block(hidden, aux)`` where ``aux`` carries what
every layer shares (RoPE tables, one per RoPE base; the document ids); that is the signature of a
layer template (see ``templates.py``). Which block class, which final norm and whether the
embedding is scaled come from the family object (``megatrain_jax/families.py``) named by ``cfg.family``.

Weights are kept in ``param_dtype`` (fp32 master); compute happens in the dtype of the incoming
weights and hidden state, so the same module serves fp32 and bf16 compute. Kernels are stored
``(in, out)`` (the Flax convention); the Hugging Face converter transposes.
"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax import kvcache
from megatrain_jax.attention import attention
from megatrain_jax.config import ModelConfig
from megatrain_jax.families import get_family

Aux = dict[str, Any]


# ------------------------------------------------------------------------------------------ RoPE


def rope_tables(positions: jax.Array, head_dim: int, theta: float,
                scaling: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape (B, S, head_dim // 2) in fp32 for integer positions (B, S); YaRN scales both
    by its attention factor, as transformers does."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    factor = 1.0
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "linear":  # transformers' _compute_linear_scaling_rope_parameters
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "yarn":
            inv_freq, factor = yarn_frequencies(head_dim, theta, scaling)
        else:
            inv_freq = llama3_scale_frequencies(inv_freq, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, S, D/2)
    if factor != 1.0:
        return jnp.cos(angles) * factor, jnp.sin(angles) * factor
    return jnp.cos(angles), jnp.sin(angles)


def yarn_frequencies(head_dim: int, theta: float, scaling: dict) -> tuple[jax.Array, float]:
    """YaRN (as ``transformers``' ``_compute_yarn_parameters``): (inv_freq, attention factor). Between
    the dimensions that turn ``beta_fast`` and ``beta_slow`` times over ``original_max_position_embeddings``
    the frequencies ramp linearly from kept to divided by ``factor``; the attention factor (cos and sin
    are multiplied by it) is ``attention_factor``, else 0.1 ln(factor) + 1 (with ``mscale`` and
    ``mscale_all_dim``: their ratio). ``truncate`` (default true) rounds the ramp's ends outwards."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = scaling.get("attention_factor")
    if att is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep, float(att)


def llama3_scale_frequencies(inv_freq: jax.Array, scaling: dict) -> jax.Array:
    """Llama 3.1 RoPE scaling (as ``transformers``' ``_compute_llama3_parameters``): long
    wavelengths are divided by ``factor``, short ones kept, the band between interpolated."""
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"unsupported rope_scaling {scaling!r}; only rope_type llama3 and linear are implemented")
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


def make_aux(positions: jax.Array, cfg: ModelConfig, segment_ids: jax.Array | None = None) -> Aux:
    """Per-sequence inputs every block shares: RoPE tables and (optionally) document segment ids.
    With ``rope_local_theta`` (Gemma 3) a second pair, ``cos_local``/``sin_local``, for the
    sliding-window layers (``rope_scaling`` applies to the global tables only, as in transformers).
    A family with tables of its own (``Family.make_aux``: partial or decoupled rotary dims) builds them."""
    own = get_family(cfg.family).make_aux
    if own is not None:
        return own(positions, cfg, segment_ids)
    cos, sin = rope_tables(positions, cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling)
    aux = {"cos": cos, "sin": sin}
    if cfg.rope_local_theta is not None:
        aux["cos_local"], aux["sin_local"] = rope_tables(positions, cfg.dim_per_head, cfg.rope_local_theta)
    if segment_ids is not None:
        aux["segment_ids"] = segment_ids
    return aux


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face Llama layout). x: (B, S, N, D); cos/sin: (B, S, D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------------------------- norms


class RMSNorm(nnx.Module):
    """Llama's RMSNorm: ``scale * x / rms(x)``, the product in the input dtype."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


class OffsetRMSNorm(nnx.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` all in fp32, then cast; ``weight`` starts at 0.
    The leaf is called ``weight`` (not ``scale``): the fast host initialiser sets scales to 1, which
    here would double every norm."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


# ------------------------------------------------------------------------------------- attention


def linear(din: int, dout: int, bias: bool, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=bias, kernel_init=nnx.initializers.normal(std),
                      bias_init=nnx.initializers.zeros_init(), param_dtype=jnp.float32, rngs=rngs)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                          window: int | None = None, softcap: float | None = None,
                          scale: float | None = None) -> jax.Array:
    """Causal GQA attention, inside document boundaries when ``segment_ids`` is given, through the
    one entry point that picks cuDNN / padded cuDNN / XLA / blockwise per shape (``attention.py``)."""
    return attention(q, k, v, causal=True, segment_ids=segment_ids, window=window, softcap=softcap, scale=scale)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE; causal, optionally windowed, inside documents.

    Options (static, so layers that differ in them become separate template kinds): ``window``
    (this layer's sliding window), ``qk_norm`` (a norm class applied per head to q and k before RoPE:
    Qwen3, Gemma 3), ``softcap`` (attention-logit soft-capping: Gemma 2), ``scale`` (None:
    1/sqrt(head_dim)), ``local_rope`` (use ``aux``'s ``cos_local``/``sin_local``), ``fused``
    (one ``qkv_proj`` kernel, as Phi-3 stores it, instead of q/k/v_proj).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, window: int | None = None, bias: bool = False,
                 qk_norm=None, softcap: float | None = None, scale: float | None = None,
                 local_rope: bool = False, fused: bool = False):
        h, d = cfg.hidden_size, cfg.dim_per_head
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, d
        self.window, self.softcap, self.scale, self.local_rope, self.fused = window, softcap, scale, local_rope, fused
        if fused:
            self.qkv_proj = linear(h, (cfg.num_heads + 2 * cfg.kv_heads) * d, bias, cfg.init_std, rngs)
        else:
            self.q_proj = linear(h, cfg.num_heads * d, bias, cfg.init_std, rngs)
            self.k_proj = linear(h, cfg.kv_heads * d, bias, cfg.init_std, rngs)
            self.v_proj = linear(h, cfg.kv_heads * d, bias, cfg.init_std, rngs)
        self.o_proj = linear(cfg.num_heads * d, h, False, cfg.init_std, rngs)
        if qk_norm is not None:
            self.q_norm = qk_norm(d, cfg.rms_norm_eps)
            self.k_norm = qk_norm(d, cfg.rms_norm_eps)

    def __call__(self, x: jax.Array, aux: Aux) -> jax.Array:
        q, k, v = self.project(x, *self.rope(aux))
        return self.o_proj(self.attend(q, k, v, aux))

    def rope(self, aux: Aux) -> tuple[jax.Array, jax.Array]:
        """This layer's (cos, sin) tables."""
        return (aux["cos_local"], aux["sin_local"]) if self.local_rope else (aux["cos"], aux["sin"])

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v (B, S, heads, D) of normed hidden states, q/k-normed and rotated: per token, so it
        may run over sequence tiles (``over_tiles``)."""
        b, s, _ = x.shape
        n, kv, d = self.num_heads, self.kv_heads, self.head_dim
        if self.fused:
            qkv = self.qkv_proj(x)
            q, k, v = qkv[..., :n * d], qkv[..., n * d:(n + kv) * d], qkv[..., (n + kv) * d:]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.reshape(b, s, n, d), k.reshape(b, s, kv, d), v.reshape(b, s, kv, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, aux: Aux) -> jax.Array:
        """Attention over the whole sequence (B, S, heads x D), before the output projection; while a generation
        kernel traces the block, over its KV cache instead (``kvcache.py``)."""
        ctx = kvcache.current()
        if ctx is not None:
            return ctx.attend(self, q, k, v)
        b, s, n, d = q.shape
        out = dot_product_attention(q, k, v, aux.get("segment_ids"), window=self.window, softcap=self.softcap,
                                    scale=self.scale)
        return out.reshape(b, s, n * d)


# ------------------------------------------------------------------------------ sequence tiles


def over_tiles(fn, modules: Any, tile: int, *xs: jax.Array) -> Any:
    """``fn(modules, *tiles)`` over the sequence axis (1) of ``xs`` in tiles of ``tile`` tokens, as a
    ``lax.map`` of a ``jax.checkpoint``-ed tile function: a VJP keeps only each tile's inputs and
    recomputes the rest per tile, so the working set is set by the tile, not the sequence. A
    sequence the tile does not divide ends with one shorter tile. ``fn`` must act per token."""
    graph, state = nnx.split(modules)
    dtypes = jax.tree_util.tree_map(lambda a: a.dtype, state)
    # half-precision weights enter the loop as fp32 (an exact copy): the loop then sums their per-tile
    # gradients in fp32, rounding once as the untiled matmul does, not once per tile
    state = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32) if a.dtype.itemsize < 4 else a, state)

    @jax.checkpoint
    def body(state, *ts):
        return fn(nnx.merge(graph, jax.tree_util.tree_map(lambda a, d: a.astype(d), state, dtypes)), *ts)

    s = xs[0].shape[1]
    n, rest = divmod(s, tile)
    out = None
    if n:
        def split(a):  # (B, n*tile, ...) -> (n, B, tile, ...)
            return jnp.moveaxis(a[:, :n * tile].reshape(a.shape[0], n, tile, *a.shape[2:]), 1, 0)

        stacked = jax.lax.map(lambda ts: body(state, *ts), tuple(split(a) for a in xs))
        out = jax.tree_util.tree_map(
            lambda a: jnp.moveaxis(a, 0, 1).reshape(a.shape[1], n * tile, *a.shape[3:]), stacked)
    if rest:
        last = body(state, *(a[:, n * tile:] for a in xs))
        out = last if out is None else jax.tree_util.tree_map(
            lambda a, b: jnp.concatenate([a, b], axis=1), out, last)
    return out


# ------------------------------------------------------------------------------------------- MLP


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); ``act`` silu (SwiGLU) or gelu_tanh (GeGLU); ``fused``:
    one ``gate_up_proj`` kernel whose first half is the gate (Phi-3's layout)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, act: str = "silu", fused: bool = False):
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.act, self.fused = act, fused
        if fused:
            self.gate_up_proj = linear(h, 2 * f, False, cfg.init_std, rngs)
        else:
            self.gate_proj = linear(h, f, False, cfg.init_std, rngs)
            self.up_proj = linear(h, f, False, cfg.init_std, rngs)
        self.down_proj = linear(f, h, False, cfg.init_std, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fused:
            gu = self.gate_up_proj(x)
            f = gu.shape[-1] // 2
            gate, up = gu[..., :f], gu[..., f:]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        a = jax.nn.silu(gate) if self.act == "silu" else jax.nn.gelu(gate, approximate=True)
        return self.down_proj(a * up)


def dense_block_params(cfg: ModelConfig, *, norms: int = 2, qk_norm: bool = False, qkv_bias: bool = False) -> int:
    """Parameters of a dense block: attention, gated MLP, ``norms`` hidden-size norms, optional
    per-head q/k norms and q/k/v biases."""
    h, d = cfg.hidden_size, cfg.dim_per_head
    q, kv = cfg.num_heads * d, cfg.kv_heads * d
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if qkv_bias else 0) + (2 * d if qk_norm else 0)
    return attn + 3 * h * cfg.intermediate_size + norms * h


# ---------------------------------------------------------------------------- embedding and head


class Embed(nnx.Module):
    """The token embedding. With ``pad_token_id`` the looked-up rows of that token get no gradient, as
    transformers' ``nn.Embedding(padding_idx=pad_token_id)`` (every family's HF embedding has one);
    a tied head still trains the row through the logits, as there."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        self.embedding = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32))
        # Gemma: times sqrt(hidden) cast to the table's (compute) dtype first, as transformers does
        self.scale = math.sqrt(cfg.hidden_size) if get_family(cfg.family).embed_scale else None
        self.pad_id = getattr(cfg, "pad_token_id", None)

    def __call__(self, tokens: jax.Array, dtype=None) -> jax.Array:
        table = self.embedding[...]
        if dtype is not None:
            table = table.astype(dtype)
        x = jnp.take(table, tokens, axis=0)  # (B, S, H)
        if self.pad_id is not None:
            x = jnp.where((tokens == self.pad_id)[..., None], jax.lax.stop_gradient(x), x)
        if self.scale is not None:
            x = x * jnp.asarray(self.scale, table.dtype)
        return x


class Head(nnx.Module):
    """Final norm and the LM head (absent when embeddings are tied: the head uses Embed's table)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        norm = get_family(cfg.family).norm or RMSNorm
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied = cfg.tie_embeddings
        self.softcap = cfg.final_softcap
        if not self.tied:
            init = nnx.initializers.normal(cfg.init_std)
            self.lm_head = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), jnp.float32))

    def output_matrix(self, embedding: jax.Array | None = None) -> jax.Array:
        """(H, V) matrix mapping normed hidden states to logits."""
        return embedding.T if self.tied else self.lm_head[...]

    def __call__(self, x: jax.Array, embedding: jax.Array | None = None) -> jax.Array:
        w = self.output_matrix(embedding).astype(x.dtype)
        logits = jnp.einsum("bsh,hv->bsv", self.norm(x), w, preferred_element_type=jnp.float32)
        if self.softcap is not None:
            logits = self.softcap * jnp.tanh(logits / self.softcap)
        return logits


# ------------------------------------------------------------------------------- the decoder


class Decoder(nnx.Module):
    """The whole decoder of any family, for the in-memory reference trainer and for inference."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.cfg = cfg
        self.embed = init_part(cfg, seed, "embed")
        self.layers = nnx.List([init_part(cfg, seed, f"block_{i}") for i in range(cfg.num_layers)])
        self.head = init_part(cfg, seed, "head")

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, dtype=jnp.float32, remat: bool = False) -> jax.Array:
        """Logits (B, S, V) in fp32 (soft-capped where the family does). ``remat`` recomputes each
        block in the backward."""
        x = self.final_hidden(tokens, positions, segment_ids, dtype, remat)
        emb = self.embed.embedding[...].astype(dtype) if self.cfg.tie_embeddings else None
        return self.head(x, emb)

    def final_hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
                     segment_ids: jax.Array | None = None, dtype=jnp.float32, remat: bool = False) -> jax.Array:
        """The last block's output (B, S, H), before the final norm."""
        return self.final_hidden_aux(tokens, positions, segment_ids, dtype, remat)[0]

    def final_hidden_aux(self, tokens: jax.Array, positions: jax.Array | None = None,
                         segment_ids: jax.Array | None = None, dtype=jnp.float32,
                         remat: bool = False) -> tuple[jax.Array, jax.Array | None]:
        """(the last block's output, the family's auxiliary loss on this batch or None): blocks with
        ``emits_stats`` return ``(hidden, stats)``; their stats are summed over the layers and the
        auxiliary loss (``aux_loss_fn``) is taken of the total (the MoE router loss)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        aux = make_aux(positions, self.cfg, segment_ids)
        x = self.embed(tokens, dtype)
        call = nnx.remat(_call_block) if remat else _call_block
        total = None
        for layer in self.layers:
            x = call(layer, x, aux)
            if isinstance(x, tuple):
                x, stats = x
                stats = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), stats)
                total = stats if total is None else jax.tree_util.tree_map(jnp.add, total, stats)
        fn = self.aux_loss_fn()
        return x, (fn(total) if (fn is not None and total is not None) else None)

    def aux_loss_fn(self):
        """The family's auxiliary loss of the summed block statistics, or None (most models)."""
        return get_family(self.cfg.family).aux_loss(self.cfg)


def _call_block(layer: nnx.Module, x: jax.Array, aux: Aux) -> jax.Array:
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
    return get_family(cfg.family).block(cfg, nnx.Rngs(params=jax.random.fold_in(base, index)), index)


def part_names(cfg: ModelConfig) -> list[str]:
    return ["embed"] + [f"block_{i}" for i in range(cfg.num_layers)] + ["head"]


def init_model(cfg: ModelConfig, seed: int) -> Decoder:
    return Decoder(cfg, seed)


def abstract_model(cfg: ModelConfig) -> Decoder:
    """The model's structure with ``ShapeDtypeStruct`` leaves: templates without allocating weights."""
    return nnx.eval_shape(lambda: Decoder(cfg, 0))


def streamed_parts(model: Decoder) -> "StreamedModel":
    """Split a decoder into the engine's parts, through the same door a user's NNX model uses."""
    from megatrain_jax.templates import StreamedModel, from_nnx

    cfg = model.cfg
    embed_graph, embed_state = nnx.split(model.embed)
    head_graph, head_state = nnx.split(model.head)
    embed_fn, head_fn, aux_fn = _part_fns(embed_graph, head_graph, cfg)
    return StreamedModel(embed_fn=embed_fn, blocks=from_nnx(list(model.layers), aux_loss=model.aux_loss_fn()),
                         head_fn=head_fn,
                         aux_fn=aux_fn, embed_weights=nnx.to_pure_dict(embed_state),
                         head_weights=nnx.to_pure_dict(head_state), tied=cfg.tie_embeddings,
                         logit_softcap=cfg.final_softcap, pad_id=model.embed.pad_id,
                         frozen=tuple(get_family(cfg.family).frozen_leaves(cfg)))


# equal models get the same part functions, so that their trainers share compiled kernels (engine/kernels.py:
# program_key compares the functions by identity); the most recent few are kept
_PART_FNS: OrderedDict[tuple, tuple] = OrderedDict()
_PART_FNS_KEPT = 64


def _part_fns(embed_graph: Any, head_graph: Any, cfg: ModelConfig) -> tuple:
    """(embed_fn, head_fn, aux_fn) of a decoder: what they compute is fixed by the two graphs (module types and
    static attributes, as ``nnx.jit`` keys them) and the config (its fields' repr), the one ``aux_fn`` reads."""
    try:
        key = (embed_graph, head_graph, repr(cfg))
        fns = _PART_FNS.get(key)
    except TypeError:  # an unhashable graph: functions of its own
        return _new_part_fns(embed_graph, head_graph, copy.deepcopy(cfg))
    if fns is None:
        fns = _PART_FNS[key] = _new_part_fns(embed_graph, head_graph, copy.deepcopy(cfg))
        while len(_PART_FNS) > _PART_FNS_KEPT:
            _PART_FNS.popitem(last=False)
    _PART_FNS.move_to_end(key)
    return fns


def _new_part_fns(embed_graph: Any, head_graph: Any, cfg: ModelConfig) -> tuple:
    from megatrain_jax.templates import shareable

    def embed_fn(w, tokens):
        return nnx.merge(embed_graph, w)(tokens)

    def head_fn(w, hidden, embed_w):
        head = nnx.merge(head_graph, w)
        emb = embed_w["embedding"] if embed_w is not None else None
        return head.norm(hidden), head.output_matrix(emb).astype(hidden.dtype)

    def aux_fn(positions, segment_ids=None):
        return make_aux(positions, cfg, segment_ids)

    return shareable(embed_fn), shareable(head_fn), shareable(aux_fn)  # (graphs and a config copy: no weights)


def init_host_store(cfg: ModelConfig, seed: int, bf16_stream: bool, own=None):
    """Abstract parts plus a host store initialised part by part (peak memory: one part).

    Returns ``(parts, store)``; equal to ``streamed_parts(init_model(cfg, seed))`` in value. ``own``: ``(bounds,
    align)`` of a sharded store (``HostStore.own``), which then backs only its values, given back part by part.
    """
    from megatrain_jax.hoststore import HostStore
    from megatrain_jax.templates import Layout

    parts = streamed_parts(abstract_model(cfg))
    store = HostStore({n: Layout(t) for n, t in parts.host_trees().items()}, bf16_stream)
    if own is not None:
        store.own(*own)
    if cfg.init == "fast":
        store.fill_fast(seed, cfg.init_std)
        return parts, store
    for name in part_names(cfg):
        module = init_part(cfg, seed, name)
        store.load_group(name, nnx.to_pure_dict(nnx.state(module)))
        del module
    return parts, store
