"""Sampler on a tiny random transformers checkpoint: greedy parity with `generate`, logprob
parity with a full forward, keys, bucketed compilation, shared prefixes, mesh, bad input."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from strata_jax.models import load_checkpoint
from strata_jax.sampling import (FINISH_LENGTH, FINISH_STOP, Sampler, SamplingParams,
                                 compiled_program_count)
from strata_jax.sampling.stops import build_stop_text_from_bytes
from strata_jax.models import shard_params
from strata_jax.sharding import make_mesh
from tests.fixtures.sampler import build_checkpoint, compile_counter, hf_greedy, prompts

N_NEW = 32
LENGTHS = [5, 12, 3, 9, 16]  # one prompt bucket (16), one batch bucket (8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    compile_counter()  # register the listener before anything compiles
    model, path = build_checkpoint(str(tmp_path_factory.mktemp("sampler_ckpt")))
    config, params = load_checkpoint(path)
    sampler = Sampler(config, max_cache_len=128)
    return model, config, params, sampler


@pytest.fixture(scope="module")
def greedy_reference(setup):
    """HF greedy generations, a stop id that ends some rows early, and HF's stopped output."""
    model, config, _, _ = setup
    ps = prompts(LENGTHS, config.vocab_size, seed=0)
    free = [hf_greedy(model, p, N_NEW) for p in ps]
    # The stop id: the token seen before the last step in the most rows, but not in all rows.
    rows_with = {}
    for r, g in enumerate(free):
        for tok in set(g[: N_NEW - 1]):
            rows_with.setdefault(tok, set()).add(r)
    candidates = [(len(rs), -tok) for tok, rs in rows_with.items() if len(rs) < len(ps)]
    stop = -max(candidates)[1]
    stopped = [hf_greedy(model, p, N_NEW, stop_id=stop) for p in ps]
    return ps, stop, stopped


def _keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


def test_greedy_token_identical_to_transformers_generate(setup, greedy_reference):
    _, _, params, sampler = setup
    ps, stop, hf = greedy_reference
    assert any(len(g) < N_NEW for g in hf) and any(len(g) == N_NEW for g in hf), \
        "the stop id must end some rows early and not all"
    assert len({tuple(g) for g in hf}) == len(hf)  # the rows really differ
    out = sampler.generate(params, ps, SamplingParams(temperature=0.0, max_new_tokens=N_NEW,
                                                      stop_token_ids=[stop]), _keys(len(ps)))
    for row, ref in zip(out, hf):
        assert row.token_ids.tolist() == ref
        assert row.length == len(ref)
        ended = ref[-1] == stop
        assert row.finish_reason == (FINISH_STOP if ended else FINISH_LENGTH)
        assert np.all(np.isfinite(row.logprobs)) and np.all(row.logprobs <= 0)


def test_logprobs_equal_full_forward(setup, greedy_reference):
    _, _, params, sampler = setup
    ps, stop, _ = greedy_reference
    for sp in (SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=N_NEW,
                              stop_token_ids=[stop]),
               SamplingParams(greedy=True, max_new_tokens=N_NEW)):
        out = sampler.generate(params, ps, sp, _keys(len(ps), seed=1))
        ref = sampler.score(params, ps, [g.token_ids for g in out],
                            temperature=sp.logprob_temperature)
        for g, r in zip(out, ref):
            assert g.length > 0
            np.testing.assert_allclose(g.logprobs, r, atol=1e-4)


def test_keys_reproduce_rows_differ_and_layout_does_not_matter(setup):
    _, config, params, sampler = setup
    ps = prompts([7] * 6, config.vocab_size, seed=2)
    same = [ps[0]] * 4 + ps[4:]
    sp = SamplingParams(temperature=1.0, max_new_tokens=20)
    keys = _keys(6, seed=3)
    a = sampler.generate(params, same, sp, keys)
    b = sampler.generate(params, same, sp, keys)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    # Same prompt, different keys: the four generations are not all the same.
    assert len({tuple(a[i].token_ids.tolist()) for i in range(4)}) > 1
    # A row's generation depends on its prompt and key, not on its place in the batch.
    perm = np.array([5, 3, 1, 0, 2, 4])
    c = sampler.generate(params, [same[i] for i in perm], sp, keys[perm])
    np.testing.assert_array_equal(c.token_ids, a.token_ids[perm])


