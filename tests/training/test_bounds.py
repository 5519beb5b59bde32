"""`ShapeBounds.from_config` (strata_jax/training/bounds.py) on the built-in tiny configs, by
hand: the batch rows (with the rows a replay draw appends), the mini-batch rows and widths."""
from configs import builtin
from strata_jax.training.bounds import ShapeBounds, replay_rows


def test_bounds_of_the_tiny_strata_and_grpo_configs():
    # tiny: 4 tasks, N = 2 strategies x M = 4 episodes (grpo: group 8), 8 env steps,
    # row_multiple 8, mini-batch 64 rows, micro-batch 16, actions 32 / strategies 48 tokens
    s = ShapeBounds.from_config(builtin.get_config("tiny"))
    assert s == ShapeBounds(prompt=512, response=48, rows=4 * (8 * 8 + 2),
                            mini_batch_rows=80)   # 64 + 4 x 2 strategy rows -> 5 x 16
    g = ShapeBounds.from_config(builtin.get_config("tiny,grpo"))
    assert g == ShapeBounds(prompt=512, response=32, rows=256, mini_batch_rows=64)


def test_a_replay_draw_raises_the_row_bound_by_what_it_can_append():
    c = builtin.get_config("tiny,grpo")
    assert replay_rows(c, 256) == 0   # off
    c.replay.enabled = True
    # fraction 0.25 of the rows trained: floor(0.25 x 256 / 0.75) = 85 more, 341 -> x 8 = 344
    assert replay_rows(c, 256) == 85
    assert ShapeBounds.from_config(c).rows == 344
    c.replay.capacity = 40   # the pool never holds more than its capacity
    assert replay_rows(c, 256) == 40 and ShapeBounds.from_config(c).rows == 296


def test_sampler_rungs_of_the_tiny_configs_and_of_a_cohort_split():
    from strata_jax.training.bounds import sampler_floors
    c = builtin.get_config("tiny")
    assert sampler_floors(c) == {}            # off: the sampler's own floors
    c.rollout.sampler_fixed_shapes = True
    # strategies 4 tasks x 2 x oversample 2 = 16; one cohort (memory_key steps instantly)
    # holds at most num_workers = 8 of the 32 episodes; the judge sees all 32; budget 512,
    # the rows' ladder from 512 / 8 = 64
    assert sampler_floors(c) == dict(batch_rungs=(8, 16, 32), length_floor=512, rows_floor=64,
                                     warm_ladder=True)
    c.rollout.cohorts, c.env.num_workers, c.env.max_prompt_tokens = 2, 40, 600
    assert sampler_floors(c) == dict(batch_rungs=(16, 32), length_floor=1024,  # 20 -> 32
                                     rows_floor=128, warm_ladder=True)
    c.env.max_prompt_tokens = 100                                   # 128 / 8 -> the floor 16
    assert sampler_floors(c)["rows_floor"] == 16
    g = builtin.get_config("tiny,grpo")
    g.rollout.sampler_fixed_shapes = True
    assert sampler_floors(g) == dict(batch_rungs=(8, 32), length_floor=512, rows_floor=64,
                                     warm_ladder=True)


def test_embed_floors_follow_the_strategy_candidates_and_budget():
    from strata_jax.training.bounds import embed_floors
    c = builtin.get_config("tiny")
    assert embed_floors(c) == (1, 16)
    c.rollout.sampler_fixed_shapes = True
    assert embed_floors(c) == (16, 64)     # 4 x 2 x 2 candidates; 48 strategy tokens
