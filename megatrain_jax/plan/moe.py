"""What the plan counts for a mixture of experts on the grouped path (``models/grouped_experts.py``).

**Working set.** Each token is k routed rows of the grouped layout (plus each expert's padding to a
whole tile: ``E * tile`` rows a micro-batch). Per routed row the block's backward holds, in the
compute dtype: the gathered input, the expert output and its gradient, the router-weighted output
gradient and the input gradient in fp32 (about 16 bytes per unit of H), and gate, up, their product
and their gradients (about 14 bytes per unit of F): ``ROUTED_BYTES`` per unit of (H + F), rounded
up. ``moe_impl: dense`` keeps the dense formulation's coefficient (every expert on every token).

**Compute.** The routed matmuls run ``k`` experts a token, at the grouped layer's rate rather than the
plain matmul rate the plan counts a dense block at: ``grouped_rate_share`` of it, so the plan counts the
routed parameters at 1 / share of their weight. The share grows with the rows each expert gets in a
micro-batch (wider tiles, fewer part-filled ones). Measured (experiments/bench_moe.py layer, one H100,
16,384 tokens, the whole layer forward + backward: routing, gathers, activation and the grouped matmuls),
as a share of the 600 TFLOP/s the plan counts for a dense block: 512 rows per expert (gpt-oss-120b)
284 TFLOP/s, 0.473; 1,024 (Qwen3-30B-A3B) 401, 0.668; 2,048 (OLMoE) 472, 0.787; 4,096 (Mixtral-8x7B) 542,
0.903. Between them the share is interpolated in log2(rows); beyond them it stays at the nearest.
"""
from __future__ import annotations

import numpy as np

ROUTED_BYTES = 16.0  # bytes per routed row and unit of (H + F), bf16 compute (module docstring)
GROUPED_TILE = 128  # rows per tile of the grouped layout on the GPU (models/grouped_kernels.py)
# (rows per expert in a micro-batch, the layer's rate as a share of a dense block's): module docstring
GROUPED_RATE_POINTS = ((512, 0.473), (1024, 0.668), (2048, 0.787), (4096, 0.903))


def is_moe(m) -> bool:
    return bool(getattr(m, "num_experts", None))


def routed(m) -> bool:
    """A MoE whose experts run grouped (every impl but the dense reference)."""
    return is_moe(m) and getattr(m, "moe_impl", "auto") != "dense"


def expert_width(m) -> int:
    return m.moe_intermediate_size or m.intermediate_size


def routed_mlp_width(m) -> int:
    """Units of (H + F) a token holds in the grouped layout: its k routed rows."""
    return m.experts_per_token * (m.hidden_size + expert_width(m))


def padding_tokens(m) -> int:
    """Each expert's group padded to a whole tile: ``E * tile`` rows a micro-batch, as tokens of k rows."""
    return -(-m.num_experts * GROUPED_TILE // m.experts_per_token)


def grouped_rate_share(rows_per_expert: float) -> float:
    """The grouped layer's rate as a share of a dense block's, by the rows each expert gets (module docstring)."""
    xs, ys = zip(*GROUPED_RATE_POINTS)
    return float(np.interp(np.log2(max(rows_per_expert, 1.0)), np.log2(xs), ys))


def step_matmul_params(m, tokens_mb: int) -> int:
    """The non-embedding parameters whose matmuls a token's step runs, weighted by their rate: every
    expert in the dense formulation; on the grouped path the k routed experts at the grouped rate for
    ``tokens_mb`` tokens a micro-batch."""
    if not routed(m):
        return m.non_embedding_params()
    active = m.active_non_embedding_params()
    sparse = m.num_layers - len(getattr(m, "mlp_only_layers", None) or ())
    routed_params = sparse * m.experts_per_token * 3 * m.hidden_size * expert_width(m)
    share = grouped_rate_share(tokens_mb * m.experts_per_token / m.num_experts)
    return int(active + routed_params * (1.0 / share - 1.0))