def test_top_k_one_and_temperature_zero_equal_greedy(setup, greedy_reference):
    _, _, params, sampler = setup
    ps, _, _ = greedy_reference
    keys = _keys(len(ps), seed=4)
    greedy = sampler.generate(params, ps, SamplingParams(greedy=True, max_new_tokens=N_NEW), keys)
    top1 = sampler.generate(params, ps, SamplingParams(temperature=1.5, top_k=1,
                                                       max_new_tokens=N_NEW), keys)
    t0 = sampler.generate(params, ps, SamplingParams(temperature=0.0, max_new_tokens=N_NEW), keys)
    np.testing.assert_array_equal(top1.token_ids, greedy.token_ids)
    np.testing.assert_array_equal(t0.token_ids, greedy.token_ids)
    assert np.all(np.isfinite(t0.logprobs)) and np.all(t0.logprobs < 0)
    np.testing.assert_array_equal(t0.logprobs, greedy.logprobs)


def test_compilations_bounded_by_buckets(setup):
    _, config, params, sampler = setup
    counter = compile_counter()
    # Batch sizes 5..8 share the batch bucket 8, prompt lengths 9..16 the prompt bucket 16,
    # max_new_tokens 17..32 the bucket 32; stop ids, temperature and top_p are traced.
    calls = [([16, 3, 9, 10, 11], 20, [7], 0.7, 0.9),
             ([9, 9, 9, 9, 9, 9], 17, [], 1.0, 0.5),
             ([13, 1, 2, 3, 4, 5, 6], 32, [1, 2], 1.3, 0.95),
             ([10, 11, 12, 13, 14, 15, 16, 2], 25, [3], 0.5, 0.8),
             ([15] * 5, 31, [4, 5, 6], 0.9, 0.7),
             ([12, 14, 9, 11, 2, 4], 18, [], 1.0, 0.99)]
    inputs = [(prompts(lens, config.vocab_size, seed=i), _keys(len(lens), seed=i),
               SamplingParams(temperature=t, top_p=p, max_new_tokens=n, stop_token_ids=stop))
              for i, (lens, n, stop, t, p) in enumerate(calls)]
    ps, keys, sp = inputs[0]
    sampler.generate(params, ps, sp, keys)  # warm-up
    before_events, before_programs = counter.count, compiled_program_count()
    for ps, keys, sp in inputs[1:]:
        out = sampler.generate(params, ps, sp, keys)
        assert out.token_ids.shape == (len(ps), sp.max_new_tokens)
    assert counter.count == before_events
    assert compiled_program_count() == before_programs


def _synthetic_stop(vocab_size, free_first_token):
    """A stop string ("</a" then "n>") over a made-up byte vocabulary of 250 ids (the model has
    300: the table is widened, the extra ids spell nothing). Random short pieces make the
    patterns appear split over several tokens at various steps; one row's first generated
    token spells the whole thing, so it stops on the token chosen from the prefill."""
    rng = np.random.default_rng(0)
    alphabet = [b"<", b"/", b"a", b"</", b"ac", b"tion", b">", b"ion>", b"act", b"x", b">x", None]
    vocab = [alphabet[i] for i in rng.integers(0, len(alphabet), 250)]
    vocab += [None] * (free_first_token + 1 - len(vocab))
    vocab[free_first_token] = b"</an>"
    return build_stop_text_from_bytes(vocab, ("</a", "n>"))


