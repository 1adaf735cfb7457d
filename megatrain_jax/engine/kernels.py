"""The jitted pieces of a streamed step, and the per-layer kernel variants the sweeps call.

Each piece is the single-device computation inside a ``shard_map`` over the devices' one-axis mesh:
weights replicated, activations and data split by sequence, and the accumulated weight gradients per
device (a ``(devices x size,)`` array, each device's share its own partial sum) until ``reduce`` sums
them with one collective per group. On one device the map is the identity and ``reduce`` is None.
Every block of a kind shares one forward / backward executable (one kind for identical blocks).

A layer's variant is chosen once, at construction (``layers[i]``): ``Recompute`` (the backward
recomputes the block from its saved input), ``KeepResiduals`` (the last blocks keep their forward's
VJP residuals: no recompute) or ``EmitsStats`` (a block that adds auxiliary-loss statistics, e.g.
MoE router load balancing, to the step's accumulator and takes their cotangent in the backward).
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megatrain_jax.engine.loss import chunked_cross_entropy
from megatrain_jax.hoststore import HostStore
from megatrain_jax.templates import StreamedModel, block_rng, is_shareable

F32 = jnp.float32
# the memory-bound helpers over whole groups (norms, casts, slices, zeros) are not autotuned: XLA's autotuner
# profiles a fusion on redzone copies of its operands, a second copy of a 2 GB gradient at the step's peak
# (an 8B embedding's norm ran out of memory under a 24 GB budget there, bench_gpu_budgets.py); nothing to tune
NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}


def local_shard(x: jax.Array, j: int = 0) -> jax.Array:
    """One local device's copy of a replicated array (chunk ``j`` of a gradient leaves through
    local device ``j mod n``: each device's own link carries a share)."""
    shards = x.addressable_shards
    if len(shards) == 1:
        return shards[0].data
    return shards[j % len(shards)].data



def named(name: str, fn: Callable) -> Callable:
    """``fn`` under ``name``: XLA names its executable ``jit_<name>``, so an out-of-memory error says which
    helper asked (a lambda's is ``jit__lambda``, which an 8B run at 10 GB could not be traced to)."""
    fn.__name__ = fn.__qualname__ = name
    return fn

# The helpers that close over nothing of a model: one jitted function each, shared by every trainer in the
# process, so that the next trainer (a resumed run, a test's next case) neither traces nor lowers them again
# (each trainer's own lambdas were traced and lowered anew: 190 of the 568 lowerings of test_engine.py).
grad_sqnorm = jax.jit(named("grad_sqnorm", lambda g: jnp.sum(jnp.square(g))), compiler_options=NO_AUTOTUNE)
grad_to_bf16 = jax.jit(named("grad_to_bf16", lambda g: g.astype(jnp.bfloat16)), compiler_options=NO_AUTOTUNE)
grad_slab_slice = jax.jit(named("grad_slab_slice", lambda g, lo, n: jax.lax.dynamic_slice_in_dim(g, lo, n).astype(F32)),
                          static_argnums=2, compiler_options=NO_AUTOTUNE)
step_totals = jax.jit(named("step_totals", lambda losses, sqs: (sum(losses), sum(sqs))))  # one fetch per step


@functools.lru_cache(maxsize=None)
def accumulator_zeros(mesh: Mesh) -> Callable[[int], jax.Array]:
    """``zeros(n)``: a gradient accumulator of ``n`` fp32 values per device of ``mesh``, split over them."""
    n_dev = mesh.devices.size
    return jax.jit(named("grad_accumulator_zeros", lambda n: jnp.zeros((n * n_dev,), F32)), static_argnums=0,
                   out_shardings=NamedSharding(mesh, P("data")), compiler_options=NO_AUTOTUNE)


def _layout_key(lay: Any) -> tuple:
    return lay.signature(), lay.size  # tree, leaf paths and shapes (the offsets follow from them)


