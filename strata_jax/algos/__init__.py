"""RL math as pure functions of arrays: the batch contract, advantage estimators, losses.

See method.md sections 2-4 and 6 for the pinned conventions.
"""
from strata_jax.algos.batch import KIND_ACTION, KIND_STRATEGY, PAD_ID, SampleBatch, make_sample_batch

__all__ = ["KIND_ACTION", "KIND_STRATEGY", "PAD_ID", "SampleBatch", "make_sample_batch"]