def test_stop_text_on_device_equals_the_host_scan(setup):
    """Each row stops on the token at which `StopText.scan` (the host mirror) completes the
    patterns over the row's unstopped generation; rows that never complete them run to the
    limit. Greedy and sampled (same keys: the tokens before the stop do not change)."""
    _, config, params, sampler = setup
    ps = prompts([5, 12, 3, 9, 16, 7, 7, 4], config.vocab_size, seed=0)
    keys = _keys(len(ps), seed=8)
    counter = compile_counter()
    for sp in (SamplingParams(greedy=True, max_new_tokens=N_NEW),
               SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=N_NEW)):
        free = sampler.generate(params, ps, sp, keys)
        stop = _synthetic_stop(config.vocab_size, int(free[2].token_ids[0]))
        out = sampler.generate(params, ps, dataclasses.replace(sp, stop_text=stop), keys)
        cuts = [stop.scan(g.token_ids) for g in free]
        assert cuts[2] == 1 and any(c == 0 for c in cuts) and len(set(cuts) - {0, 1}) >= 2, cuts
        for g, f, n in zip(out, free, cuts):
            if n:
                assert g.finish_reason == FINISH_STOP and g.length == n
                assert g.token_ids.tolist() == f.token_ids[:n].tolist()
                np.testing.assert_allclose(g.logprobs, f.logprobs[:n], atol=1e-6)
            else:
                assert g.finish_reason == FINISH_LENGTH
                assert g.token_ids.tolist() == f.token_ids.tolist()
    # Other patterns, stop ids and limits reuse the compiled program (the table is traced).
    before = counter.count, compiled_program_count()
    other = build_stop_text_from_bytes([b"a", b"b", b">"] * 100, ("ab>",))
    sampler.generate(params, ps, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20,
                                                stop_token_ids=[3], stop_text=other), keys)
    assert (counter.count, compiled_program_count()) == before


def test_shared_prefixes_equal_full_prompts(setup):
    _, config, params, sampler = setup
    prefixes = prompts([10, 4, 7], config.vocab_size, seed=5)
    index = [0, 2, 1, 0, 2, 1, 0]
    suffixes = prompts([3, 6, 1, 8, 2, 5, 4], config.vocab_size, seed=6)
    full = [prefixes[i] + s for i, s in zip(index, suffixes)]
    keys = _keys(len(full), seed=7)
    for sp in (SamplingParams(greedy=True, max_new_tokens=16),
               SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=16)):
        ref = sampler.generate(params, full, sp, keys)
        got = sampler.generate_with_prefixes(params, prefixes, index, suffixes, sp, keys)
        np.testing.assert_array_equal(got.token_ids, ref.token_ids)
        np.testing.assert_array_equal(got.lengths, ref.lengths)
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="prefix_index"):
        sampler.generate_with_prefixes(params, prefixes, [0, 3], suffixes[:2], sp, keys[:2])


