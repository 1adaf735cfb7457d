"""The training loop: config -> data -> model -> engine -> steps, with logging, checkpoints and faults.

The streamed engine is driven through ``trainer.Trainer``, the same object research code uses
(``Trainer.from_config`` / ``Trainer.resume`` with the memory plan's decisions): one path to the
engine. ``train.engine=reference`` is a separate small branch: the plain in-memory
``ReferenceTrainer``, a correctness reference that writes no checkpoints.

Everything that can fail on user input (config, data, tokens, the checkpoint to resume from) is
checked before the output directory is written, so a bad run leaves nothing half-written.

- **Checkpoints** (``checkpoint.py``): every ``train.ckpt_every`` steps in the background while
  training continues, and always at the end; ``keep_last`` newest plus every ``keep_every``-th kept.
- **Resume** (``--resume``): the newest checkpoint that passes its checksums (a corrupted one is
  moved aside and the previous one used); weights, optimizer state and count (hence the LR
  schedule) are restored, the data continues at the saved step (batches are a pure function of
  the step), and ``metrics.jsonl`` is cut back to that step so that no step appears twice.
  Resuming reproduces an uninterrupted run bit for bit.
- **Signals**: SIGINT / SIGTERM finish the current step, save a checkpoint and return normally
  (exit 0); a second signal aborts at once.
- **Numerical faults**: a step whose loss or gradient norm is NaN/inf applies no update (weights and
  optimizer moments untouched: the engine defers every update until the norm is known), is logged
  and counted; ``train.max_bad_steps`` consecutive ones save a checkpoint and stop with a
  ``UserError``.

Test hooks (environment): ``MEGATRAIN_DEBUG_NAN_STEPS=3,4`` makes the forward of those (1-based)
steps produce NaN; ``MEGATRAIN_DEBUG_KILL_AFTER_STEP=7`` SIGKILLs the process after step 7 once the
saves in flight are committed; ``MEGATRAIN_DEBUG_KILL_IN_SAVE=10`` SIGKILLs it in the middle of
the save of step 10 (see ``checkpoint.py``).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import numpy as np
import yaml

from megatrain_jax import checkpoint as ck
from megatrain_jax.config import Config
from megatrain_jax.distributed import is_main
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.errors import UserError
from megatrain_jax.memory import memory_snapshot
from megatrain_jax.metrics import MetricsWriter, attention_flops_per_token, model_flops_per_token
from megatrain_jax.plan import few_malloc_arenas, plan_or_refuse  # noqa: F401 - importable here too
from megatrain_jax.trainer import Trainer

Log = Callable[[str], None]



def reference_trainer(cfg: Config, model=None):
    """``train.engine=reference``: the whole model and plain optax in device memory, a correctness
    reference for the streamed engine (no plan, no checkpoints)."""
    from megatrain_jax.models import init_model
    from megatrain_jax.optim import build_reference_tx
    from megatrain_jax.reference import ReferenceTrainer

    t = cfg.train
    model = model if model is not None else init_model(cfg.model, t.seed)
    return ReferenceTrainer(model, build_reference_tx(cfg.optim, t.steps), compute_dtype=t.compute_dtype)


def build_trainer(cfg: Config, model=None, plan=None):
    """The configured engine itself (for benchmarks that drive it directly): the reference trainer,
    or the ``StreamedTrainer`` of ``Trainer.from_config(cfg, plan, model=model)``."""
    if cfg.train.engine == "reference":
        return reference_trainer(cfg, model)
    return Trainer.from_config(cfg, plan, model=model).engine


def restore_trainer(cfg: Config, root: str, log: Log = print, plan=None) -> tuple[StreamedTrainer, str, dict]:
    """The ``StreamedTrainer`` of ``Trainer.resume(cfg, root, plan, log)``, its checkpoint's path and state."""
    trainer, path, state = Trainer.resume(cfg, root, plan, log)
    return trainer.engine, path, state


def to_engine_batch(b: Any, doc_masking: bool) -> Batch:
    """Data-loader batch -> engine batch; document structure is passed only when masking by it."""
    return Batch(b.tokens, b.labels, b.loss_mask,
                 b.segment_ids if doc_masking else None, b.positions if doc_masking else None)


# ------------------------------------------------------------------------------------ helpers


