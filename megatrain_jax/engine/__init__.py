"""The streamed engine: ``StreamedTrainer.step`` in ``step.py``, read top to bottom; its machinery in
``weights.py`` (weight stream, boundary activations), ``updaters.py`` (host or device-side updates),
``kernels.py`` (the jitted pieces, one variant per layer) and ``loss.py`` (chunked cross-entropy)."""
from megatrain_jax.engine.loss import chunked_cross_entropy
from megatrain_jax.engine.step import Batch, MicroBatch, StepResult, StreamedTrainer

__all__ = ["Batch", "MicroBatch", "StepResult", "StreamedTrainer", "chunked_cross_entropy"]
