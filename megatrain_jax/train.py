"""The training loop: config -> data -> model -> engine -> steps, with logging, checkpoints and faults.

The streamed engine is driven through ``trainer.Trainer``, the same object research code uses
(``Trainer.from_config`` / ``Trainer.resume`` with the memory plan's decisions): one path to the
engine. ``train.engine=reference`` is a separate small branch: the plain in-memory
``ReferenceTrainer``, a correctness reference that writes no checkpoints.

Everything that can fail on user input (config, data, tokens, the checkpoint to resume from) is
checked before the output directory is written, so a bad run leaves nothing half-written
(``run_start.start_run``, which also takes the run lock).

- **Checkpoints** (``checkpoint.py``): every ``train.ckpt_every`` steps in the background while
  training continues, and always at the end; ``keep_last`` newest plus every ``keep_every``-th kept.
- **Resume** (``--resume``): the newest checkpoint that passes its checksums (a corrupted one is
  moved aside and the previous one used); weights, optimizer state and count (hence the LR
  schedule) are restored, the data continues at the saved step (batches are a pure function of
  the step), and ``metrics.jsonl`` is cut back to that step so that no step appears twice.
  Resuming reproduces an uninterrupted run bit for bit.
- **Signals** (``signals.py``): SIGINT / SIGTERM finish the current step, save a checkpoint and return
  normally (exit 0); a second one abandons a save in flight cleanly (the checkpoints before it intact,
  no thread left writing) and one line names the newest complete checkpoint (the CLI exits 130).
- **Where it writes**: ``train.out_dir`` and ``train.export`` obey the writers' rule (``atomic.py``).
- **Numerical faults**: a step whose loss or gradient norm is NaN/inf applies no update (weights and
  optimizer moments untouched: the engine defers every update until the norm is known), is logged
  and counted; ``train.max_bad_steps`` consecutive ones save a checkpoint and stop with a
  ``UserError``.

Test hooks are arguments (``TrainHooks``: NaN steps, kills after a step and inside a save).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import yaml

from megatrain_jax import checkpoint as ck
from megatrain_jax.config import Config
from megatrain_jax.distributed import is_main
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.errors import UserError
from megatrain_jax.evaluate import eta_with_evals
from megatrain_jax.plan import memory_snapshot
from megatrain_jax.reference_logps import reward_line
from megatrain_jax.metrics import MetricsWriter, attention_flops_per_token, model_flops_per_token
from megatrain_jax.plan import few_malloc_arenas, plan_or_refuse  # noqa: F401 - importable here too
from megatrain_jax.run_start import RunStart, reference_trainer, start_run
from megatrain_jax.signals import StopSignals, abort_line
from megatrain_jax.trainer import Trainer
from megatrain_jax.watchdog import StallWatchdog

Log = Callable[[str], None]


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
    return Batch(b.tokens, b.labels, b.loss_mask, b.segment_ids if doc_masking else None,
                 b.positions if doc_masking else None, getattr(b, "ref_logps", None))  # (dpo/ipo: the reference's)


# ------------------------------------------------------------------------------------ helpers


@dataclass(frozen=True)
class TrainHooks:
    """Faults a test injects into ``train()`` (arguments, never read from the environment).

    ``nan_steps``: the forward of these (1-based) steps produces NaN; ``kill_after_step``: SIGKILL
    the process after that step once the saves in flight are committed; ``kill_in_save``: SIGKILL it
    in the middle of the save of that step (``checkpoint.CheckpointSaver.kill_in_save``);
    ``sigint_after_step`` / ``sigint_in_save``: a Ctrl-C after that step / in the middle of its save
    (``CheckpointSaver.sigint_in_save``); ``hang_in_step``: that step never returns (``watchdog.py``)."""

    nan_steps: frozenset = frozenset()
    kill_after_step: int | None = None
    kill_in_save: int | None = None
    sigint_after_step: int | None = None  # SIGINT to the process once that step is logged (a first Ctrl-C)
    sigint_in_save: int | None = None  # SIGINT to the main thread in the middle of the save of that step
    hang_in_step: int | None = None  # that step never ends (a device waiting in a collective): the watchdog's case


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


def _eta(seconds: float) -> str:
    """A time left as h:mm:ss (a day and more: d days h:mm:ss)."""
    if not seconds == seconds or seconds == float("inf"):
        return "?"
    s = int(round(max(seconds, 0.0)))
    days, s = divmod(s, 86400)
    text = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text


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
        with contextlib.suppress(OSError):
            if os.path.getsize(path) == 0:
                os.remove(path)  # (an empty log on a full disk: nothing to read in it)
        path = "(could not be written)"
    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT,
                                              errno.EIO, errno.EFBIG):
        what, fix = ck.io_problem(e)
        where = f"writing {e.filename}" if getattr(e, "filename", None) else "writing"
        tb = f"; full traceback in {path}" if not path.startswith("(") else ""
        return UserError("disk", f"{where} failed after step {step}: {what}{tb}",
                         f"{fix} (train.out_dir), lower train.keep_last, or set train.ckpt_every=0 and "
                         f"train.final_checkpoint=false; {ck.newest_line(ck.checkpoint_root(out_dir))}")
    if "RESOURCE_EXHAUSTED" in msg or "Out of memory" in msg:
        return UserError("GPU memory", f"the device ran out of memory after step {step}: {msg}; full traceback "
                         f"in {path}", "lower train.gpu_memory_gb or the tokens per micro-batch "
                         "(train.micro_batches), and report the plan (megatrain-jax plan) with this log")
    return UserError("train", f"failed after step {step}: {msg}; full traceback in {path}",
                     "read the log; committed checkpoints are intact, continue with --resume")


# ------------------------------------------------------------------------------------ the outputs


def rng_state(cfg: Any) -> dict:
    """The run's random state a checkpoint records (the loop writes it; resume reads its numpy part)."""
    import jax

    np_state = np.random.get_state()
    return {"train_seed": cfg.train.seed, "data_seed": cfg.data.seed,
            "jax_key_data": np.asarray(jax.random.key_data(jax.random.key(cfg.train.seed))).tolist(),
            "numpy_global": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "note": "the loop is deterministic: batches from (data_seed, step), init from train_seed"}


