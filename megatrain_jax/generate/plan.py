"""The memory plan of a generation: the weights (resident, or streamed block by block), the KV cache and the working
set, on the GPU; the batch that fits; a refusal with a fix that fits when it does not.

Counted per device (bytes):
- weights: resident, every group in the compute dtype; streamed, the embedding and head plus three blocks (one
  computing, the next two in flight; with int8, those two as int8 and scales plus one dequantised block);
- KV cache: 2 (keys, values) x layers x batch x cache slots x kv heads x head dim x the compute dtype's bytes;
- working set: the prefill's activations (the hidden state in and out, q/k/v, the MLP's intermediate), its attention
  scores in fp32 (batch x heads x prompt chunk x cache slots: a long prompt passes in chunks, ``engine.PREFILL_CHUNK``),
  and the logits (batch x vocabulary, fp32) with the sampling's sorted copy.
The GPU budget is the device's memory less the training plan's margin (``plan.sizes.GPU_MARGIN``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatrain_jax.errors import UserError

GB = 1e9


@dataclass
class GenPlan:
    weights: str  # resident | streamed
    batch: int
    max_batch: int  # the largest batch this placement fits (the budget's), 0: none
    cache_len: int
    rows: dict = field(default_factory=dict)  # what -> bytes
    need: float = 0.0
    budget: float | None = None  # None: no GPU (the CPU backend; device buffers are host memory)
    notes: list = field(default_factory=list)

    def table(self) -> str:
        lines = [f"generation plan: weights {self.weights}, batch {self.batch} (at most {self.max_batch} fit), "
                 f"cache {self.cache_len} slots"]
        for k, v in self.rows.items():
            lines.append(f"  {k:<44} {v / GB:10.3f} GB")
        lines.append(f"  {'total':<44} {self.need / GB:10.3f} GB" + (
            f" of a {self.budget / GB:.1f} GB GPU budget" if self.budget else " (no GPU: host memory)"))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "batch": self.batch, "max_batch": self.max_batch,
                "cache_len": self.cache_len, "rows_gb": {k: v / GB for k, v in self.rows.items()},
                "need_gb": self.need / GB, "budget_gb": None if self.budget is None else self.budget / GB,
                "notes": self.notes}


def _sizes(cfg: Any, layouts: dict) -> dict:
    blocks = [layouts[n].size for n in layouts if n.startswith("block_")]
    return {"embed": layouts["embed"].size, "head": layouts["head"].size, "block_max": max(blocks),
            "blocks": sum(blocks)}


def _rows(cfg: Any, sz: dict, weights: str, batch: int, prompt: int, cache: int, itemsize: int, int8: bool) -> dict:
    L, H, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    kvh, d, n = cfg.kv_heads, cfg.dim_per_head, cfg.num_heads
    f = max(cfg.intermediate_size, (cfg.moe_intermediate_size or 0) * (cfg.experts_per_token or 0))
    if cfg.num_experts and getattr(cfg, "moe_impl", "dense") == "dense":
        f = max(f, (cfg.moe_intermediate_size or cfg.intermediate_size) * cfg.num_experts)
    ends = (sz["embed"] + sz["head"]) * itemsize
    if weights == "resident":
        w = {"weights (every group, resident)": ends + sz["blocks"] * itemsize}
    else:
        per_block = sz["block_max"] * (1 + 4 / 64 if int8 else itemsize)  # int8: values + a small side buffer
        w = {"embedding and head (resident)": ends,
             "blocks in flight (one computing, two arriving)": 3 * per_block}
        if int8:
            w["one block dequantised"] = sz["block_max"] * itemsize * 2  # (its tree and the flat copy)
    from megatrain_jax.generate.engine import prefill_chunk_of

    chunk = prefill_chunk_of(prompt)  # the prompt passes the blocks a chunk at a time
    kv = 2 * L * batch * cache * kvh * d * itemsize
    acts = batch * chunk * (4 * H + (n + 2 * kvh) * d + 3 * f) * itemsize
    scores = 2 * batch * n * chunk * cache * 4
    logits = 3 * batch * V * 4
    return {**w, f"KV cache ({batch} x {cache} slots)": kv, "prefill activations": acts,
            "prefill attention scores (fp32)": scores, "logits and sampling (fp32)": logits}


def plan_generation(cfg: Any, layouts: dict, *, batch: int, prompt_len: int, max_new_tokens: int, dtype: str,
                    weights: str = "auto", int8: bool = False, gpu_bytes: float | None = None,
                    cache_len: int | None = None) -> GenPlan:
    """The plan for ``batch`` prompts of up to ``prompt_len`` tokens and ``max_new_tokens`` each; ``gpu_bytes`` the
    device's memory (None: no GPU). Raises ``UserError`` with a fix when nothing fits."""
    from megatrain_jax.plan.sizes import GPU_MARGIN, usable

    itemsize = 2 if dtype == "bfloat16" else 4
    cache = cache_len or (prompt_len + max_new_tokens)
    sz = _sizes(cfg, layouts)
    budget = None if gpu_bytes is None else usable(gpu_bytes, GPU_MARGIN)

    def need(mode: str, b: int) -> float:
        return sum(_rows(cfg, sz, mode, b, prompt_len, cache, itemsize, int8).values())

    def max_batch(mode: str) -> int:
        if budget is None:
            return 1 << 20
        lo, hi = 0, 1
        while hi <= (1 << 20) and need(mode, hi) <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mode, mid) <= budget else (lo, mid)
        return lo

    modes = ["resident", "streamed"] if weights == "auto" else [weights]
    if int8 and weights == "auto":
        modes = ["streamed"]
    fits = {m: max_batch(m) for m in modes}
    pick = next((m for m in modes if fits[m] >= batch), None)
    if pick is None:
        best = max(modes, key=lambda m: (fits[m], m == "streamed"))
        total = need(best, batch)
        if fits[best] >= 1:
            fix = (f"pass --batch-size {fits[best]} (it fits" + (f" with --weights {best}" if best != weights else "")
                   + "; more prompts run as further batches)")
        elif not int8 and need("streamed", 1) > (budget or 0) and cfg.num_layers:
            fix = "stream the blocks as int8 (--int8), or lower --max-new-tokens / the prompt length"
        else:
            fix = "lower --max-new-tokens or the prompt length, or use a GPU with more memory"
        raise UserError("--batch-size", f"{batch} sequences of {cache} tokens need {total / GB:.1f} GB of GPU memory "
                        f"with {best} weights, the budget is {budget / GB:.1f} GB", fix)
    rows = _rows(cfg, sz, pick, batch, prompt_len, cache, itemsize, int8)
    plan = GenPlan(pick, batch, fits[pick], cache, rows, sum(rows.values()), budget)
    if pick == "streamed" and weights == "auto":
        plan.notes.append("the weights do not fit the GPU with this batch: the blocks stream from host memory for the "
                          "prefill and every decoding step (one transfer of the model per step, shared by the batch)")
    return plan