def program_key(parts: StreamedModel, store: HostStore, mesh: Mesh, dtype: Any, loss_chunk: int) -> tuple | None:
    """Everything a ``Kernels``' closures read, as a hashable value: the model's functions (compared by identity;
    ``models.streamed_parts`` hands equal models the same ones), the groups' layouts, the mesh, the compute dtype
    and the loss chunk. None unless every function is ``templates.shareable``: a function that may close over a
    model's weights is never kept beyond its trainer."""
    stack, aux = parts.blocks, parts.blocks.aux_loss
    kinds = list(dict.fromkeys(stack.kinds))
    fns = [parts.embed_fn, parts.head_fn, parts.aux_fn] + [stack.templates[k] for k in kinds] + \
        ([aux.fn] if aux is not None else [])
    if not all(map(is_shareable, fns)):
        return None
    key = (tuple(fns), bool(parts.tied), parts.logit_softcap, tuple(stack.kinds), tuple(kinds), bool(stack.takes_rng),
           None if aux is None else aux.kinds, _layout_key(store["embed"].layout), _layout_key(store["head"].layout),
           tuple(_layout_key(store[f"block_{stack.kinds.index(k)}"].layout) for k in kinds),
           mesh, jnp.dtype(dtype), int(loss_chunk))
    try:
        hash(key)
    except TypeError:  # (an unhashable kind or layout tree)
        return None
    return key


# Trainers of one model in one process (a resumed run, the next test case, each data-parallel run of a worker)
# share its jitted kernels, so that the next one neither traces, lowers nor compiles them again: the
# data-parallel worker lowered 299 of its 507 programs a second time (experiments/bench_data_parallel.py), and
# tests/test_engine.py alone, with an empty compilation cache, took 44.5 s (61 CPU s) before and 36.3 s (48 CPU s)
# with them shared (a 2-core AMD EPYC). Keyed by ``program_key``; the most recent models are kept,
# at most _SHARED_MODELS (a bound on what a long-lived process holds, each entry its executables; not tuned).
_SHARED_MODELS = 8
_shared: OrderedDict[tuple, dict] = OrderedDict()


def shared_kernels(key: tuple | None) -> dict:
    """The kernels of the model ``key`` (``program_key``), by piece; a fresh dict where key is None."""
    if key is None:
        return {}
    found = _shared.get(key)
    if found is None:
        found = _shared[key] = {}
        while len(_shared) > _SHARED_MODELS:
            _shared.popitem(last=False)
    _shared.move_to_end(key)
    return found