def _open_outputs(cfg: Config, start: RunStart, resume: bool, main: bool, log: Log) -> tuple[MetricsWriter, str]:
    """``out_dir/config.yaml`` and the metrics (cut back to the resumed step, or a fresh file)."""
    t = cfg.train
    if not main:
        return MetricsWriter(os.devnull, tensorboard=False, log=log), os.devnull
    os.makedirs(t.out_dir, exist_ok=True)
    with open(os.path.join(t.out_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    path = os.path.join(t.out_dir, "metrics.jsonl")
    if resume:
        _truncate_metrics(path, start.start_step, log)
    elif os.path.isfile(path):
        old = f"{path}.old-{int(time.time())}"
        os.replace(path, old)
        log(f"metrics: a fresh run; the previous {path} was moved to {old}")
    return MetricsWriter(path, tensorboard=True, log=log), path


# ------------------------------------------------------------------------------------ the loop


class _Loop:
    """The steps of one run: batches in, records and checkpoints out, faults counted."""

    def __init__(self, cfg: Config, start: RunStart, metrics: MetricsWriter, hooks: TrainHooks, main: bool, log: Log):
        t, d = cfg.train, cfg.data
        self.cfg, self.start, self.metrics, self.hooks, self.main, self.log = cfg, start, metrics, hooks, main, log
        self.trainer = start.trainer
        self.tokens_per_step = t.batch_size * d.seq_len
        self.fpt = model_flops_per_token(cfg.model)
        self.fpt_attn = self.fpt + attention_flops_per_token(cfg.model, d.seq_len)
        loop = start.state.get("loop", {})
        self.skipped = int(loop.get("skipped_total", 0))
        self.bad_streak = int(loop.get("bad_streak", 0))
        if self.bad_streak >= t.max_bad_steps:
            self.bad_streak = 0  # that run stopped on it; the user has had a chance to change something
        self.last_good = int(loop.get("last_good_step", start.start_step))
        self.rng = rng_state(cfg)
        # process 0 writes the checkpoints; with a sharded host state every process writes its own shares
        self.saver = self.trainer.saver(start.root, keep_last=t.keep_last, keep_every=t.keep_every, log=log) \
            if main or self.trainer.sharded_checkpoints else None  # None too where the trainer writes none (reference)
        if self.saver is not None and hooks.kill_in_save is not None:
            self.saver.kill_in_save = hooks.kill_in_save
        if self.saver is not None and hooks.sigint_in_save is not None:
            self.saver.sigint_in_save = hooks.sigint_in_save
        self.losses: list[float] = []
        self.step_done = start.start_step
        self.stopped_by: str | None = None
        self.final_path: str | None = None
        self.abandoned_step: int | None = None  # a save given up by an abort (a second signal)
        self._reported = 0  # saves reported so far (saver.history)

    def run(self) -> None:
        """Steps ``start_step + 1 .. train.steps``; stops early (with a checkpoint) on a signal or on
        ``train.max_bad_steps`` non-finite steps in a row. Closes the saver and the trainer."""
        t = self.cfg.train
        stop = StopSignals()
        aborted = failed = False
        # a step that stops making progress (a GPU failed inside a collective) ends the run instead of hanging it
        watchdog = StallWatchdog(t.stall_timeout_s, t.out_dir, start_step=self.start.start_step)
        try:
            t0 = last = time.perf_counter()
            for s in range(self.start.start_step + 1, t.steps + 1):
                res = self._step(s)
                watchdog.beat(s)
                now = time.perf_counter()
                dt, last = now - last, now
                self._count(s, res)
                rec = self._record(s, res, dt)
                last = self.start.eval.run_into(rec, s, self.trainer, watchdog, last) if self.start.eval else last
                self.metrics.write(rec)
                if s % t.log_every == 0 or s == self.start.start_step + 1 or s == t.steps:
                    self._log_step(s, res, rec, now - t0)
                if self.saver is not None:
                    self.saver.poll()  # a background save that has committed since the last step
                    self._report_saved()
                if s == self.hooks.sigint_after_step:
                    signal.raise_signal(signal.SIGINT)  # test hook: a Ctrl-C now (handled before the next line)
                self._stop_if_bad(s)
                if stop.received:
                    self.stopped_by, self.final_path = stop.received, self.save(s, wait=True)
                    break
                if t.ckpt_every and s % t.ckpt_every == 0:
                    self.save(s, wait=False)
                if s == self.hooks.kill_after_step:
                    self._kill()
            else:
                if t.final_checkpoint:
                    self.final_path = self.save(self.step_done, wait=True)
        except KeyboardInterrupt:
            aborted = True  # a second signal: do not wait for a save in flight (its .tmp is ignored later)
            raise
        except UserError:
            failed = True
            raise
        except Exception as e:  # noqa: BLE001 - a background failure (optimizer thread, checkpoint writer, device)
            aborted = True
            raise _background_failure(e, t.out_dir, self.step_done) from None
        finally:
            watchdog.close()
            try:
                self._close(aborted, failed)  # on an abort: the save in flight abandoned, its writer ended
            finally:
                stop.restore()  # only now: a third signal must not cut that clean-up short

    def _step(self, s: int):
        """Step ``s`` (1-based): the batch of index ``s - 1`` (a pure function of the step)."""
        t, d = self.cfg.train, self.cfg.data
        batch = to_engine_batch(self.start.dataset.batch(s - 1, t.batch_size, d.seq_len), d.doc_masking)
        engine = self.trainer.engine
        traced = _Timeline(engine, t.out_dir, s, self.log) if (self.main and s == t.trace_step) \
            else contextlib.nullcontext()
        poisoned = engine.nan_forward() if s in self.hooks.nan_steps else contextlib.nullcontext()
        with poisoned, traced:
            res = self.trainer.step(batch)
            while s == self.hooks.hang_in_step:  # test hook: a step that never returns
                time.sleep(1.0)
        self.step_done = s
        self.losses.append(res.loss)
        return res

    def _count(self, s: int, res) -> None:
        if not res.skipped:
            self.bad_streak, self.last_good = 0, s
            return
        self.skipped += 1
        self.bad_streak += 1
        self.log(f"step {s}: non-finite loss {res.loss} / grad_norm {res.grad_norm}: update skipped, weights and "
                 f"optimizer state unchanged ({self.bad_streak} in a row, {self.skipped} in total, "
                 f"limit train.max_bad_steps={self.cfg.train.max_bad_steps})")

    def _record(self, s: int, res, dt: float) -> dict:
        n = self.tokens_per_step
        rec = {"step": s, "loss": res.loss, "grad_norm": res.grad_norm, "step_time_s": dt, "tokens_per_s": n / dt,
               "model_tflops": self.fpt * n / dt / 1e12, "model_tflops_with_attention": self.fpt_attn * n / dt / 1e12,
               "skipped": res.skipped}
        if getattr(res, "aux_loss", None) is not None:  # e.g. the MoE router's load-balancing term, inside loss
            rec["aux_loss"] = res.aux_loss
        rec.update(getattr(res, "preference", None) or {})  # a preference objective's rewards/* and logps/* (TRL's)
        rec["lr"] = self.trainer.lr_at(self.trainer.step_count)
        rec.update(memory_snapshot(self.trainer.memory_device))
        return rec

    def _log_step(self, s: int, res, rec: dict, elapsed: float) -> None:
        t = self.cfg.train
        eta = eta_with_evals(self.start.eval, elapsed, s, self.start.start_step, t.steps)  # (evaluate.py)
        self.log(f"step {s:>6}/{t.steps}  loss {res.loss:.4f}  grad_norm {res.grad_norm:.3f}  {reward_line(rec)}"
                 f"tokens/s {rec['tokens_per_s']:,.0f}  model TFLOPS {rec['model_tflops']:.3f}  "
                 f"elapsed {_eta(elapsed)}  eta {_eta(eta)}")

    def _stop_if_bad(self, s: int) -> None:
        if self.bad_streak < self.cfg.train.max_bad_steps:
            return
        path = self.save(s, wait=True)
        raise UserError("train.max_bad_steps",
                        f"{self.bad_streak} consecutive steps ({s - self.bad_streak + 1}..{s}) had a non-finite loss "
                        f"or gradient norm; none of them changed the model, whose weights are those after step "
                        f"{self.last_good}" + (f"; checkpoint saved to {path}" if path else ""),
                        "lower optim.lr, set optim.clip_norm or check the data around these steps, then "
                        "continue with --resume (or raise train.max_bad_steps)")

    def save(self, step: int, wait: bool) -> str | None:
        """A checkpoint of the state after ``step`` with what resuming needs (loop counters, LR,
        data position, RNG, config); None where no checkpoint is written."""
        if self.saver is None:
            return None
        cfg, t, d, tr = self.cfg, self.cfg.train, self.cfg.data, self.trainer
        meta = {"loop": {"step": step, "skipped_total": self.skipped, "bad_streak": self.bad_streak,
                         "last_good_step": self.last_good},
                "lr_schedule": {"count": tr.step_count, "next_lr": tr.lr_at(tr.step_count + 1),
                                "schedule": cfg.optim.schedule.__dict__, "total_steps": t.steps},
                "data": {"position": self.start.dataset.position(step, t.batch_size, d.seq_len),
                         "describe": self.start.dataset.describe(), "batch_size": t.batch_size, "seq_len": d.seq_len},
                "rng": self.rng, "config": cfg.to_dict()}
        try:
            path = self.saver.save(step, meta, wait=wait)
        finally:
            self._report_saved()  # every save that committed, also one save() waited for (saves slower than steps)
        return path

    def _report_saved(self) -> None:
        """One line for each save committed since the last report (``CheckpointSaver.history``)."""
        history = self.saver.history if self.saver is not None else []
        for st in history[self._reported:]:
            self.log(f"checkpoint: step {st.step} saved to {st.path} ({st.nbytes / 1e9:.3f} GB in {st.write_s:.2f}s; "
                     f"training loop blocked {st.call_s:.3f}s, updates held {st.held_s:.3f}s)")
        self._reported = len(history)

    def _kill(self) -> None:
        """``TrainHooks.kill_after_step``: a hard kill once the checkpoints so far are committed."""
        if self.saver is not None:
            self.saver.wait()
        os.kill(os.getpid(), signal.SIGKILL)

    def _close(self, aborted: bool, failed: bool = False) -> None:
        """Close the saver (an abort: abandon its save in flight), the trainer and the metrics. After
        an abort the abandoned save's writer is waited for, so no thread is left writing (or
        starting orbax work) while the interpreter shuts down."""
        try:
            if self.saver is not None:
                if aborted:
                    self.abandoned_step = self.saver.abandon()
                else:
                    try:
                        self.saver.close()
                        self._report_saved()
                    except KeyboardInterrupt:  # a second signal while waiting for the last save
                        aborted = True
                        self.abandoned_step = self.saver.abandon()
                        raise
        finally:
            try:
                self.trainer.close()  # settles the queued updates an abandoned save may wait for
            except Exception:  # noqa: BLE001 - after a failure, the pending updates fail the same way
                if not aborted:
                    raise
            finally:
                if aborted and self.saver is not None:
                    self.saver.settle()  # (a saver that writes in-line has nothing to settle)
                try:
                    self.metrics.close()
                except OSError as e:  # (a full disk): never in place of the error being reported
                    if not (aborted or failed):
                        what, fix = ck.io_problem(e)
                        raise UserError("train.out_dir", f"closing the metrics in {self.cfg.train.out_dir} failed: "
                                        f"{what}", f"{fix}; {ck.newest_line(self.start.root)}") from None

    def abort_line(self, why: str) -> str:
        """The one line after an abort (``signals.abort_line``)."""
        return abort_line(why, self.step_done, self.abandoned_step,
                          ck.list_checkpoints(self.saver.root) if self.saver else None, self.cfg.train.out_dir, self.main)


def _summary(cfg: Config, loop: _Loop, resume: bool, wall: float) -> dict[str, Any]:
    plan, losses = loop.start.plan, loop.losses
    return {"steps": loop.step_done, "first_loss": losses[0] if losses else None,
            "plan": None if plan is None else {"host_gb": plan.host_need / 1e9,
                                               "gpu_gb": plan.gpu_need and plan.gpu_need / 1e9,
                                               "decisions": plan.decisions,
                                               "predicted_step_s": plan.step["predicted_step_s"]},
            "measured": memory_snapshot(loop.trainer.memory_device),
            "last_loss": losses[-1] if losses else None,
            "mean_last10": float(np.mean(losses[-10:])) if losses else None, "wall_s": wall,
            "skipped_steps": loop.skipped, "resumed_from": loop.start.start_step if resume else None,
            "eval": loop.start.eval.last if loop.start.eval else None,
            "checkpoint": loop.final_path, "stopped_by": loop.stopped_by}


def train(cfg: Config, resume: bool = False, log: Log = print, hooks: TrainHooks | None = None,
          inputs: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps; returns a summary (first/last losses, throughput).

    ``resume`` continues from the newest complete checkpoint in ``train.out_dir``; ``hooks``: faults
    a test injects (``TrainHooks``); ``inputs``: files the run reads besides those the config names
    (the config file itself), which ``train.out_dir`` and ``train.export`` may not be, hold or lie in.
    """
    t = cfg.train
    main = is_main()  # process 0 writes checkpoints, metrics and logs; the others only train
    if not main:
        log = lambda _msg: None  # noqa: E731
    start = start_run(cfg, resume, log, main, inputs)  # every check; nothing written yet (train.out_dir locked)
    try:
        return _train_locked(cfg, start, resume, log, hooks, main)
    finally:
        if start.lock is not None:
            start.lock.release()


def _train_locked(cfg: Config, start: RunStart, resume: bool, log: Log, hooks: TrainHooks | None,
                  main: bool) -> dict[str, Any]:
    t = cfg.train
    metrics, metrics_path = _open_outputs(cfg, start, resume, main, log)
    log(f"model: {cfg.model.total_params() / 1e6:.2f}M parameters "
        f"({cfg.model.non_embedding_params() / 1e6:.2f}M non-embedding), engine={t.engine}, "
        f"compute={t.compute_dtype}, {t.batch_size * cfg.data.seq_len} tokens/step")
    loop = _Loop(cfg, start, metrics, hooks or TrainHooks(), main, log)
    t0 = time.perf_counter()
    try:
        loop.run()
    except KeyboardInterrupt as e:  # a second signal (or Ctrl-C without our handler): one line, no traceback
        raise KeyboardInterrupt(loop.abort_line(str(e) or "interrupted")) from None
    if t.export and loop.stopped_by is None and main:  # the weights (LoRA: the adapter, in the PEFT format)
        start.trainer.export(cfg, t.export, sources=start.inputs, own_run=t.out_dir, log=log)
    summary = _summary(cfg, loop, resume, time.perf_counter() - t0)
    if main:
        with open(os.path.join(t.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    losses = loop.losses
    if loop.stopped_by:
        log(f"stopped by {loop.stopped_by} after step {loop.step_done}: " + (
            f"checkpoint saved to {loop.final_path}; continue with `megatrain-jax train ... --resume` "
            f"(train.out_dir={t.out_dir})" if loop.final_path else "no checkpoint (the reference engine writes none)"))
    elif not losses:
        log(f"nothing to do: the checkpoint is at step {start.start_step} and train.steps={t.steps}")
    else:
        log(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {summary['wall_s']:.0f}s; "
            f"metrics in {metrics_path}" + (f"; checkpoint {loop.final_path}" if loop.final_path else ""))
    return summary
