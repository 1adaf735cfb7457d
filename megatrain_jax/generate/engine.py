"""Batched autoregressive decoding through the training block templates, with a KV cache on the device.

- **Weights** (``Weights``): each group cast once to the compute dtype. ``resident``: every group on the device for
  the whole run. ``streamed``: the embedding and head resident, the blocks in page-aligned host buffers (DMA-registered
  on a GPU, ``transfer.Transfers``), each put in flight one block ahead of the compute that uses it, for the prefill
  and for every decoding step; with ``int8`` a block streams as int8 with one fp32 scale per output channel
  (``engine/lora_base``'s quantisation, about 1 byte per weight) and is dequantised on the device.
- **Kernels**: per block kind one jitted step ``(w, h, aux, k_cache, v_cache, start, pad) -> (h, k_cache, v_cache)``
  (the caches donated: updated in place), which traces the training template under a ``kvcache.KVContext``: one
  executable serves every layer of a kind, for the prefill shape and for the one-token decoding shape.
- **Batch**: prompts are left-padded to the longest (``pad[b]``: row b's first real slot, positions from 0 there), so
  every row writes the same cache slot at each step and the whole batch decodes as one: a streamed decoding step
  moves the weights once for every row. Sampled tokens stay on the device and feed the next step; the host reads each
  step's tokens one step late (the device is never idle waiting for it) to stop on end-of-sequence ids and stop
  strings.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.errors import UserError
from megatrain_jax.kvcache import KVContext

F32 = jnp.float32
WEIGHT_MODES = ("auto", "resident", "streamed")


@dataclass(frozen=True)
class Sampling:
    """greedy (``temperature`` 0), or temperature with optional top-k / top-p, from ``seed``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Completion:
    prompt_ids: list
    ids: list  # the generated tokens (an end-of-sequence id included when it ended the row)
    text: str | None = None
    finish_reason: str = "length"  # length | eos | stop


@dataclass
class Timing:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_steps: int = 0
    batch: int = 0
    extra: dict = field(default_factory=dict)


def sample_logits(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array, *, greedy: bool,
                  top_k: int, use_top_p: bool) -> jax.Array:
    """(B,) int32 tokens from (B, V) fp32 logits."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lg = logits / temperature
    if top_k:
        kth = jax.lax.top_k(lg, top_k)[0][:, -1:]
        lg = jnp.where(lg < kth, -jnp.inf, lg)
    if use_top_p:
        srt = jnp.sort(lg, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # the smallest prefix whose mass reaches top_p
        thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        lg = jnp.where(lg < thresh, -jnp.inf, lg)
    return jax.random.categorical(key, lg, axis=-1).astype(jnp.int32)


class Weights:
    """Every group of a ``Source`` on the device or in host memory, in the compute dtype (see the module docstring)."""

    def __init__(self, source: Any, dtype: Any, streamed: bool, int8: bool = False, device: jax.Device | None = None,
                 log: Callable[[str], None] = lambda _: None):
        from megatrain_jax.optim.fused_adamw import to_bf16_bits_
        from megatrain_jax.optim.host import alloc_aligned
        from megatrain_jax.transfer import Transfers

        self.dtype, self.streamed, self.int8 = jnp.dtype(dtype), streamed, bool(int8 and streamed)
        self.device = device or jax.local_devices()[0]
        self.layouts = source.layouts
        self.resident: dict[str, jax.Array] = {}
        self.host: dict[str, Any] = {}
        self.xfer = Transfers(self.device) if streamed else None
        self.host_bytes = self.device_bytes = 0
        np_dtype = _np_dtype(self.dtype)
        quantised = getattr(source, "quantised", None)  # a benchmark's synthetic int8 blocks (no fp32 pass)
        for name, lay in self.layouts.items():
            block = name.startswith("block_")
            synthetic = self.int8 and block and quantised is not None
            flat = None
            if not synthetic:
                flat = np.empty(lay.size, np.float32)
                source.fill(name, flat)
            if streamed and block:
                if self.int8:
                    q, scale = quantised(name) if synthetic else _quantise_group(lay, flat)
                    qb = alloc_aligned(q.size, np.int8)
                    qb[:] = q
                    sb = alloc_aligned(scale.size, np.float32)
                    sb[:] = scale
                    self.host[name] = (qb, sb)
                    self.xfer.register(name + ":q", qb)
                    self.xfer.register(name + ":s", sb)
                    self.host_bytes += qb.nbytes + sb.nbytes
                else:
                    buf = alloc_aligned(lay.size, np.uint16 if np_dtype.itemsize == 2 else np.float32)
                    view = buf.view(np_dtype)
                    if np_dtype.itemsize == 2:
                        to_bf16_bits_(flat, buf)  # (the host store's parallel cast: round to nearest even, as XLA)
                    else:
                        view[:] = flat
                    self.host[name] = view
                    self.xfer.register(name, view)
                    self.host_bytes += view.nbytes
            else:  # split into its leaves once, cast on the device: the kernels read each matrix where it lies
                arr = jax.device_put(flat, self.device)
                self.resident[name] = _splitter(lay, self.dtype)(arr)
                self.device_bytes += lay.size * self.dtype.itemsize
                del arr
            del flat
        log(f"generate: weights {'streamed' if streamed else 'resident'}"
            f"{' (int8 blocks)' if self.int8 else ''}: {self.device_bytes / 1e9:.3f} GB on the device, "
            f"{self.host_bytes / 1e9:.3f} GB streamed from host memory")

    def put(self, name: str) -> Any:
        """Group ``name`` on the device (a transfer in flight for a streamed block)."""
        w = self.resident.get(name)
        if w is not None:
            return w
        if self.int8:
            q, s = self.host[name]
            return self.xfer.to_device(name + ":q", q), self.xfer.to_device(name + ":s", s)
        return self.xfer.to_device(name, self.host[name])

    def close(self) -> None:
        if self.xfer is not None:
            self.xfer.close()


_SPLITTERS: dict[Any, Callable] = {}


def _splitter(lay: Any, dtype: Any) -> Callable:
    """A jitted ``lay.unflatten`` of the group cast to ``dtype``, one per layout signature (every block of a kind
    shares one compilation)."""
    key = (lay.signature(), lay.size, jnp.dtype(dtype))
    fn = _SPLITTERS.get(key)
    if fn is None:
        fn = _SPLITTERS[key] = jax.jit(lambda flat: lay.unflatten(flat.astype(dtype)))
    return fn


def _tree(lay: Any, w: Any, dt: Any) -> Any:
    """A group's weight tree: resident groups are trees already; a streamed block is one flat buffer."""
    if isinstance(w, dict):
        return jax.tree_util.tree_map(lambda a: a.astype(dt), w)
    return lay.unflatten(w.astype(dt))


