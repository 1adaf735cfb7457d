"""What the plan counts for a mixture of experts on the grouped path (``models/grouped_experts.py``).

**Working set.** Each token is k routed rows of the grouped layout (plus each expert's padding to a
whole tile: ``E * tile`` rows a micro-batch). Per routed row the block's backward holds, in the
compute dtype: the gathered input, the expert output and its gradient, the router-weighted output
gradient and the input gradient in fp32 (about 16 bytes per unit of H), and gate, up, their product
and their gradients (about 14 bytes per unit of F): ``ROUTED_BYTES`` per unit of (H + F), rounded
up. ``moe_impl: dense`` keeps the dense formulation's coefficient (every expert on every token).

**Compute.** The routed matmuls run ``k`` experts a token, at the grouped kernels' rate rather than a
plain matmul's: ``GROUPED_RATE_SHARE`` of it, so the plan counts the routed parameters at 1 / share of
their weight. Measured (experiments/bench_moe.py kernels mode, one H100, the default tiles): the
projections, input and weight gradients at 428-484 TFLOP/s against one plain matmul of the same routed
size at 730 (OLMoE's shape: 0.59-0.66), 539-609 against 788 (Mixtral's: 0.68-0.77).
"""
from __future__ import annotations

ROUTED_BYTES = 16.0  # bytes per routed row and unit of (H + F), bf16 compute (module docstring)
GROUPED_TILE = 128  # rows per tile of the grouped layout on the GPU (models/grouped_kernels.py)
GROUPED_RATE_SHARE = 0.65  # grouped matmul rate / plain matmul rate (module docstring: 0.59-0.77 measured)


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


def step_matmul_params(m) -> int:
    """The non-embedding parameters whose matmuls a token's step runs, weighted by their rate: every
    expert in the dense formulation; on the grouped path the k routed experts at the grouped rate."""
    if not routed(m):
        return m.non_embedding_params()
    active = m.active_non_embedding_params()
    sparse = m.num_layers - len(getattr(m, "mlp_only_layers", None) or ())
    routed_params = sparse * m.experts_per_token * 3 * m.hidden_size * expert_width(m)
    return int(active + routed_params * (1.0 / GROUPED_RATE_SHARE - 1.0))
