"""Test-only entry point: ``megatrain-jax`` with ``train.TrainHooks`` (the production CLI takes none).

    python tests/train_with_hooks.py [--nan-steps 3,4] [--kill-after-step 7] [--kill-in-save 10]
        [--sigint-after-step 5] [--sigint-in-save 5] [--hang-in-step 3] -- train CONFIG ...
"""
import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import every_process_caches  # noqa: E402 - tests/, this script's folder
from megatrain_jax import cli, train  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nan-steps", default="")
    p.add_argument("--kill-after-step", type=int, default=None)
    p.add_argument("--kill-in-save", type=int, default=None)
    p.add_argument("--sigint-after-step", type=int, default=None)
    p.add_argument("--sigint-in-save", type=int, default=None)
    p.add_argument("--hang-in-step", type=int, default=None)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    a = p.parse_args()
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    hooks = train.TrainHooks(nan_steps=frozenset(int(x) for x in a.nan_steps.split(",") if x.strip()),
                             kill_after_step=a.kill_after_step, kill_in_save=a.kill_in_save,
                             sigint_after_step=a.sigint_after_step, sigint_in_save=a.sigint_in_save,
                             hang_in_step=a.hang_in_step)
    train.train = functools.partial(train.train, hooks=hooks)  # what cli._train calls
    every_process_caches.enable()  # the next run's processes 1..N-1 load their programs instead of compiling them
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