def test_prefix_kv_kept_across_calls_equals_full_prompts(setup):
    """Three decode calls as a rollout makes them (the same prefixes, new suffixes each step;
    a new prefix in the third; a longer prefix widening the prefix bucket): with a
    PrefixKVCache every prefix is prefilled once, and each call gives `generate`'s tokens on
    the full prompts (logprobs to float rounding). Warm calls compile nothing; eviction and
    clear() prefill again."""
    from strata_jax.sampling import PrefixKVCache
    _, config, params, sampler = setup
    pre = prompts([10, 4, 7, 20], config.vocab_size, seed=8)   # buckets 16, 16, 16, 32
    kept = PrefixKVCache(2 ** 30)
    counter = compile_counter()
    calls = [([0, 1, 2], [0, 2, 1, 0, 2]), ([0, 1, 2], [1, 1, 0, 2, 0]),
             ([0, 3, 2], [1, 0, 2, 1, 1])]   # (the call's prefixes, each row's index into them)
    sp = SamplingParams(greedy=True, max_new_tokens=12)
    for n, (which, index) in enumerate(calls + calls[:2]):
        prefixes = [pre[i] for i in which]
        suffixes = prompts([3, 6, 1, 8, 2], config.vocab_size, seed=20 + n)
        full = [prefixes[i] + s for i, s in zip(index, suffixes)]
        keys = _keys(len(full), seed=n)
        if n == 3:
            before = counter.count            # calls 4-5 repeat calls 1-2's shapes
        ref = sampler.generate(params, full, sp, keys)
        got = sampler.generate_with_prefixes(params, prefixes, index, suffixes, sp, keys, kept)
        np.testing.assert_array_equal(got.token_ids, ref.token_ids, err_msg=f"call {n}")
        np.testing.assert_array_equal(got.lengths, ref.lengths)
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5)
    assert counter.count == before
    st = kept.stats()
    # each of the 4 prefixes prefilled once (10 + 4 + 7 + 20 tokens); 15 lookups, 4 misses
    assert (st["misses"], st["hits"], st["computed_tokens"]) == (4, 11, 41)
    # served: calls 2, 4, 5 all three of theirs (10 + 4 + 7), call 3 prefixes 0 and 2
    assert st["reused_tokens"] == 3 * (10 + 4 + 7) + (10 + 7)
    assert st["entries"] == 4 and st["evictions"] == 0
    # per token: 2 (k, v) x layers x kv heads x head_dim x 4 bytes (fp32) + the valid flag
    per_slot = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 + 1
    assert st["bytes"] == per_slot * (16 * 3 + 32)
    # a budget of two 16-slot entries: the oldest goes; clear() drops all (new params)
    small = PrefixKVCache(2 * 16 * per_slot)
    for i in (0, 1, 2):
        sampler.generate_with_prefixes(params, [pre[i]], [0], [[1]], sp, _keys(1), small)
    assert small.stats()["evictions"] == 1 and len(small) == 2
    small.clear()
    assert len(small) == 0 and small.stats()["bytes"] == 0
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        PrefixKVCache(0)


def test_prefix_kv_kept_on_a_mesh(setup):
    """Rows over (data, fsdp), kv heads over tensor: the kept prefixes (prefilled alone at the
    smallest batch bucket of the mesh) give the single-device tokens."""
    from strata_jax.sampling import PrefixKVCache
    _, config, params, sampler = setup
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = Sampler(config, mesh=mesh, max_cache_len=128)
    sparams = shard_params(params, config, mesh)
    pre = prompts([10, 4], config.vocab_size, seed=9)
    kept = PrefixKVCache(2 ** 30)
    sp = SamplingParams(greedy=True, max_new_tokens=12)
    for n in range(2):
        suffixes = prompts([3, 6, 1], config.vocab_size, seed=30 + n)
        index = [0, 1, 0]
        got = sharded.generate_with_prefixes(sparams, pre, index, suffixes, sp, _keys(3), kept)
        ref = sampler.generate_with_prefixes(params, pre, index, suffixes, sp, _keys(3))
        np.testing.assert_array_equal(got.token_ids, ref.token_ids)
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)
    assert kept.stats()["computed_tokens"] == 14 and kept.stats()["hits"] == 2


def test_mesh_sharded_same_tokens(setup, greedy_reference):
    _, config, params, sampler = setup
    ps, stop, hf = greedy_reference
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = Sampler(config, mesh=mesh, max_cache_len=128)
    sp = SamplingParams(temperature=0.0, max_new_tokens=N_NEW, stop_token_ids=[stop])
    out = sharded.generate(shard_params(params, config, mesh), ps, sp, _keys(len(ps)))
    assert [g.token_ids.tolist() for g in out] == hf
    single = sampler.generate(params, ps, sp, _keys(len(ps)))
    # Sharded reductions sum in another order: same tolerance as the logprob parity test.
    np.testing.assert_allclose(out.logprobs, single.logprobs, atol=1e-4)
    # The stop-string table (replicated) with rows split over the mesh: same cuts.
    st = _synthetic_stop(config.vocab_size, int(single[2].token_ids[0]))
    sp = dataclasses.replace(sp, stop_text=st)
    got = sharded.generate(shard_params(params, config, mesh), ps, sp, _keys(len(ps)))
    ref = sampler.generate(params, ps, sp, _keys(len(ps)))
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    np.testing.assert_array_equal(got.token_ids, ref.token_ids)
    assert got.lengths[2] == 1 and got.finish_reasons[2] == FINISH_STOP


