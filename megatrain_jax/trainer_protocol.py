"""What a trainer answers: the contract ``train.py`` drives and every trainer implements.

``trainer.Trainer`` (the streamed engine; with ``lora=`` or ``model.lora`` it trains adapters over a frozen
base), its runs (``trainer.StreamedRun``, ``lora_trainer.LoraRun``) and the in-memory reference
(``reference.ReferenceTrainer``) all answer ``TrainerProtocol``, so the training loop, the evaluation
and the export call them without asking which one they hold. A checkpoint writer answers ``Saver``
(``checkpoint.CheckpointSaver``: background, per group; with ``files``: a run's adapters, in-line).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Saver(Protocol):
    """Checkpoints into ``root`` between steps (``checkpoint.CheckpointSaver``'s interface)."""

    root: str
    history: list  # checkpoint.SaveStats of every committed save, oldest first
    kill_in_save: int | None  # fault injection (train.TrainHooks)

    def save(self, step: int, meta: dict, *, wait: bool = False) -> str: ...

    def poll(self) -> Any: ...

    def wait(self) -> Any: ...

    def close(self) -> None: ...

    def abandon(self) -> Any: ...

    def settle(self, timeout: float = 300.0) -> bool: ...


@runtime_checkable
class TrainerProtocol(Protocol):
    """One training run's object: steps, weights, checkpoints, plan and export.

    ``engine``: the streamed engine (None for the in-memory reference); ``store``: the host store it streams
    (the trained weights, or a run of adapters' frozen base; None for the reference); ``sharded_checkpoints``:
    every process writes its own shares (``train.host_state=sharded``), else process 0 writes."""

    engine: Any
    store: Any

    @property
    def step_count(self) -> int: ...

    @property
    def memory_device(self) -> Any: ...

    @property
    def sharded_checkpoints(self) -> bool: ...

    def step(self, batch: Any) -> Any: ...

    def lr_at(self, count: int) -> float | None: ...

    def params(self) -> Any: ...

    def saver(self, directory: str, *, keep_last: int = 2, keep_every: int = 0, log: Any = None) -> Saver | None: ...

    def save(self, directory: str, *, keep_last: int = 2, meta: dict | None = None, log: Any = None) -> str: ...

    def restore(self, directory: str, log: Any = None) -> dict: ...

    def plan(self, *args: Any, **kwargs: Any) -> Any: ...

    def export(self, cfg: Any, out: str, *, sources: Any = (), own_run: str | None = None,
               log: Any = print) -> None: ...

    def close(self) -> None: ...
