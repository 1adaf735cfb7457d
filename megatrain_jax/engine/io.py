"""The embedding and the LM head at both ends of the step: resident, or streamed (``stream_io``).

``ResidentIO`` (the default) takes both groups whole for the step: the fp32 master crosses PCIe
once, is cast on the device, and fp32 gradient accumulators of both sizes live there.

``StreamIO`` (``EngineOptions.stream_io``) keeps neither on the GPU, for a vocabulary too large for
a small card:

- ``EmbedRows``: the host gathers only the rows the step's tokens use (plus the group's other, small
  leaves) into one (U, H) block; the embedding runs on ids remapped into it. Its (U, H) gradient goes
  to the host and is scattered into the group's dense gradient there (AdamW decays every row).
- ``HeadStream``: the output matrix streams from the host store in vocabulary chunks, twice. Pass 1
  keeps, per token, a running max, sum of exponentials and the label's logit (online log-sum-exp);
  pass 2 (chunks in reverse: the last one is still on the device) forms softmax - onehot per (token
  chunk x vocab chunk) tile, accumulates d normed in fp32, and sends each vocabulary chunk's weight
  gradient to the host at once. The final norm's small weights stay resident; its VJP runs last.
- Tied embeddings (head = embedding^T): the chunks are rows of the embedding's table (contiguous),
  their gradient fills every row of the embedding's dense gradient, and the rows' gradient is added
  to it (the group's squared norm gains the cross term).

The head's streaming (gathered, cast, scattered off the dispatching thread) is ``io_head.py``'s.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from megatrain_jax.engine.io_head import HeadStream, only_leaf_shaped, with_shape
from megatrain_jax.engine.kernels import F32, local_shard, named
from megatrain_jax.engine.updaters import EMBED, HEAD
from megatrain_jax.errors import UserError
from megatrain_jax.optim.host import alloc_aligned

ROWS_BUCKET = 1024  # the gathered embedding rows are padded to a multiple of this: few shapes, few compiles
COPY_THREADS = 4  # host threads of the embedding rows' strided gather (numpy copies release the GIL)


# shared by every trainer in the process (kernels.py says why)
_embed_zero_pad_row = jax.jit(
    named("embed_zero_pad_row", lambda g, lo, n: jax.lax.dynamic_update_slice(g, jnp.zeros((n,), F32), (lo,))),
    static_argnums=2, donate_argnums=0)


@dataclass(frozen=True)
class IOParts:
    """What the embedding and head I/O use of the engine (``StreamedTrainer`` builds it), not the
    trainer itself: the streamed model and options, the kernels, transfers, updaters, weight stream
    and host store, and ``deliver(group, gradient, scale)``: a group's complete gradient reduced, its
    squared norm taken and handed to the updater."""

    parts: Any
    options: Any
    kernels: Any
    xfer: Any
    updates: Any
    weights: Any
    store: Any
    deliver: Callable


class ResidentIO:
    """Today's path: the embedding and head resident for the step, whole."""

    second_loss_reads_outputs = True  # a resweep's second sweep runs the loss again, from the last block's outputs
    embed_grad_on_host = False  # the embedding's gradient is made on the device (a resweep's second sweep makes it again)
    streams_head = False  # a forward-only pass applies the head whole (``head_of``)

    def __init__(self, io: IOParts):
        self.k, self.weights, self.store, self.parts = io.kernels, io.weights, io.store, io.parts
        self.deliver = io.deliver  # reduce, squared norm, hand to the updater
        self._g_emb = None

    def take_embed(self, batch: Any, mbs: list) -> jax.Array:
        return self.weights.take(EMBED)  # (embed size,)

    def embed(self, emb: jax.Array, mbs: list) -> list:
        return [self.k.embed_fwd(emb, mb.inputs) for mb in mbs]

    def prefetch_head(self) -> None:
        self.weights.prefetch(HEAD, wait=False)

    def take_head(self) -> jax.Array:
        return self.weights.take(HEAD)  # (head size,)

    def loss(self, head: jax.Array, emb: jax.Array, hs: list, mbs: list, inv: jax.Array,
             scale: float | None = None) -> tuple:
        """(M losses, M d hidden, [the head's squared gradient norm]); the head's gradient is out
        (``scale``: a resweep's second sweep sends it clipped)."""
        k = self.k
        g_head, g_emb = k.zeros(self.store["head"].size), k.zeros(self.store["embed"].size)  # fp32 per device
        losses, dhs = [], []
        for h, mb in zip(hs, mbs):
            loss, dh, g_head, g_emb = k.head_loss(head, emb, h, mb.labels, mb.mask, inv, g_head, g_emb) \
                if k.objective is None else k.objective.resident_loss(k, head, emb, h, mb, inv, g_head, g_emb)
            losses.append(loss)
            dhs.append(dh)
        self._g_emb = g_emb
        return losses, dhs, [self.deliver(HEAD, g_head, scale)]

    def embed_backward(self, emb: jax.Array, mbs: list, dhs: list, scale: float | None = None) -> jax.Array:
        g, self._g_emb = self._g_emb, None
        for m, mb in enumerate(mbs):
            g = self.k.embed_bwd(emb, mb.inputs, dhs[m], g)
        return self.deliver(EMBED, g, scale)

    def resident(self, emb: jax.Array, head: jax.Array) -> dict:
        return {"embed": emb, "head": head}

    def head_of(self, dt: Any) -> tuple:
        """What a forward-only pass applies (``evaluate.ForwardPass``): ``trees(wh, we)`` (the head's weights and
        the tied embedding's, in ``dt``), the head function, its logit softcap, and a key naming them for a cache
        of compiled heads (None: not hashable)."""
        parts = self.parts
        lay_h, lay_e = self.store["head"].layout, self.store["embed"].layout
        head_fn, tied, cap = parts.head_fn, parts.tied, parts.logit_softcap

        def trees(wh, we):
            return lay_h.unflatten(wh.astype(dt)), (lay_e.unflatten(we.astype(dt)) if tied else None)
        key = (head_fn, tied, cap, lay_h.signature(), lay_e.signature(), jnp.dtype(dt)) \
            if getattr(head_fn, "__hash__", None) is not None else None
        return trees, head_fn, cap, key

    def seq_logps(self, head: jax.Array, emb: jax.Array, hs: list, mbs: list) -> list:
        """Each row's summed log-probability of its labels under the preference objective's head, forward only."""
        return [self.k.objective.resident_logps(self.k, head, emb, h, mb) for h, mb in zip(hs, mbs)]

    def close(self) -> None:
        """Nothing to end (``StreamIO`` ends its background threads)."""


