"""Prefix-tree packing (training/prefix_tree.py): hand-built trees, exact layouts, and the
attention rule reproducing every row's causal context."""
from __future__ import annotations

import numpy as np
import pytest

from strata_jax.buckets import response_slots
from strata_jax.training.prefix_tree import pack_rows


def make_rows(rows: list[tuple[list[int], list[int]]], tp: int | None = None,
              tr: int | None = None):
    """prompt_ids, prompt_mask [R, Tp] (left-padded), response_ids, response_mask [R, Tr]
    (right-padded) of (prompt tokens, response tokens) pairs; pads are id 0."""
    tp = tp or max(len(p) for p, _ in rows)
    tr = tr or max(max(len(r) for _, r in rows), 1)
    pi = np.zeros((len(rows), tp), np.int32)
    pm = np.zeros((len(rows), tp), bool)
    ri = np.zeros((len(rows), tr), np.int32)
    rm = np.zeros((len(rows), tr), bool)
    for i, (p, r) in enumerate(rows):
        if p:
            pi[i, tp - len(p):], pm[i, tp - len(p):] = p, True
        ri[i, :len(r)], rm[i, :len(r)] = r, True
    return pi, pm, ri, rm


def check_layout(layout, rows):
    """Every row's tokens sit at token_index with positions 0..n-1, all in one packed row, and
    the rule k <= q < key_end[k] shows each of its queries exactly its own earlier tokens; every
    packed real token belongs to some row."""
    w = layout.width
    vis = layout.visible()
    flat_tokens = layout.tokens.reshape(-1)
    used = set()
    for r, (p, resp) in enumerate(rows):
        seq = list(p) + list(resp)
        ti = layout.token_index[r]
        idx = ti[ti >= 0]
        assert idx.size == len(seq)
        np.testing.assert_array_equal(flat_tokens[idx], seq)
        np.testing.assert_array_equal(layout.positions.reshape(-1)[idx], np.arange(len(seq)))
        if not seq:
            continue
        prow, cols = idx // w, idx % w
        assert (prow == prow[0]).all()
        for i, q in enumerate(cols):
            np.testing.assert_array_equal(np.flatnonzero(vis[prow[0], q]), np.sort(cols[:i + 1]))
        used.update(idx.tolist())
    assert used == set(np.flatnonzero(layout.mask.reshape(-1)).tolist())


def test_one_shared_root_exact_layout():
    s = [5, 6, 7]
    rows = [(s + [10], [11, 12]), (s + [20, 21], [22]), (s + [30], [31])]
    lay = pack_rows(*make_rows(rows), max_width=64)
    # root segment once, then each row's suffix (pre-order, first-appearance order)
    assert lay.tokens.shape == (1, 16)
    np.testing.assert_array_equal(lay.tokens[0, :12], [5, 6, 7, 10, 11, 12, 20, 21, 22, 30, 31, 0])
    np.testing.assert_array_equal(lay.positions[0, :11], [0, 1, 2, 3, 4, 5, 3, 4, 5, 3, 4])
    np.testing.assert_array_equal(lay.key_end[0, :12], [11, 11, 11, 6, 6, 6, 9, 9, 9, 11, 11, 12])
    np.testing.assert_array_equal(lay.segment_ids[0, :12], [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, -1])
    np.testing.assert_array_equal(lay.parent, [-1, 0, 0, 0])
    assert lay.num_packed_tokens == 11 and lay.num_row_tokens == 6 + 6 + 5
    # response column j is predicted by the row's previous token
    tp = 5
    np.testing.assert_array_equal(lay.score_index(), [[3, 4], [7, 8], [9, 10]])
    np.testing.assert_array_equal(lay.last_index(), [5, 8, 10])
    np.testing.assert_array_equal(lay.token_index[1], [0, 1, 2, 6, 7, 8, -1])
    assert lay.prompt_width == tp
    check_layout(lay, rows)


def test_two_and_three_levels():
    inst, t1, t2, s1, s2 = [1, 2, 3, 4], [50, 51], [60], [70, 71, 72], [80]
    rows = [(inst + t1 + s1 + [100], [101]),
            (inst + t1 + s1 + [110, 111], [112, 113]),
            (inst + t1 + s2 + [120], [121]),
            (inst + t2 + [130], [131, 132]),
            (inst + t2 + [140], [141])]
    lay = pack_rows(*make_rows(rows), max_width=128)
    check_layout(lay, rows)
    # instruction block once, t1 once, s1 once, s2 once, t2 once, then the five suffixes
    suffixes = 2 + 4 + 2 + 3 + 2
    assert lay.num_packed_tokens == 4 + 2 + 3 + 1 + 1 + suffixes
    seg = lay.segment_ids[0]
    depth = {}
    for nid, par in enumerate(lay.parent):
        depth[nid] = 0 if par < 0 else depth[par] + 1
    assert max(depth.values()) == 3   # inst -> task -> strategy -> suffix
    assert len(set(seg[seg >= 0].tolist())) == len(lay.parent)


