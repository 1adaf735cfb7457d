"""LoRA adapters on any family's blocks: ``y = x W (+ b) + (alpha / r) * dropout(x) A B``.

A targeted projection (an ``nnx.Linear`` named ``q_proj`` .. ``down_proj``) becomes a ``LoraLinear``:
the same module with the same ``kernel``/``bias`` leaves (so the base's host layout, Hugging Face
names and importer are unchanged) plus ``lora_a`` (in, r) and ``lora_b`` (r, out), kept as
``LoraParam`` so that ``nnx.split(block, LoraParam, LoraRng, ...)`` separates what trains (the
adapters), the dropout keys and the frozen rest. Initialisation as peft: A kaiming-uniform with
a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B zeros, so a fresh adapter changes nothing. peft
stores ``lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r): the transposes (``hf/peft.py``).

Biases (Qwen2's q/k/v) stay in the base: the adapter adds to the linear part, as peft's does. The
experts of a mixture-of-experts block are stacked parameters, not ``Linear`` modules: only its
attention projections take adapters (``config/validate.py`` refuses MLP targets there).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.config import ModelConfig

# model.lora.targets name -> (the block's submodule, the projection's attribute; peft's target_modules name)
LORA_MODULES = {"q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "v": ("self_attn", "v_proj"),
                "o": ("self_attn", "o_proj"), "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"),
                "down": ("mlp", "down_proj")}
TARGET_ORDER = tuple(LORA_MODULES)  # a target's index seeds its A: the same draw whatever else is targeted


def plain_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` without adapters: the frozen base's model (its layouts, initialisation, export)."""
    import dataclasses

    return dataclasses.replace(cfg, lora=None)


def adapter_shapes(cfg: ModelConfig) -> list[dict]:
    """Every layer's adapter tree as ``ShapeDtypeStruct`` leaves (``{submodule: {proj: {lora_a, lora_b}}}``)."""
    return [split_lora(abstract_lora_block(cfg, i))[1] for i in range(cfg.num_layers)]


class LoraParam(nnx.Param):
    """An adapter weight (``lora_a``, ``lora_b``): the only thing LoRA training updates."""


class LoraRng(nnx.Variable):
    """A projection's dropout key (raw uint32 key data), set per call (``set_dropout_keys``)."""


class LoraLinear(nnx.Linear):
    """``nnx.Linear`` plus a low-rank update; made from an existing ``Linear`` by ``attach``."""

    rank: int
    scale: float
    dropout: float

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        y = super().__call__(x, out_sharding)
        xa = x
        if self.dropout > 0 and getattr(self, "lora_dropout", None) is not None:
            xa = self.lora_dropout(x)  # Trainer(lora=): an nnx.Dropout that stream() reseeds per block call
        elif self.dropout > 0:
            key = jax.random.wrap_key_data(self.lora_rng[...])
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            xa = jnp.where(keep, x / jnp.asarray(1.0 - self.dropout, x.dtype), jnp.zeros((), x.dtype))
        a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
        return y + jnp.dot(jnp.dot(xa, a), b) * jnp.asarray(self.scale, x.dtype)


def attach(lin: nnx.Linear, rank: int, scale: float, dropout: float, key: jax.Array | None) -> LoraLinear:
    """``lin`` as a ``LoraLinear`` sharing its kernel/bias. ``key``: draw A (peft's init), B zeros;
    None: abstract adapters (``ShapeDtypeStruct``), for structure only."""
    new = LoraLinear.__new__(LoraLinear)
    vars(new).update(vars(lin))
    new.rank, new.scale, new.dropout = int(rank), float(scale), float(dropout)
    din, dout = lin.in_features, lin.out_features
    if key is None:
        a, b = jax.ShapeDtypeStruct((din, rank), jnp.float32), jax.ShapeDtypeStruct((rank, dout), jnp.float32)
    else:
        bound = 1.0 / (din ** 0.5)  # kaiming_uniform(a=sqrt(5)) on (r, in): bound = 1 / sqrt(fan_in)
        a = jax.random.uniform(key, (din, rank), jnp.float32, -bound, bound)
        b = jnp.zeros((rank, dout), jnp.float32)
    new.lora_a, new.lora_b = LoraParam(a), LoraParam(b)
    if dropout > 0:
        new.lora_rng = LoraRng(jnp.zeros((2,), jnp.uint32) if key is not None else
                               jax.ShapeDtypeStruct((2,), jnp.uint32))
    return new


def adapter_key(seed: int, layer: int) -> jax.Array:
    """Layer ``layer``'s adapter key (apart from every key the base's init uses)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0x10A0), layer)


def targets_of(block: nnx.Module, targets: list[str]) -> list[tuple[str, str, str]]:
    """(target, submodule, attribute) for each target this block has as a ``Linear``."""
    out = []
    for t in TARGET_ORDER:
        if t not in targets:
            continue
        parent_name, name = LORA_MODULES[t]
        parent = getattr(block, parent_name, None)
        if isinstance(getattr(parent, name, None), nnx.Linear):
            out.append((t, parent_name, name))
    return out


def add_adapters(block: nnx.Module, cfg: ModelConfig, layer: int, seed: int | None) -> nnx.Module:
    """Make ``block``'s targeted projections ``LoraLinear`` in place (``seed`` None: abstract)."""
    lora = cfg.lora
    base = None if seed is None else adapter_key(seed, layer)
    for t, parent_name, name in targets_of(block, lora.targets):
        parent = getattr(block, parent_name)
        key = None if base is None else jax.random.fold_in(base, TARGET_ORDER.index(t))
        setattr(parent, name, attach(getattr(parent, name), lora.rank, lora.scale, lora.dropout, key))
    return block


