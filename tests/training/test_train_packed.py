"""The prefix-tree packed update (the update's one path) against the per-row reference
(`Trainer(per_row=True)`): same scores, same optimizer steps, fewer computed tokens."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.algos import KIND_ACTION, KIND_STRATEGY
from strata_jax.models import init_params
from strata_jax.training import Trainer, tree_to_numpy
from strata_jax.training.batching import num_minibatches, trim_padding
from tests.fixtures.trainer import TINY, make_batch, train_config


def shared_records(seed=0, n_tasks=2, per_task=5, strategies=2):
    """Step rows whose prompts share an instruction block, then their task's goal, then (for
    half of them) a strategy text, then their own step; strategy rows share the instruction
    block and their task's goal. Random responses of 1-12 tokens."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(1, TINY.vocab_size, n)  # noqa: E731
    inst = tok(12)
    recs = []
    for t in range(n_tasks):
        goal, strat = tok(int(rng.integers(3, 8))), tok(6)
        for j in range(per_task):
            prompt = [inst, goal] + ([strat] if j % 2 else []) + [tok(int(rng.integers(1, 9)))]
            recs.append(dict(prompt_ids=np.concatenate(prompt),
                             response_ids=tok(int(rng.integers(1, 13))), task_id=t,
                             trajectory_id=j, kind=KIND_ACTION, score=float((j + t) % 2),
                             step_reward=float((j + t) % 2)))
    for s in range(strategies):
        recs.append(dict(prompt_ids=np.concatenate([inst, tok(2)]), response_ids=tok(3),
                         task_id=0, trajectory_id=100 + s, strategy_id=s, kind=KIND_STRATEGY))
    return recs


@pytest.fixture(scope="module")
def params():
    return init_params(TINY, jax.random.PRNGKey(0))


def _moved(trainer, params, key):
    """A fresh state whose policy (adapters) moved off the reference: KL, ratios and clipping
    are live."""
    state = trainer.init_state(params, jax.random.PRNGKey(1))
    return state.replace(params=jax.tree.map(
        lambda x: x + 0.05 * jax.random.normal(key, x.shape), state.params))


@pytest.mark.parametrize("algo", ["ppo", "stapo"])
def test_packed_scoring_equals_per_row_scoring(params, algo):
    batch = make_batch(shared_records(seed=1))
    cfg = train_config(algo, dropout=0.0, score_rows=4)
    packed = Trainer(TINY, cfg)
    rows = Trainer(TINY, cfg, per_row=True)
    state = _moved(rows, params, jax.random.PRNGKey(2))
    a = packed.score(state, batch, params, jax.random.PRNGKey(0))
    b = rows.score(state, batch, params, jax.random.PRNGKey(0))
    valid = np.asarray(b.valid)
    assert valid.sum() == 12 and np.abs(np.asarray(b.ref_logprobs)[valid]).sum() > 0
    assert np.abs(np.asarray(b.values)[valid]).sum() > 0
    # fp32, same operations in another summation order: a few ulps of logprobs ~ log V
    for f in ("old_logprobs", "ref_logprobs", "values", "value_std"):
        np.testing.assert_allclose(np.asarray(getattr(a, f))[valid],
                                   np.asarray(getattr(b, f))[valid], rtol=1e-5, atol=1e-5,
                                   err_msg=f)
    np.testing.assert_array_equal(np.asarray(a.values)[~valid], 0.0)
    # with dropout the value-std passes run per packed chunk (their masks are its own draws):
    # a spread on every valid row, none on the padding rows
    drop = Trainer(TINY, dataclasses.replace(cfg, dropout=0.1))
    std = np.asarray(drop.score(state, batch, params, jax.random.PRNGKey(0)).value_std)
    assert (std[valid] > 0).all() and (std[~valid] == 0).all()


@pytest.mark.parametrize("algo,epochs,lora,mini,width", [
    ("grpo", 1, False, 4, 0), ("stapo", 2, False, 4, 0), ("ppo", 2, True, 4, 0),
    ("grpo", 1, False, 64, 0), ("stapo", 2, False, 4, 64)])
