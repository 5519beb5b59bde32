"""Behaviour cloning (SFT) on expert trajectories rendered with the rollout's prompts: the
library half of the warm start (`strata_jax.jobs.warm_start` runs it for an experiment config).

Why: a randomly initialised tiny model never emits a parsable ``<action>``, so RL from scratch
on CPU has no signal. Cloning an expert first gives a policy whose actions reach the env from
the first iteration, with room left for RL (the data holds a little noise).

One job per module: config.py (`SFTConfig`), experts.py (expert play with noise), render.py
(examples in the rollout's own prompts), cloning.py (batches, loss, the jitted trainer).
"""
from strata_jax.training.sft.cloning import (SFT_PROGRESS_S, SFTTrainer, batch_order,
                                             batch_shapes, column_costs, make_sft_batch,
                                             sft_loss, sft_progress, train_sft)
from strata_jax.training.sft.config import (PLAN_CODES, PROMPT_HISTORIES, STRATEGY_MODES,
                                            SFTConfig, renders_full)
from strata_jax.training.sft.experts import (SCIWORLD_NOISE_ACTIONS, ExpertEpisode, ExpertStep,
                                             collect_expert_episodes, play_builtin_expert,
                                             play_gold)
from strata_jax.training.sft.render import (KINDS, MASKED_CODE, SFTExample, action_response,
                                            build_examples, judge_response, keeps_code,
                                            mask_codes, plan_text, render_episode)

__all__ = [
    "SFTConfig", "ExpertStep", "ExpertEpisode", "SFTExample", "SFTTrainer",
    "play_builtin_expert", "play_gold", "collect_expert_episodes", "plan_text", "mask_codes",
    "MASKED_CODE", "action_response", "judge_response", "render_episode", "build_examples",
    "keeps_code",
    "make_sft_batch", "sft_loss", "batch_order", "batch_shapes", "column_costs", "train_sft",
    "sft_progress", "SFT_PROGRESS_S",
    "SCIWORLD_NOISE_ACTIONS", "STRATEGY_MODES", "PLAN_CODES", "KINDS",
    "PROMPT_HISTORIES", "renders_full",
]
