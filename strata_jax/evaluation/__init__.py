"""Evaluation: everything eval.py and the training loop's periodic eval run.

- ``protocol``  the eval protocol of docs/method.md §10 (one strategy per task at the eval
                temperature; per-family success, score and cost) and the task lists it plays.
- ``scaling``   its optional test-time strategy scaling (S candidates, probes, a chooser;
                docs/method.md §10.1), eval.py only.
- ``run``       eval.py's job: load a checkpoint or the config's model, play, write the files.

The protocol's names are re-exported here; ``scaling`` and ``run`` are imported where used
(they pull in the trainer and the checkpoint code the protocol does not need).
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
