"""Rollout orchestration: prompts, strategies (format check, FPS), the step loop with env
overlap, self-judgment, strategy revision (option), and the rollout modes that fill a
`SampleBatch`.

Public API:
  prompts:   PromptBuilder, PromptIds, HistoryEntry, invalid_history_action
  strategy:  StrategyCheck, check_strategy, farthest_point_selection, select_strategies,
             StrategyGroup, strategy_stage, embed_candidates, STRATEGY_EMBEDDINGS
  judge:     parse_bad_steps, judge_flags, judge_stage, JudgeModel, build_judge_model
  revision:  RevisionConfig, StrategyReviser, revision_trigger
  keys:      row_keys, PURPOSE_STRATEGY / PURPOSE_ACTION / PURPOSE_JUDGE / PURPOSE_REVISION
  policy:    Policy (protocol), SamplerPolicy, prefix_metrics
  scripted:  ScriptedPolicy, forced_output_params, FORCED_CONFIG, FORCED_TEXT
  episodes:  EpisodeSpec, StepRecord, Trajectory, Revision, Interval, LoopStats, run_episodes,
             anchor_hash, env_rejected
  report:    rollout_stats, dump_trajectories
  rollout:   RolloutConfig, RolloutResult, make_prompt_builder,
             collect_rollout, dapo_rollout, rollout
"""
from strata_jax.rollout.episodes import anchor_hash, run_episodes
from strata_jax.rollout.records import (EpisodeSpec, Interval, LoopStats, Revision, StepRecord,
                                        Trajectory, env_rejected)
from strata_jax.rollout.judge import (JudgeModel, build_judge_model, judge_flags, judge_stage,
                                      parse_bad_steps)
from strata_jax.rollout.keys import (PURPOSE_ACTION, PURPOSE_JUDGE, PURPOSE_REVISION,
                                     PURPOSE_STRATEGY, row_keys)
from strata_jax.rollout.policy import Policy, SamplerPolicy, prefix_metrics
from strata_jax.rollout.prompts import (HistoryEntry, PromptBuilder, PromptIds,
                                        invalid_history_action)
from strata_jax.rollout.report import dump_trajectories, rollout_stats
from strata_jax.rollout.revision import RevisionConfig, StrategyReviser, revision_trigger
from strata_jax.rollout.rollout import (RolloutConfig, RolloutResult, collect_rollout,
                                        dapo_rollout, make_prompt_builder, rollout)
from strata_jax.rollout.scripted import (FORCED_CONFIG, FORCED_TEXT, ScriptedPolicy,
                                         forced_output_params)
from strata_jax.rollout.strategy import (STRATEGY_EMBEDDINGS, StrategyCheck, StrategyGroup,
                                         check_strategy, embed_candidates,
                                         farthest_point_selection, select_strategies,
                                         strategy_stage)

__all__ = [
    "PromptBuilder", "PromptIds", "HistoryEntry", "invalid_history_action", "StrategyCheck",
    "check_strategy", "farthest_point_selection", "select_strategies", "strategy_stage",
    "embed_candidates", "STRATEGY_EMBEDDINGS",
    "parse_bad_steps", "judge_flags", "judge_stage", "JudgeModel", "build_judge_model",
    "RevisionConfig", "StrategyReviser", "revision_trigger", "row_keys", "PURPOSE_STRATEGY",
    "PURPOSE_ACTION", "PURPOSE_JUDGE", "PURPOSE_REVISION", "Policy", "SamplerPolicy",
    "prefix_metrics", "ScriptedPolicy", "forced_output_params", "FORCED_CONFIG", "FORCED_TEXT",
    "EpisodeSpec", "StepRecord", "Trajectory", "Revision",
    "Interval", "LoopStats", "run_episodes", "anchor_hash", "env_rejected", "RolloutConfig",
    "RolloutResult", "StrategyGroup", "make_prompt_builder", "collect_rollout", "dapo_rollout",
    "rollout", "rollout_stats", "dump_trajectories",
]
