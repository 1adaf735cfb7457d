"""``python -m megatrain_jax.data INPUTS... --out PREFIX``: the same as ``megatrain-jax prepare``."""
import sys

from megatrain_jax.cli import main

sys.exit(main(["prepare", *sys.argv[1:]]))
