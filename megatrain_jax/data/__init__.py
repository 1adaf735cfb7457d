"""Data: tokenizers, ``megatrain-jax prepare`` (text / JSONL -> packed token files) and the batch loader.

- ``tokenizer.py``: UTF-8 bytes or a Hugging Face ``tokenizer.json``;
- ``pipeline.py`` (with ``jsonl.py`` and ``chat.py``): the ``prepare`` pipeline;
- ``packed.py``: the packed format, its writer, and ``PackedDataset`` (batches a pure function of the step);
- ``load.py``: ``load_dataset``, every check before a run writes anything.
"""
from megatrain_jax.data import chat
from megatrain_jax.data.load import load_dataset
from megatrain_jax.data.packed import FORMAT_NAME, FORMAT_VERSION, SUFFIXES, Batch, PackedDataset
from megatrain_jax.data.pipeline import prepare, prepare_main
from megatrain_jax.data.tokenizer import ByteTokenizer, HFTokenizer, dtype_for_vocab, load_tokenizer

__all__ = ["Batch", "ByteTokenizer", "FORMAT_NAME", "FORMAT_VERSION", "HFTokenizer", "PackedDataset", "SUFFIXES",
           "chat", "dtype_for_vocab", "load_dataset", "load_tokenizer", "prepare", "prepare_main"]