def _check_fields(cfg: Config) -> None:
    t = cfg.train
    for name, v, low in [("train.ckpt_every", t.ckpt_every, 0), ("train.keep_last", t.keep_last, 0),
                         ("train.keep_every", t.keep_every, 0), ("train.max_bad_steps", t.max_bad_steps, 1)]:
        if v < low:
            raise UserError(name, f"must be >= {low}, got {v}", f"set {name} to an integer >= {low}")


def _debug_steps(var: str) -> set[int]:
    raw = os.environ.get(var, "").strip()
    return {int(x) for x in raw.split(",") if x.strip()} if raw else set()


@contextlib.contextmanager
def _nan_forward(trainer):
    """Test hook: the embedding's output (hence loss and every gradient) is NaN for one step."""
    import jax.numpy as jnp

    orig = trainer._embed_fwd
    trainer._embed_fwd = lambda w, tokens: orig(w, tokens) * jnp.nan
    try:
        yield
    finally:
        trainer._embed_fwd = orig


class _Timeline:
    """``train.trace_step``: one step's per-layer timeline (``trace.py``) written next to the metrics.

    The window is the step in steady state (the previous step's deferred updates may still run at its
    start); after it, the step's own deferred updates are awaited so their bars are complete."""

    def __init__(self, trainer, out_dir: str, step: int, log: Log):
        self.trainer, self.out_dir, self.step, self.log = trainer, out_dir, step, log

    def __enter__(self):
        from megatrain_jax.trace import Tracer

        self.trainer.tracer = Tracer()
        self.t0 = time.perf_counter() - self.trainer.tracer.t0

    def __exit__(self, exc_type, *_):
        import jax

        from megatrain_jax.trace import exposed_times, plot_timeline

        tracer = self.trainer.tracer
        try:
            if exc_type is None:
                jax.block_until_ready(jax.device_put(0))
                t1 = time.perf_counter() - tracer.t0
                self.trainer.finish()
        finally:
            events = tracer.close()
            self.trainer.tracer = None
        if exc_type is not None:
            return
        exposed = exposed_times(events, self.t0, t1)
        base = os.path.join(self.out_dir, f"timeline_step{self.step}")
        with open(base + ".json", "w") as f:
            json.dump({"step": self.step, "window_s": [self.t0, t1], "exposed_s": exposed, "events": events}, f)
        try:
            plot_timeline(events, base + ".png", f"step {self.step}: per-layer timeline")
        except ImportError:  # matplotlib is optional: the JSON holds every bar
            pass
        self.log(f"timeline of step {self.step}: {t1 - self.t0:.3f} s, compute busy {exposed['compute_busy']:.3f} s; "
                 f"compute waited for " + ", ".join(f"{k} {v:.3f} s" for k, v in exposed.items()
                                                   if k not in ("compute_busy",)) + f"  [{base}.json/.png]")


class _StopSignals:
    """SIGINT / SIGTERM: remember it and let the loop finish the step; a second one aborts."""

    def __init__(self, log: Log):
        self.received: str | None = None
        self._old: dict[int, Any] = {}
        self._log = log
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            self.restore()
            raise KeyboardInterrupt(f"second {name}: aborting without waiting for the checkpoint")
        self.received = name
        print(f"\n{name}: finishing the current step, then saving a checkpoint (send it again to abort)",
              file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()


def _truncate_metrics(path: str, step: int, log: Log) -> None:
    """Keep the records of steps <= ``step`` (the resumed-from checkpoint) and drop the rest,
    including a partial last line from a kill: the dropped steps are recomputed identically."""
    if not os.path.isfile(path):
        return
    keep, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            if int(rec.get("step", 0)) <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)
        log(f"metrics: dropped {dropped} record(s) after step {step} from {path} (those steps are recomputed)")