def _np_dtype(dtype: Any) -> np.dtype:
    if jnp.dtype(dtype) == jnp.bfloat16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(jnp.dtype(dtype).name)


def quantised_leaves(lay: Any) -> list:
    """A block's 2-D kernels (quantised per output channel); every other leaf stays fp32 in the scale buffer."""
    return [lf for lf in lay.leaves if len(lf.shape) >= 2]


def _quantise_group(lay: Any, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values of the group, fp32 side buffer): each kernel of shape (..., out) as int8 with one scale per output
    channel (max |w| / 127 over its inputs); the side buffer holds every kernel's scales, then every other leaf."""
    q = np.zeros(lay.size, np.int8)
    side = []
    for lf in lay.leaves:
        w = flat[lf.offset:lf.offset + lf.size].reshape(lf.shape)
        if len(lf.shape) >= 2:
            m = w.reshape(-1, lf.shape[-1])
            scale = np.maximum(np.abs(m).max(axis=0), 1e-30) / 127.0
            q[lf.offset:lf.offset + lf.size] = np.clip(np.rint(m / scale), -127, 127).astype(np.int8).reshape(-1)
            side.append(scale.astype(np.float32))
    for lf in lay.leaves:
        if len(lf.shape) < 2:
            side.append(flat[lf.offset:lf.offset + lf.size].astype(np.float32))
    return q, np.concatenate(side) if side else np.zeros(1, np.float32)


def _dequantise(lay: Any, q: jax.Array, side: jax.Array, dtype: Any) -> Any:
    """The block's weight tree from its int8 values and side buffer (``_quantise_group``), on the device."""
    leaves, pos = {}, 0
    for lf in lay.leaves:
        if len(lf.shape) >= 2:
            out = lf.shape[-1]
            scale = side[pos:pos + out]
            pos += out
            w = q[lf.offset:lf.offset + lf.size].reshape(-1, out).astype(F32) * scale
            leaves[lf.path] = w.reshape(lf.shape).astype(dtype)
    for lf in lay.leaves:
        if len(lf.shape) < 2:
            leaves[lf.path] = side[pos:pos + lf.size].reshape(lf.shape).astype(dtype)
            pos += lf.size
    flat = jnp.concatenate([leaves[lf.path].reshape(-1) for lf in lay.leaves])
    return lay.unflatten(flat)


