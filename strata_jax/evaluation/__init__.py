"""Evaluation: the protocol and its test-time scaling, which eval.py's job
(`strata_jax.jobs.evaluate`) and the training loop's periodic eval run.

- ``protocol``  the eval protocol of docs/method.md §10 (one strategy per task at the eval
                temperature; per-family success, score and cost) and the task lists it plays.
- ``scaling``   its optional test-time strategy scaling (S candidates, probes, a chooser;
                docs/method.md §10.1), eval.py only.

The protocol's names are re-exported here; ``scaling`` is imported where used (it pulls in
code the protocol does not need).
"""
from strata_jax.evaluation.protocol import (
    SCORE_SCALE,
    cost_metrics,
    episode_stats,
    episode_tokens,
    eval_rollout_config,
    eval_tasks,
    evaluate,
    family_of,
    format_metrics,
    per_family,
    protocol_costs,
    spread_over_families,
    summarize,
    task_family,
)

__all__ = [
    "SCORE_SCALE", "cost_metrics", "episode_stats", "episode_tokens", "eval_rollout_config",
    "eval_tasks", "evaluate", "family_of", "format_metrics", "per_family", "protocol_costs",
    "spread_over_families", "summarize", "task_family",
]