def test_fixed_shape_sampler_on_a_mesh_equals_the_single_device_one(setup, greedy_reference):
    """The fixed-shape setting on a mesh (rows over data x fsdp, kv heads over tensor): a
    64-column bucket prefilled in 16-column chunks from the first real chunk, the rows packed
    into their own 16-slot rung (`compact_rows`) before decoding: HF's greedy tokens, and with
    kept prefixes the plain single-device sampler's tokens."""
    _, config, params, sampler = setup
    ps, stop, hf = greedy_reference
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    wide = Sampler(config, mesh=mesh, max_cache_len=192, length_floor=64, rows_floor=16,
                   prefill_chunk=16)
    sparams = shard_params(params, config, mesh)
    sp = SamplingParams(temperature=0.0, max_new_tokens=N_NEW, stop_token_ids=[stop])
    out = wide.generate(sparams, ps, sp, _keys(len(ps)))
    assert [g.token_ids.tolist() for g in out] == hf
    np.testing.assert_allclose(out.logprobs, sampler.generate(params, ps, sp, _keys(len(ps))
                                                              ).logprobs, atol=1e-4)
    pre = prompts([10, 4], config.vocab_size, seed=9)
    suffixes = prompts([3, 6, 1], config.vocab_size, seed=30)
    sp = SamplingParams(greedy=True, max_new_tokens=12)
    got = wide.generate_with_prefixes(sparams, pre, [0, 1, 0], suffixes, sp, _keys(3))
    ref = sampler.generate_with_prefixes(params, pre, [0, 1, 0], suffixes, sp, _keys(3))
    np.testing.assert_array_equal(got.token_ids, ref.token_ids)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)