class Kernels:
    """Jits the step's pieces for ``parts`` over ``mesh``; ``layers[i]`` is layer i's variant."""

    def __init__(self, parts: StreamedModel, store: HostStore, mesh: Mesh, dtype: Any, loss_chunk: int,
                 keep_residuals: int):
        self.parts, self.store, self.mesh, self.dtype = parts, store, mesh, dtype
        self.num_devices = mesh.devices.size
        self.loss_chunk = int(loss_chunk)
        self.objective = None  # a preference objective (objectives.py) in place of cross-entropy; None: SFT
        self.preference_logps: list = []  # its rows' log-probabilities, per micro-batch, of the step's loss
        self._shared = shared_kernels(program_key(parts, store, mesh, dtype, loss_chunk))
        dt, chunk = dtype, loss_chunk
        lay_e, lay_h = store["embed"].layout, store["head"].layout
        tied, cap = parts.tied, parts.logit_softcap
        embed_fn, head_fn = parts.embed_fn, parts.head_fn  # (the closures below keep no weights: they may be shared)
        stack = parts.blocks
        aux_loss = stack.aux_loss
        rep, dat = P(), P("data")
        multi = self.num_devices > 1

        # weights arrive as the host streams them: bf16, or the fp32 master cast here, on the device
        def embed_fwd(w, tokens):
            return embed_fn(lay_e.unflatten(w.astype(dt)), tokens).astype(dt)

        def head_loss(wh, we, h, labels, mask, inv, gh, ge):
            def f(wh, we, h):
                normed, out = head_fn(lay_h.unflatten(wh.astype(dt)), h,
                                      lay_e.unflatten(we.astype(dt)) if tied else None)
                return chunked_cross_entropy(normed, out, labels, mask, chunk, cap) * inv

            loss, (dwh, dwe, dh) = jax.value_and_grad(f, argnums=(0, 1, 2))(wh, we, h)
            if tied:
                ge = ge + dwe.astype(F32)
            if multi:
                loss = jax.lax.psum(loss, "data")
            return loss, dh, gh + dwh.astype(F32), ge

        def embed_bwd(we, tokens, dh, ge):
            _, vjp = jax.vjp(lambda w: embed_fwd(w, tokens), we)
            (dw,) = vjp(dh)
            return ge + dw.astype(F32)

        smap, once = self._smap, self.once
        self._block_raw: dict[Any, Callable] = {}  # per template: its plain forward (for kept residuals)
        self.vjp_jits: dict[Any, tuple] = {}  # (those this trainer used: the jits themselves are shared)
        self.embed_fwd = once("embed_fwd", lambda: jax.jit(smap(embed_fwd, (rep, dat), dat)))
        self._block_fns: dict[Any, tuple] = {}
        for k in dict.fromkeys(stack.kinds):
            raw, self._block_fns[k] = once(("block_fns", k), lambda k=k: self._block_fns_of(
                stack.templates[k], store[f"block_{stack.kinds.index(k)}"].layout,
                aux_loss is not None and k in aux_loss.kinds, multi))
            self._block_raw[stack.templates[k]] = raw
        self._block_jits: dict[Any, tuple] = {}  # (forward, backward[, statistics shapes]) per kind and aux layout
        self._aux_cache: dict[Any, Callable] = {}
        self.head_loss = once("head_loss", lambda: jax.jit(
            smap(head_loss, (rep, rep, dat, dat, dat, rep, dat, dat), (rep, dat, dat, dat)), donate_argnums=(6, 7)))
        self.embed_bwd = once("embed_bwd", lambda: jax.jit(smap(embed_bwd, (rep, dat, dat, dat), dat),
                                                           donate_argnums=(3,)))
        self.reduce = once("reduce", lambda: jax.jit(smap(lambda g: jax.lax.psum(g, "data"), (dat,), rep))) \
            if multi else None
        self._reduce_scatters: dict[int, Callable] = {}
        self._aux_total = None
        if aux_loss is not None:
            def aux_total(acc):  # the step's summed statistics -> (aux loss, its gradient w.r.t. them)
                total = jax.tree_util.tree_map(lambda a: a[0], acc)
                if multi:
                    total = jax.lax.psum(total, "data")
                return jax.value_and_grad(aux_loss.fn)(total)

            self._aux_total = once("aux_total", lambda: jax.jit(smap(aux_total, (dat,), (rep, rep))))
        self._stats_zero_fn: Callable | None = None
        self.sqnorm, self.to_bf16, self.chunk = grad_sqnorm, grad_to_bf16, grad_slab_slice
        self.totals = step_totals
        # committed to the devices like every other operand, so the first micro-batch's call
        # (fresh zeros) and later ones (accumulated outputs) share one executable
        self.batch_sharding = NamedSharding(mesh, dat)
        self._zeros_fn = accumulator_zeros(mesh)
        self._rng_fn = once("rng", lambda: jax.jit(block_rng, out_shardings=NamedSharding(mesh, rep))) \
            if stack.takes_rng else None
        self.rng_seed, self.rng_step = 0, 0
        self.stats = _Stats()
        L = store.num_blocks
        self.keep_residuals = max(0, min(int(keep_residuals), L - 1))  # never the first block
        self.layers: list[Recompute] = [
            EmitsStats(self, i) if stack.emits_stats(i) else
            KeepResiduals(self, i) if i >= L - self.keep_residuals else Recompute(self, i) for i in range(L)]

    def once(self, piece: Hashable, build: Callable[[], Any]) -> Any:
        """This model's ``piece`` (``shared_kernels``): built by the first trainer that asks for it."""
        fn = self._shared.get(piece)
        if fn is None:
            fn = self._shared[piece] = build()
        return fn

    # ---------------------------------------------------------------------------- per step

    def begin(self, step: int) -> None:
        """A new step: dropout keys are (updates done before it, layer, micro-batch)."""
        self.rng_step = step
        self.stats.acc = self.stats.ct = None
        self.preference_logps = []

    def reduce_scatter(self, g: jax.Array, total: int) -> jax.Array:
        """The devices' partial sums of a group's gradient summed, each device receiving only its share of the
        group padded to ``total`` values (``shards.py``: several GPUs updating on the device)."""
        fn = self._reduce_scatters.get(total)
        if fn is None:
            def scatter(a):
                return jax.lax.psum_scatter(jnp.pad(a, (0, total - a.shape[0])), "data", scatter_dimension=0,
                                            tiled=True)
            fn = self.once(("reduce_scatter", total), lambda: jax.jit(
                named("grad_reduce_scatter", self._smap(scatter, (P("data"),), P("data"))),
                compiler_options=NO_AUTOTUNE))
            self._reduce_scatters[total] = fn
        return fn(g)

    def zeros(self, size: int) -> jax.Array:
        """A gradient accumulator: ``size`` fp32 values per device."""
        return self._zeros_fn(size)

    def block_zeros(self, i: int) -> jax.Array:
        """Layer ``i``'s gradient accumulator: its group's size, fp32 per device."""
        return self.zeros(self.store[f"block_{i}"].size)

    def rng(self, layer: int, micro: int) -> jax.Array | None:
        """The dropout key of (this step, layer, micro-batch); None for blocks without randomness."""
        if self._rng_fn is None:
            return None
        return self._rng_fn(self.rng_seed, self.rng_step, layer, micro)

    def aux_total(self) -> jax.Array | None:
        """The step's auxiliary loss (None: no block emitted statistics); its gradient w.r.t. the
        summed statistics is kept for the emitting blocks' backward."""
        if self.stats.acc is None:
            return None
        value, self.stats.ct = self._aux_total(self.stats.acc)
        return value

    def aux_of(self, positions: jax.Array, segment_ids: jax.Array | None) -> Any:
        """``aux_fn`` on each device's share of the micro-batch. Leaves that carry the batch
        dimension stay split over the devices; any other leaf is replicated."""
        key = (positions.shape, segment_ids is None)
        fn = self._aux_cache.get(key)
        if fn is None:
            fn = self._aux_cache[key] = self.once(("aux_of",) + key, lambda: self._aux_kernel(*key))
        return fn(positions, segment_ids)

    def _aux_kernel(self, shape: tuple, no_segments: bool) -> Callable:
        local = jax.ShapeDtypeStruct((shape[0] // self.num_devices,) + shape[1:], jnp.int32)
        shapes = jax.eval_shape(self.parts.aux_fn, local, None if no_segments else local)
        specs = jax.tree_util.tree_map(
            lambda a: P("data") if (a.ndim >= 1 and a.shape[0] == local.shape[0]) else P(), shapes)
        in_specs = (P("data"), None if no_segments else P("data"))
        return jax.jit(self._smap(self.parts.aux_fn, in_specs, specs))

    # ---------------------------------------------------------------------------- blocks

    def block_fwd(self, i: int, w, h, aux, rng, stats=None):
        """Layer ``i``'s output; ``(output, stats + its statistics)`` for a layer that emits them."""
        if stats is None:
            return self._block_kernels(i, aux)[0](w, h, aux, rng)
        return self._block_kernels(i, aux)[0](w, h, aux, rng, stats)

    def block_bwd(self, i: int, w, h, aux, rng, dh, g, stats_ct=None):
        """Recompute layer ``i`` from its input ``h``, VJP: (d input, g + d weights)."""
        if stats_ct is None:
            return self._block_kernels(i, aux)[1](w, h, aux, rng, dh, g)
        return self._block_kernels(i, aux)[1](w, h, aux, rng, dh, g, stats_ct)

    def stats_zeros(self, i: int, w, h, aux, rng) -> Any:
        """Zero accumulators for the auxiliary loss's statistics: one per device (leading axis)."""
        if self._stats_zero_fn is None:
            shapes = jax.eval_shape(self._block_kernels(i, aux)[2], w, h, aux, rng)
            self._stats_zero_fn = jax.jit(
                lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, F32), shapes),
                out_shardings=self.batch_sharding)
        return self._stats_zero_fn()

    def _smap(self, f: Callable, in_specs: Any, out_specs: Any) -> Callable:
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _block_fns_of(self, template, lay, emits_stats: bool, multi: bool) -> tuple[Callable, tuple]:
        """(the block's plain forward, for kept residuals; its kernels' functions)."""
        dt, takes_rng = self.dtype, self.parts.blocks.takes_rng

        def block_fwd(w, h, aux, rng):
            if takes_rng:
                if multi:  # each device's sequences get their own masks
                    rng = jax.random.fold_in(rng, jax.lax.axis_index("data"))
                return template(lay.unflatten(w.astype(dt)), h, aux, rng)
            return template(lay.unflatten(w.astype(dt)), h, aux)

        def block_bwd(w, h, aux, rng, dh, g):
            _, vjp = jax.vjp(lambda w_, h_: block_fwd(w_, h_, aux, rng), w, h)
            dw, dh_in = vjp(dh)
            return dh_in, g + dw.astype(F32)

        if not emits_stats:
            return block_fwd, (block_fwd, block_bwd)

        # a block that also returns statistics: (hidden, stats), the stats in fp32
        def fwd_stats(w, h, aux, rng):
            out, stats = block_fwd(w, h, aux, rng)
            return out, jax.tree_util.tree_map(lambda x: x.astype(F32), stats)

        def block_fwd_acc(w, h, aux, rng, acc):  # acc: this device's running sums, leaves (1, ...)
            out, stats = fwd_stats(w, h, aux, rng)
            return out, jax.tree_util.tree_map(lambda a, x: a + x[None], acc, stats)

        def block_bwd_ct(w, h, aux, rng, dh, g, ct):  # ct: d aux_loss / d (summed stats)
            _, vjp = jax.vjp(lambda w_, h_: fwd_stats(w_, h_, aux, rng), w, h)
            dw, dh_in = vjp((dh, ct))
            return dh_in, g + dw.astype(F32)

        def stats_only(w, h, aux, rng):  # for the accumulator's shapes (eval_shape only)
            return jax.tree_util.tree_map(lambda x: x[None], fwd_stats(w, h, aux, rng)[1])

        return block_fwd, (block_fwd_acc, block_bwd_ct, stats_only)

    @staticmethod
    def _kernel_key(kind: Any, aux: Any) -> tuple[tuple, Any]:
        """A block kind's compiled kernels are one per layout of ``aux`` (its tree and each leaf's sharding): the
        cache key, and the leaves' partition specs (the kernels' ``in_specs`` for it)."""
        specs = jax.tree_util.tree_map(lambda a: a.sharding.spec, aux)
        return (kind, jax.tree_util.tree_structure(aux),
                tuple(jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)))), specs

    def _block_kernels(self, i: int, aux: Any) -> tuple:
        """Layer ``i``'s (forward, backward) executables, for ``aux`` laid out as it is."""
        kind = self.parts.blocks.kinds[i]
        key, specs = self._kernel_key(kind, aux)
        fns = self._block_jits.get(key)
        if fns is None:
            fns = self._block_jits[key] = self.once(("block",) + key, lambda: self._block_jits_of(kind, specs))
        return fns

    def _block_jits_of(self, kind: Any, specs: Any) -> tuple:
        rep, dat = P(), P("data")
        if len(self._block_fns[kind]) == 2:
            fwd, bwd = self._block_fns[kind]
            return (jax.jit(self._smap(fwd, (rep, dat, specs, rep), dat)),
                    jax.jit(self._smap(bwd, (rep, dat, specs, rep, dat, dat), (dat, dat)), donate_argnums=(4, 5)))
        # emits statistics: the forward adds them to the accumulator, the backward takes their cotangent
        fwd, bwd, stats_only = self._block_fns[kind]
        return (jax.jit(self._smap(fwd, (rep, dat, specs, rep, dat), (dat, dat)), donate_argnums=(4,)),
                jax.jit(self._smap(bwd, (rep, dat, specs, rep, dat, dat, rep), (dat, dat)), donate_argnums=(4, 5)),
                self._smap(stats_only, (rep, dat, specs, rep), dat))

    def vjp_kernels(self, i: int, aux: Any) -> tuple[Callable, Callable]:
        """Layer ``i``'s forward that also returns its VJP (the residuals, kept on the device) and
        the backward that applies it: no recompute. With several devices each keeps its own micro-batch's
        residuals (a leading axis of one per device, so that every residual, even a scalar, splits by device)."""
        kind = self.parts.blocks.kinds[i]
        key, specs = self._kernel_key(kind, aux)
        fns = self.vjp_jits.get(key)
        if fns is None:
            fns = self.vjp_jits[key] = self.once(("vjp",) + key, lambda: self._vjp_jits_of(kind, specs))
        return fns

    def _vjp_jits_of(self, kind: Any, specs: Any) -> tuple[Callable, Callable]:
        fwd = self._block_raw[self.parts.blocks.templates[kind]]

        # matmul outputs are kept; the elementwise rest (norms, activations, rotary, casts) and the
        # attention's own computation are recomputed from them in the backward, a small part of the
        # block's forward, for residuals of a few activations per token
        keep = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

        # the residuals leave out the block's weights and its input: the weights would be one copy per
        # micro-batch as the jit's outputs (experiments/RESULTS.md), and the input is the boundary
        # activation the step keeps anyway; the backward gets both again as arguments and puts them
        # back where the VJP expects them
        layout: dict[tuple, tuple] = {}  # per input shape: the VJP's tree and which leaves are w / h

        def fwd_vjp(w, h, aux, rng):
            out, f = jax.vjp(jax.checkpoint(lambda w_, h_: fwd(w_, h_, aux, rng), policy=keep), w, h)
            leaves, tree = jax.tree_util.tree_flatten(f)
            slots = tuple("w" if x is w else "h" if x is h else None for x in leaves)
            layout[h.shape, str(h.dtype)] = (tree, slots)
            return out, [x for x, s in zip(leaves, slots) if s is None]

        def bwd_vjp(w, h, res, dh, g):
            tree, slots = layout[h.shape, str(h.dtype)]
            rest = iter(res)
            f = jax.tree_util.tree_unflatten(tree, [w if s == "w" else h if s == "h" else next(rest)
                                                    for s in slots])
            dw, dh_in = f(dh)
            return dh_in, g + dw.astype(F32)

        if self.num_devices == 1:
            fns = (jax.jit(fwd_vjp),
                   jax.jit(bwd_vjp, donate_argnums=(3, 4), out_shardings=(self.batch_sharding, None)))
        else:  # per device, as the recomputing kernels (_block_kernels): residuals stay where they were made
            rep, dat = P(), P("data")

            def fwd_local(w, h, aux_, rng):
                out, res = fwd_vjp(w, h, aux_, rng)
                return out, [x[None] for x in res]

            def bwd_local(w, h, res, dh, g):
                return bwd_vjp(w, h, [x[0] for x in res], dh, g)

            fns = (jax.jit(self._smap(fwd_local, (rep, dat, specs, rep), (dat, dat))),
                   jax.jit(self._smap(bwd_local, (rep, dat, dat, dat, dat), (dat, dat)), donate_argnums=(3, 4)))
        return fns

    def residual_bytes(self, h: Any, aux: Any) -> int:
        """Bytes of the VJP residuals the last block keeps for one micro-batch of hidden states
        shaped like ``h`` (abstract evaluation: nothing runs)."""
        L = self.store.num_blocks
        v = self.store[f"block_{L - 1}"].stream_view()
        w = jax.ShapeDtypeStruct(v.shape, v.dtype)
        h = jax.ShapeDtypeStruct(h.shape, self.dtype)
        _, vjp = jax.eval_shape(self.vjp_kernels(L - 1, aux)[0], w, h, aux, self.rng(L - 1, 0))
        return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(vjp)))


