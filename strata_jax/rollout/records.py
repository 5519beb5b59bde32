"""The records of a rollout: what an episode was asked to play (`EpisodeSpec`), what it played
(`Trajectory` of `StepRecord` steps and `Revision` plans), and how the step loop spent its time
(`LoopStats` of `Interval` periods). Plain dataclasses, filled by `strata_jax.rollout.episodes`
and read by the advantage / batch code, the reports and the dumps (docs/method.md §2-§3).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from envs_bridge.base import PromptPieces, Task
from strata_jax.rollout.prompts import HistoryEntry, PromptIds
from strata_jax.sampling import Generation


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """One episode to play.

    Attributes:
      task: the env task (M / G copies of one task are identical).
      task_uid: global task id in this iteration (the SampleBatch task_id).
      strategy_id: which kept strategy of the task (0 without StraTA).
      trajectory_id: episode index inside the task (strategy_id * M + j for StraTA).
      strategy: z shown in every step prompt, or None.
    """

    task: Task
    task_uid: int
    strategy_id: int
    trajectory_id: int
    strategy: str | None = None


@dataclasses.dataclass
class StepRecord:
    """One step of one episode.

    Attributes:
      prompt: the prompt ids the policy saw (prefix + suffix).
      generation: the policy's output (sampler token ids incl. stop token, logprobs).
      output_text: decoded output (stop token removed).
      action: the action sent to the env, or None when `invalid` (nothing sent).
      invalid: the output failed the action format or hit the token limit.
      observation: the raw observation the step acted on (anchor state).
      reward: env reward of the step; info: the env's step info.
    """

    prompt: PromptIds
    generation: Generation
    output_text: str
    action: str | None
    invalid: bool
    observation: str
    reward: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Revision:
    """A strategy revision written during an episode (docs/method.md §5.9; rollout option).

    Attributes:
      step: env steps taken when it was written (it precedes the action of 0-based step
        `step`; >= 1).
      ordinal: 1 for the episode's first revision, 2 for its second, ...
      trigger: "every" (``revise_every``) or "stuck" (``revise_on="stuck"``).
      prompt / generation / output_text: the revision prompt, the policy's output (ids
        and logprobs, never re-tokenised) and its decoded text.
      strategy: the plan later step prompts carry: the body of the new ``<strategy>`` block,
        or the previous plan when the output failed the format.
      token_len / format_fail / reason: the format check of the output (as for z: |z'|,
        P_fmt, why it failed).
    """

    step: int
    ordinal: int
    trigger: str
    prompt: PromptIds
    generation: Generation
    output_text: str
    strategy: str | None
    token_len: int
    format_fail: bool
    reason: str = ""


@dataclasses.dataclass
class Trajectory:
    """A played episode, with texts for logs and dumps.

    Attributes:
      spec: what was played. steps: one `StepRecord` per env step (invalid ones included).
      observations: reset observation, then one per step.
      pieces: the prompt pieces at reset (task description, role name).
      done / crashed / error / success: how it ended (crashed episodes are masked out of the
        loss). verdict / bad_steps: the self-judgment output and its 1-based bad steps;
        judge_tokens: the verdict's generated token count (0 when unjudged).
      revisions: the strategy revisions written during the episode (empty unless the
        rollout's revision option is on).
      family: the task family the env named in its reset info (``info["family"]``; "" when
        the reset crashed or the env names none).
    """

    spec: EpisodeSpec
    steps: list[StepRecord] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)
    pieces: PromptPieces | None = None
    done: bool = False
    crashed: bool = False
    error: str = ""
    success: bool = False
    verdict: str | None = None
    bad_steps: tuple[int, ...] = ()
    judge_tokens: int = 0
    revisions: list[Revision] = dataclasses.field(default_factory=list)
    family: str = ""
    # loop state
    episode_id: int = -1
    current_pieces: PromptPieces | None = None
    history: list[HistoryEntry] = dataclasses.field(default_factory=list)

    @property
    def episode_return(self) -> float:
        """Sum of the step rewards ([0,1]-scale units, docs/method.md §1.1)."""
        return float(sum(s.reward for s in self.steps))

    @property
    def strategy(self) -> str | None:
        """The plan in force: the last revision's, else the spec's z (None without StraTA)."""
        return self.revisions[-1].strategy if self.revisions else self.spec.strategy


def env_rejected(step: StepRecord) -> bool:
    """Whether the env refused a step's action although it passed the format check: the env's
    ``info["invalid"]`` (ScienceWorld: "No known action matches that input."; ALFWorld:
    "Nothing happens."; WebShop: an action that is not one of the page's ``search`` / ``click``
    actions; built-in envs: "Nothing happens."). A format-invalid step sent nothing: False."""
    return bool(step.action is not None and not step.invalid and step.info.get("invalid", False))


@dataclasses.dataclass
class Interval:
    """A recorded period: kind "sampler" (a policy call), "env" (a step ticket in flight) or
    "reset" (a reset ticket in flight); cohort index; perf_counter start / end seconds."""

    kind: str
    cohort: int
    start: float
    end: float
    rows: int = 0


@dataclasses.dataclass
class LoopStats:
    """Timing of one `run_episodes` call (seconds, time.perf_counter based)."""

    wall_s: float = 0.0
    env_wait_s: float = 0.0
    sampler_s: float = 0.0
    sampler_calls: int = 0
    intervals: list[Interval] = dataclasses.field(default_factory=list)

    @property
    def env_wait_frac(self) -> float:
        """Fraction of the loop's wall time spent blocked waiting on envs."""
        return self.env_wait_s / self.wall_s if self.wall_s > 0 else 0.0
