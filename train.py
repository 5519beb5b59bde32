"""strata-jax training entry point.

Usage (once the end-to-end pieces land):
      python train.py --config=configs/sciworld.py:tiny
      python train.py --config=configs/sciworld.py --config.algo=grpo

For now it prints this help and checks that the model stack imports.
"""
import sys


def main(argv):
    print(__doc__)
    import strata_jax  # noqa: F401  (import check)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