class StreamIO:
    """``stream_io``: the embedding's rows and the head's vocabulary chunks, neither resident."""

    second_loss_reads_outputs = False  # a resweep's second sweep starts from the first's top cotangents
    embed_grad_on_host = True  # the first sweep's embedding gradient waits in host memory (its update starts at the norm)
    streams_head = True  # a forward-only pass streams the head's chunks past the tokens (``HeadStream.forward_stats``)

    def __init__(self, io: IOParts):
        parts, o = io.parts, io.options
        hs = jax.eval_shape(parts.embed_fn, parts.embed_weights, _probe_inputs(parts))
        H = int(hs.shape[-1])
        out = jax.eval_shape(lambda hw, h, ew: parts.head_fn(hw, h, ew)[1], parts.head_weights, hs,
                             parts.embed_weights if parts.tied else None)
        if tuple(out.shape) != (H, out.shape[-1]):
            raise UserError("train.stream_io", f"the head's output matrix is {tuple(out.shape)}, not (hidden, vocab)",
                            "set train.stream_io=false (a folded output bias is not streamed)")
        V = int(out.shape[-1])
        self.rows = EmbedRows(io, H, V)
        self.head = HeadStream(io, H, V, min(int(o.vocab_chunk), V), self.rows)
        self.tr = io
        self._again: tuple | None = None  # resweep: the first sweep's losses, top cotangents and head norms

    def take_embed(self, batch: Any, mbs: list) -> Any:
        self.head.reset()  # a step that raised may have left its head chunks behind
        self._again = None
        rows = self.rows.take(batch, mbs)
        self.head.stage_early()  # the head's gather overlaps the forward when its update is done already
        return rows

    def embed(self, emb: Any, mbs: list) -> list:
        return self.rows.forward(emb, mbs)

    def prefetch_head(self) -> None:
        self.head.start(wait=False)

    def take_head(self) -> jax.Array:
        return self.head.start(wait=True)

    def loss(self, head: jax.Array, emb: Any, hs: list, mbs: list, inv: jax.Array,
             scale: float | None = None) -> tuple:
        """The head's loss and backward; with ``grad_hold=resweep`` the first sweep also keeps the top
        cotangents (one layer of activations on the device: the plan counts it), and the second sweep,
        ``scale`` known, starts from them and sends the head's gradient, which waited in host memory
        where it was made: the head is neither streamed nor computed again."""
        if scale is not None:
            losses, dhs, sq = self._again
            self._again = None
            self.tr.updates.send("head", self.head.dense, scale)
            return losses, dhs, sq
        losses, dhs, sq = self.head.loss(head, hs, mbs, inv)
        if self.tr.updates.resweep:
            self._again = (losses, [d.copy() for d in dhs], sq)  # the blocks' VJPs donate the originals
        return losses, dhs, sq

    def embed_backward(self, emb: Any, mbs: list, dhs: list, scale: float | None = None) -> jax.Array:
        """The rows' gradient into the embedding's host gradient; in a resweep's second sweep that
        gradient, made by the first, is sent as it is (tied: it holds the head's part too)."""
        if scale is not None:
            self.tr.updates.send("embed", self.rows.dense, scale)
            return self.rows.last_sq
        return self.rows.backward(emb, dhs)

    def resident(self, emb: Any, head: jax.Array) -> dict:
        return {}

    def seq_logps(self, head: jax.Array, emb: Any, hs: list, mbs: list) -> list:
        """Each row's summed log-probability (the head's chunks, pass 1 only)."""
        return self.head.seq_logps(head, hs, mbs)

    def close(self) -> None:
        self.head.close()


