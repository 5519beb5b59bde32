"""StraTA strategies: the strategy stage of a rollout, the format check (P_fmt, |z|),
farthest-point selection (FPS) and the strategy rows of the batch.

Source: docs/method.md §5.1-§5.2 (the strategy body, P_fmt, |z|, the embeddings FPS measures:
the policy's states or a frozen sentence encoder, greedy max-min cosine FPS, format failures
dropped first and used only as fill).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Collection, Sequence

import numpy as np

from envs_bridge.base import PromptPieces, Task
from envs_bridge.parsing import contains_cjk, has_visible_text
from envs_bridge.pool import EnvPool
from strata_jax.algos.batch import KIND_STRATEGY
from strata_jax.rollout.episodes import (content_ids, decode_generation, generate_timed,
                                         prompt_pieces_for)
from strata_jax.rollout.records import LoopStats
from strata_jax.rollout.keys import PURPOSE_STRATEGY, base_key_data, row_keys
from strata_jax.rollout.policy import Policy
from strata_jax.rollout.prompts import PromptBuilder, PromptIds
from strata_jax.sampling import FINISH_LENGTH, Generation, SamplingParams

_OPEN_RE = re.compile(r"<strategy>", re.IGNORECASE)
_CLOSE_RE = re.compile(r"</strategy>", re.IGNORECASE)
_BLOCK_RE = re.compile(r"<strategy>(.*?)</strategy>", re.IGNORECASE | re.DOTALL)


@dataclasses.dataclass(frozen=True)
class StrategyCheck:
    """Result of `check_strategy`.

    Attributes:
      text: z as it is prepended to the step prompts: the stripped body of the first
        ``<strategy>`` block, or, when there is no closed block, the whole stripped output
        (a failed candidate used as fill still needs some plan text).
      token_len: |z|, the token count of `text` (the estimator's P_len input).
      format_fail: P_fmt = 1 (bool): not exactly one block with a visible character
        (`envs_bridge.parsing.has_visible_text`), truncated, or CJK.
      reason: why it failed ("" when it passed), for logs.
    """

    text: str
    token_len: int
    format_fail: bool
    reason: str = ""


def check_strategy(output: str, truncated: bool,
                   count_tokens: Callable[[str], int]) -> StrategyCheck:
    """Check one strategy candidate (docs/method.md §5.1).

    Args:
      output: the decoded generation (stop token removed).
      truncated: the generation hit the token limit (finish reason "length").
      count_tokens: text -> token count (the policy's tokenizer, no special tokens).
    Returns:
      `StrategyCheck`; never raises on any string.
    """
    blocks = _BLOCK_RE.findall(output)
    z = blocks[0].strip() if blocks else output.strip()
    n_open, n_close = len(_OPEN_RE.findall(output)), len(_CLOSE_RE.findall(output))
    reason = ""
    if truncated:
        reason = "truncated at the token limit"
    elif not blocks:
        reason = "no closed <strategy> block"
    elif n_open != 1 or n_close != 1:
        reason = f"{n_open} <strategy> / {n_close} </strategy> tags, need exactly one block"
    elif not has_visible_text(z):
        # zero-width characters, U+3164, U+2800, soft hyphens, controls: a plan nobody can read
        reason = "empty <strategy> block"
    elif contains_cjk(output):
        reason = "cjk"
    return StrategyCheck(z, int(count_tokens(z)) if z else 0, bool(reason), reason)


def _unit_rows(embeddings: np.ndarray) -> np.ndarray:
    x = np.asarray(embeddings, np.float64)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be [n, D], got shape {x.shape}")
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return np.where(norm > 0, x / np.where(norm > 0, norm, 1.0), 0.0)


def farthest_point_selection(embeddings: np.ndarray, k: int, *,
                             candidates: Sequence[int] | None = None,
                             selected: Sequence[int] = (), first: int | None = None,
                             rng: np.random.Generator | None = None) -> list[int]:
    """Greedy max-min cosine-distance selection (farthest-point sampling).

    Distance = 1 - cosine similarity (a zero vector has similarity 0 to everything). With
    nothing `selected` yet, the first point is `first` if given, else drawn uniformly from
    `candidates` by `rng` (else the lowest candidate). Each next point maximises its minimum
    distance to the points chosen so far; ties go to the lowest index.

    Args:
      embeddings: [n, D] float.
      k: points to add (at most the number of candidates not already selected).
      candidates: indices allowed to be picked (default all).
      selected: indices already chosen (they count for the distances, are not returned).
      first: explicit first point (must be a candidate), used only when `selected` is empty.
      rng: numpy Generator for the first point.
    Returns:
      the k newly chosen indices, in selection order.
    Raises:
      ValueError: bad shapes, k larger than the candidates left, or `first` not a candidate.
    """
    x = _unit_rows(embeddings)
    n = x.shape[0]
    cand = list(range(n)) if candidates is None else sorted(int(c) for c in candidates)
    chosen = [int(s) for s in selected]
    pool = [c for c in cand if c not in chosen]
    if k > len(pool):
        raise ValueError(f"asked for {k} points but only {len(pool)} candidates are left")
    if k <= 0:
        return []
    out: list[int] = []
    if not chosen:
        if first is None:
            first = pool[int(rng.integers(len(pool)))] if rng is not None else pool[0]
        if first not in pool:
            raise ValueError(f"first point {first} is not among the candidates {pool}")
        out.append(int(first))
        chosen.append(int(first))
    sims = x @ x.T
    min_dist = np.min(1.0 - sims[:, chosen], axis=1)
    while len(out) < k:
        mask = np.full(n, -np.inf)
        free = [c for c in pool if c not in chosen]
        mask[free] = min_dist[free]
        nxt = int(np.argmax(mask))  # argmax returns the lowest index among equal maxima
        out.append(nxt)
        chosen.append(nxt)
        min_dist = np.minimum(min_dist, 1.0 - sims[:, nxt])
    return out


def select_strategies(embeddings: np.ndarray, format_fail: Sequence[bool], k: int, *,
                      diverse: bool = True, first: int | None = None,
                      rng: np.random.Generator | None = None) -> list[int]:
    """Pick the k strategies of one task from its candidates (docs/method.md §5.2).

    Format failures are dropped first; FPS runs over the passing candidates; if fewer than k
    pass, all passing ones are kept and the rest is filled with failed candidates, continuing
    the same max-min rule (they keep their P_fmt penalty). With ``diverse=False`` the first k
    passing candidates are kept (then the first failed ones), no FPS.

    Args:
      embeddings: [n, D]; format_fail: [n] bool; k <= n.
      first / rng: see `farthest_point_selection` (first must be a passing candidate).
    Returns:
      k candidate indices: the passing ones first, in selection order.
    Raises:
      ValueError: k > n or mismatched lengths.
    """
    fail = np.asarray(format_fail, bool)
    n = fail.shape[0]
    if np.shape(embeddings)[0] != n:
        raise ValueError(f"{np.shape(embeddings)[0]} embeddings for {n} format flags")
    if k > n:
        raise ValueError(f"cannot keep {k} strategies out of {n} candidates; raise the oversample")
    good = [i for i in range(n) if not fail[i]]
    bad = [i for i in range(n) if fail[i]]
    if not diverse:
        return (good + bad)[:k]
    if len(good) >= k:
        return farthest_point_selection(embeddings, k, candidates=good, first=first, rng=rng)
    if not good:
        return farthest_point_selection(embeddings, k, candidates=bad, first=first, rng=rng)
    kept = farthest_point_selection(embeddings, len(good), candidates=good, first=first, rng=rng)
    return kept + farthest_point_selection(embeddings, k - len(good), candidates=bad,
                                           selected=kept)


# --------------------------------------------------------------------------- the stage


@dataclasses.dataclass
class StrategyGroup:
    """The strategy stage of one task (logs, dumps, strategy rows).

    Attributes: task, task_uid; prompt (the strategy prompt); candidates (decoded texts);
    checks (`StrategyCheck` per candidate); generations; kept (candidate indices, in
    strategy_id order); first_observation.
    """

    task: Task
    task_uid: int
    prompt: PromptIds
    candidates: list[str]
    checks: list[StrategyCheck]
    generations: list[Generation]
    kept: list[int]
    first_observation: str


def first_observations(pool: EnvPool, tasks: Sequence[Task]
                       ) -> list[tuple[str, PromptPieces] | None]:
    """Reset each task once (in waves of free slots, one retry) for the strategy prompt.

    Returns (first observation, prompt pieces) per task, None for a task whose reset crashed
    twice. Every episode is released again (its slot is free for the episodes)."""
    out: list[tuple[str, PromptPieces] | None] = [None] * len(tasks)
    todo = list(range(len(tasks)))
    for _attempt in range(2):
        if _attempt and todo:
            pool.note_retries(len(todo))   # logged as rollout/env_retries
        retry = []
        while todo:
            wave, todo = todo[: max(pool.num_free, 1)], todo[max(pool.num_free, 1):]
            outs = pool.reset([tasks[i] for i in wave])
            for i, o in zip(wave, outs):
                if o.crashed:
                    retry.append(i)
                else:
                    out[i] = (o.observation, prompt_pieces_for(o, tasks[i].env))
            pool.release([o.episode_id for o in outs if not o.done])
        todo = retry
    return out


STRATEGY_EMBEDDINGS = ("policy", "sentence")


def check_strategy_embedding(name: str) -> str:
    """`name` if it is one of `STRATEGY_EMBEDDINGS`; else ValueError (one line, the choices)."""
    if name not in STRATEGY_EMBEDDINGS:
        raise ValueError(f"rollout.strategy_embedding must be one of {STRATEGY_EMBEDDINGS}, "
                         f"got {name!r}")
    return name


def embed_candidates(policy: Policy, builder: PromptBuilder, generations: Sequence[Generation],
                     checks: Sequence[StrategyCheck], embedding: str = "policy") -> np.ndarray:
    """The FPS embeddings of strategy candidates (docs/method.md §5.2), [n, D] float32.

    ``"policy"``: ``policy.embed`` of each generation's tokens without a final stop id
    (`content_ids`). ``"sentence"``: the frozen sentence encoder
    (`strata_jax.models.sentence_encoder.load_sentence_encoder`, loaded once per process, D =
    384) on each candidate's text z (`StrategyCheck.text`: the block's body, no tags).
    Raises ValueError on another name, ImportError when "sentence" lacks its package."""
    if check_strategy_embedding(embedding) == "sentence":
        from strata_jax.models.sentence_encoder import load_sentence_encoder

        return load_sentence_encoder().encode([c.text for c in checks])
    return policy.embed([content_ids(builder.tokenizer, g) for g in generations])


def strategy_stage(policy: Policy, pool: EnvPool, builder: PromptBuilder,
                   tasks: Sequence[Task], uids: Sequence[int], key: Any, *, num_keep: int,
                   oversample: int, diverse: bool, sampling: SamplingParams,
                   stats: LoopStats, embedding: str = "policy") -> list[StrategyGroup | None]:
    """Strategy candidates, format check, embeddings and selection for every task
    (docs/method.md §5.1-§5.2).

    Args:
      policy / pool / builder: the rollout's `Policy`, `EnvPool` and `PromptBuilder`.
      tasks / uids: the tasks and their task uids.
      key: the iteration's base key; candidate c of task uid u samples with
        ``row_keys(key, (PURPOSE_STRATEGY, u, c))``.
      num_keep: N kept strategies per task. oversample: sigma (sigma*N candidates when
        `diverse`; N candidates, all kept, without FPS otherwise).
      sampling: the strategy sampling params (stop text ``</strategy>``).
      stats: `LoopStats` the one batched policy call is timed into (cohort label -1).
      embedding: what FPS measures distances on (`embed_candidates`): "policy" (the policy's
        mean-pooled hidden states) or "sentence" (the frozen sentence encoder on z).
    Returns:
      one `StrategyGroup` per task, None where the task's first reset crashed twice.
    """
    check_strategy_embedding(embedding)
    firsts = first_observations(pool, tasks)
    n_cand = oversample * num_keep if diverse else num_keep
    live = [i for i, f in enumerate(firsts) if f is not None]
    groups: list[StrategyGroup | None] = [None] * len(tasks)
    if not live:
        return groups
    prompts = {i: builder.strategy_prompt(firsts[i][1], firsts[i][0]) for i in live}
    rows = [(i, c) for i in live for c in range(n_cand)]
    keys = row_keys(key, [(PURPOSE_STRATEGY, uids[i], c) for i, c in rows])
    gens = generate_timed(policy, [prompts[i] for i, _ in rows], keys, sampling, stats, -1)
    gen_list = [gens[r] for r in range(len(rows))]
    texts = [decode_generation(builder.tokenizer, g) for g in gen_list]
    checks = [check_strategy(t, g.finish_reason == FINISH_LENGTH, builder.count_tokens)
              for t, g in zip(texts, gen_list)]
    emb = None
    if diverse:
        emb = embed_candidates(policy, builder, gen_list, checks, embedding)
    seed = [int(x) for x in base_key_data(key)]
    for j, i in enumerate(live):
        sl = slice(j * n_cand, (j + 1) * n_cand)
        task_emb = emb[sl] if emb is not None else np.zeros((n_cand, 1))
        kept = select_strategies(task_emb, [c.format_fail for c in checks[sl]], num_keep,
                                 diverse=diverse, rng=np.random.default_rng(seed + [uids[i]]))
        groups[i] = StrategyGroup(tasks[i], uids[i], prompts[i], texts[sl], checks[sl],
                                  gen_list[sl], kept, firsts[i][0])
    return groups


def strategy_records(groups: Sequence[StrategyGroup], num_episodes: int,
                     played: Collection[tuple[int, int]] | None = None) -> list[dict]:
    """The strategy rows of the batch (see `strata_jax.algos.batch`): one per kept strategy,
    kind=KIND_STRATEGY, strategy_id = its rank, trajectory_id = `num_episodes` (N*M) +
    strategy_id, step_index 0, anchor_id 0, strategy_len = |z|, format_fail = P_fmt.

    valid: True when (task_uid, strategy_id) is in `played`, the strategies with at least one
    valid episode (not crashed, at least one step); a strategy without one has no reward
    (docs/method.md §5.5) and its row stays out of the loss like a crashed episode's rows
    (docs/method.md §1.2). ``played=None``: every row valid.
    """
    recs = []
    for g in groups:
        for sid, c in enumerate(g.kept):
            gen = g.generations[c]
            ok = played is None or (g.task_uid, sid) in played
            recs.append(dict(
                prompt_ids=g.prompt.ids, response_ids=gen.token_ids,
                sampler_logprobs=gen.logprobs, task_id=g.task_uid, strategy_id=sid,
                trajectory_id=num_episodes + sid, step_index=0, kind=KIND_STRATEGY, anchor_id=0,
                score=0.0, step_reward=0.0, valid=ok, strategy_len=g.checks[c].token_len,
                format_fail=g.checks[c].format_fail))
    return recs