def test_packed_update_equals_per_row_update(params, algo, epochs, lora, mini, width):
    """One iteration's update (scoring, several mini-batches of the same composition, epochs;
    mini 64: one exactly on-policy step without the old-logprob pass) with the packed path
    gives the per-row path's params and metrics; it computes fewer tokens; a second update of
    the same shapes compiles nothing. width 64: packed rows of 64 slots, several per
    micro-batch (the budget of 4 rows of 48 columns holds 3, rounded down to P = 2); auto:
    one packed row of 128 slots (192 rounded down to a power of two)."""
    from strata_jax.models.lora import LoraConfig
    from tests.fixtures.sampler import compile_counter
    counter = compile_counter()
    batch = make_batch(shared_records(seed=3))
    extra = dict(lora=LoraConfig(rank=4, alpha=8.0)) if lora else {}
    # adam_eps 1e-6 (torch's 1e-8 elsewhere): see the params comparison below
    cfg = train_config(algo, ppo_epochs=epochs, dropout=0.0, mini_batch_size=mini,
                       micro_batch_rows=4, adam_eps=1e-6, **extra)
    packed = Trainer(TINY, dataclasses.replace(cfg, pack_width=width))
    rows = Trainer(TINY, cfg, per_row=True)
    state = _moved(rows, params, jax.random.PRNGKey(4))
    a, ma = packed.update(jax.tree.map(jnp.copy, state), batch, params)
    b, mb = rows.update(jax.tree.map(jnp.copy, state), batch, params)
    trimmed = trim_padding(batch)
    shape = packed.pack_shape(4, trimmed.prompt_ids.shape[1], trimmed.response_ids.shape[1])
    assert shape == ((64, 2, 1) if width else (128, 1, 1))   # rows of 40 + 8 columns
    assert ma["optimizer_steps"] == mb["optimizer_steps"] == (3 if mini == 4 else 1) * epochs
    assert packed.on_policy(batch) == (mini == 64)
    # AdamW's first step is ~lr * g / (|g| + eps) per weight: ~lr * sign(g) where |g| >> eps,
    # the tolerance of test_train's grouped vs scan comparison (1% of a 1e-3 step), the
    # gradients compared through grad_norm below. Where |g| is round-off (k_bias, whose exact
    # gradient is 0: softmax is invariant to the per-query constant q . b_k; an lm_head row of
    # a token no response holds, whose group-centred advantages cancel to ~1e-9), torch's eps
    # 1e-8 turns each path's own round-off into steps of up to ~lr; with eps 1e-6 such a step
    # is ~lr * |g| / eps, far below the tolerance, while the leaves the loss really moves keep
    # their ~lr steps. (test_prefix_tree.py compares every gradient leaf directly.)
    flat_a = jax.tree_util.tree_flatten_with_path(tree_to_numpy(a))[0]
    for (path, x), y in zip(flat_a, jax.tree.leaves(tree_to_numpy(b))):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))
    assert ma.keys() == mb.keys()
    for k in ma:
        if k != "perf/update_token_fill":
            np.testing.assert_allclose(ma[k], mb[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert mb["train/grad_norm"] > 0 and mb["train/kl"] > 0
    assert ma["perf/update_token_fill"] > mb["perf/update_token_fill"]
    before = counter.count
    packed.update(jax.tree.map(jnp.copy, state), batch, params)
    assert counter.count == before


def test_packed_update_block_sparse_equals_per_row_update(params, monkeypatch):
    """The update with the block-sparse attention actually gathering keys: the trainer's packed
    micro-batches built for query blocks of 8 (the forward then runs query_chunk 8, the block
    each index carries), so blocks past the ancestor chain score only their visible keys; the
    params and metrics equal the per-row update's (the tolerances above)."""
    import functools

    import strata_jax.training.trainer as trainer_mod
    from strata_jax.training.prefix_tree import packed_micro_batches
    made = []

    def small_blocks(*a, **kw):
        out = packed_micro_batches(*a, block=8, **kw)
        made.extend(out)
        return out
    monkeypatch.setattr(trainer_mod, "packed_micro_batches", functools.wraps(
        packed_micro_batches)(small_blocks))
    batch = make_batch(shared_records(seed=3))
    cfg = train_config("grpo", dropout=0.0, mini_batch_size=4, micro_batch_rows=4,
                       adam_eps=1e-6)
    packed = Trainer(TINY, cfg)
    rows = Trainer(TINY, cfg, per_row=True)
    state = _moved(rows, params, jax.random.PRNGKey(4))
    a, ma = packed.update(jax.tree.map(jnp.copy, state), batch, params)
    b, mb = rows.update(jax.tree.map(jnp.copy, state), batch, params)
    # some block of some micro-batch has fewer indexed keys than its causal slice: gathered
    assert made and all(mb_.block == 8 for mb_ in made)
    assert any(mb_.key_index.shape[2] < i for mb_ in made for i in range(0, mb_.width, 8))
    flat_a = jax.tree_util.tree_flatten_with_path(tree_to_numpy(a))[0]
    for (path, x), y in zip(flat_a, jax.tree.leaves(tree_to_numpy(b))):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    for k in ma:
        if k != "perf/update_token_fill":
            np.testing.assert_allclose(ma[k], mb[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert mb["train/grad_norm"] > 0


def test_packed_update_on_a_mesh_equals_single_device(params):
    """The packed update on 8 fake devices (data 2 x fsdp 2 x tensor 2; a micro-batch's packed
    rows shard over data x fsdp) gives the single-device packed update."""
    from strata_jax.sharding import make_mesh
    batch = make_batch(shared_records(seed=5))
    cfg = train_config("grpo", dropout=0.0)
    single_trainer = Trainer(TINY, cfg)
    state = single_trainer.init_state(params, jax.random.PRNGKey(1))
    single, m1 = single_trainer.update(state, batch, ref_params=params)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded_trainer = Trainer(TINY, cfg, mesh=mesh)
    s_state = sharded_trainer.init_state(params, jax.random.PRNGKey(1))
    sharded, m8 = sharded_trainer.update(s_state, batch, ref_params=params)
    assert len(sharded.params["layers"][0]["q_proj"].sharding.device_set) == 8
    for a, b in zip(jax.tree.leaves(tree_to_numpy(sharded.params)),
                    jax.tree.leaves(tree_to_numpy(single.params))):
        np.testing.assert_allclose(a, b, atol=2e-5)
    np.testing.assert_allclose(m8["train/loss"], m1["train/loss"], rtol=1e-4, atol=1e-6)
    # the mesh packs narrower rows, P a multiple of its 4 batch shards (data x fsdp) so they
    # shard over the data axes: more ancestor copies and all-padding rows, so a lower fill
    trimmed = trim_padding(batch)
    tp, tr = trimmed.prompt_ids.shape[1], trimmed.response_ids.shape[1]
    w1, p1, _ = single_trainer.pack_shape(cfg.micro_batch_rows, tp, tr)
    w8, p8, shards = sharded_trainer.pack_shape(cfg.micro_batch_rows, tp, tr)
    # (budget 4 x 48: one row of 128 alone; on the mesh 48 per shard -> the row's 64, P 2 -> 4)
    assert (tp + tr, shards) == (48, 4)
    assert (w1, p1) == (128, 1) and (w8, p8) == (64, 4)
    assert 0 < m8["perf/update_token_fill"] < m1["perf/update_token_fill"]
    assert m1["perf/update_token_fill"] > 1.0


def test_update_padded_up_to_earlier_marks_equals_a_fresh_trainers(params):
    """A trainer whose shape marks were raised by a bigger batch pads the next, smaller
    batch's micro-batches up to them (more rows, response columns and key slots, all padding):
    its update equals a fresh trainer's on the same state and batch (and the per-row path's),
    and its micro-batches were indeed wider."""
    cfg = train_config("stapo", ppo_epochs=2, dropout=0.0, mini_batch_size=4,
                       micro_batch_rows=4, adam_eps=1e-6)
    cfg = dataclasses.replace(cfg, pack_width=64)
    raised, fresh, rows = Trainer(TINY, cfg), Trainer(TINY, cfg), Trainer(TINY, cfg, per_row=True)
    state = _moved(rows, params, jax.random.PRNGKey(4))
    big = make_batch(shared_records(seed=8, n_tasks=3, per_task=6))
    raised.update(jax.tree.map(jnp.copy, state), big, params)
    before = dict(raised.shape_marks)
    small = make_batch(shared_records(seed=3, n_tasks=2, per_task=3, strategies=1))
    a, ma = raised.update(jax.tree.map(jnp.copy, state), small, params)
    b, mb = fresh.update(jax.tree.map(jnp.copy, state), small, params)
    c, mc = rows.update(jax.tree.map(jnp.copy, state), small, params)
    # marks only grow, and the raised trainer padded some shape the small batch alone (fresh)
    # did not need
    after = raised.shape_marks
    assert all(all(x >= y for x, y in zip(after[k], v)) for k, v in before.items())
    assert any(any(x > y for x, y in zip(after[k], v)) for k, v in fresh.shape_marks.items())
    # against the per-row path: the tolerances (and AdamW eps) of
    # test_packed_update_equals_per_row_update
    flat = jax.tree_util.tree_flatten_with_path(tree_to_numpy(a))[0]
    for (path, x), y, z in zip(flat, *(jax.tree.leaves(tree_to_numpy(t)) for t in (b, c))):
        atol = 1e-5
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=atol, err_msg=jax.tree_util.keystr(path))
        np.testing.assert_allclose(x, z, rtol=1e-5, atol=atol, err_msg=jax.tree_util.keystr(path))
    # a clip fraction counts targets past a threshold: a target on the clip edge may fall on
    # either side of it under the two layouts' summation orders, so these two metrics may differ
    # by one flipped target in one optimizer step (1 / (steps x the fewest step samples in a
    # mini-batch; minibatch_plan splits them evenly; a flipped token moves the token-mean
    # policy fractions less, each step sample having a response token)); every other metric is
    # continuous
    n_step = int(np.sum(np.asarray(small.valid) & (np.asarray(small.kind) == KIND_ACTION)))
    n_mb = num_minibatches(np.asarray(small.valid), np.asarray(small.kind), cfg.mini_batch_size)
    one_flip = 1.0 / (cfg.ppo_epochs * n_mb * (n_step // n_mb))
    assert ma["optimizer_steps"] == mb["optimizer_steps"] == cfg.ppo_epochs * n_mb
    edge = {"train/clip_frac", "train/dual_clip_frac", "train/vf_clip_frac"}
    assert edge & set(ma)
    for k in ma:
        if k in edge:
            assert abs(ma[k] - mb[k]) <= one_flip + 1e-6, (k, ma[k], mb[k], one_flip)
        elif k != "perf/update_token_fill":
            np.testing.assert_allclose(ma[k], mb[k], rtol=1e-4, atol=1e-6, err_msg=k)
    # the forward runs over the same [P, w] packed rows: padding m, wr and A adds no slots
    assert ma["perf/update_token_fill"] == mb["perf/update_token_fill"]
    # the marks survive a checkpoint's JSON
    again = Trainer(TINY, cfg)
    again.set_host_state(json.loads(json.dumps(raised.host_state())))
    assert again.shape_marks == raised.shape_marks
    with pytest.raises(ValueError, match=r"\[pass, P, W, m, wr, A, N\]"):
        again.set_host_state({"shape_marks": [["train", 1, 64]]})
    # a checkpoint written before the response-slot mark: N starts at 0
    again.set_host_state({"shape_marks": [["train", 2, 64, 8, 16, 0]]})
    assert again.shape_marks == {("train", 2, 64): (8, 16, 0, 0)}


def test_packed_compilations_plateau_as_batches_drift(params, monkeypatch):
    """Drifting iterations (2-3 tasks of 4-6 rows, new prompts and responses each time, so the
    row count and the prompt and response widths change) through the packed update with a
    fixed pack_width: the static shapes of its micro-batches, (P, w, m, wr, A), take few values
    (w one of the fixed width's two micro widths; P and m powers of two; A 0, one query
    block per packed row), and the
    gradient step and the scoring pass compile only in iterations that meet a shape not met
    before; with the trainer's shape marks a (pass, P, w) only grows its (m, wr, A, N)."""
    import functools

    import logging

    import strata_jax.training.trainer as trainer_mod
    from benchmarks.compilations import ProgramNames
    from strata_jax.training.prefix_tree import packed_micro_batches
    made = []

    def recorded(*a, **kw):
        out = packed_micro_batches(*a, **kw)
        made.extend((kw["mark_key"], mb) for mb in out)
        return out
    monkeypatch.setattr(trainer_mod, "packed_micro_batches", functools.wraps(
        packed_micro_batches)(recorded))
    # a config of this test only (lr): the programs it compiles are its own
    cfg = train_config("grpo", dropout=0.0, mini_batch_size=64, micro_batch_rows=4, lr=3e-4)
    trainer = Trainer(TINY, dataclasses.replace(cfg, pack_width=64))
    state = trainer.init_state(params, jax.random.PRNGKey(1))
    # XLA compilations of the two programs that run the model (jax's "Compiling <name>" log)
    names = ProgramNames()
    lg = logging.getLogger("jax")
    lg.addHandler(names)
    monkeypatch.setattr(lg, "level", logging.WARNING)
    monkeypatch.setattr(lg, "propagate", False)
    jax.config.update("jax_log_compiles", True)

    def programs():
        return names.names["jit(_micro_step)"] + names.names["jit(_score_rows)"]

    seen, grown, quiet, order = set(), [], 0, {}
    drift = [(2, 5), (3, 4), (2, 6), (3, 5), (2, 4), (3, 6), (2, 5), (3, 4), (2, 6), (3, 5)]
    try:
        for i, (n_tasks, per_task) in enumerate(drift):
            made.clear()
            batch = make_batch(shared_records(seed=40 + i, n_tasks=n_tasks, per_task=per_task))
            before = programs()
            state, _ = trainer.update(state, batch, params)
            keys = {(mb.tokens.shape[0], mb.width, mb.idx.size, mb.response_width,
                     mb.key_index.shape[2], mb.response_slot.size) for _, mb in made}
            for pass_, mb in made:   # the shape marks: per (pass, P, w) shapes only grow
                shape = (mb.idx.size, mb.response_width, mb.key_index.shape[2],
                         mb.response_slot.size)
                last = order.setdefault((pass_, mb.tokens.shape[0], mb.width), [shape])[-1]
                assert all(x >= y for x, y in zip(shape, last)), (pass_, shape, last)
                order[(pass_, mb.tokens.shape[0], mb.width)].append(shape)
            new = keys - seen
            seen |= keys
            grown.append(programs() - before)
            if not new:
                assert grown[-1] == 0, (i, keys)
                quiet += 1
    finally:
        jax.config.update("jax_log_compiles", False)
        lg.removeHandler(names)
    print("shapes:", sorted(seen), "new programs per iteration:", grown)
    # few distinct shapes per (pass, P, w): the marks (the rest is new P values, each the
    # power of two of a last, partly filled micro-batch)
    assert all(len(set(v)) <= 3 for v in order.values()), order
    assert all(w in (48, 64) and a == 0 for _, w, _, _, a, _ in seen)
    assert all(p & (p - 1) == 0 and m & (m - 1) == 0 for p, _, m, _, _, _ in seen)
    # each shape compiles each program at most once (a fresh and a running accumulator share
    # one program: `steps.zero_carry` commits its scalars), and half the iterations compile
    # nothing though every one has other rows, widths and prompts
    assert sum(grown) <= 2 * len(seen)
    assert quiet >= 5


def test_bounded_update_equals_the_unbounded_one_at_one_shape_per_pass(params, monkeypatch):
    """A trainer with `ShapeBounds` pads every batch to the bounds' rows and widths and every
    packed micro-batch of a pass to one (P, w, m, wr, A, N): over drifting batches (other row
    counts, prompts, responses) its micro-batches keep that one shape from the first update
    on, its gradient step compiles in the first update only, and each update equals an
    unbounded trainer's (the marks path) on the same state and batch."""
    import functools
    import logging

    import strata_jax.training.trainer as trainer_mod
    from benchmarks.compilations import ProgramNames
    from strata_jax.training.bounds import ShapeBounds
    from strata_jax.training.prefix_tree import packed_micro_batches
    made = []

    def recorded(*a, **kw):
        out = packed_micro_batches(*a, **kw)
        made.extend((kw["mark_key"], mb) for mb in out)
        return out
    monkeypatch.setattr(trainer_mod, "packed_micro_batches", functools.wraps(
        packed_micro_batches)(recorded))
    # a config of this test only (lr): the programs it compiles are its own
    cfg = train_config("ppo", dropout=0.0, mini_batch_size=8, micro_batch_rows=4, lr=2e-4,
                       adam_eps=1e-6)
    cfg = dataclasses.replace(cfg, pack_width=64)
    bounds = ShapeBounds(prompt=40, response=12, rows=48, mini_batch_rows=16)
    fixed, free = Trainer(TINY, cfg, bounds=bounds), Trainer(TINY, cfg)
    state = _moved(free, params, jax.random.PRNGKey(4))
    names = ProgramNames()
    lg = logging.getLogger("jax")
    lg.addHandler(names)
    monkeypatch.setattr(lg, "level", logging.WARNING)
    monkeypatch.setattr(lg, "propagate", False)
    shapes, grown = set(), []
    jax.config.update("jax_log_compiles", True)
    try:
        # the last batch fits one mini-batch: an exactly on-policy update (no old-logprob
        # pass, `Trainer.on_policy`), which runs the same programs as the others
        for i, (n_tasks, per_task) in enumerate([(3, 6), (2, 5), (3, 5), (1, 3)]):
            batch = make_batch(shared_records(seed=60 + i, n_tasks=n_tasks, per_task=per_task))
            assert fixed.on_policy(batch) == (i == 3), i
            made.clear()
            before = names.names["jit(_micro_step)"] + names.names["jit(_score_rows)"]
            a, ma = fixed.update(jax.tree.map(jnp.copy, state), batch, params)
            grown.append(names.names["jit(_micro_step)"] + names.names["jit(_score_rows)"]
                         - before)
            shapes |= {(p, mb.tokens.shape, mb.idx.size, mb.response_width,
                        mb.key_index.shape[2], mb.response_slot.shape) for p, mb in made}
            b, mb_ = free.update(jax.tree.map(jnp.copy, state), batch, params)
            flat = jax.tree_util.tree_flatten_with_path(tree_to_numpy(a))[0]
            for (path, x), y in zip(flat, jax.tree.leaves(tree_to_numpy(b))):
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5,
                                           err_msg=jax.tree_util.keystr(path))
            for k in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm",
                      "optimizer_steps", "mismatch/sampler_abs"):
                np.testing.assert_allclose(ma[k], mb_[k], rtol=1e-4, atol=1e-6, err_msg=k)
    finally:
        jax.config.update("jax_log_compiles", False)
        lg.removeHandler(names)
    # one shape per pass: ppo scores (old logprobs, the critic) and trains. P x w = the budget
    # of 4 rows (micro_batch_rows) of the bounds' 48 + 16 columns at pack width 64, m = the
    # bounds' rows as a power of two (score: the batch's 48, train: a mini-batch's 16), wr =
    # response_columns(12) = 16, A = 0 (a 64-wide row is one query block), N = m x wr
    assert sorted(shapes) == [
        ("score", (4, 64), 64, 16, 0, (1, 64 * 16)),
        ("train", (4, 64), 16, 16, 0, (1, 16 * 16))], sorted(shapes)
    assert grown[0] > 0 and grown[1:] == [0, 0, 0], grown