def test_bad_input(setup):
    _, config, params, sampler = setup
    sp = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.generate(params, [[1, 2], []], sp, _keys(2))
    with pytest.raises(ValueError, match="max_cache_len"):
        sampler.generate(params, [[1] * 126], sp, _keys(1))
    with pytest.raises(ValueError, match="one PRNG key per row"):
        sampler.generate(params, [[1], [2]], sp, _keys(3))
    with pytest.raises(ValueError, match="outside"):
        sampler.generate(params, [[config.vocab_size]], sp, _keys(1))
    # Not silently truncated or wrapped: float ids, Python ints beyond int64, float counts.
    with pytest.raises(ValueError, match=r"prompt 0 must hold integer token ids, got dtype float64 "
                                         r"\(first value 1.5\)"):
        sampler.generate(params, [[1.5, 2]], sp, _keys(1))
    big = 2 ** 70   # 1180591620717411303424
    with pytest.raises(ValueError, match=rf"outside \[0, \d+\): min {big}, max {big}"):
        sampler.generate(params, [[big]], sp, _keys(1))
    for kw, msg in ((dict(top_k=2.0), "top_k must be an integer, got 2.0"),
                    (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True"),
                    (dict(stop_token_ids=[1.0]), "stop_token_ids must be integer token ids")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)
    assert SamplingParams(top_k=np.int64(3)).top_k == 3 and type(SamplingParams(top_k=np.int64(3)).top_k) is int
    empty = sampler.generate(params, [[1, 2], [3]], SamplingParams(max_new_tokens=0), _keys(2))
    assert [g.token_ids.tolist() for g in empty] == [[], []]
    assert empty.lengths.tolist() == [0, 0]


def test_wide_bucket_prefilled_by_chunks_equals_transformers(setup, greedy_reference):
    """A 64-column prompt bucket run in 16-column chunks (the fixed-shape setting: the bucket is
    the whole budget, the prompts are short): HF's greedy tokens, the one-pass logprobs; and a
    row set whose padding fills whole chunks is not computed there (the padding token's
    embedding set to NaN poisons the one-pass prefill, not the chunked one)."""
    _, config, params, sampler = setup
    ps, stop, hf = greedy_reference
    wide = Sampler(config, max_cache_len=128, length_floor=64, prefill_chunk=16)
    sp = SamplingParams(temperature=0.0, max_new_tokens=N_NEW, stop_token_ids=[stop])
    out = wide.generate(params, ps, sp, _keys(len(ps)))
    assert [g.token_ids.tolist() for g in out] == hf
    ref = sampler.generate(params, ps, sp, _keys(len(ps)))
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
    # 8 rows of 16 tokens in a 64 bucket: columns 0-47 are padding in every row
    # (an untied head keeps the output matrix clean)
    rows = prompts([16] * 8, config.vocab_size, seed=11)
    untied = dataclasses.replace(config, tie_word_embeddings=False)
    head = params.get("lm_head", params["embed"])
    poisoned = dict(params, lm_head=head, embed=params["embed"].at[0].set(np.nan))
    sp = SamplingParams(greedy=True, max_new_tokens=8)
    chunked = Sampler(untied, max_cache_len=128, length_floor=64, prefill_chunk=16)
    got = chunked.generate(poisoned, rows, sp, _keys(8))
    want = sampler.generate(params, rows, sp, _keys(8))
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    assert np.isfinite(got.logprobs).all()
    one_pass = Sampler(untied, max_cache_len=128, length_floor=64, prefill_chunk=64)
    assert not np.isfinite(one_pass.generate(poisoned, rows, sp, _keys(8)).logprobs).all()


def test_prefixed_rows_packed_into_their_own_bucket(setup):
    """With a 64-wide prefix bucket and a 64-wide suffix bucket, rows of at most 30 tokens
    decode from a cache of 64 + N slots (each row's slots packed by `compact_rows`), not
    128 + N; tokens equal `generate` on the full prompts, with and without kept prefix KV."""
    from strata_jax.sampling import PrefixKVCache, programs
    _, config, params, sampler = setup
    wide = Sampler(config, max_cache_len=256, length_floor=64, prefill_chunk=16)
    prefixes = prompts([10, 4, 20], config.vocab_size, seed=12)
    index = [0, 2, 1, 0, 2, 1, 0]
    suffixes = prompts([3, 6, 1, 8, 10, 5, 4], config.vocab_size, seed=13)
    full = [prefixes[i] + s for i, s in zip(index, suffixes)]
    keys = _keys(len(full), seed=14)
    seen = []
    real_decode = programs.decode

    def spy(params, cache, *args, **kw):
        seen.append(cache.max_len)
        return real_decode(params, cache, *args, **kw)

    programs.decode = spy
    try:
        for sp in (SamplingParams(greedy=True, max_new_tokens=16),
                   SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=16)):
            ref = sampler.generate(params, full, sp, keys)
            for kept in (None, PrefixKVCache(2 ** 30)):
                got = wide.generate_with_prefixes(params, prefixes, index, suffixes, sp, keys,
                                                  kept)
                np.testing.assert_array_equal(got.token_ids, ref.token_ids)
                np.testing.assert_array_equal(got.lengths, ref.lengths)
                # float32 summation order (chunked prefill, packed slots) differs by CPU
                np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=5e-5)
    finally:
        programs.decode = real_decode
    # generate: bucket 32 + 16 new; the wide sampler's prefixed calls: 64 + 16, not 128 + 16
    assert seen == [48, 80, 80, 48, 80, 80]


def test_compact_rows_hand_values():
    """Valid slots keep their order and move to the right of `width`; `extra` free slots."""
    import jax.numpy as jnp
    from strata_jax.models import KVCache
    from strata_jax.sampling.programs import compact_rows
    valid = np.array([[0, 1, 1, 0, 0, 1], [1, 0, 0, 0, 0, 0]], bool)
    k = np.arange(12, dtype=np.float32).reshape(1, 2, 6, 1, 1) + 1   # slot values 1..12
    cache = KVCache(k=jnp.asarray(k), v=jnp.asarray(-k), valid=jnp.asarray(valid))
    out = compact_rows(cache, width=4, extra=2)
    assert out.k.shape == (1, 2, 6, 1, 1)
    np.testing.assert_array_equal(out.k[0, :, :, 0, 0], [[0, 2, 3, 6, 0, 0], [0, 0, 0, 7, 0, 0]])
    np.testing.assert_array_equal(out.v[0, :, :, 0, 0], -np.asarray(out.k[0, :, :, 0, 0]))
    np.testing.assert_array_equal(out.valid, [[0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0]])
    # a filler row with more valid slots than `width` keeps its last `width` of them
    out = compact_rows(cache, width=2, extra=1)
    np.testing.assert_array_equal(out.k[0, :, :, 0, 0], [[3, 6, 0], [0, 7, 0]])
    np.testing.assert_array_equal(out.valid, [[1, 1, 0], [0, 1, 0]])