class Decoder:
    """Generates from a ``Source`` (``generate/source.py``) with ``Weights``; ``run(prompts)`` -> completions."""

    def __init__(self, source: Any, weights: Weights):
        from megatrain_jax.models.common import abstract_model, streamed_parts

        from megatrain_jax.engine.weights import Pace

        self.source, self.weights = source, weights
        self.pace = Pace(2)
        cfg = source.cfg
        self.cfg, self.dtype = cfg, weights.dtype
        parts = streamed_parts(abstract_model(cfg))
        self.parts = parts
        self.num_layers = cfg.num_layers
        self.kinds = list(parts.blocks.kinds)
        self.kv_shape = (cfg.kv_heads, cfg.dim_per_head)
        dt, lays = self.dtype, weights.layouts
        lay_e, lay_h = lays["embed"], lays["head"]
        embed_fn, head_fn, aux_fn, tied, cap = parts.embed_fn, parts.head_fn, parts.aux_fn, parts.tied, \
            parts.logit_softcap

        def embed(we, tokens):
            return embed_fn(_tree(lay_e, we, dt), tokens).astype(dt)

        self._embed = jax.jit(embed)
        self._aux = jax.jit(lambda pos: aux_fn(pos, None))
        self._blocks: dict[Any, Callable] = {}
        for kind in dict.fromkeys(self.kinds):
            lay = lays[f"block_{self.kinds.index(kind)}"]
            self._blocks[kind] = self._block_kernel(parts.blocks.templates[kind], lay)

        def logits_of(wh, we, h):
            normed, out = head_fn(_tree(lay_h, wh, dt), h, _tree(lay_e, we, dt) if tied else None)
            lg = jnp.dot(normed[:, -1, :], out.astype(normed.dtype), preferred_element_type=F32)
            return lg if cap is None else cap * jnp.tanh(lg / cap)

        self.logits = jax.jit(logits_of)

        def head_sample(wh, we, h, key, temperature, top_p, *, greedy, top_k, use_top_p):
            return sample_logits(logits_of(wh, we, h), key, temperature, top_p, greedy=greedy, top_k=top_k,
                                 use_top_p=use_top_p)

        self._head_sample = jax.jit(head_sample, static_argnames=("greedy", "top_k", "use_top_p"))

    def _block_kernel(self, template, lay) -> Callable:
        dt = self.dtype

        def step(w, h, aux, kc, vc, start, pad):
            tree = _dequantise(lay, w[0], w[1], dt) if isinstance(w, tuple) else _tree(lay, w, dt)
            with KVContext(kc, vc, start, pad) as ctx:
                out = template(tree, h, aux)
            if isinstance(out, tuple):  # (hidden, router statistics): not needed here
                out = out[0]
            return out.astype(dt), ctx.k, ctx.v

        return jax.jit(step, donate_argnums=(3, 4))

    # ------------------------------------------------------------------------------------ one batch

    def _sweep(self, h, aux, caches, start, pad):
        """Every block once (the next one's weights in flight first); ``caches`` updated in place."""
        w_names = [f"block_{i}" for i in range(self.num_layers)]
        nxt = self.weights.put(w_names[0])
        self.pace.reset()
        for i in range(self.num_layers):
            w = nxt
            if i + 1 < self.num_layers:
                nxt = self.weights.put(w_names[i + 1])  # issued before block i's compute: it overlaps it
            kc, vc = caches[i]
            h, kc, vc = self._blocks[self.kinds[i]](w, h, aux, kc, vc, start, pad)
            caches[i] = (kc, vc)
            if self.weights.streamed:  # streamed blocks: the thread stays two blocks ahead of the device, so at most
                self.pace.dispatched(h)  # three blocks' weights are on it at once (the plan counts three)
        return h

    def run_batch(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, *,
                  eos_ids: tuple = (), stop: Callable[[int, list], int | None] | None = None,
                  pad_id: int = 0, timing: Timing | None = None, cache_len: int | None = None,
                  prefill_chunk: int | None = None) -> list[Completion]:
        """One batch decoded together. ``stop(row, ids)``: the length to cut the row's ids to where a stop string
        ends it (None: go on). ``prefill_chunk``: the prompts pass the blocks this many slots at a time (the
        attention scores of one chunk, not of the whole prompt, exist at once; ``prefill_chunk_of``)."""
        b = len(prompts)
        chunk = prefill_chunk or prefill_chunk_of(max(len(x) for x in prompts))
        p = -(-max(len(x) for x in prompts) // chunk) * chunk  # left-padded to whole chunks: one prefill shape
        t_len = max(cache_len or 0, p + max_new_tokens)
        pads = np.asarray([p - len(x) for x in prompts], np.int32)
        toks = np.full((b, p), pad_id, np.int32)
        for r, x in enumerate(prompts):
            toks[r, p - len(x):] = x
        positions = np.maximum(np.arange(p, dtype=np.int32)[None, :] - pads[:, None], 0)
        kvh, d = self.kv_shape
        caches = [(jnp.zeros((b, t_len, kvh, d), self.dtype), jnp.zeros((b, t_len, kvh, d), self.dtype))
                  for _ in range(self.num_layers)]
        pad = jnp.asarray(pads)
        we, wh = self.weights.put("embed"), self.weights.put("head")
        key0 = jax.random.key(sampling.seed)
        temp = jnp.asarray(max(sampling.temperature, 1e-6), F32)
        top_p = jnp.asarray(sampling.top_p, F32)
        static = dict(greedy=sampling.greedy, top_k=int(sampling.top_k or 0),
                      use_top_p=(not sampling.greedy) and sampling.top_p < 1.0)

        t0 = time.perf_counter()
        for lo in range(0, p, chunk):  # (the last chunk's output is the last prompt token's)
            h = self._embed(we, jnp.asarray(toks[:, lo:lo + chunk]))
            h = self._sweep(h, self._aux(jnp.asarray(positions[:, lo:lo + chunk])), caches,
                            jnp.asarray(lo, jnp.int32), pad)
        tok = self._head_sample(wh, we, h, jax.random.fold_in(key0, 0), temp, top_p, **static)
        tok.block_until_ready()
        t1 = time.perf_counter()

        out = [Completion(list(x), []) for x in prompts]
        done = np.zeros(b, bool)
        eos = set(int(e) for e in eos_ids)
        pending = [tok]  # device tokens not yet read

        def take(step_tok) -> None:
            ids = np.asarray(step_tok)
            for r in range(b):
                if done[r]:
                    continue
                out[r].ids.append(int(ids[r]))
                if int(ids[r]) in eos:
                    done[r], out[r].finish_reason = True, "eos"
                elif stop is not None:
                    cut = stop(r, out[r].ids)
                    if cut is not None:
                        out[r].ids = out[r].ids[:cut]
                        done[r], out[r].finish_reason = True, "stop"

        steps = 0
        for t in range(1, max_new_tokens):
            slot = p + t - 1
            pos = (slot - pads)[:, None].astype(np.int32)
            h = self._embed(we, tok[:, None])
            h = self._sweep(h, self._aux(jnp.asarray(pos)), caches, jnp.asarray(slot, jnp.int32), pad)
            tok = self._head_sample(wh, we, h, jax.random.fold_in(key0, t), temp, top_p, **static)
            steps += 1
            take(pending.pop(0))  # the previous step's tokens (that step is done or about to be)
            pending.append(tok)
            if done.all():
                break
        for x in pending:
            if not done.all():
                take(x)
        jax.block_until_ready(tok)
        t2 = time.perf_counter()
        if timing is not None:
            timing.prefill_s += t1 - t0
            timing.decode_s += t2 - t1
            timing.prefill_tokens += int(b * p)
            timing.decode_steps += steps
            timing.batch = max(timing.batch, b)
        return out


PREFILL_CHUNK = 1024  # prompts longer than this pass the blocks in chunks of it


def prefill_chunk_of(prompt_len: int) -> int:
    """The prefill's slots per pass: the whole (padded) prompt up to ``PREFILL_CHUNK``, else ``PREFILL_CHUNK``."""
    return prompt_len if prompt_len <= PREFILL_CHUNK else PREFILL_CHUNK


def padded_prompt(prompt_len: int) -> int:
    """Prompt slots after left-padding to whole prefill chunks."""
    chunk = prefill_chunk_of(prompt_len)
    return -(-prompt_len // chunk) * chunk


def cache_bucket(n: int) -> int:
    """Cache lengths rounded up to a multiple of 64 (few distinct shapes, few compilations)."""
    return int(math.ceil(n / 64) * 64)


def check_mode(mode: str) -> None:
    if mode not in WEIGHT_MODES:
        raise UserError("--weights", f"{mode!r} is not a placement", "use auto, resident or streamed")