def target_names(targets: list[str]) -> set[str]:
    """Attribute names a user's block is matched with: each entry is a ``Linear`` attribute's own name
    (peft's ``target_modules`` rule); a short name (``q`` .. ``down``) also matches its projection's
    (``q_proj`` .. ``down_proj``)."""
    return set(targets) | {LORA_MODULES[t][1] for t in targets if t in LORA_MODULES}


def add_named_adapters(block: nnx.Module, names: set[str], rank: int, scale: float, layer: int, seed: int,
                       dropout: float = 0.0) -> int:
    """Make every ``nnx.Linear`` of ``block`` whose attribute name is in ``names`` a ``LoraLinear`` (in
    place). The ``j``-th match in graph order draws A from ``fold_in(adapter_key(seed, layer), j)``.
    Dropout on the adapter's input is an ``nnx.Dropout`` (stream: the block's key, reseeded per call).
    Returns the number of projections adapted."""
    found = []
    for path, node in nnx.iter_graph(block):
        if path and isinstance(node, nnx.Linear) and not isinstance(node, LoraLinear) and str(path[-1]) in names:
            found.append(path)
    base = adapter_key(seed, layer)
    for j, path in enumerate(found):
        parent = block
        for p in path[:-1]:
            parent = parent[p] if isinstance(p, int) else getattr(parent, p)
        last = path[-1]
        new = attach(parent[last] if isinstance(last, int) else getattr(parent, last), rank, scale, 0.0,
                     jax.random.fold_in(base, j))
        if dropout > 0:
            new.dropout, new.lora_dropout = float(dropout), nnx.Dropout(dropout, rngs=nnx.Rngs(dropout=0))
        if isinstance(last, int):
            parent[last] = new
        else:
            setattr(parent, last, new)
    return len(found)


def lora_decoder(cfg: ModelConfig, seed: int, adapter_seed: int | None = None):
    """The whole decoder (``common.Decoder``, base from ``seed``) with adapters (from ``adapter_seed``,
    default ``seed``): the in-memory LoRA model of tests and the reference."""
    from megatrain_jax.models.common import Decoder

    model = Decoder(cfg, seed)
    for i, layer in enumerate(model.layers):
        add_adapters(layer, cfg, i, seed if adapter_seed is None else adapter_seed)
    return model


def abstract_lora_block(cfg: ModelConfig, layer: int) -> nnx.Module:
    """Layer ``layer``'s block with adapters, every leaf a ``ShapeDtypeStruct`` (no allocation)."""
    from megatrain_jax.models.common import init_part

    return nnx.eval_shape(lambda: add_adapters(init_part(cfg, 0, f"block_{layer}"), cfg, layer, 0))


def split_lora(module: nnx.Module) -> tuple[Any, dict, dict, dict]:
    """(graphdef, adapters, dropout keys, frozen rest) as pure dicts."""
    graph, adapters, rngs, rest = nnx.split(module, LoraParam, LoraRng, ...)
    return graph, nnx.to_pure_dict(adapters), nnx.to_pure_dict(rngs), nnx.to_pure_dict(rest)


def dropout_keys(rng_tree: Any, key: jax.Array | None) -> Any:
    """Fill a module's ``LoraRng`` tree: leaf ``j`` gets ``fold_in(key, j)`` (zeros without a key)."""
    leaves, treedef = jax.tree_util.tree_flatten(rng_tree)
    if key is None:
        return jax.tree_util.tree_unflatten(treedef, [jnp.zeros((2,), jnp.uint32) for _ in leaves])
    return jax.tree_util.tree_unflatten(
        treedef, [jax.random.key_data(jax.random.fold_in(key, j)).astype(jnp.uint32) for j in range(len(leaves))])


def merge_block(graph: Any, adapters: Any, rng_tree: Any, base: Any, key: jax.Array | None) -> nnx.Module:
    """The block of ``graph`` with these adapters and frozen weights, its dropout keys from ``key``."""
    return nnx.merge(graph, adapters, dropout_keys(rng_tree, key), base)


def adapter_paths(adapters: Any) -> list[tuple[str, str, str]]:
    """(submodule, attribute, leaf) of each adapter leaf of one block's adapter tree."""
    out = []
    for parent, mods in adapters.items():
        for name, leaves in mods.items():
            for leaf in leaves:
                out.append((parent, name, leaf))
    return out


def num_adapter_params(cfg: ModelConfig) -> int:
    """Adapter parameters of the whole model (what trains)."""
    total = 0
    for i in range(cfg.num_layers):
        block = abstract_lora_block(cfg, i)
        total += sum(int(x.size) for x in jax.tree_util.tree_leaves(split_lora(block)[1]))
    return total


ADAPTER_LEAVES = ("lora_a", "lora_b")  # a LoRA'd projection's two leaves beside its kernel


def split_adapters(tree: dict) -> tuple[dict, dict]:
    """A block's pure-dict weights -> (adapter leaves only, the rest), both nested as ``tree``."""
    ad, rest = {}, {}
    for k, v in tree.items():
        if k in ADAPTER_LEAVES:
            ad[k] = v
        elif isinstance(v, dict):
            a, r = split_adapters(v)
            if a:
                ad[k] = a
            if r or not a:
                rest[k] = r
        else:
            rest[k] = v
    return ad, rest


def merge_adapters(adapters: dict, rest: dict) -> dict:
    """The inverse of ``split_adapters``."""
    out = dict(rest)
    for k, v in adapters.items():
        out[k] = merge_adapters(v, rest.get(k, {})) if isinstance(v, dict) else v
    return out
