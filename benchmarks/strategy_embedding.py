"""FPS on stored strategies with each embedding of ``rollout.strategy_embedding``: how diverse
are the N kept strategies, and what does one selection cost. Prints a table, writes JSON with
``--out``; asserts nothing.

Usage: python -m benchmarks.strategy_embedding [--sets 200] [--size 16] [--keep 4] [--timed 20]
                                               [--out benchmarks/results/strategy_embedding/results.json]

Candidate sets come from the study trajectories under studies/*/results (each stored episode's
format-valid "strategy", z, and its "strategy_raw" generation; one occurrence per
(file, iteration, task, strategy id), so a text counts as often as it was kept). Per env
(memory_key, scienceworld), two kinds of set:
  sampled:  `--size` draws with replacement, weighted by occurrences (duplicates as a sampler
            at temperature writes them);
  distinct: `--size` distinct texts (at most the env's distinct count).
Selections of `--keep` per set:
  fps_sentence  FPS on the frozen sentence encoder (all-MiniLM-L6-v2 on z; the "sentence" option);
  fps_policy    FPS on a stand-in for the policy states ("policy"): `SamplerPolicy.embed` of the
                raw generation's Qwen tokens through the tiny preset's shape with random weights
                and Qwen's vocabulary (the real 0.5B is too heavy for this box);
  fps_bag       FPS on a 64-bucket bag of the same tokens (`ScriptedPolicy.embed`, lexical);
  random        `--keep` positions without replacement;  first  the first `--keep` (no FPS).
FPS's first point and the random draw share one seeded rng per set. Diversity of the kept:
the mean pairwise cosine distance in the sentence encoder's space (it favours fps_sentence by
construction), the mean pairwise word-set Jaccard distance and the number of distinct z texts
(both embedding-free). The sentence embeddings of
the selections are read from one encoding of every distinct z (the same numbers a set's own
forward gives, to float rounding). Cost: wall ms per candidate set of the real call,
embedding forward + FPS, after a warm-up (compilation apart), median over the first
`--timed` sets.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import subprocess
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_strategies(root: str = ROOT) -> dict[str, list[tuple[str, str]]]:
    """{env: [(z, raw generation), ...]} from studies/*/results/**/*trajectories*.jsonl, one
    entry per (file, iteration, task uid, strategy id) with a format-valid strategy."""
    out: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    seen = set()
    pattern = os.path.join(root, "studies", "*", "results", "**", "*trajectories*.jsonl")
    for path in sorted(glob.glob(pattern, recursive=True)):
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                z, raw = d.get("strategy"), d.get("strategy_raw")
                if not z or not raw or not d.get("strategy_format_ok"):
                    continue
                k = (path, d.get("step"), d.get("task_uid"), d.get("strategy_id"))
                if k not in seen:
                    seen.add(k)
                    out[d.get("env", "?")].append((z, raw))
    return dict(out)


def candidate_sets(pool: list[tuple[str, str]], kind: str, size: int, count: int,
                   seed: int) -> list[list[tuple[str, str]]]:
    """`count` candidate sets of `size` from `pool` ("sampled": with replacement by
    occurrence; "distinct": distinct z texts, size capped at their number)."""
    rng = np.random.default_rng(seed)
    if kind == "sampled":
        return [[pool[i] for i in rng.integers(len(pool), size=size)] for _ in range(count)]
    uniq = list({z: (z, raw) for z, raw in pool}.values())
    n = min(size, len(uniq))
    return [[uniq[i] for i in rng.choice(len(uniq), n, replace=False)] for _ in range(count)]


def mean_pairwise_cosine_distance(e: np.ndarray) -> float:
    """Mean of 1 - cos over the distinct pairs of the rows of `e` [k, D]."""
    u = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
    s = u @ u.T
    k = len(e)
    return float(np.mean(1.0 - s[np.triu_indices(k, 1)])) if k > 1 else 0.0


def mean_pairwise_word_jaccard(texts: list[str]) -> float:
    """Mean of 1 - |A & B| / |A | B| over the distinct pairs of the texts' lower-cased word
    sets (a lexical diversity no embedding enters; two empty texts count as distance 0)."""
    words = [set(t.lower().split()) for t in texts]
    d = [1.0 - len(a & b) / len(a | b) if a | b else 0.0
         for i, a in enumerate(words) for b in words[i + 1:]]
    return float(np.mean(d)) if d else 0.0


def _sem(x: list[float]) -> float:
    """Standard error of the mean (ddof 1; 0 for fewer than two values)."""
    return float(np.std(x, ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", type=int, default=200, help="candidate sets per env and kind")
    ap.add_argument("--size", type=int, default=16, help="candidates per set (sigma * N)")
    ap.add_argument("--keep", type=int, default=4, help="N kept per set")
    ap.add_argument("--timed", type=int, default=20, help="sets whose selection is timed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="JSON file for the results")
    a = ap.parse_args()

    import jax

    from strata_jax.models import PRESETS, init_params, load_tokenizer
    from strata_jax.models.sentence_encoder import load_sentence_encoder
    from strata_jax.rollout import (SamplerPolicy, ScriptedPolicy, farthest_point_selection)
    from strata_jax.sampling import Sampler

    up_start = _uptime()
    pools = load_strategies()
    t = time.perf_counter()
    enc = load_sentence_encoder()
    load_s = time.perf_counter() - t
    tok = load_tokenizer()
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=len(tok))
    policy = SamplerPolicy(Sampler(cfg, max_cache_len=1024), init_params(cfg, jax.random.key(0)))
    bag = ScriptedPolicy(tok, lambda p, k: "")
    ids = lambda cs: [tok.encode(raw, add_special_tokens=False) for _, raw in cs]  # noqa: E731
    embedders = {
        "fps_sentence": lambda cs: enc.encode([z for z, _ in cs]),
        "fps_policy": lambda cs: policy.embed(ids(cs)),
        "fps_bag": lambda cs: bag.embed(ids(cs)),
    }
    results: dict = dict(command="python -m benchmarks.strategy_embedding " + " ".join(
        f"--{k} {v}" for k, v in vars(a).items() if v != ""), uptime_start=up_start,
        encoder_load_s=load_s, jax_backend=jax.default_backend(), envs={})
    t = time.perf_counter()
    enc.encode(["warm-up"])
    results["encoder_first_call_s"] = time.perf_counter() - t

    print(f"{'env':<13}{'kind':<9}{'method':<14}{'cos dist (s.e.)':>20}{'jaccard (s.e.)':>20}"
          f"{'distinct (s.e.)':>16}{'ms/set':>9}")
    for env, pool in sorted(pools.items()):
        zs_all = sorted({z for z, _ in pool})
        cache = dict(zip(zs_all, enc.encode(zs_all)))
        select_emb = dict(embedders, fps_sentence=lambda cs: np.stack([cache[z] for z, _ in cs]))
        results["envs"][env] = dict(strategies=len(pool), distinct=len(cache), kinds={})
        for kind in ("sampled", "distinct"):
            sets = candidate_sets(pool, kind, a.size, a.sets, a.seed)
            rows = {}
            for m in list(embedders) + ["random", "first"]:
                dist, jac, nd, ms = [], [], [], []
                if m in embedders:
                    for cs in sets[:a.timed]:
                        embedders[m](cs)    # warm-up: these sets' programs compiled
                    for s, cs in enumerate(sets[:a.timed]):
                        t = time.perf_counter()
                        farthest_point_selection(embedders[m](cs), a.keep,
                                                 rng=np.random.default_rng([a.seed, s]))
                        ms.append(1e3 * (time.perf_counter() - t))
                for s, cs in enumerate(sets):
                    rng = np.random.default_rng([a.seed, s])
                    if m in embedders:
                        kept = farthest_point_selection(select_emb[m](cs), a.keep, rng=rng)
                    elif m == "random":
                        kept = [int(i) for i in rng.choice(len(cs), a.keep, replace=False)]
                    else:
                        kept = list(range(a.keep))
                    zs = [cs[i][0] for i in kept]
                    dist.append(mean_pairwise_cosine_distance(np.stack([cache[z] for z in zs])))
                    nd.append(len(set(zs)))
                    jac.append(mean_pairwise_word_jaccard(zs))
                rows[m] = dict(mean_cos_dist=float(np.mean(dist)), cos_dist_sem=_sem(dist),
                               word_jaccard=float(np.mean(jac)), word_jaccard_sem=_sem(jac),
                               distinct=float(np.mean(nd)), distinct_sem=_sem(nd),
                               ms_per_set=float(np.median(ms)) if ms else None,
                               set_size=len(sets[0]))
                cost = f"{rows[m]['ms_per_set']:.2f}" if ms else "-"
                print(f"{env:<13}{kind:<9}{m:<14}{rows[m]['mean_cos_dist']:>8.4f} +- "
                      f"{rows[m]['cos_dist_sem']:.4f}{rows[m]['word_jaccard']:>8.4f} +- "
                      f"{rows[m]['word_jaccard_sem']:.4f}{rows[m]['distinct']:>6.2f} +- "
                      f"{rows[m]['distinct_sem']:.2f}{cost:>9}")
            results["envs"][env]["kinds"][kind] = rows
    results["uptime_end"] = _uptime()
    print(f"encoder load {load_s:.2f} s, first call {results['encoder_first_call_s']:.2f} s")
    print(f"uptime at start: {up_start}\nuptime at end:   {results['uptime_end']}")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