def _resume_checks(cfg: Config, dataset, state: dict, log: Log) -> None:
    """Warn about what differs from the checkpointed run (the model itself was checked on load)."""
    saved_cfg = state.get("config", {})
    saved_data = state.get("data", {})
    desc, old = dataset.describe(), saved_data.get("describe", {})
    diff = [k for k in ("n_tokens", "n_docs", "dtype", "has_mask", "tokenizer", "sha256") if old.get(k) != desc.get(k)]
    if diff:
        log(f"warning: the data differs from the checkpointed run's ({', '.join(diff)}: {old.get(diff[0])!r} -> "
            f"{desc.get(diff[0])!r}); the run continues at step {state['step']} of the new data")
    st = saved_cfg.get("train", {})
    for key, now in (("batch_size", cfg.train.batch_size), ("steps", cfg.train.steps)):
        if key in st and st[key] != now:
            log(f"warning: train.{key} was {st[key]} in the checkpointed run, now {now}"
                + (" (the LR schedule's horizon changes)" if key == "steps" else " (the data order changes)"))
    if saved_cfg.get("data", {}).get("seq_len", cfg.data.seq_len) != cfg.data.seq_len:
        log(f"warning: data.seq_len was {saved_cfg['data']['seq_len']} in the checkpointed run, now {cfg.data.seq_len}")
    rng = state.get("rng", {}).get("numpy_global")
    if rng is not None:
        np.random.set_state((rng[0], np.asarray(rng[1], np.uint32), *rng[2:]))


def _background_failure(e: BaseException, out_dir: str, step: int) -> UserError:
    """A failure from inside the step or a background thread as the one-line error; the full
    traceback goes to ``out_dir/error.log``. Committed checkpoints are untouched (a save in flight
    stays a ``.tmp`` directory, which resume ignores)."""
    import errno
    import traceback

    path = os.path.join(out_dir, "error.log")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"--- after step {step}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.write("".join(traceback.format_exception(e)))
    except OSError:
        path = "(could not be written)"
    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return UserError("disk", f"writing failed after step {step}: {msg}; full traceback in {path}",
                         "free space in train.out_dir, lower train.keep_last, or set train.ckpt_every=0 and "
                         "train.final_checkpoint=false; committed checkpoints are intact (--resume)")
    if "RESOURCE_EXHAUSTED" in msg or "Out of memory" in msg:
        return UserError("GPU memory", f"the device ran out of memory after step {step}: {msg}; full traceback "
                         f"in {path}", "lower train.gpu_memory_gb or the tokens per micro-batch "
                         "(train.micro_batches), and report the plan (megatrain-jax plan) with this log")
    return UserError("train", f"failed after step {step}: {msg}; full traceback in {path}",
                     "read the log; committed checkpoints are intact, continue with --resume")


def _rng_state(cfg: Config) -> dict:
    import jax

    np_state = np.random.get_state()
    return {"train_seed": cfg.train.seed, "data_seed": cfg.data.seed,
            "jax_key_data": np.asarray(jax.random.key_data(jax.random.key(cfg.train.seed))).tolist(),
            "numpy_global": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "note": "the loop is deterministic: batches from (data_seed, step), init from train_seed"}


# ------------------------------------------------------------------------------------ the loop


