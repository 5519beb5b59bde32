"""SampleBatch contract: padding, sentinels, pytree registration."""
import jax
import numpy as np
import pytest

from strata_jax.algos.batch import PAD_ROW_ID, SampleBatch, make_sample_batch
from strata_jax.buckets import bucket_size


def _rec(**kw):
    base = dict(prompt_ids=[5, 6, 7], response_ids=[1, 2], task_id=3, trajectory_id=0, kind=0)
    base.update(kw)
    return base


def test_padding_rows_get_sentinels_and_prompt_is_left_padded():
    b = make_sample_batch([_rec(score=0.5), _rec(prompt_ids=[9], response_ids=[4, 5, 6, 7, 8],
                                                 response_mask=[1, 1, 1, 0, 0], trajectory_id=1)],
                          row_multiple=8)
    assert b.prompt_ids.shape == (8, 8) and b.response_ids.shape == (8, 8)
    np.testing.assert_array_equal(b.prompt_ids[0], [0, 0, 0, 0, 0, 5, 6, 7])
    np.testing.assert_array_equal(b.prompt_mask[1], [0] * 7 + [1])
    np.testing.assert_array_equal(b.response_mask[1], [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.valid, [1, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.task_id[2:], [PAD_ROW_ID] * 6)
    np.testing.assert_array_equal(b.kind[2:], [PAD_ROW_ID] * 6)
    assert b.score.dtype == np.float32 and b.task_id.dtype == np.int32
    assert b.score[0] == np.float32(0.5)


def test_bucketed_sizes_are_static():
    b = make_sample_batch([_rec()] * 3, row_buckets=[4, 16], response_buckets=[32, 64])
    assert b.num_rows == 4 and b.response_len == 32
    with pytest.raises(ValueError, match="larger bucket"):
        bucket_size(17, [4, 16])


def test_default_buckets_are_two_per_octave():
    # pitfall: rounding to a multiple of 8 recompiled the update whenever prompt lengths drifted
    assert [bucket_size(n, None, 8) for n in (1, 8, 9, 13, 36, 40, 49, 640, 688, 848)] == \
        [8, 8, 16, 16, 48, 48, 64, 768, 768, 1024]
    assert bucket_size(3, None) == 3 and bucket_size(5, None) == 6 and bucket_size(12, None, 24) == 24


def test_is_a_pytree_that_jits():
    b = make_sample_batch([_rec(score=1.0)])
    leaves = jax.tree_util.tree_leaves(b)
    assert len(leaves) == len(SampleBatch.__dataclass_fields__)
    out = jax.jit(lambda x: x.replace(values=x.score * 2))(b)
    assert float(out.values[0]) == 2.0


def test_missing_key_and_mismatched_mask_raise():
    with pytest.raises(ValueError, match="required"):
        make_sample_batch([dict(prompt_ids=[1], response_ids=[1])])
    with pytest.raises(ValueError, match="response_mask"):
        make_sample_batch([_rec(response_mask=[1])])


def test_pad_batch_left_pads_prompts_right_pads_responses():
    from strata_jax.algos import ID_FIELDS, PAD_ROW_ID, pad_batch
    b = make_sample_batch([dict(prompt_ids=[5, 6], response_ids=[7], task_id=3, trajectory_id=1,
                                kind=1)], row_multiple=1)
    p = pad_batch(b, 3, b.prompt_ids.shape[1] + 2, b.response_ids.shape[1] + 1)
    assert p.prompt_ids.shape == (3, 10) and list(p.prompt_ids[0, -2:]) == [5, 6]
    assert list(p.prompt_mask[0, :2]) == [False, False] and p.prompt_mask[0].sum() == 2
    assert p.response_ids.shape == (3, 9) and p.old_logprobs.shape == (3, 9)
    assert p.response_ids[0, 0] == 7 and not p.response_mask[0, 1:].any()
    assert list(p.task_id) == [3, PAD_ROW_ID, PAD_ROW_ID]
    assert list(p.valid) == [True, False, False]
    for f in ID_FIELDS:   # every id field of a padding row is PAD_ROW_ID, every other field 0
        assert list(getattr(p, f)[1:]) == [PAD_ROW_ID, PAD_ROW_ID], f
    assert float(p.score[1:].sum()) == 0.0 and not p.prompt_mask[1:].any()
    with pytest.raises(ValueError, match="cannot shrink"):
        pad_batch(b, 0)


def test_saved_batch_loads_back_field_for_field_with_its_meta(tmp_path):
    from strata_jax.algos.batch import load_sample_batch, save_sample_batch
    b = make_sample_batch([_rec(score=0.25, step_reward=0.5),
                           _rec(prompt_ids=[9], response_ids=[4, 5, 6], trajectory_id=1, kind=1,
                                strategy_len=3)], row_multiple=4)
    b = b.replace(old_logprobs=np.full(b.response_ids.shape, -0.5, np.float32))
    path = str(tmp_path / "iter_0000.npz")
    save_sample_batch(jax.device_put(b), path, iteration=0, algo="strata")
    got, meta = load_sample_batch(path)
    assert meta == {"iteration": 0, "algo": "strata", "version": 1}
    for f in b.__dataclass_fields__:
        want = np.asarray(getattr(b, f))
        np.testing.assert_array_equal(getattr(got, f), want, err_msg=f)
        assert getattr(got, f).dtype == want.dtype, f
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000.npz"]   # no temp file left


def test_loading_a_file_that_is_not_a_batch_says_to_dump_it_again(tmp_path):
    from strata_jax.algos.batch import load_sample_batch
    path = str(tmp_path / "other.npz")
    np.savez(path, prompt_ids=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="log.dump_batches"):
        load_sample_batch(path)
