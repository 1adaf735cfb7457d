"""A Linen decoder in the style of the flax examples' lm1b model, trained by megatrain-jax with its params.

    .venv/bin/python examples/lm1b_linen.py --steps 20            # tiny shape, CPU
    .venv/bin/python examples/lm1b_linen.py --shape 1b --steps 10 --batch 8 --compute bfloat16   # a GPU

``TransformerLM`` -> ``Decoder`` (``nn.compact``): ``nn.Embed``, learned position embeddings
(``AddPositionEmbs``), ``num_layers`` x ``EncoderDecoder1DBlock`` (pre-LayerNorm, self-attention with
the decoder mask, MLP) named ``encoderdecoderblock_<i>``, a final ``LayerNorm`` and a ``Dense`` to the
vocabulary (``logitdense``). Dropout as in flax's lm1b: ``dropout_rate`` after the attention and twice
in the MLP, ``attention_dropout_rate`` on the attention weights, on while ``deterministic`` is False
(``--dropout 0.1``, the flax example's rate, is on by default here; the config's default is 0, so
the module is deterministic unless asked). Each block draws its ``dropout`` stream from the engine's
key for (step, layer, micro-batch) (``templates.block_rng``; the same key in the backward's recompute).
Differences from flax/examples/lm1b: no padding mask (sequences are packed windows; a mask computed
from token values cannot be rebuilt per block, see docs/porting.md), no dropout right after the
embedding (the engine gives keys to the blocks only), and inputs are shifted by the data rather than
inside the decoder.

``stream(module, params=params)`` finds the blocks by their numbered names, the embedding as what runs
before them and the head as what runs after, ending at ``logitdense``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 256
    emb_dim: int = 64
    num_heads: int = 4
    num_layers: int = 2
    qkv_dim: int = 64
    mlp_dim: int = 256
    max_len: int = 64
    dropout_rate: float = 0.0  # flax's lm1b: 0.1 (see --dropout)
    attention_dropout_rate: float = 0.0
    deterministic: bool = False  # dropout on (when its rate > 0); True for evaluation
    dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)


SHAPES = {
    "tiny": TransformerConfig(),
    "1b": TransformerConfig(vocab_size=32000, emb_dim=2048, num_heads=16, num_layers=20, qkv_dim=2048,
                            mlp_dim=8192, max_len=1024),  # 1.07B params
}


class AddPositionEmbs(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        cfg = self.config
        pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1, cfg.max_len, inputs.shape[-1]))
        return inputs + pe[:, :inputs.shape[1], :]


class MlpBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        cfg = self.config
        x = nn.Dense(cfg.mlp_dim, dtype=cfg.dtype, kernel_init=cfg.kernel_init, bias_init=cfg.bias_init)(inputs)
        x = nn.relu(x)
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
        x = nn.Dense(inputs.shape[-1], dtype=cfg.dtype, kernel_init=cfg.kernel_init, bias_init=cfg.bias_init)(x)
        return nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)


class EncoderDecoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        cfg = self.config
        x = nn.LayerNorm(dtype=cfg.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads, dtype=cfg.dtype, qkv_features=cfg.qkv_dim,
                                            kernel_init=cfg.kernel_init, bias_init=cfg.bias_init, use_bias=False,
                                            broadcast_dropout=False, dropout_rate=cfg.attention_dropout_rate,
                                            deterministic=cfg.deterministic)(x, x, mask=decoder_mask)
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
        x = x + inputs
        z = nn.LayerNorm(dtype=cfg.dtype)(x)
        return x + MlpBlock(config=cfg)(z)


class Decoder(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        cfg = self.config
        y = nn.Embed(num_embeddings=cfg.vocab_size, features=cfg.emb_dim,
                     embedding_init=nn.initializers.normal(stddev=1.0))(inputs.astype("int32"))
        y = AddPositionEmbs(config=cfg, name="posembed_output")(y)
        y = y.astype(cfg.dtype)
        for lyr in range(cfg.num_layers):
            y = EncoderDecoder1DBlock(config=cfg, name=f"encoderdecoderblock_{lyr}")(y, decoder_mask=decoder_mask)
        y = nn.LayerNorm(dtype=cfg.dtype, name="encoderdecoder_norm")(y)
        return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, kernel_init=cfg.kernel_init, bias_init=cfg.bias_init,
                        name="logitdense")(y)


class TransformerLM(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        decoder_mask = nn.make_causal_mask(inputs, dtype=self.config.dtype)  # from the shape only
        return Decoder(config=self.config, name="decoder")(inputs, decoder_mask=decoder_mask)


def build(cfg: TransformerConfig, seed: int = 0):
    module = TransformerLM(cfg)
    params = jax.jit(module.init)(jax.random.key(seed), jnp.zeros((1, cfg.max_len), jnp.int32))["params"]
    return module, params


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="default: max_len")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--dropout", type=float, default=0.1, help="dropout_rate and attention_dropout_rate "
                    "(flax's lm1b: 0.1); 0 turns it off")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--compute", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args(argv)

    from gpt2_nnx import batches  # same data: tinyshakespeare bytes or random tokens

    from megatrain_jax.config import OptimConfig
    from megatrain_jax.trainer import Trainer

    cfg = dataclasses.replace(SHAPES[args.shape], dropout_rate=args.dropout, attention_dropout_rate=args.dropout)
    module, params = build(cfg)
    # the CLI's optimizer section: fused AdamW on the host (== optax.adamw), global-norm clipping
    opt = OptimConfig(lr=args.lr, b1=0.9, b2=0.98, weight_decay=0.1, clip_norm=1.0)
    tr = Trainer(module, opt, params=params, micro_batches=args.micro_batches, compute_dtype=args.compute)
    print(f"lm1b-style Linen, {sum(g.size for g in tr.engine.store) / 1e6:.2f}M parameters; "
          f"streamed: {tr.parts.summary}")
    losses = []
    t_last = time.perf_counter()
    for step, toks in enumerate(batches(args.steps, args.batch, args.seq or cfg.max_len, cfg.vocab_size), 1):
        res = tr.step(toks)
        now = time.perf_counter()
        losses.append(res.loss)
        print(f"step {step:4d}  loss {res.loss:.4f}  grad_norm {res.grad_norm:.3f}  "
              f"tokens/s {toks[:, :-1].size / (now - t_last):,.0f}", flush=True)
        t_last = now
    tr.close()
    return losses


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