def test_prefill_chunk_must_be_positive(setup):
    _, config, _, _ = setup
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1, got 0"):
        Sampler(config, prefill_chunk=0)


def test_batch_rungs_bound_the_programs_to_the_rungs(setup):
    """Rows round up to the smallest rung that holds them (on a mesh, a multiple of its batch
    shards), past the largest to the powers of two; calls of 1..8 rows on rungs (3, 8) compile
    two prefill + decode pairs, and a row's tokens do not depend on its rung."""
    _, config, params, sampler = setup
    ruled = Sampler(config, max_cache_len=128, batch_rungs=(8, 3))
    assert [ruled._batch_bucket(n) for n in (1, 3, 4, 8, 9, 17)] == [3, 3, 8, 8, 16, 32]
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert Sampler(config, mesh=mesh, batch_rungs=(3, 8)).batch_rungs == (4, 8)
    sp = SamplingParams(greedy=True, max_new_tokens=8)
    rows = prompts([5, 9, 3, 12, 7, 4, 10, 6], config.vocab_size, seed=15)
    ruled.generate(params, rows[:1], sp, _keys(1))          # warm-up: rung 3
    ruled.generate(params, rows, sp, _keys(8))              # rung 8
    want = [sampler.generate(params, rows[:n], sp, _keys(8)[:n]) for n in range(1, 9)]
    counter = compile_counter()
    before = counter.count
    got = [ruled.generate(params, rows[:n], sp, _keys(8)[:n]) for n in range(1, 9)]
    assert counter.count == before
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    with pytest.raises(ValueError, match=r"batch_rungs must all be >= 1, got \[4, 0\]"):
        Sampler(config, batch_rungs=(4, 0))
    # a prefix missing from the kept KV is prefilled alone: one row, not the rung's 3
    from strata_jax.sampling import PrefixKVCache, programs
    rows_seen, real = [], programs.prefill_prefix_kv

    def spy(params, tokens, *args, **kw):
        rows_seen.append(tokens.shape[0])
        return real(params, tokens, *args, **kw)

    programs.prefill_prefix_kv = spy
    try:
        got = ruled.generate_with_prefixes(params, rows[:2], [0, 1, 1], rows[2:5], sp, _keys(3),
                                           PrefixKVCache(2 ** 30))
    finally:
        programs.prefill_prefix_kv = real
    assert rows_seen == [1, 1]
    full = [rows[i] + s for i, s in zip([0, 1, 1], rows[2:5])]
    np.testing.assert_array_equal(got.token_ids,
                                  sampler.generate(params, full, sp, _keys(3)).token_ids)


def _spy_decode():
    """programs.decode wrapped to record each call's cache slots; returns (seen, restore)."""
    from strata_jax.sampling import programs
    seen, real = [], programs.decode

    def spy(params, cache, *args, **kw):
        seen.append(cache.max_len)
        return real(params, cache, *args, **kw)

    programs.decode = spy
    return seen, lambda: setattr(programs, "decode", real)