def make_io(io: IOParts) -> ResidentIO | StreamIO:
    return StreamIO(io) if io.options.stream_io else ResidentIO(io)


# ------------------------------------------------------------------------------------ helpers


def _probe_inputs(parts: Any) -> Any:
    tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return (tok, tok) if parts.embed_takes_positions else tok




class _Copier:
    """Strided host copies split by rows over a few threads (the dispatching thread must not stall)."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="io-copy")

    def run(self, fn, n: int) -> None:
        step = -(-n // COPY_THREADS)
        for f in [self.pool.submit(fn, lo, min(lo + step, n)) for lo in range(0, n, step)]:
            f.result()


# ------------------------------------------------------------------------------------ embedding rows


class EmbedRows:
    """The embedding's rows that the step's tokens use, gathered on the host; the rest stays there."""

    def __init__(self, tr: IOParts, H: int, V: int):
        self.tr, self.k, self.xfer, self.upd = tr, tr.kernels, tr.xfer, tr.updates
        g = tr.store["embed"]
        self.group, self.H, self.V = g, H, V
        self.layout = g.layout
        self.ti = only_leaf_shaped(self.layout, (V, H), "embed", "the token table")
        leaf = self.layout.leaves[self.ti]
        self.table = g.master[leaf.offset:leaf.offset + leaf.size].reshape(V, H)
        self.pad_id = getattr(tr.parts, "pad_id", None)
        self.tied = tr.parts.tied  # the head's chunks write every row of the gradient first (HeadStream)
        self.dense = np.zeros(g.size, np.float32)  # the group's gradient, on the host (pageable)
        self.dense_table = self.dense[leaf.offset:leaf.offset + leaf.size].reshape(V, H)
        self._dirty: np.ndarray | None = None  # rows of ``dense_table`` written last step
        self.last_sq: Any = None  # the squared norm of the gradient made last (a resweep sends it again)
        self._bufs: list[np.ndarray] = []  # staging buffers (registered; kept alive until close)
        self._fns: dict[int, tuple] = {}  # per padded row count: (layout, forward, backward)
        self._zero_slot = _embed_zero_pad_row
        self.copy = _Copier()

    def _kernels(self, U: int) -> tuple:
        fns = self._fns.get(U)
        if fns is None:
            lay, dt, p, smap = with_shape(self.layout, self.ti, (U, self.H)), self.k.dtype, self.tr.parts, self.k._smap
            rep, dat = P(), P("data")

            def fwd(w, inputs):
                return p.embed_fn(lay.unflatten(w.astype(dt)), inputs).astype(dt)

            def bwd(w, inputs, dh, g):
                _, vjp = jax.vjp(lambda w_: fwd(w_, inputs), w)
                return g + vjp(dh)[0].astype(F32)

            fns = (lay, jax.jit(smap(fwd, (rep, dat), dat)),
                   jax.jit(smap(bwd, (rep, dat, dat, dat), dat), donate_argnums=(3,)))
            self._fns[U] = fns
        return fns

    def _slots(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(ids per slot, -1 for filler; each token's slot; padded slot count; a slot whose gradient
        must be zeroed, or -1). The padding id keeps its own id as its slot when that slot exists,
        so that an ``embed_fn`` comparing ids with it (no gradient for padding) still sees it."""
        uniq, inv = np.unique(tokens, return_inverse=True)
        U = min(-(-(len(uniq) + 1) // ROWS_BUCKET) * ROWS_BUCKET, self.V)
        ids = np.full(U, -1, np.int64)
        pad, zero = self.pad_id, -1
        if pad is not None and pad < U:
            rest = uniq[uniq != pad]
            where = np.arange(U)
            where = where[where != pad][:len(rest)]
            ids[where], ids[pad] = rest, pad
            slot_of = np.empty(len(uniq), np.int64)
            slot_of[uniq != pad] = where
            slot_of[uniq == pad] = pad
        else:
            ids[:len(uniq)] = uniq
            slot_of = np.arange(len(uniq))
            hit = np.nonzero(uniq == pad)[0] if pad is not None else []
            zero = int(hit[0]) if len(hit) else -1  # the padding token sits elsewhere: its gradient is dropped
        return ids, slot_of[inv].reshape(tokens.shape).astype(np.int32), U, zero

    def take(self, batch: Any, mbs: list) -> Any:
        """The step's rows on the device, and each micro-batch's remapped embedding input."""
        ids, remapped, U, zero = self._slots(np.asarray(batch.tokens))
        lay, fwd, bwd = self._kernels(U)
        self.upd.wait("embed")  # its update has written the master
        buf = self._staging(lay.size)
        real = ids >= 0
        src = np.where(real, ids, 0)
        for j, (s, d) in enumerate(zip(self.layout.leaves, lay.leaves)):
            if j == self.ti:
                rows = buf[d.offset:d.offset + d.size].reshape(U, self.H)
                self.copy.run(lambda lo, hi: np.take(self.table, src[lo:hi], axis=0, out=rows[lo:hi]), U)
            else:
                buf[d.offset:d.offset + d.size] = self.group.master[s.offset:s.offset + s.size]
        name = f"embed/rows{len(self._bufs) - 1}"
        self.xfer.host_written(name, buf)
        w = self.xfer.to_device(name, buf)
        m, b = len(mbs), remapped.shape[0]
        sharding = self.k.batch_sharding
        inputs = []
        for part, mb in enumerate(mbs):
            x = np.ascontiguousarray(remapped[part * b // m:(part + 1) * b // m])
            tok = jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx])
            inputs.append((tok, mb.inputs[1]) if self.tr.parts.embed_takes_positions else tok)
        return _Rows(w, inputs, ids, U, zero, lay)

    def _staging(self, n: int) -> np.ndarray:
        """A registered host buffer of at least ``n`` values (grown rarely: its size follows the
        batch's distinct tokens, bucketed). A view of exactly ``n`` values."""
        if not self._bufs or self._bufs[-1].size < n:
            buf = alloc_aligned(n, np.float32)
            self._bufs.append(buf)
            self.xfer.register(f"embed/rows{len(self._bufs) - 1}", buf)
        return self._bufs[-1][:n]

    def forward(self, rows: "_Rows", mbs: list) -> list:
        fwd = self._kernels(rows.U)[1]
        return [fwd(rows.w, x) for x in rows.inputs]

    def backward(self, rows: "_Rows", dhs: list) -> jax.Array:
        """The rows' gradient, summed over the devices, to the host and scattered into the dense
        gradient there; returns its squared norm (the dense one's: every other row is zero; tied, the
        head's part is counted by the head, and the cross term is added here)."""
        lay, _, bwd = self._kernels(rows.U)
        k = self.k
        g = k.zeros(lay.size)
        for x, dh in zip(rows.inputs, dhs):
            g = bwd(rows.w, x, dh, g)
        if k.reduce is not None:
            g = k.reduce(g)
        if rows.zero >= 0:
            off = lay.leaves[self.ti].offset
            g = self._zero_slot(g, off + rows.zero * self.H, self.H)
        sq = k.sqnorm(g)
        host = self.xfer.to_host(local_shard(g))
        self.upd.wait("embed")  # the last update read ``dense``: its rows are rewritten now
        flat = np.asarray(self.xfer.host_view(host))
        if self._dirty is not None and not self.tied:
            self.dense_table[self._dirty] = 0.0
        real = rows.ids >= 0
        for j, (s, d) in enumerate(zip(self.layout.leaves, lay.leaves)):
            src = flat[d.offset:d.offset + d.size]
            if j != self.ti:
                self.dense[s.offset:s.offset + s.size] = src
                continue
            add, ids = src.reshape(rows.U, self.H)[real], rows.ids[real]
            if self.tied:  # the head's gradient of every row is there already: add, and the norm's cross term
                cur = self.dense_table[ids]
                sq = sq + 2.0 * float(np.dot(cur.ravel().astype(np.float64), add.ravel().astype(np.float64)))
                add = cur + add
            self.dense_table[ids] = add
        self._dirty = rows.ids[real]
        self.upd.gradient("embed", self.dense)
        self.last_sq = sq
        return sq


class _Rows:
    """One step's gathered embedding: the device block, each micro-batch's input, the slots' ids."""

    def __init__(self, w, inputs, ids, U, zero, layout):
        self.w, self.inputs, self.ids, self.U, self.zero, self.layout = w, inputs, ids, U, zero, layout
