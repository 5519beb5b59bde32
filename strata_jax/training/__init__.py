"""Trainer: train state, scoring passes, critic, mini-batched PPO update, checkpoints.

See update.py for the update flow (docs/method.md §9) and checkpoint.py for the orbax
checkpoint layout and resume rules.
"""
from strata_jax.training.config import TrainConfig
from strata_jax.training.critic import (dropout_values, init_critic, init_value_head,
                                        value_from_hidden)
from strata_jax.training.scoring import response_logprobs, response_states, sequence_inputs
from strata_jax.training.state import TrainState, create_train_state, lr_schedule, make_optimizer
from strata_jax.training.update import (Trainer, accumulate_grads, advantages, micro_loss, minibatch_plan,
                                        pad_rows, score_batch, train_minibatch)

__all__ = [
    "TrainConfig", "TrainState", "Trainer", "create_train_state", "make_optimizer",
    "lr_schedule", "init_critic", "init_value_head", "value_from_hidden", "dropout_values",
    "response_states", "response_logprobs", "sequence_inputs", "score_batch", "advantages",
    "train_minibatch", "accumulate_grads", "micro_loss", "minibatch_plan", "pad_rows",
]
from strata_jax.training.checkpoint import (  # noqa: E402
    Checkpointer, CheckpointWriteError, CorruptCheckpointError, PreemptionFlag, tree_to_numpy)
from strata_jax.training.loop import run_loop  # noqa: E402

__all__ += ["Checkpointer", "CheckpointWriteError", "CorruptCheckpointError", "PreemptionFlag",
            "tree_to_numpy", "run_loop"]