def test_no_sharing_packs_end_to_end():
    rows = [([1, 2, 3], [4]), ([5, 6], [7, 8]), ([9], [10])]
    lay = pack_rows(*make_rows(rows), max_width=32)
    check_layout(lay, rows)
    assert lay.tokens.shape == (1, 16) and lay.num_packed_tokens == 10
    np.testing.assert_array_equal(lay.key_end[0, :10], [4] * 4 + [8] * 4 + [10] * 2)
    np.testing.assert_array_equal(lay.positions[0, :10], [0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(lay.parent, [-1, -1, -1])


def test_prompt_prefix_of_another_prompt_and_duplicate_and_empty_rows():
    rows = [([1, 2, 3], [7, 8]),           # its prompt is a prefix of the next row's prompt
            ([1, 2, 3, 4, 5], [9]),
            ([1, 2, 3], [7, 8]),           # identical to row 0: shares every token
            ([1, 2], []),                  # a row that ends inside the shared root
            ([], [])]                      # a padding row: no tokens at all
    lay = pack_rows(*make_rows(rows), max_width=32)
    check_layout(lay, rows)
    assert lay.num_packed_tokens == 2 + 1 + 2 + 3
    np.testing.assert_array_equal(lay.token_index[0], lay.token_index[2])
    assert (lay.token_index[4] == -1).all()
    # the first response token of row 0 is predicted from the shared parent's last token, which
    # row 1's continuation also sees
    si = lay.score_index()
    assert lay.segment_ids.reshape(-1)[si[0, 0]] != lay.segment_ids.reshape(-1)[si[0, 1]]
    assert lay.tokens.reshape(-1)[si[0, 0]] == 3
    assert lay.tokens.reshape(-1)[si[1, 0]] == 5
    assert lay.last_index()[4] == 0


def test_units_move_whole_to_the_next_packed_row_and_width_is_bucketed():
    # three unrelated rows of 5, 5, 4 tokens with max width 8: no segment crosses a packed row
    rows = [([1, 2, 3], [4, 5]), ([6, 7, 8, 9], [10]), ([11, 12], [13, 14])]
    lay = pack_rows(*make_rows(rows), max_width=8)
    check_layout(lay, rows)
    assert lay.tokens.shape == (3, 8)
    lay = pack_rows(*make_rows(rows), max_width=12, widths=(6, 10, 12))
    check_layout(lay, rows)
    assert lay.tokens.shape == (2, 10)      # 5 + 4 in one row, 5 in the other; bucket 10
    lay = pack_rows(*make_rows(rows), max_width=12, row_multiple=4)
    assert lay.tokens.shape[0] == 4 and not lay.mask[2:].any()


def test_split_tree_copies_the_ancestor_path():
    root = [1, 2, 3, 4]
    rows = [(root + [10, 11], [12, 13]), (root + [20, 21], [22, 23]),
            (root + [30, 31], [32, 33]), (root + [40], [41])]
    lay = pack_rows(*make_rows(rows), max_width=12)
    check_layout(lay, rows)
    # 4 + 4 + 4 = 12 fits one unit; the rest gets a copy of the root
    assert lay.tokens.shape[0] == 2
    root_copies = [(lay.segment_ids[p] == 0).sum() for p in range(2)]
    assert root_copies == [4, 4]
    assert lay.num_packed_tokens == 4 + 4 + 4 + 4 + 4 + 2
    # a deeper split: instruction [1, 2, 3] -> task [50, 51] (too wide: split below it, the
    # instruction + task path copied) -> three strategy rows; task [60] fits whole
    rows = [([1, 2, 3, 50, 51, i, i + 1], [i + 2]) for i in (100, 200, 300)]
    rows.append(([1, 2, 3, 60], [61]))
    lay = pack_rows(*make_rows(rows), max_width=11)
    check_layout(lay, rows)
    # units: (path inst+task, two strategies) = 5 + 6, (path inst+task, one) = 5 + 3, and
    # (path inst, task 60) = 3 + 2; 8 + 5 > 11, so each unit takes its own packed row
    assert lay.num_packed_tokens == 11 + 8 + 5
    assert lay.tokens.shape == (3, 11)


def test_errors():
    rows = [([1, 2, 3, 4, 5], [6, 7])]
    with pytest.raises(ValueError, match="exceeds the largest packed width"):
        pack_rows(*make_rows(rows), max_width=6)
    pi, pm, ri, rm = make_rows(rows, tp=6)
    pm2 = pm.copy()
    pm2[0, -1] = False                     # a hole at the prompt's end
    with pytest.raises(ValueError, match="left-padded"):
        pack_rows(pi, pm2, ri, rm, max_width=16)
    with pytest.raises(ValueError, match="exceed max_width"):
        pack_rows(pi, pm, ri, rm, max_width=16, widths=(8, 32))


def random_tree(rng, inst=6, rows=9, task=3, strat=3, own=3, resp=3, width=30):
    """(rows [(prompt, response)], a packed layout of them) of a random StraTA-like tree:
    one instruction block, then per row a few task / strategy / own tokens from small alphabets
    (so rows collide into shared prefixes), bounds exclusive; packed rows of a random width
    in [8, width) or the longest row."""
    block = rng.integers(1, 50, rng.integers(0, inst)).tolist()
    out = []
    for _ in range(rng.integers(1, rows)):
        t = rng.integers(1, 4, rng.integers(0, task)).tolist()
        z = rng.integers(1, 3, rng.integers(0, strat)).tolist()
        o = rng.integers(1, 4, rng.integers(0 if block or t or z else 1, own)).tolist()
        out.append((block + t + z + o, rng.integers(1, 4, rng.integers(0, resp)).tolist()))
    longest = max(len(p) + len(r) for p, r in out)
    return out, pack_rows(*make_rows(out), max_width=max(longest, int(rng.integers(8, width))))


def test_random_batches_keep_every_rows_context():
    rng = np.random.default_rng(0)
    for trial in range(20):
        rows, lay = random_tree(rng)
        check_layout(lay, rows)
        assert lay.num_packed_tokens <= lay.num_row_tokens


def open_keys_by_rule(lay, block):
    """The index's sets from the dense rule: key k < j * block that some query of block j sees."""
    vis = lay.visible()
    out = []
    for p in range(lay.tokens.shape[0]):
        row = []
        for j0 in range(0, lay.width, block):
            seen = vis[p, j0:j0 + block, :j0].any(0)
            row.append(np.flatnonzero(seen).tolist())
        out.append(row)
    return out


def test_block_key_index_exact_sets():
    # root [5, 6, 7] (slots 0-2, subtree to 11), children [10, 11, 12] (3-5), [20, 21, 22]
    # (6-8), [30, 31] (9-10), padding from 11
    s = [5, 6, 7]
    rows = [(s + [10], [11, 12]), (s + [20, 21], [22]), (s + [30], [31])]
    lay = pack_rows(*make_rows(rows), max_width=64)
    assert lay.width == 16
    ix = lay.key_index(4)
    # block 1 starts at 4 inside the first child (3 open); block 2 at 8 inside the second
    # (6, 7 open; the first child closed); block 3 at 12 is padding: nothing open
    assert ix.shape == (1, 4, 8)
    np.testing.assert_array_equal(ix[0], [[-1] * 8,
                                          [0, 1, 2, 3, -1, -1, -1, -1],
                                          [0, 1, 2, 6, 7, -1, -1, -1],
                                          [-1] * 8])
    ix = lay.key_index(3)
    # blocks of 3 start on the children's boundaries (3, 6, 9): only the root is open, A = 3;
    # at 12 and 15 the root's subtree (to 11) is closed
    assert ix.shape == (1, 6, 3)
    np.testing.assert_array_equal(ix[0], [[-1] * 3, [0, 1, 2], [0, 1, 2], [0, 1, 2],
                                          [-1] * 3, [-1] * 3])
    # one block over the row: nothing before it, A = 0
    assert lay.key_index(16).shape == (1, 1, 0)
    with pytest.raises(ValueError, match="block >= 1"):
        lay.key_index(0)


def test_block_key_index_matches_the_rule_on_random_trees():
    rng = np.random.default_rng(5)
    for trial in range(20):
        _, lay = random_tree(rng, inst=9, rows=12, task=5, strat=1, own=6, resp=4, width=60)
        for block in (1, 3, 8):
            ix = lay.key_index(block)
            assert ix.shape[2] % block == 0
            want = open_keys_by_rule(lay, block)
            for p in range(ix.shape[0]):
                for j in range(ix.shape[1]):
                    got = ix[p, j]
                    assert (got[got >= 0].tolist()) == want[p][j]
                    assert (got[len(want[p][j]):] == -1).all()
            # A is the largest set rounded up to the block: no larger
            most = max(len(x) for r in want for x in r)
            assert ix.shape[2] == -(-most // block) * block


def test_key_index_buckets_stay_few_over_random_batches():
    """The packed micro-batches' static shapes take few values: over many StraTA-shaped
    random batches (rows of at most 200 tokens) every micro-batch runs at one of the two
    micro widths (the smallest holding its fullest packed row) and pads its exact key index
    with -1 to A = block x two sizes per octave of blocks: with block 32 at most 0, 32, 64,
    96, 128, 192, 256 (the exact A is at most ceil(200 / 32) + 1 = 8 blocks)."""
    from strata_jax.buckets import key_index_width, micro_widths
    from strata_jax.training.prefix_tree import block_key_index, packed_micro_batches
    rng = np.random.default_rng(7)
    seen, widths_seen = set(), set()
    for trial in range(30):
        inst = rng.integers(1, 90, rng.integers(10, 60)).tolist()
        rows = []
        for _ in range(rng.integers(2, 4)):
            goal = rng.integers(1, 90, rng.integers(5, 40)).tolist()
            for _ in range(rng.integers(1, 3)):
                strat = rng.integers(1, 90, rng.integers(5, 30)).tolist()
                for _ in range(rng.integers(1, 4)):
                    step = rng.integers(1, 90, rng.integers(5, 80)).tolist()
                    resp = rng.integers(1, 90, rng.integers(1, 30)).tolist()
                    rows.append((inst + goal + strat + step, resp))
        pi, pm, ri, rm = make_rows(rows)
        n = len(rows)
        big = 4 * (pi.shape[1] + ri.shape[1])
        micro = packed_micro_batches(pi, pm, ri, rm, np.arange(n), np.ones(n, bool),
                                     max_width=big, block=32)
        widths = micro_widths(big)
        for mb in micro:
            assert mb.block == 32
            exact = block_key_index(mb.mask, mb.key_end, 32)
            a = mb.key_index.shape[2]
            # the exact index, padded with -1 to A = key_index_width of it (hand values below)
            np.testing.assert_array_equal(mb.key_index[..., :exact.shape[2]], exact)
            assert (mb.key_index[..., exact.shape[2]:] == -1).all()
            assert a == key_index_width(exact.shape[2], 32)
            assert mb.key_index.shape[:2] == (1, -(-mb.width // 32))
            # the smallest micro width that holds the fullest packed row
            fullest = int(mb.mask.sum(1).max())
            assert mb.width == min(w for w in widths if w >= fullest), (mb.width, fullest)
            seen.add(a)
            widths_seen.add(mb.width)
    print("A values:", sorted(seen), "widths:", sorted(widths_seen))
    assert seen <= {0, 32, 64, 96, 128, 192, 256} and len(seen) >= 2
    assert len(widths_seen) >= 2


def test_key_index_width_hand_values():
    """A in whole blocks, then two sizes per octave of blocks (1, 2, 3, 4, 6, 8, 12, 16):
    6 blocks stay 6 (a power-of-two bucket made them 8), 5 -> 6, 9 -> 12, 13 -> 16, 0 -> 0."""
    from strata_jax.buckets import key_index_width
    assert [key_index_width(n * 128, 128) for n in (0, 1, 2, 3, 5, 6, 7, 9, 13)] == [
        0, 128, 256, 384, 768, 768, 1024, 1536, 2048]
    assert key_index_width(96, 32) == 96 and key_index_width(160, 32) == 192


def test_micro_widths_and_the_fullest_rows_first():
    """Hand values: the two micro widths of W (3W/4 rounded up to 8, and W), and a batch whose
    packed rows fill unevenly runs its fullest row at W and the emptier at 3W/4, each row
    scored from its own micro-batch."""
    from strata_jax.buckets import micro_widths
    from strata_jax.training.prefix_tree import packed_micro_batches
    assert micro_widths(2048) == (1536, 2048)
    assert micro_widths(100) == (80, 100)
    with pytest.raises(ValueError, match="max_width"):
        micro_widths(4)
    # four rows that share nothing: 50, 45, 20 and 12 tokens, packed rows of at most 64
    # -> first-fit decreasing: [50 + 12], [45], [20]; fills 62, 45, 20 -> widths 64, 48, 48
    rows = [([5] * 40, [6] * 10), ([7] * 40, [8] * 5), ([9] * 15, [3] * 5), ([4] * 10, [2] * 2)]
    pi, pm, ri, rm = make_rows(rows)
    micro = packed_micro_batches(pi, pm, ri, rm, np.arange(4), np.ones(4, bool),
                                 max_width=64, block=16)
    assert [mb.width for mb in micro] == [64, 48, 48]
    assert [int(mb.mask.sum()) for mb in micro] == [62, 45, 20]
    assert [sorted(mb.idx[mb.real].tolist()) for mb in micro] == [[0, 3], [1], [2]]
    # the scored state of row 1's first response token is its last prompt token (id 7)
    mb = micro[1]
    first = mb.score_index[0, 0]
    assert mb.tokens.reshape(-1)[first] == 7 and mb.positions.reshape(-1)[first] == 39
    assert mb.tokens.reshape(-1)[first + 1] == 8


# ----------------------------------------------------------------------------- packed forward
# The packed forward against the per-row forward (`scoring.response_states`) on a tiny random
# model. fp32 tolerances: the two paths run the same operations on the same values, but the
# matmuls and the softmax sums see other shapes (packed rows, a different key count per query
# block: masked keys add exact zeros), so the results differ by summation order only, a few
# fp32 ulps per op; through 2 layers and a log-softmax over V that stays below 1e-5 absolute
# on logprobs / entropies of magnitude ~log V, and gradients agree to 1e-4 of each leaf's scale.

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from strata_jax.models import Qwen2Config, init_params  # noqa: E402
from strata_jax.models.lora import LoraConfig, init_lora, lora_params  # noqa: E402
from strata_jax.training.critic import init_value_head, value_from_hidden  # noqa: E402
from strata_jax.training.scoring import (PackedInputs, packed_response_states,  # noqa: E402
                                         response_logprobs, response_states)

CFG = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4)
LORA = LoraConfig(rank=4, alpha=8)


def tree_rows(seed=0):
    """Rows with an instruction block, two tasks, strategies under one task, own steps and
    responses; a row whose prompt is a prefix of another's, a duplicate and a padding row."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(1, CFG.vocab_size, n).tolist()  # noqa: E731
    inst, t1, t2, s1, s2 = tok(9), tok(5), tok(4), tok(6), tok(3)
    rows = [(inst + t1 + s1 + tok(3), tok(4)),
            (inst + t1 + s1 + tok(5), tok(2)),
            (inst + t1 + s2 + tok(2), tok(5)),
            (inst + t1 + s2, tok(3)),                 # prefix of the previous row's prompt
            (inst + t2 + tok(7), tok(1)),
            (inst + t2 + tok(2), tok(4)),
            (tok(6), tok(3))]                          # shares nothing
    rows.append(rows[1])                               # a duplicate row
    rows.append(([], []))                              # a padding row
    return rows


def perturbed_params(key):
    p = init_params(CFG, key)
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.fold_in(key, x.size),
                                                                 x.shape), p)


def both_paths(max_width, query_chunk=128, lora=False, remat="none", dtype="float32",
               sparse=False):
    """(loss fn of params for the per-row path, same for the packed path, params, base,
    response mask); loss = sum of response logprobs + entropies/10 + values/10 (every output
    the update reads), aux = (lp, ent, values). sparse: the packed path carries the layout's
    block key index (block-sparse attention), else the dense tree rule."""
    rows = tree_rows()
    pi, pm, ri, rm = (jnp.asarray(x) for x in make_rows(rows))
    lay = pack_rows(*make_rows(rows), max_width=max_width)
    packed = PackedInputs(*(jnp.asarray(x) for x in (lay.tokens, lay.positions, lay.mask,
                                                     lay.key_end, lay.score_index(),
                                                     lay.last_index())))
    if sparse:
        packed = PackedInputs(*(jnp.asarray(x) for x in (
            lay.tokens, lay.positions, lay.mask, lay.key_end, lay.score_index(),
            lay.last_index(), lay.key_index(query_chunk))), block=query_chunk)
    key = jax.random.key(3)
    base = perturbed_params(key)
    head = init_value_head(jax.random.key(4), CFG.hidden_size, 1.0)
    params = base
    if lora:
        params = init_lora(CFG, LORA, key)
        params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(key, x.shape, x.dtype),
                              params)

    def outputs(p, states):
        model_p = lora_params(base, p, LORA) if lora else p
        h, last = states(model_p)
        lp, ent = response_logprobs(model_p, CFG, h, ri, rm, temperature=0.9, chunk_size=4,
                                    compute_dtype=dtype)
        v = value_from_hidden(head, last) * (pm.any(1) | rm.any(1))
        return jnp.sum(lp) + 0.1 * jnp.sum(ent) + 0.1 * jnp.sum(v), (lp, ent, v)

    def per_row(p):
        return outputs(p, lambda mp: response_states(mp, CFG, pi, pm, ri, rm, remat=remat,
                                                     compute_dtype=dtype))

    def tree(p):
        return outputs(p, lambda mp: packed_response_states(mp, CFG, packed, remat=remat,
                                                            query_chunk=query_chunk,
                                                            compute_dtype=dtype))

    return per_row, tree, params, np.asarray(rm), lay


@pytest.mark.parametrize("max_width, chunk, lora, remat", [
    (128, 128, False, "none"),     # one packed row, one query block
    (40, 8, False, "none"),        # split tree (ancestor copies), segments across 8-query blocks
    (40, 8, True, "full"),         # LoRA over a frozen base, per-layer remat
])
def test_packed_forward_equals_per_row(max_width, chunk, lora, remat):
    per_row, tree, params, rm, lay = both_paths(max_width, chunk, lora=lora, remat=remat)
    assert lay.num_packed_tokens < lay.num_row_tokens
    if max_width == 40:
        assert lay.tokens.shape[0] > 1   # the tree really is split
    per_row_vg = jax.jit(jax.value_and_grad(per_row, has_aux=True))
    tree_vg = jax.jit(jax.value_and_grad(tree, has_aux=True))
    (l1, (lp1, ent1, v1)), g1 = per_row_vg(params)
    (l2, (lp2, ent2, v2)), g2 = tree_vg(params)
    m = rm.astype(bool)
    print("max |diff| lp, ent, v:", np.abs(np.asarray(lp2 - lp1)).max(),
          np.abs(np.asarray(ent2 - ent1)).max(), np.abs(np.asarray(v2 - v1)).max())
    assert np.abs(np.asarray(lp1)[m]).min() > 0   # real logprobs on every response token
    np.testing.assert_allclose(np.asarray(lp2)[m], np.asarray(lp1)[m], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent2)[m], np.asarray(ent1)[m], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(v2), np.asarray(v1), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(lp2)[~m], 0.0)
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-6)
    leaves1, leaves2 = jax.tree.leaves(g1), jax.tree.leaves(g2)
    assert len(leaves1) == len(leaves2) and len(leaves1) > 0
    worst = 0.0
    for a, b in zip(leaves2, leaves1):
        a, b = np.asarray(a), np.asarray(b)
        scale = np.abs(b).max()
        assert scale > 0
        worst = max(worst, np.abs(a - b).max() / scale)
        assert np.abs(a - b).max() <= 1e-4 * scale + 1e-7, (np.abs(a - b).max(), scale)
    print("max relative gradient diff:", worst)


def test_response_slots_hand_values():
    """N: a two-per-octave bucket of max(n, slots / 2, mark), a multiple of 8 x row_multiple,
    capped at the slots (rounded up to that multiple)."""
    assert response_slots(40, 128) == 64          # the floor: half the slots
    assert response_slots(65, 128) == 96          # 3 x 2^5
    assert response_slots(100, 128) == 128
    assert response_slots(200, 384) == 256        # the ScienceWorld shape: 8 rows x 48
    assert response_slots(300, 384) == 384
    assert response_slots(10, 48, 8) == 64        # 8 shards: a multiple of 64, the cap 64
    assert response_slots(5, 128, 1, 96) == 96     # a mark raises it
    assert response_slots(5, 64, 1, 96) == 64      # never past the slots
    # from the floor up a (P, w) meets at most three sizes, whatever n drifts through
    assert {response_slots(n, 256) for n in range(257)} == {128, 192, 256}


def test_lm_head_on_response_slots_equals_all_positions():
    """`response_logprobs` with slots (the LM head on the real response tokens only, in S rows
    of n, padding entries included, then scattered back) gives every position's logprob and
    entropy, 0 off the mask, and the same gradient, as the head on all B x Tr positions: each
    position's logits depend on its own state only, so only summation order can differ."""
    rows = tree_rows()
    pi, pm, ri, rm = (jnp.asarray(x) for x in make_rows(rows))
    params = perturbed_params(jax.random.key(5))
    b, t = rm.shape
    real = np.flatnonzero(np.asarray(rm).reshape(-1))
    n = -(-(real.size + 3) // 2)                    # S = 2 rows, at least 3 padding entries
    slots = np.full(2 * n, b * t, np.int32)
    slots[:real.size] = real
    slots = jnp.asarray(slots.reshape(2, n))

    def f(p, sl):
        h, _ = response_states(p, CFG, pi, pm, ri, rm)
        lp, ent = response_logprobs(p, CFG, h, ri, rm, temperature=0.9, chunk_size=4, slots=sl)
        return jnp.sum(lp * jnp.arange(1, t + 1)) + 0.1 * jnp.sum(ent), (lp, ent)

    (l1, (lp1, ent1)), g1 = jax.jit(jax.value_and_grad(lambda p: f(p, None), has_aux=True))(
        params)
    (l2, (lp2, ent2)), g2 = jax.jit(jax.value_and_grad(lambda p: f(p, slots), has_aux=True))(
        params)
    m = np.asarray(rm).astype(bool)
    assert np.abs(np.asarray(lp1)[m]).min() > 0
    np.testing.assert_allclose(np.asarray(lp2), np.asarray(lp1), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(ent2), np.asarray(ent1), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(lp2)[~m], 0.0)
    np.testing.assert_array_equal(np.asarray(ent2)[~m], 0.0)
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-6)
    assert _grad_rel_diff(g2, g1) <= 1e-5


def test_lm_head_skips_chunks_of_padding_slots(monkeypatch):
    """Slots padded far past the real response tokens (the fixed response slots of a bounded
    run, dealt round S = 2 rows as `packed_micro_batches` deals them): the same logprobs,
    entropies and gradient as the head on all positions, and the head runs on the chunks that
    hold a real slot only (counted by a callback inside the LM head's matmul)."""
    import strata_jax.models.heads as heads
    rows = tree_rows()
    pi, pm, ri, rm = (jnp.asarray(x) for x in make_rows(rows))
    params = perturbed_params(jax.random.key(6))
    b, t = rm.shape
    real = np.flatnonzero(np.asarray(rm).reshape(-1))
    chunk, n = 4, 64                                # 2 x 64 slots: 16 chunks, most padding
    flat = np.full(2 * n, b * t, np.int32)
    flat[:real.size] = real
    slots = jnp.asarray(flat.reshape(n, 2).T)       # token k at [k % 2, k // 2]
    live_chunks = -(-(-(-real.size // 2)) // chunk)
    assert real.size < 2 * n and live_chunks < n // chunk

    def f(p, sl):
        h, _ = response_states(p, CFG, pi, pm, ri, rm)
        lp, ent = response_logprobs(p, CFG, h, ri, rm, temperature=0.9, chunk_size=chunk,
                                    slots=sl)
        return jnp.sum(lp * jnp.arange(1, t + 1)) + 0.1 * jnp.sum(ent), (lp, ent)

    (l1, (lp1, ent1)), g1 = jax.jit(jax.value_and_grad(lambda p: f(p, None), has_aux=True))(
        params)
    (l2, (lp2, ent2)), g2 = jax.jit(jax.value_and_grad(lambda p: f(p, slots), has_aux=True))(
        params)
    np.testing.assert_allclose(np.asarray(lp2), np.asarray(lp1), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(ent2), np.asarray(ent1), atol=1e-6, rtol=0)
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-6)
    assert _grad_rel_diff(g2, g1) <= 1e-5
    calls = []
    logits = heads._logits

    def counted(h, w):
        jax.debug.callback(lambda: calls.append(1))
        return logits(h, w)
    monkeypatch.setattr(heads, "_logits", counted)
    jax.block_until_ready(jax.jit(lambda p: f(p, slots)[1])(params))
    assert len(calls) == live_chunks, (len(calls), live_chunks)


def _grad_rel_diff(g_a, g_b):
    """Largest |a - b| / max|b| over the gradient leaves (each leaf has a nonzero scale)."""
    la, lb = jax.tree.leaves(g_a), jax.tree.leaves(g_b)
    assert len(la) == len(lb) and len(la) > 0
    worst = 0.0
    for a, b in zip(la, lb):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b).max() > 0
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    return worst


@pytest.mark.parametrize("max_width, chunk, lora, remat", [
    (128, 8, False, "none"),       # one packed row; 7 of its 12 blocks gather their keys
    (40, 4, False, "none"),        # a tree split across 3 packed rows, segments across blocks
    (64, 8, True, "full"),         # split in 2, LoRA over a frozen base, per-layer remat
    (40, 6, False, "full"),        # packed widths not whole blocks: the last block padded
])
def test_block_sparse_forward_equals_dense_rule_and_per_row(max_width, chunk, lora, remat):
    """The block-sparse attention (key index) against the dense tree rule (no index) and the
    per-row forward: the same keys are visible, the left-out ones had probability exactly 0,
    so only summation order differs. Against per-row: the dense rule's tolerances above
    (logprobs / entropies / values 1e-5 absolute, loss 1e-6 relative, every gradient leaf 1e-4
    of its scale). Against the dense rule, the same matmul shapes outside the attention:
    2e-6 absolute and 1e-5 of each gradient leaf's scale (a few fp32 ulps of log V)."""
    per_row, sparse, params, rm, lay = both_paths(max_width, chunk, lora=lora, remat=remat,
                                                  sparse=True)
    _, dense, _, _, _ = both_paths(max_width, chunk, lora=lora, remat=remat)
    a = lay.key_index(chunk).shape[2]
    assert sum(1 for i in range(0, lay.width, chunk) if a < i) > 0   # some block skips keys
    if chunk == 6:
        assert lay.width % chunk != 0
    if max_width < 128:
        assert lay.tokens.shape[0] > 1
    res = {}
    for name, fn in (("per_row", per_row), ("dense", dense), ("sparse", sparse)):
        (loss, aux), g = jax.jit(jax.value_and_grad(fn, has_aux=True))(params)
        res[name] = (float(loss), [np.asarray(x) for x in aux], g)
    m = rm.astype(bool)
    for ref, atol, gtol in (("dense", 2e-6, 1e-5), ("per_row", 1e-5, 1e-4)):
        (l1, (lp1, ent1, v1), g1), (l2, (lp2, ent2, v2), g2) = res[ref], res["sparse"]
        print(f"sparse vs {ref}: max |diff| lp {np.abs(lp2 - lp1).max():.2e} ent "
              f"{np.abs(ent2 - ent1).max():.2e} v {np.abs(v2 - v1).max():.2e}, relative "
              f"gradient {_grad_rel_diff(g2, g1):.2e}")
        np.testing.assert_allclose(lp2[m], lp1[m], atol=atol, rtol=0)
        np.testing.assert_allclose(ent2[m], ent1[m], atol=atol, rtol=0)
        np.testing.assert_allclose(v2, v1, atol=atol, rtol=0)
        np.testing.assert_array_equal(lp2[~m], 0.0)
        np.testing.assert_allclose(l2, l1, rtol=1e-6)
        assert _grad_rel_diff(g2, g1) <= gtol
    assert np.abs(res["per_row"][1][0][m]).min() > 0   # real logprobs on every response token


def test_block_sparse_block_mismatch_raises():
    _, sparse, params, _, _ = both_paths(40, 4, sparse=True)
    rows = tree_rows()
    lay = pack_rows(*make_rows(rows), max_width=40)
    packed = PackedInputs(*(jnp.asarray(x) for x in (
        lay.tokens, lay.positions, lay.mask, lay.key_end, lay.score_index(), lay.last_index(),
        lay.key_index(4))), block=4)
    with pytest.raises(ValueError, match="built for query blocks of 4"):
        packed_response_states(params, CFG, packed, query_chunk=8)
    # an index whose block count does not fit the width
    bad = PackedInputs(*(jnp.asarray(x) for x in (
        lay.tokens, lay.positions, lay.mask, lay.key_end, lay.score_index(), lay.last_index(),
        lay.key_index(4)[:, :3])), block=4)
    with pytest.raises(ValueError, match="must be \\[B, nblocks, A\\]"):
        packed_response_states(params, CFG, bad)


def test_micro_row_counts():
    from strata_jax.training.prefix_tree import micro_row_counts
    assert micro_row_counts(11, 4, 2) == [4, 4, 4]      # 3 left -> 2 x 2 (a power of two)
    assert micro_row_counts(9, 4, 2) == [4, 4, 2]
    assert micro_row_counts(5, 8, 2) == [8]             # 3 x 2 -> 2 x 4, capped at 8
    assert micro_row_counts(3, 3, 2) == [4]             # rows_per_micro rounded up to 2 x 2
    assert micro_row_counts(7, 1) == [1] * 7
    assert micro_row_counts(0, 4, 2) == []
    with pytest.raises(ValueError, match="must be >= 1"):
        micro_row_counts(3, 0)


@pytest.mark.parametrize("rows_per_micro, row_multiple", [(1, 1), (2, 1), (2, 2), (3, 4)])
def test_packed_micro_batches_partition_the_rows(rows_per_micro, row_multiple):
    from strata_jax.training.prefix_tree import micro_row_counts, packed_micro_batches
    rows = tree_rows(seed=2)
    pi, pm, ri, rm = make_rows(rows)
    idx = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0], np.int32)   # two padding entries
    real = np.arange(idx.size) < 9
    micro = packed_micro_batches(pi, pm, ri, rm, idx, real, max_width=40,
                                 rows_per_micro=rows_per_micro, row_multiple=row_multiple)
    one = packed_micro_batches(pi, pm, ri, rm, idx, real, max_width=40)
    assert len(one) > 1                        # the budget splits the tree
    # the same packed rows, grouped P at a time (P from micro_row_counts), padding rows added
    assert [mb.tokens.shape[0] for mb in micro] == micro_row_counts(len(one), rows_per_micro,
                                                                    row_multiple)
    assert sum(int(mb.mask.any(1).sum()) for mb in micro) == len(one)
    seen = []
    for mb in micro:
        n_p, w = mb.tokens.shape
        assert n_p % row_multiple == 0 and w <= 40 and mb.num_slots == n_p * w
        assert mb.idx.size == mb.real.size == mb.score_index.shape[0] == mb.last_index.size
        assert mb.key_index.shape[0] == n_p
        empty = ~mb.mask.any(1)                # all-padding packed rows see only themselves
        np.testing.assert_array_equal(mb.key_end[empty], np.broadcast_to(np.arange(1, w + 1),
                                                                         (int(empty.sum()), w)))
        tokens, positions = mb.tokens.reshape(-1), mb.positions.reshape(-1)
        for i, r in zip(mb.idx[mb.real], np.flatnonzero(mb.real)):
            p, resp = rows[i]
            seq = p + resp
            if not seq:
                continue
            seen.append(int(i))
            n_r = len(resp)
            # response column j is scored by the row's previous token; the last token is last
            np.testing.assert_array_equal(tokens[mb.score_index[r, :n_r]], seq[len(p) - 1:-1])
            np.testing.assert_array_equal(positions[mb.score_index[r, :n_r]],
                                          np.arange(len(p) - 1, len(seq) - 1))
            assert tokens[mb.last_index[r]] == seq[-1]
            # a row's tokens all sit in one packed row
            assert len(set(mb.score_index[r, :n_r] // w) | {mb.last_index[r] // w}) == 1
        assert (mb.score_index[~mb.real] == 0).all() and (mb.last_index[~mb.real] == 0).all()
        # the LM head's positions: every real response token (row r, column j) once, row-major,
        # as r * wr + j, then m * wr padding, dealt round the S = row_multiple rows (token k at
        # [k % S, k // S]); S x n a bucket of 8 x S
        m, wr = mb.idx.size, mb.response_width
        want = [r * wr + j for r in np.flatnonzero(mb.real)
                for j in range(len(rows[mb.idx[r]][1]))]
        slot = mb.response_slot
        assert slot.dtype == np.int32 and slot.shape[0] == row_multiple
        assert slot.size == response_slots(len(want), m * wr, row_multiple)
        assert len(want) <= slot.size <= -(-m * wr // (8 * row_multiple)) * 8 * row_multiple
        np.testing.assert_array_equal(slot.T.reshape(-1)[:len(want)], want)
        assert (slot.T.reshape(-1)[len(want):] == m * wr).all()
    # every real row with tokens in exactly one micro-batch (the empty padding row in none)
    assert sorted(seen) == [i for i in range(9) if rows[i][0] or rows[i][1]]


def test_packed_forward_bf16_tolerance():
    """bfloat16 compute: both paths round every activation to 8 mantissa bits (2^-8 relative
    per rounding), in a different order, so they agree only to bf16 round-off carried through
    the layers: 1e-2 absolute on logprobs / entropies of magnitude ~log V, 2e-2 on values of
    scale ~1; the fp32 tests above are the exactness check."""
    per_row, tree, params, rm, _ = both_paths(40, 8, dtype="bfloat16")
    _, (lp1, ent1, v1) = jax.jit(per_row)(params)
    _, (lp2, ent2, v2) = jax.jit(tree)(params)
    m = rm.astype(bool)
    print("bf16 max |diff| lp, ent, v:", np.abs(np.asarray(lp2 - lp1)).max(),
          np.abs(np.asarray(ent2 - ent1)).max(), np.abs(np.asarray(v2 - v1)).max())
    np.testing.assert_allclose(np.asarray(lp2)[m], np.asarray(lp1)[m], atol=1e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(ent2)[m], np.asarray(ent1)[m], atol=1e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(v2), np.asarray(v1), atol=2e-2, rtol=0)


def test_marks_pad_later_micro_batches_up_to_the_largest_shapes_met():
    """With a marks dict kept across calls, a micro-batch of a (P, w) met before takes the
    largest rows m, response columns wr and key slots A met for that (P, w): padding only (the
    same packed tokens, the same indices of the real rows, zeros / -1 past them), and the
    marks hold the maxima. Two calls: all nine rows, then three short ones."""
    from strata_jax.training.prefix_tree import packed_micro_batches
    rows = tree_rows(seed=2)
    pi, pm, ri, rm = make_rows(rows)
    every = np.arange(9, dtype=np.int32), np.ones(9, bool)
    few = np.array([0, 1, 2], np.int32), np.ones(3, bool)
    kw = dict(max_width=40, rows_per_micro=1, block=8)

    def shape(mb):
        return mb.idx.size, mb.response_width, mb.key_index.shape[2], mb.response_slot.size

    zero = (0, 0, 0, 0)

    def maxima(micro, key):
        out = {}
        for mb in micro:
            k = (key, mb.tokens.shape[0], mb.width)
            out[k] = tuple(max(x, y) for x, y in zip(out.get(k, zero), shape(mb)))
        return out

    def slots(mb):        # (row, column) of each real response slot
        s = mb.response_slot.reshape(-1)
        s = s[s < mb.idx.size * mb.response_width]
        return np.stack([s // mb.response_width, s % mb.response_width], 1)
    marks = {}
    first = packed_micro_batches(pi, pm, ri, rm, *every, marks=marks, mark_key="t", **kw)
    # the marks: per (key, P, w) the largest (m, wr, A, N) of the first call's micro-batches
    want = maxima(first, "t")
    assert marks == want
    plain = packed_micro_batches(pi, pm, ri, rm, *few, **kw)
    padded = packed_micro_batches(pi, pm, ri, rm, *few, marks=marks, mark_key="t", **kw)
    # within the first call too: a micro-batch is at least every earlier one of its (P, w)
    for i, mb in enumerate(first):
        for prev in first[:i]:
            if prev.width == mb.width:
                assert all(x >= y for x, y in zip(shape(mb), shape(prev)))
    assert len(padded) == len(plain)
    grew = 0
    for a, b in zip(padded, plain):
        assert a.width == b.width
        key = ("t", b.tokens.shape[0], b.width)
        # a (P, w) the first call met pads up to its marks; a new one keeps its own shapes
        assert shape(a) == tuple(max(x, y) for x, y in zip(want.get(key, zero), shape(b)))
        grew += shape(a) != shape(b)
        for f in ("tokens", "positions", "mask", "key_end"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
        n, wr, k, _ = shape(b)
        # the same response tokens scored, each at its own (row, column); the rest padding
        np.testing.assert_array_equal(slots(a), slots(b))
        assert (a.response_slot.reshape(-1)[len(slots(b)):] == a.idx.size * a.response_width).all()
        np.testing.assert_array_equal(a.idx[:n], b.idx)
        np.testing.assert_array_equal(a.real[:n], b.real)
        assert not a.real[n:].any() and (a.idx[n:] == 0).all()
        np.testing.assert_array_equal(a.score_index[:n, :wr], b.score_index)
        assert (a.score_index[n:] == 0).all()   # columns past wr: masked by the responses
        np.testing.assert_array_equal(a.last_index[:n], b.last_index)
        np.testing.assert_array_equal(a.key_index[..., :k], b.key_index)
        assert (a.key_index[..., k:] == -1).all()
    assert grew >= 1                 # the marks do pad the short call
    # another mark key keeps its own marks: the short call's own maxima, not the first's
    other = packed_micro_batches(pi, pm, ri, rm, *few, marks=marks, mark_key="s", **kw)
    own = maxima(plain, "s")
    assert {k: v for k, v in marks.items() if k[0] == "s"} == own
    short = maxima(plain, "t")       # the short call raised what it met, per (P, w)
    merged = {k: tuple(max(x, y) for x, y in zip(want.get(k, zero), short.get(k, zero)))
              for k in {**want, **short}}
    assert {k: v for k, v in marks.items() if k[0] == "t"} == merged
    assert [shape(mb) for mb in other] == [shape(mb) for mb in plain]


def test_slots_without_rows_drops_the_skipped_rows_tokens_and_keeps_the_shape():
    from strata_jax.training.prefix_tree import packed_micro_batches, slots_without_rows
    # batch rows 0..3, responses of 3, 2, 4, 1 tokens; row 1 and row 3 have their pi_old
    rows = [([5] * 6, [6] * 3), ([5] * 6, [7] * 2), ([5] * 4, [8] * 4), ([9] * 3, [3] * 1)]
    pi, pm, ri, rm = make_rows(rows)
    (mb,) = packed_micro_batches(pi, pm, ri, rm, np.arange(4), np.ones(4, bool), max_width=64,
                                 row_multiple=2)
    skip = np.array([False, True, False, True])
    out = slots_without_rows(mb, skip)
    assert out.shape == mb.response_slot.shape and out.dtype == np.int32
    m, wr = mb.idx.size, mb.response_width
    none = m * wr

    def cells(s):   # (batch row, column) of each real slot, in dealing order
        flat = s.T.reshape(-1)
        flat = flat[flat < none]
        return [(int(mb.idx[f // wr]), int(f % wr)) for f in flat]

    before, after = cells(mb.response_slot), cells(out)
    assert len(before) == 10
    assert after == [c for c in before if c[0] in (0, 2)] and len(after) == 7
    # dealt round the S = 2 rows again: the real slots fill the first columns of both rows
    assert sorted((out < none).sum(1).tolist()) == [3, 4]
    assert np.array_equal(slots_without_rows(mb, np.zeros(4, bool)), mb.response_slot)
