import sys

from megatrain_jax.cli import main

sys.exit(main())
