"""Preference objectives (``train.objective``: dpo | ipo | simpo | orpo) on the chunked loss path.

Every objective is a function of per-sequence log-probabilities. A preference batch holds each pair
in two adjacent rows of the batch (row ``2j`` the chosen completion, row ``2j + 1`` the rejected one,
both after the same prompt: ``data/preference.py``), so a pair never straddles a micro-batch or a
device, and the prompt's tokens have loss mask 0. A row's log-probability is the sum of its
completion tokens' log-probabilities, ``s = sum_t mask_t * logp_t``, with ``logp_t = z_t[y_t] - lse_t``.

**How the pair's coupling reaches the logits (the design choice).** The loss ``F(s_chosen, s_rejected)``
couples the two rows of a pair, so the gradient w.r.t. a token's logits is ``dF/ds_row * mask_t *
(onehot(y_t) - softmax(z_t))``: the token-level gradient of plain cross-entropy times one scalar per
row. Two ways to get that scalar: a first forward pass over the whole model to compute every ``s``,
then a training step whose token weights are the coefficients (one more forward of every block per
step, about a third of the step), or a head whose backward applies the coefficient. We do the second:
only the head's loss knows ``s``, and it is computed right there, chunk by chunk, before the head's
backward runs, so no block runs twice.

- Resident head (``io.ResidentIO``, LoRA's ``FrozenEnds``): ``token_logps`` is a chunked log-softmax
  gather with a hand-written VJP. Its forward keeps each token's log-sum-exp (one matmul per chunk,
  no logits kept); the objective is plain JAX on the ``(rows,)`` sums, and ``jax.value_and_grad``
  of the whole head produces the per-token cotangent ``g_t = dF/ds_row * mask_t`` that the VJP turns
  into ``g_t * (onehot - softmax)`` one chunk at a time (logits made again: four matmuls per chunk
  instead of SFT's three; the head is a few percent of a 7B step).
- Streamed head (``stream_io``, ``engine/io_head.py``): its pass 1 already keeps, per token, the
  running max, sum of exponentials and the label's logit. The objective turns them into ``s`` and
  ``dF/ds`` between the passes, and pass 2 runs unchanged with the per-token weight
  ``-dF/ds_row * mask_t`` in place of SFT's ``mask_t / n_tokens``.

The formulas are TRL's (``huggingface/trl``, ``trl/trainer/dpo_trainer.py`` ``DPOTrainer.dpo_loss``,
``cpo_trainer.py`` ``CPOTrainer.cpo_loss``, ``orpo_trainer.py`` ``ORPOTrainer.odds_ratio_loss``), with
``pi = (pi_c, pi_r)`` the policy's and ``ref`` the reference model's log-probabilities:

- ``dpo`` (DPOTrainer, ``loss_type="sigmoid"``): ``z = (pi_c - pi_r) - (ref_c - ref_r)`` on summed
  log-probabilities; ``loss = -logsigmoid(beta z) (1 - ls) - logsigmoid(-beta z) ls`` (``ls``:
  ``label_smoothing``, 0 by default).
- ``ipo`` (DPOTrainer, ``loss_type="ipo"``): the same ``z`` on log-probabilities averaged over each
  completion's tokens (TRL divides ``all_logps`` by the completion length for ipo);
  ``loss = (z - 1 / (2 beta))^2``.
- ``simpo`` (CPOTrainer, ``loss_type="simpo"``): averaged log-probabilities, no reference;
  ``x = (pi_c - pi_r) - gamma / beta``; ``loss = -logsigmoid(beta x) (1 - ls) - logsigmoid(-beta x) ls``
  (TRL's ``simpo_gamma``; CPOTrainer's ``cpo_alpha`` NLL term is 0 here, as in the SimPO paper).
- ``orpo`` (ORPOTrainer): averaged log-probabilities, no reference;
  ``log_odds = (pi_c - pi_r) - (log1p(-exp(pi_c)) - log1p(-exp(pi_r)))``;
  ``loss = NLL(chosen) - lambda * mean(logsigmoid(log_odds))``, the NLL a token mean over the step's
  chosen completion tokens (TRL's ``beta`` is ORPO's lambda).

Each is a mean over the step's pairs (the NLL over its chosen tokens), whatever the micro-batches:
the head's loss of a micro-batch is its share times ``1 / pairs`` (and ``1 / chosen tokens``).

Logged as TRL logs them (``metrics``): ``rewards/chosen``, ``rewards/rejected`` (``beta (pi - ref)``
for dpo and ipo, ``beta pi`` for simpo and orpo), ``rewards/accuracies`` (chosen > rejected),
``rewards/margins``, ``logps/chosen``, ``logps/rejected``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.config.objective import OBJECTIVES, check_objective

F32 = jnp.float32
PREFERENCE = OBJECTIVES[1:]
NEEDS_REFERENCE = ("dpo", "ipo")
AVERAGED = ("ipo", "simpo", "orpo")  # log-probabilities averaged over each completion's tokens (TRL's)


# ------------------------------------------------------------------------------ the chunked log-probabilities


def token_logps(normed: jax.Array, out_matrix: jax.Array, labels: jax.Array, chunk: int,
                softcap: float | None = None) -> jax.Array:
    """``log softmax(normed @ out_matrix)[labels]`` per token, (B, S) fp32, ``chunk`` tokens at a time:
    the (tokens x vocab) logits never exist at once, forward or backward (hand-written VJP)."""
    h = normed.shape[-1]
    x, y = normed.reshape(-1, h), labels.reshape(-1)
    n = x.shape[0]
    c = min(chunk, n)
    pad = (-n) % c
    if pad:
        x, y = jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(y, (0, pad))
    lp = _token_logps(x.reshape(-1, c, h), out_matrix, y.reshape(-1, c), softcap)
    return lp.reshape(-1)[:n].reshape(labels.shape)


def capped(logits: jax.Array, softcap: float | None) -> jax.Array:
    """Final-logit soft-capping, as ``engine/loss.capped`` (Gemma 2): ``softcap * tanh(logits / softcap)``."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def _chunk_stats(xc, w, yc, softcap):
    logits = capped(jnp.dot(xc, w, preferred_element_type=F32), softcap)  # (c, V)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
    return logits, lse, picked


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_logps(xs, w, ys, softcap):
    def body(_, inp):
        xc, yc = inp
        _, lse, picked = _chunk_stats(xc, w, yc, softcap)
        return None, picked - lse

    return jax.lax.scan(body, None, (xs, ys))[1]