def train(cfg: Config, resume: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps; returns a summary (first/last losses, throughput).

    ``resume`` continues from the newest complete checkpoint in ``train.out_dir``.
    """
    from megatrain_jax.data import load_dataset

    t, d = cfg.train, cfg.data
    _check_fields(cfg)
    main = is_main()  # process 0 writes checkpoints, metrics and logs; the others only train
    if not main:
        log = lambda _msg: None  # noqa: E731
    if cfg.model.from_hf:
        from megatrain_jax.hf import resolve_hf_model_config

        resolve_hf_model_config(cfg.model)  # architecture fields before anything uses the sizes
    dataset = load_dataset(d, cfg.model.vocab_size)  # validates the data before anything is written
    root = ck.checkpoint_root(t.out_dir)
    streamed = t.engine == "streamed"
    start_step, state = 0, {}
    if resume and not streamed:
        raise UserError("--resume", "checkpoints are written by the streamed engine only",
                        "set train.engine=streamed (or train without --resume)")
    plan = plan_or_refuse(cfg, log) if streamed else None  # before anything is allocated or written
    if resume:
        trainer, path, state = Trainer.resume(cfg, root, plan, log)  # every process reads the checkpoint
        start_step = int(state["step"])
        _resume_checks(cfg, dataset, state, log)
        log(f"resumed from {path}: step {start_step}, optimizer count {trainer.step_count}")
    else:
        existing = ck.list_checkpoints(root) if main else []
        if existing:
            raise UserError("train.out_dir", f"{t.out_dir} already holds checkpoints (newest: step {existing[-1].step})",
                            "pass --resume to continue that run, or choose another train.out_dir "
                            f"(or delete {root})")
        trainer = Trainer.from_config(cfg, plan) if streamed else reference_trainer(cfg)

    if main:
        os.makedirs(t.out_dir, exist_ok=True)
        with open(os.path.join(t.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    metrics_path = os.path.join(t.out_dir, "metrics.jsonl") if main else os.devnull
    if main and resume:
        _truncate_metrics(metrics_path, start_step, log)
    elif main and os.path.isfile(metrics_path):
        old = f"{metrics_path}.old-{int(time.time())}"
        os.replace(metrics_path, old)
        log(f"metrics: a fresh run; the previous {metrics_path} was moved to {old}")
    metrics = MetricsWriter(metrics_path, tensorboard=main, log=log)
    tokens_per_step = t.batch_size * d.seq_len
    fpt = model_flops_per_token(cfg.model)
    fpt_attn = fpt + attention_flops_per_token(cfg.model, d.seq_len)
    log(f"model: {cfg.model.total_params() / 1e6:.2f}M parameters "
        f"({cfg.model.non_embedding_params() / 1e6:.2f}M non-embedding), engine={t.engine}, "
        f"compute={t.compute_dtype}, {tokens_per_step} tokens/step")

    saver = trainer.saver(root, keep_last=t.keep_last, keep_every=t.keep_every, log=log) \
        if (streamed and main) else None
    loop = state.get("loop", {})
    skipped = int(loop.get("skipped_total", 0))
    bad_streak = int(loop.get("bad_streak", 0))
    if bad_streak >= t.max_bad_steps:
        bad_streak = 0  # that run stopped on it; the user has had a chance to change something
    last_good = int(loop.get("last_good_step", start_step))
    rng = _rng_state(cfg)
    nan_steps = _debug_steps("MEGATRAIN_DEBUG_NAN_STEPS")
    kill_after = _debug_steps("MEGATRAIN_DEBUG_KILL_AFTER_STEP")

    def save(step: int, wait: bool) -> str | None:
        if saver is None:
            return None
        lr = trainer.lr_at(trainer.step_count + 1)
        meta = {"loop": {"step": step, "skipped_total": skipped, "bad_streak": bad_streak, "last_good_step": last_good},
                "lr_schedule": {"count": trainer.step_count, "next_lr": lr,
                                "schedule": cfg.optim.schedule.__dict__, "total_steps": t.steps},
                "data": {"position": dataset.position(step, t.batch_size, d.seq_len), "describe": dataset.describe(),
                         "batch_size": t.batch_size, "seq_len": d.seq_len},
                "rng": rng, "config": cfg.to_dict()}
        path = saver.save(step, meta, wait=wait)
        if wait:
            _report(saver.history[-1] if saver.history else None)
        return path

    def _report(st) -> None:
        if st is not None:
            log(f"checkpoint: step {st.step} saved to {st.path} ({st.nbytes / 1e9:.3f} GB in {st.write_s:.2f}s; "
                f"training loop blocked {st.call_s:.3f}s, updates held {st.held_s:.3f}s)")

    losses: list[float] = []
    start = time.perf_counter()
    last = start
    stop = _StopSignals(log)
    stopped_by = None
    final_path = None
    aborted = False
    step_done = start_step
    try:
        for step in range(start_step, t.steps):
            s = step + 1
            batch = to_engine_batch(dataset.batch(step, t.batch_size, d.seq_len), d.doc_masking)
            traced = _Timeline(trainer.engine, t.out_dir, s, log) if (streamed and main and s == t.trace_step) \
                else contextlib.nullcontext()
            with _nan_forward(trainer.engine) if (s in nan_steps and streamed) else contextlib.nullcontext(), traced:
                res = trainer.step(batch)
            step_done = s
            now = time.perf_counter()
            dt, last = now - last, now
            losses.append(res.loss)
            if res.skipped:
                skipped += 1
                bad_streak += 1
                log(f"step {s}: non-finite loss {res.loss} / grad_norm {res.grad_norm}: update skipped, weights and "
                    f"optimizer state unchanged ({bad_streak} in a row, {skipped} in total, "
                    f"limit train.max_bad_steps={t.max_bad_steps})")
            else:
                bad_streak, last_good = 0, s
            rec = {"step": s, "loss": res.loss, "grad_norm": res.grad_norm, "step_time_s": dt,
                   "tokens_per_s": tokens_per_step / dt, "model_tflops": fpt * tokens_per_step / dt / 1e12,
                   "model_tflops_with_attention": fpt_attn * tokens_per_step / dt / 1e12, "skipped": res.skipped}
            if getattr(res, "aux_loss", None) is not None:  # e.g. the MoE router's load-balancing term, inside loss
                rec["aux_loss"] = res.aux_loss
            if streamed:
                rec["lr"] = trainer.lr_at(trainer.step_count)
                rec.update(memory_snapshot(trainer.memory_device))
            metrics.write(rec)
            if s % t.log_every == 0 or s == start_step + 1 or s == t.steps:
                elapsed = now - start
                eta = elapsed / (s - start_step) * (t.steps - s)
                log(f"step {s:>6}/{t.steps}  loss {res.loss:.4f}  grad_norm {res.grad_norm:.3f}  "
                    f"tokens/s {rec['tokens_per_s']:,.0f}  model TFLOPS {rec['model_tflops']:.3f}  "
                    f"elapsed {elapsed:.0f}s  eta {eta:.0f}s")
            if saver is not None:
                _report(saver.poll())  # a background save that has committed since the last step
            if bad_streak >= t.max_bad_steps:
                path = save(s, wait=True)
                raise UserError("train.max_bad_steps",
                                f"{bad_streak} consecutive steps ({s - bad_streak + 1}..{s}) had a non-finite loss or "
                                f"gradient norm; none of them changed the model, whose weights are those after step "
                                f"{last_good}" + (f"; checkpoint saved to {path}" if path else ""),
                                "lower optim.lr, set optim.clip_norm or check the data around these steps, then "
                                "continue with --resume (or raise train.max_bad_steps)")
            if stop.received:
                stopped_by = stop.received
                final_path = save(s, wait=True)
                break
            if t.ckpt_every and s % t.ckpt_every == 0:
                save(s, wait=False)
            if s in kill_after:  # test hook: a hard kill once the checkpoints so far are committed
                if saver is not None:
                    saver.wait()
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            if saver is not None and t.final_checkpoint:
                final_path = save(step_done, wait=True)
    except KeyboardInterrupt:
        aborted = True  # a second signal: do not wait for a save in flight (its .tmp is ignored later)
        raise
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a background failure (optimizer thread, checkpoint writer, device)
        aborted = True
        raise _background_failure(e, t.out_dir, step_done) from None
    finally:
        stop.restore()
        try:
            if saver is not None:
                saver.abandon() if aborted else saver.close()
        finally:
            try:
                if hasattr(trainer, "close"):
                    trainer.close()
            except Exception:  # noqa: BLE001 - after a failure, the pending updates fail the same way
                if not aborted:
                    raise
            metrics.close()
    if t.export and streamed and stopped_by is None and main:
        from megatrain_jax.hf import export_hf

        export_hf(trainer.store, cfg.model, t.export, t.export_dtype, overwrite=True, log=log)
    wall = time.perf_counter() - start
    summary = {"steps": step_done, "first_loss": losses[0] if losses else None,
               "plan": None if plan is None else {"host_gb": plan.host_need / 1e9, "gpu_gb": plan.gpu_need and plan.gpu_need / 1e9,
                                                  "decisions": plan.decisions, "predicted_step_s": plan.step["predicted_step_s"]},
               "measured": memory_snapshot(trainer.memory_device if streamed else None),
               "last_loss": losses[-1] if losses else None,
               "mean_last10": float(np.mean(losses[-10:])) if losses else None, "wall_s": wall,
               "skipped_steps": skipped, "resumed_from": start_step if resume else None,
               "checkpoint": final_path, "stopped_by": stopped_by}
    if main:
        with open(os.path.join(t.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    if stopped_by:
        log(f"stopped by {stopped_by} after step {step_done}: " + (
            f"checkpoint saved to {final_path}; continue with `megatrain-jax train ... --resume` "
            f"(train.out_dir={t.out_dir})" if final_path else "no checkpoint (the reference engine writes none)"))
    elif not losses:
        log(f"nothing to do: the checkpoint is at step {start_step} and train.steps={t.steps}")
    else:
        log(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {wall:.0f}s; "
            f"metrics in {metrics_path}" + (f"; checkpoint {final_path}" if final_path else ""))
    return summary
