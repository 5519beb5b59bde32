"""Trainer: train state, scoring passes, critic, mini-batched PPO update, checkpoints.

One job per module: state.py (the TrainState and its optimisers), scoring.py (the forward and
the chunked LM-head logprobs), critic.py, batching.py (host-side batch helpers), prefix_tree/
(the prefix-tree packed layout of a batch's rows, host numpy), steps.py (the pure jitted
scoring / advantage / micro-batch steps), per_row.py (the per-row reference update),
trainer.py (`Trainer`: the update flow of docs/method.md §9 around those steps), replay.py
(STAPO's replay pool and the update's hooks into it, docs/method.md §7.5), checkpoint.py
(the orbax layout and resume rules), checkpoint_files.py (a step's manifest and the checks
before its restore), sft/ (the behaviour-cloning warm start's data and
trainer).
"""
from strata_jax.training.config import TrainConfig
from strata_jax.training.critic import (dropout_values, init_critic, init_value_head,
                                        value_from_hidden)
from strata_jax.training.scoring import (PackedInputs, packed_response_states, response_logprobs,
                                         response_states, sequence_inputs)
from strata_jax.training.prefix_tree import PackedLayout, pack_rows
from strata_jax.training.state import TrainState, create_train_state, lr_schedule, make_optimizer
from strata_jax.algos.batch import pad_rows
from strata_jax.training.batching import minibatch_plan, num_minibatches, trim_padding
from strata_jax.training.steps import advantages, effective_params, micro_loss
from strata_jax.training.per_row import accumulate_grads, score_batch, train_minibatch
from strata_jax.training.trainer import Trainer
from strata_jax.training.replay import ReplayConfig, ReplayPool

__all__ = [
    "TrainConfig", "TrainState", "Trainer", "create_train_state", "make_optimizer",
    "lr_schedule", "init_critic", "init_value_head", "value_from_hidden", "dropout_values",
    "response_states", "response_logprobs", "sequence_inputs", "score_batch", "advantages",
    "train_minibatch", "accumulate_grads", "micro_loss", "minibatch_plan", "pad_rows",
    "num_minibatches", "trim_padding", "effective_params", "PackedInputs",
    "packed_response_states", "PackedLayout", "pack_rows", "ReplayConfig", "ReplayPool",
]
from strata_jax.training.checkpoint import (  # noqa: E402
    Checkpointer, CheckpointWriteError, CorruptCheckpointError, NoRestorableCheckpointError,
    PreemptionFlag, tree_to_numpy)
from strata_jax.training.loop_checkpoints import LoopCheckpoints  # noqa: E402

__all__ += ["Checkpointer", "CheckpointWriteError", "CorruptCheckpointError",
            "NoRestorableCheckpointError", "PreemptionFlag",
            "tree_to_numpy", "LoopCheckpoints"]