def test_rows_ladder_decodes_over_the_rows_bucket_not_the_prompt_bucket(setup):
    """A 64-column prompt bucket with rows_floor 16: rows of <= 16 tokens decode from 16 + N
    slots, rows of 17..32 from 32 + N (their slots packed by `compact_rows`), with the tokens
    and logprobs of the plain sampler; the ladder a call width can meet, by hand."""
    _, config, params, sampler = setup
    wide = Sampler(config, max_cache_len=128, length_floor=64, rows_floor=16, prefill_chunk=16)
    assert wide.rows_ladder(64) == [16, 32, 64]
    assert wide.rows_ladder(256) == [16, 32, 64, 128]  # rows of <= 127 tokens: bucket 128 at most
    assert wide.rows_ladder(24) == [16, 24]            # capped at the call's width
    assert wide.rows_ladder(8) == [8]
    with pytest.raises(ValueError, match="rows_floor must be >= 1, got 0"):
        Sampler(config, rows_floor=0)
    seen, restore = _spy_decode()
    try:
        for lens in ([5, 12, 3, 16], [17, 3, 30, 9]):
            rows = prompts(lens, config.vocab_size, seed=len(seen) + 20)
            sp = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=16)
            got = wide.generate(params, rows, sp, _keys(4, seed=3))
            ref = sampler.generate(params, rows, sp, _keys(4, seed=3))
            np.testing.assert_array_equal(got.token_ids, ref.token_ids)
            np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=5e-5)
    finally:
        restore()
    # each pair: the wide sampler's call, then the plain one's (prompt bucket 16 / 32 + 16)
    assert seen == [32, 32, 48, 48]


def test_warm_ladder_compiles_a_call_shapes_ladder_when_first_met(setup):
    """With warm_ladder, a call shape's first call also compiles its other rows' buckets (a
    one-token decode each: 48 and 80 slots before its own 32); later calls of that shape with
    rows of any length up to the budget compile nothing and give the plain sampler's tokens,
    on the plain path and on kept prefix KV."""
    from strata_jax.sampling import PrefixKVCache
    _, config, params, sampler = setup
    warm = Sampler(config, max_cache_len=128, length_floor=64, rows_floor=16, prefill_chunk=16,
                   warm_ladder=True, batch_rungs=(4,))
    sp = SamplingParams(temperature=0.7, max_new_tokens=16)
    seen, restore = _spy_decode()
    try:
        warm.generate(params, prompts([4, 9, 2], config.vocab_size, seed=30), sp, _keys(3))
        prefixes = prompts([6, 20], config.vocab_size, seed=31)
        kept = PrefixKVCache(2 ** 30)
        warm.generate_with_prefixes(params, prefixes, [0, 1], prompts([2, 3], config.vocab_size,
                                    seed=32), sp, _keys(2), kept)
        assert seen[:3] == [48, 80, 32]
        # the prefixed shape: widths 64 + 64, rows' ladder 16, 32, 64, 128 capped at the
        # rows the cache admits (<= 112 tokens: bucket 128): three warm calls, then its own
        assert seen[3:] == [32, 80, 144, 48]
        calls = []   # (rows, suffixes, prefix index, the plain sampler's two outputs)
        for i, lens in enumerate(([60, 3], [33, 20, 1, 7], [16])):
            rows = prompts(lens, config.vocab_size, seed=40 + i)
            sufs = prompts([n // 2 + 1 for n in lens], config.vocab_size, seed=50 + i)
            index = [j % 2 for j in range(len(lens))]
            full = [prefixes[j] + s for j, s in zip(index, sufs)]
            calls.append((rows, sufs, index,
                          sampler.generate(params, rows, sp, _keys(len(rows), seed=i)),
                          sampler.generate(params, full, sp, _keys(len(rows), seed=i))))
        counter = compile_counter()
        before = counter.count
        for i, (rows, sufs, index, ref, ref_prefixed) in enumerate(calls):
            got = warm.generate(params, rows, sp, _keys(len(rows), seed=i))
            np.testing.assert_array_equal(got.token_ids, ref.token_ids)
            got = warm.generate_with_prefixes(params, prefixes, index, sufs, sp,
                                              _keys(len(rows), seed=i), kept)
            np.testing.assert_array_equal(got.token_ids, ref_prefixed.token_ids)
        assert counter.count == before
    finally:
        restore()