def _token_logps_fwd(xs, w, ys, softcap):
    def body(_, inp):
        xc, yc = inp
        _, lse, picked = _chunk_stats(xc, w, yc, softcap)
        return None, (picked - lse, lse)

    lp, lse = jax.lax.scan(body, None, (xs, ys))[1]
    return lp, (xs, w, ys, lse)


def _token_logps_bwd(softcap, res, g):
    """``g_t * (onehot(y_t) - softmax(z_t))`` per chunk (logits made again), into d normed and d out."""
    xs, w, ys, lse = res
    vocab = w.shape[1]

    def body(dw, inp):
        xc, yc, lc, gc = inp
        logits = capped(jnp.dot(xc, w, preferred_element_type=F32), softcap)
        d = jax.nn.one_hot(yc, vocab, dtype=F32) - jnp.exp(logits - lc[:, None])
        if softcap is not None:  # through cap * tanh(raw / cap): times 1 - tanh^2
            d = d * (1.0 - jnp.square(logits / softcap))
        d = (d * gc[:, None]).astype(xc.dtype)  # d loss / d logits
        return dw + jnp.dot(xc.T, d, preferred_element_type=F32), jnp.dot(d, w.T, preferred_element_type=F32)

    dw, dxs = jax.lax.scan(body, jnp.zeros(w.shape, F32), (xs, ys, lse, g))
    return dxs.astype(xs.dtype), dw.astype(w.dtype), None


_token_logps.defvjp(_token_logps_fwd, _token_logps_bwd)


# ------------------------------------------------------------------------------ the objectives