class _Stats:
    """The auxiliary loss's running sums for one step (``acc``, per device) and their cotangent."""

    acc: Any = None
    ct: Any = None


class Recompute:
    """Layer ``i``: the forward keeps nothing; the backward recomputes it from its saved input."""

    def __init__(self, kernels: Kernels, i: int):
        self.k, self.i = kernels, i

    def forward(self, w, h, aux, m: int):
        return self.k.block_fwd(self.i, w, h, aux, self.k.rng(self.i, m))

    def backward(self, w, h, aux, m: int, dh, g):
        return self.k.block_bwd(self.i, w, h, aux, self.k.rng(self.i, m), dh, g)

    def again(self, w, h, aux, m: int):
        """The forward once more, in the backward (an input recomputed: boundary_every): the same
        executable and key as the forward's, so the same output; nothing kept, nothing accumulated."""
        return self.k.block_fwd(self.i, w, h, aux, self.k.rng(self.i, m))


class EmitsStats(Recompute):
    """A layer whose forward adds auxiliary-loss statistics to the step's accumulator, and whose
    backward receives d aux_loss / d statistics as an extra cotangent."""

    def forward(self, w, h, aux, m: int):
        k, rng = self.k, self.k.rng(self.i, m)
        if k.stats.acc is None:
            k.stats.acc = k.stats_zeros(self.i, w, h, aux, rng)
        h, k.stats.acc = k.block_fwd(self.i, w, h, aux, rng, k.stats.acc)
        return h

    def backward(self, w, h, aux, m: int, dh, g):
        return self.k.block_bwd(self.i, w, h, aux, self.k.rng(self.i, m), dh, g, self.k.stats.ct)

    def again(self, w, h, aux, m: int):
        k, rng = self.k, self.k.rng(self.i, m)  # statistics into a fresh accumulator, dropped: counted once
        return k.block_fwd(self.i, w, h, aux, rng, k.stats_zeros(self.i, w, h, aux, rng))[0]


class KeepResiduals(Recompute):
    """One of the last blocks: its forward keeps the VJP residuals on the device (one set per
    micro-batch), and its backward applies them: no recompute."""

    res: list

    def forward(self, w, h, aux, m: int):
        if m == 0:
            self.res = []
        h, res = self.k.vjp_kernels(self.i, aux)[0](w, h, aux, self.k.rng(self.i, m))
        self.res.append(res)
        return h

    def backward(self, w, h, aux, m: int, dh, g):
        res, self.res[m] = self.res[m], None  # its residuals are freed as soon as they are used
        return self.k.vjp_kernels(self.i, aux)[1](w, h, res, dh, g)
