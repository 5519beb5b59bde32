"""Rollout orchestration: prompts, strategies (format check, FPS), the step loop with env
overlap, self-judgment, and the rollout modes that fill a `SampleBatch`.

Public API:
  prompts:   PromptBuilder, PromptIds, HistoryEntry, invalid_history_action
  strategy:  StrategyCheck, check_strategy, farthest_point_selection, select_strategies,
             StrategyGroup, strategy_stage
  judge:     parse_bad_steps, judge_flags, judge_stage
  keys:      row_keys, PURPOSE_STRATEGY / PURPOSE_ACTION / PURPOSE_JUDGE
  policy:    Policy (protocol), SamplerPolicy;  scripted: ScriptedPolicy
  episodes:  EpisodeSpec, StepRecord, Trajectory, Interval, LoopStats, run_episodes, anchor_hash
  rollout:   RolloutConfig, RolloutResult, make_prompt_builder,
             collect_rollout, dapo_rollout, rollout, rollout_stats, dump_trajectories,
             env_rejected
"""
from strata_jax.rollout.episodes import (EpisodeSpec, Interval, LoopStats, StepRecord,
                                         Trajectory, anchor_hash, run_episodes)
from strata_jax.rollout.judge import judge_flags, judge_stage, parse_bad_steps
from strata_jax.rollout.keys import (PURPOSE_ACTION, PURPOSE_JUDGE, PURPOSE_STRATEGY,
                                     row_keys)
from strata_jax.rollout.policy import Policy, SamplerPolicy
from strata_jax.rollout.prompts import (HistoryEntry, PromptBuilder, PromptIds,
                                        invalid_history_action)
from strata_jax.rollout.rollout import (RolloutConfig, RolloutResult, collect_rollout,
                                        dapo_rollout, dump_trajectories, env_rejected,
                                        make_prompt_builder, rollout, rollout_stats)
from strata_jax.rollout.scripted import ScriptedPolicy
from strata_jax.rollout.strategy import (StrategyCheck, StrategyGroup, check_strategy,
                                         farthest_point_selection, select_strategies,
                                         strategy_stage)

__all__ = [
    "PromptBuilder", "PromptIds", "HistoryEntry", "invalid_history_action", "StrategyCheck",
    "check_strategy", "farthest_point_selection", "select_strategies", "strategy_stage",
    "parse_bad_steps", "judge_flags", "judge_stage", "row_keys", "PURPOSE_STRATEGY",
    "PURPOSE_ACTION", "PURPOSE_JUDGE", "Policy",
    "SamplerPolicy", "ScriptedPolicy", "EpisodeSpec", "StepRecord", "Trajectory", "Interval",
    "LoopStats", "run_episodes", "anchor_hash", "RolloutConfig", "RolloutResult",
    "StrategyGroup", "make_prompt_builder", "collect_rollout", "dapo_rollout", "rollout",
    "rollout_stats", "dump_trajectories", "env_rejected",
]