@dataclass(frozen=True)
class Objective:
    """One preference objective and its constants (``train.objective``, ``train.beta``, ``train.gamma``,
    ``train.orpo_lambda``, ``train.label_smoothing``)."""

    name: str = "dpo"
    beta: float = 0.1
    gamma: float = 0.5  # SimPO's target margin (TRL's simpo_gamma)
    lam: float = 0.1  # ORPO's lambda (TRL's ORPOConfig.beta)
    label_smoothing: float = 0.0

    @property
    def needs_reference(self) -> bool:
        return self.name in NEEDS_REFERENCE

    @property
    def averaged(self) -> bool:
        return self.name in AVERAGED

    @property
    def key(self) -> tuple:
        return (self.name, float(self.beta), float(self.gamma), float(self.lam), float(self.label_smoothing))

    # ---- the formulas (TRL's; the module docstring cites them)

    def pair_losses(self, pc, pr, rc=None, rr=None):
        """Per-pair loss from the policy's (and for dpo/ipo the reference's) log-probabilities, in the
        objective's form (summed, or averaged for ipo, simpo, orpo). ORPO's NLL term is added by ``total``."""
        b, ls = self.beta, self.label_smoothing
        if self.name in ("dpo", "ipo"):
            z = (pc - pr) - (rc - rr)
            if self.name == "ipo":
                return jnp.square(z - 1.0 / (2.0 * b))
            return -jax.nn.log_sigmoid(b * z) * (1 - ls) - jax.nn.log_sigmoid(-b * z) * ls
        if self.name == "simpo":
            x = (pc - pr) - self.gamma / b
            return -jax.nn.log_sigmoid(b * x) * (1 - ls) - jax.nn.log_sigmoid(-b * x) * ls
        if self.name == "orpo":
            log_odds = (pc - pr) - (jnp.log1p(-jnp.exp(pc)) - jnp.log1p(-jnp.exp(pr)))
            return -self.lam * jax.nn.log_sigmoid(log_odds)
        raise ValueError(self.name)

    def total(self, seq, cnt, ref, norms):
        """The micro-batch's share of the step's loss from its rows' summed log-probabilities ``seq``
        (rows: chosen, rejected, chosen, ...), completion token counts ``cnt``, the reference's summed
        log-probabilities ``ref`` (ignored without a reference) and ``norms = (1 / pairs, 1 / chosen tokens)``."""
        lp = seq / jnp.maximum(cnt, 1.0) if self.averaged else seq
        rf = (ref / jnp.maximum(cnt, 1.0) if self.averaged else ref) if self.needs_reference else None
        pc, pr = lp[0::2], lp[1::2]
        losses = self.pair_losses(pc, pr, None if rf is None else rf[0::2], None if rf is None else rf[1::2])
        out = jnp.sum(losses) * norms[0]
        if self.name == "orpo":  # + the NLL of the chosen completions, a token mean over the step
            out = out - jnp.sum(seq[0::2]) * norms[1]
        return out

    def norms(self, mask: np.ndarray) -> np.ndarray:
        """``(1 / pairs, 1 / chosen completion tokens)`` of a step's (B, S) loss mask."""
        pairs = mask.shape[0] // 2
        chosen = float(np.asarray(mask[0::2], np.float64).sum())
        return np.asarray([1.0 / max(pairs, 1), 1.0 / max(chosen, 1.0)], np.float32)

    # ---- what TRL logs

    def metrics(self, seq: np.ndarray, cnt: np.ndarray, ref: np.ndarray | None) -> dict[str, float]:
        """TRL's ``rewards/*`` and ``logps/*`` of a batch, from the rows' summed log-probabilities."""
        seq, cnt = np.asarray(seq, np.float64), np.maximum(np.asarray(cnt, np.float64), 1.0)
        lp = seq / cnt if self.averaged else seq
        pc, pr = lp[0::2], lp[1::2]
        if self.needs_reference:
            rf = np.asarray(ref, np.float64)
            rf = rf / cnt if self.averaged else rf
            rc, rr = self.beta * (pc - rf[0::2]), self.beta * (pr - rf[1::2])
        else:
            scale = self.lam if self.name == "orpo" else self.beta
            rc, rr = scale * pc, scale * pr
        return {"rewards/chosen": float(rc.mean()), "rewards/rejected": float(rr.mean()),
                "rewards/accuracies": float((rc > rr).mean()), "rewards/margins": float((rc - rr).mean()),
                "logps/chosen": float(pc.mean()), "logps/rejected": float(pr.mean())}

    # ---- the head: resident (full training)

    def _resident_fns(self, k) -> tuple:
        """(loss + grads, forward log-probabilities) of ``kernels.Kernels``' resident head, shared like its pieces."""
        from jax.sharding import PartitionSpec as P

        def build():
            parts, store, dt = k.parts, k.store, k.dtype
            lay_e, lay_h, tied, cap = store["embed"].layout, store["head"].layout, parts.tied, parts.logit_softcap
            chunk, multi = k.loss_chunk, k.num_devices > 1

            def seq_of(wh, we, h, labels, mask):
                normed, out = parts.head_fn(lay_h.unflatten(wh.astype(dt)), h,
                                            lay_e.unflatten(we.astype(dt)) if tied else None)
                return jnp.sum(token_logps(normed, out, labels, chunk, cap) * mask, axis=-1)

            def loss(wh, we, h, labels, mask, inv, gh, ge, ref):
                def f(wh, we, h):
                    seq = seq_of(wh, we, h, labels, mask)
                    return self.total(seq, jnp.sum(mask, axis=-1), ref, inv), seq

                (val, seq), (dwh, dwe, dh) = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(wh, we, h)
                if tied:
                    ge = ge + dwe.astype(F32)
                if multi:
                    val = jax.lax.psum(val, "data")
                return val, dh, gh + dwh.astype(F32), ge, seq

            rep, dat = P(), P("data")
            return (jax.jit(k._smap(loss, (rep, rep, dat, dat, dat, rep, dat, dat, dat), (rep, dat, dat, dat, dat)),
                            donate_argnums=(6, 7)),
                    jax.jit(k._smap(seq_of, (rep, rep, dat, dat, dat), dat)))

        return k.once(("preference_head",) + self.key, build)

    def resident_loss(self, k, head, emb, h, mb, inv, g_head, g_emb):
        """``Kernels.head_loss``'s outputs for a preference micro-batch; its rows' log-probabilities are kept."""
        loss, dh, g_head, g_emb, seq = self._resident_fns(k)[0](head, emb, h, mb.labels, mb.mask, inv, g_head, g_emb,
                                                                 mb.ref)
        k.preference_logps.append(seq)
        return loss, dh, g_head, g_emb

    def resident_logps(self, k, head, emb, h, mb):
        return self._resident_fns(k)[1](head, emb, h, mb.labels, mb.mask)

    # ---- the head: LoRA's frozen ends (plain jit, global arrays)

    def _frozen_ends_fns(self, k) -> tuple:
        fns = getattr(k, "_preference_fns", None)
        if fns is not None and fns[0] == self.key:
            return fns[1]
        m, dt, chunk = k.model, k.dtype, k.loss_chunk
        ge, gh = k.store["embed"], k.store["head"]

        def seq_of(wh, we, h, labels, mask):
            hw, ew = gh.dequantise((wh,), dt), (ge.dequantise((we,), dt) if m.tied else None)
            normed, out = m.head_fn(hw, h, ew)
            return jnp.sum(token_logps(normed, out, labels, chunk, m.softcap) * mask, axis=-1)

        def loss(wh, we, h, labels, mask, inv, ref):
            def f(h):
                seq = seq_of(wh, we, h, labels, mask)
                return self.total(seq, jnp.sum(mask, axis=-1), ref, inv), seq

            (val, seq), dh = jax.value_and_grad(f, has_aux=True)(h)
            return val, dh, seq

        fns = (jax.jit(loss), jax.jit(seq_of))
        k._preference_fns = (self.key, fns)
        return fns

    def frozen_ends_loss(self, k, head, emb, h, mb, inv):
        loss, dh, seq = self._frozen_ends_fns(k)[0](head, emb, h, mb.labels, mb.mask, inv, mb.ref)
        k.preference_logps.append(seq)
        return loss, dh

    def frozen_ends_logps(self, k, head, emb, h, mb):
        return self._frozen_ends_fns(k)[1](head, emb, h, mb.labels, mb.mask)

    # ---- the head: streamed in vocabulary chunks (io_head.HeadStream, between its two passes)

    def _stream_fns(self, k) -> tuple:
        from jax.sharding import PartitionSpec as P

        def build():
            multi = k.num_devices > 1

            def between(mx, se, pk, mask, ref, inv):
                lse = mx + jnp.log(se)
                cnt = jnp.sum(mask, axis=-1)

                def f(seq):
                    return self.total(seq, cnt, ref, inv)

                seq = jnp.sum((pk - lse) * mask, axis=-1)
                val, dseq = jax.value_and_grad(f)(seq)
                if multi:
                    val = jax.lax.psum(val, "data")
                return val, lse, -dseq[:, None] * mask, seq  # pass 2's per-token weight of (softmax - onehot)

            def seq_only(mx, se, pk, mask):
                return jnp.sum((pk - (mx + jnp.log(se))) * mask, axis=-1)

            rep, dat = P(), P("data")
            return (jax.jit(k._smap(between, (dat, dat, dat, dat, dat, rep), (rep, dat, dat, dat))),
                    jax.jit(k._smap(seq_only, (dat, dat, dat, dat), dat)))

        return k.once(("preference_stream",) + self.key, build)

    def stream_between(self, k, stats: list, mbs: list, inv) -> tuple[list, list, list]:
        """(losses, log-sum-exps, pass 2's per-token weights) of the micro-batches from pass 1's statistics."""
        fn = self._stream_fns(k)[0]
        out = [fn(*s, mb.mask, mb.ref, inv) for s, mb in zip(stats, mbs)]
        k.preference_logps.extend(o[3] for o in out)
        return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]

    def stream_logps(self, k, stats: list, mbs: list) -> list:
        fn = self._stream_fns(k)[1]
        return [fn(*s, mb.mask) for s, mb in zip(stats, mbs)]


def from_config(train_cfg: Any) -> Objective | None:
    """``train.objective`` and its constants as an ``Objective`` (None for sft); checked as the config is."""
    from types import SimpleNamespace

    check_objective(SimpleNamespace(train=train_cfg))
    name = train_cfg.objective or "sft"
    if name == "sft":
        return None
    return Objective(name, float(train_cfg.beta), float(train_cfg.gamma), float(train_cfg.orpo_lambda),
                     float(train_cfg.label_smoothing))
