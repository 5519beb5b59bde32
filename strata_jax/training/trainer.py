"""The update half of an iteration: scoring passes, advantages, mini-batched PPO steps.

Flow of `Trainer.update(state, batch, ref_params)` (docs/method.md §9): replayed rows appended
(STAPO's pool, off by default: replay.py) and the batch padded to the config's shape bounds
(bounds.py: one program per shape from the first iteration on), then
1. `score_batch` (steps.py; no grad): pi_old logprobs (§9.1; not of the rows no loss term
   reads, `inert.unread_rows`), reference logprobs (kl_coef != 0), critic values and their
   dropout std, filled in BEFORE the estimator runs.
2. `advantages` (steps.py): the estimator registry; value targets from ``row/value_targets``.
3. `ppo_epochs` passes; each shuffles the valid rows into mini-batches of `mini_batch_size`
   step samples (evenly split), with the strategy samples spread evenly over the mini-batches
   (`minibatch_plan`, batching.py).
4. one optimizer step per mini-batch, gradients accumulated over micro-batches; a non-finite
   step is skipped and counted in metrics["skipped_steps"].

The scoring passes and the micro-batches run over prefix-tree packed rows (prefix_tree/,
docs/design.md §12.1): each shared prompt prefix is computed once, exactly the per-row
objective (§9); the per-row forward (`Trainer(per_row=True)`) is the tests' reference.

Everything jitted is a pure function of (state, arrays), the configs static (steps.py);
`Trainer` holds the static pieces and the mesh, places batches and states, runs the host plan.

LoRA (cfg.lora.rank > 0, models/lora.py): `state.params` holds only the adapters (opt_state
their AdamW moments); the frozen base is passed as `ref_params`, is the KL reference for free,
and every forward runs ``lora_params(base, adapters)`` (W x + scale * B A x, never merged; the
sampler gets the merged copy via `policy_params`). A PPO critic trunk is its own adapters.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strata_jax import buckets
from strata_jax.algos import SampleBatch, pad_rows
from strata_jax.distributed import host_values
from strata_jax.models import Qwen2Config, init_params, param_shardings
from strata_jax.models.lora import apply_lora, init_lora, lora_shardings
from strata_jax.sharding import logical_to_spec
from strata_jax.training.batching import (fit_to_bounds, host_ids, minibatch_plan,
                                         num_minibatches)
from strata_jax.training.inert import inert_rows, unread_rows
from strata_jax.training.bounds import ShapeBounds
from strata_jax.training.config import TrainConfig
from strata_jax.training.critic import init_critic
from strata_jax.training.prefix_tree import (PackedMicroBatch, packed_micro_batches,
                                             parse_shape_marks, slots_without_rows)
from strata_jax.training.replay import ReplayPool, replay_draw, replay_merge, replay_metrics
from strata_jax.training.scoring import PackedInputs
from strata_jax.training.state import TrainState, create_train_state, make_optimizer
from strata_jax.training.per_row import gather_rows, minibatch_step, score_batch
from strata_jax.training.update_metrics import update_metrics
from strata_jax.training.steps import (Scores, accumulate_micro, advantages, apply_step,
                                       gather_chunk, gather_micro, minibatch_counts,
                                       scatter_scores, score_rows, zero_carry)

Params = dict[str, Any]
log = logging.getLogger(__name__)

_merge = jax.jit(apply_lora, static_argnums=(2, 3))


# ----------------------------------------------------------------------------- the trainer


@dataclasses.dataclass
class Trainer:
    """Static pieces of the update (model and train configs, mesh) around the pure jitted steps.

    Args:
      model: Qwen2Config of the policy (and of the PPO critic).
      cfg: TrainConfig (``TrainConfig.from_config(c)``).
      mesh: device mesh (`strata_jax.sharding.make_mesh`); None = default device, no sharding.
      per_row: run the plain per-row forward instead of the packed prefix tree (every row at
        the batch's width, micro_batch_rows rows per micro-batch): the same numbers up to float
        summation order, more work; the tests' reference, not a production path.
      bounds: the config's `ShapeBounds`: `update` pads the batch and each packed micro-batch of
        a pass to one shape (`batching.fit_to_bounds`), so programs compile once; None: marks.

    Attributes:
      shape_marks: per (pass, P, W) of the packed update, the largest (rows, response columns,
        key slots, response slots) its micro-batches met (`packed_micro_batches`' marks): later
        ones pad up to them, so the programs plateau. Host state, saved in the checkpoint's
        meta (`host_state` / `set_host_state`) so a resumed run pads as the uninterrupted one.
    """

    model: Qwen2Config
    cfg: TrainConfig
    mesh: Mesh | None = None
    per_row: bool = False
    bounds: ShapeBounds | None = None
    shape_marks: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    replay: ReplayPool = dataclasses.field(default_factory=ReplayPool, repr=False, compare=False)

    def host_state(self) -> dict:
        """The trainer's host state as a JSON-able dict (a checkpoint's "trainer_state"):
        {"shape_marks": [[pass, P, W, m, wr, A, N], ...]}, and `ReplayPool.host_state`'s."""
        marks = [[k[0], k[1], k[2], *v] for k, v in sorted(self.shape_marks.items(),
                                                            key=lambda kv: str(kv[0]))]
        return {"shape_marks": marks, **self.replay.host_state(self.cfg.replay)}

    def set_host_state(self, host: dict | None, step: int | None = None) -> None:
        """Restore `host_state`'s dict of a checkpoint at iteration `step` (None: unknown;
        None host, or a checkpoint from before it existed, leaves the marks empty; a mark of an
        older checkpoint without N gets N = 0, raised by the next micro-batch). Raises
        ValueError on a mark that is not [pass, P, W, m, wr, A, N] and on a replay pool the
        pool refuses (`ReplayPool.set_host_state`: token ids beyond this model's vocabulary,
        rows of later iterations than `step`, ...)."""
        self.shape_marks = parse_shape_marks((host or {}).get("shape_marks"))
        self.replay.set_host_state(host, self.cfg.replay, vocab_size=self.model.vocab_size,
                                   step=step)

    # -- state -------------------------------------------------------------------------

    @property
    def lora(self) -> bool:
        """True when the trainable params are LoRA adapters (cfg.lora.rank > 0)."""
        return self.cfg.lora.enabled

    @property
    def needs_reference(self) -> bool:
        """Whether `update` needs ``ref_params``: the KL penalty is on (loss.kl_coef != 0; the
        reference is the initial policy, frozen: docs/method.md §8.2) or LoRA is (the frozen
        base the adapters ride on, which is also the KL reference)."""
        return bool(self.cfg.loss.kl_coef) or self.lora

    @property
    def score_chunk(self) -> int:
        """Rows per scoring chunk (cfg.score_rows, else the micro-batch size): the multiple a
        multi-host global batch's row count is padded to (`distributed.global_batch`)."""
        return self.cfg.score_rows or self.cfg.micro_batch_rows

    def init_state(self, params: Params, key: jax.Array) -> TrainState:
        """A fresh `TrainState` from policy params (step 0): critic per cfg.critic_kind (PPO: a
        copy of params + head), zero optimizer moments, rng = a uint32 [2] key derived from key.
        Everything is placed with `state_shardings` when a mesh is set.
        LoRA: `params` is the frozen base; the state's params are fresh adapters (B = 0)."""
        key = jnp.asarray(key, jnp.uint32)
        if self.lora:
            params = init_lora(self.model, self.cfg.lora, jax.random.fold_in(key, 0x10A))
        k_head, k_state = jax.random.split(key)
        critic = init_critic(self.cfg.critic_kind, params, k_head, self.model.hidden_size,
                             self.cfg.value_head_init_std)

        def build(params, critic, rng):
            return create_train_state(params, critic, rng, self.cfg)

        # Always committed to explicit shardings (SingleDeviceSharding without a mesh), so a
        # fresh and a restored state hit the same compiled update.
        abstract = jax.eval_shape(build, params, critic, k_state)
        shardings = self.state_shardings(abstract)
        return jax.jit(build, out_shardings=shardings)(params, critic, k_state)

    def abstract_state(self, params_like: Params | None = None) -> TrainState:
        """``jax.ShapeDtypeStruct`` tree of the state with this trainer's target shardings
        (the restore target for orbax; works for any device count / mesh). params_like: the
        params tree or its ShapeDtypeStructs (default: float32 random-init shapes); with LoRA
        the base (ignored: the state's params are the adapters)."""
        if params_like is None:
            params_like = jax.eval_shape(lambda k: init_params(self.model, k),
                                         jax.random.PRNGKey(0))
        params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_like)
        cfg = self.cfg
        if self.lora:  # params_like is the base; the state holds adapters
            params_like = jax.eval_shape(lambda k: init_lora(self.model, cfg.lora, k),
                                         jax.random.PRNGKey(0))

        def build(params):
            critic = init_critic(cfg.critic_kind, params, jax.random.PRNGKey(0),
                                 self.model.hidden_size, cfg.value_head_init_std)
            return create_train_state(params, critic, jax.random.PRNGKey(0), cfg)

        abstract = jax.eval_shape(build, params_like)
        shardings = self.state_shardings(abstract)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abstract, shardings)

    def state_shardings(self, state_like: TrainState) -> TrainState:
        """NamedSharding per leaf of a state: params (and the PPO critic trunk) by the logical
        rules, optimizer moments like their params, everything else replicated."""
        if self.mesh is None:
            # What jit gives unsharded arrays: restored states then hit the same compile cache.
            single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            return jax.tree.map(lambda _: single, state_like)
        mesh = self.mesh
        rep = NamedSharding(mesh, PartitionSpec())
        trainable = lora_shardings if self.lora else param_shardings
        ps = trainable(state_like.params, self.model, mesh)
        cs = {}
        if state_like.critic_params:
            cs = {"head": jax.tree.map(lambda _: rep, state_like.critic_params["head"])}
            if "trunk" in state_like.critic_params:
                cs["trunk"] = trainable(state_like.critic_params["trunk"], self.model, mesh)
        tx, ctx = make_optimizer(self.cfg), make_optimizer(self.cfg, critic=True)
        os_ = optax.tree_map_params(tx, lambda _, s: s, state_like.opt_state, ps,
                                    transform_non_params=lambda _: rep)
        cos = {}
        if state_like.critic_params:
            cos = optax.tree_map_params(ctx, lambda _, s: s, state_like.critic_opt_state, cs,
                                        transform_non_params=lambda _: rep)
        return TrainState(params=ps, opt_state=os_, critic_params=cs, critic_opt_state=cos,
                          step=rep, rng=rep)

    # -- batch placement -----------------------------------------------------------------

    def put_batch(self, batch: SampleBatch) -> SampleBatch:
        """device_put every field with rows over the ("data", "fsdp") mesh axes (replicated when
        the row count does not divide)."""
        if self.mesh is None:
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            return jax.tree.map(lambda x: jax.device_put(x, dev), batch)

        def put(x):
            x = np.asarray(x) if not isinstance(x, jax.Array) else x
            spec = logical_to_spec(("batch",) + (None,) * (x.ndim - 1), x.shape, self.mesh)
            return jax.device_put(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(put, batch)

    def policy_params(self, state: TrainState, base: Params | None = None) -> Params:
        """Params of the current policy for the sampler / export: state.params, or with LoRA
        the base with the adapters merged (jitted ``apply_lora``, merged weights in the base's
        dtype, sharded like the base). Raises ValueError when LoRA is on and base is None."""
        if not self.lora:
            return state.params
        if base is None:
            raise ValueError("LoRA is on: policy_params needs the frozen base params")
        dtype = base["embed"].dtype
        with self._ctx():
            return _merge(base, state.params, self.cfg.lora, dtype)

    def _ctx(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    # -- prefix-tree packing ------------------------------------------------------------

    def batch_shards(self) -> int:
        """How many ways the mesh splits a batch dimension (the "batch" logical rule's mesh
        axes, data x fsdp; 1 without a mesh)."""
        if self.mesh is None:
            return 1
        from strata_jax.sharding import LOGICAL_RULES
        sizes = dict(self.mesh.shape)
        return int(np.prod([sizes.get(a, 1) for a in LOGICAL_RULES["batch"] or ()]))

    def pack_shape(self, rows: int, tp: int, tr: int, tokens: int = 0) -> tuple[int, int, int]:
        """(W, P, shards) of the packed micro-batches for a budget of `tokens` slots (0: `rows`
        per-row rows of tp + tr columns): `buckets.pack_shape` over this trainer's batch shards
        with cfg.pack_width (0: the budget over the shards, a power of two capped at 2048)."""
        shards = self.batch_shards()
        width, rows_per_micro = buckets.pack_shape(rows, tp, tr, shards, self.cfg.pack_width,
                                                   tokens)
        return width, rows_per_micro, shards

    def _packed_inputs(self, mb: PackedMicroBatch, old_slot=None) -> PackedInputs:
        """The device `PackedInputs` of a host `PackedMicroBatch` (and its `old_slot`): the
        [P, w] rows, the key index and the slots sharded over the batch shards (P is a multiple
        of them), the gather indices replicated."""
        arrays = (mb.tokens, mb.positions, mb.mask, mb.key_end, mb.score_index, mb.last_index,
                  mb.key_index, mb.response_slot, old_slot)
        if self.mesh is None:
            return PackedInputs(*(x if x is None else jnp.asarray(x) for x in arrays),
                                block=mb.block)
        rep = NamedSharding(self.mesh, PartitionSpec())

        def put(x, rowwise):
            if not rowwise:
                return jax.device_put(x, rep)
            spec = logical_to_spec(("batch",) + (None,) * (x.ndim - 1), x.shape, self.mesh)
            return jax.device_put(x, NamedSharding(self.mesh, spec))

        return PackedInputs(*(x if x is None else put(x, i not in (4, 5))
                              for i, x in enumerate(arrays)), block=mb.block)

    # -- the update ----------------------------------------------------------------------

    def on_policy(self, batch: SampleBatch) -> bool:
        """True when the update is exactly on-policy: one epoch of one mini-batch (so pi_old is
        the trainer's current logprob and the PPO ratio is 1 by construction), unless
        cfg.recompute_old asks for the old-logprob pass anyway. A collective on multi-host."""
        cfg = self.cfg
        if cfg.recompute_old or cfg.ppo_epochs != 1:
            return False
        valid, kind = host_values(batch.valid), host_values(batch.kind)
        return num_minibatches(valid, kind, cfg.mini_batch_size) == 1

    def score(self, state: TrainState, batch: SampleBatch, ref_params: Params | None,
              key: jax.Array, use_old: bool = True, stored_old: np.ndarray | None = None
              ) -> SampleBatch:
        """Pad rows, place the batch, and fill old/ref logprobs and values.

        Only the passes something reads run: the old-logprob pass when use_old, the reference
        pass when loss.kl_coef != 0, the critic when there is one; with none of them the batch
        is only padded and placed (no forward). The rows run as prefix-tree packed micro-batches
        (`_packed_score`; the value-std dropout masks drawn per packed chunk); `per_row`: as
        chunks of cfg.score_rows rows at the batch's width (`score_batch`). Invalid rows, which
        nothing reads, keep 0 logprobs on the packed path; so do the rows of `stored_old` ([R]
        bool or None: rows whose pi_old the caller has, replayed rows), which the packed path
        leaves out of the old pass's LM head, and out of every pass when no other reads them.
        Raises ValueError when LoRA is on or loss.kl_coef != 0 and ref_params is None."""
        cfg = self.cfg
        chunk = self.score_chunk
        use_ref = bool(cfg.loss.kl_coef)
        if self.lora and ref_params is None:
            raise ValueError("LoRA is on (lora.rank > 0): pass the frozen base params as "
                             "ref_params (the model the adapters ride on and the KL reference)")
        if use_ref and ref_params is None:
            raise ValueError("loss.kl_coef != 0 needs ref_params (the frozen initial policy "
                             "params); pass them to update() or set loss.kl_coef = 0")
        batch = self.put_batch(pad_rows(batch, chunk))
        if not (use_old or use_ref or cfg.critic_kind != "none"):
            return batch
        ref = ref_params if use_ref or self.lora else None
        static = dict(model=self.model, cfg=cfg, use_ref=use_ref, use_old=use_old)
        with self._ctx():
            if self.per_row:
                return score_batch(state.params, state.critic_params, ref, batch, key,
                                   chunk_rows=chunk, **static)
            # score_rows set: its rows at the batch's width; else the update's micro-batch budget
            tokens = 0 if cfg.score_rows else cfg.micro_batch_tokens
            return self._packed_score(state, batch, ref, key, chunk, tokens, static, stored_old)

    def _plan(self, ids: tuple, idx: np.ndarray, real: np.ndarray, rows: int,
              mark_key: str, tokens: int = 0) -> list[PackedMicroBatch]:
        """The packed micro-batches of rows idx[real] (`prefix_tree.packed_micro_batches`) at
        the token budget `tokens` (0: `rows` rows of the batch's width; `pack_shape`), padded
        up to this trainer's `shape_marks` of `mark_key` ("score" or "train": separate
        programs). ids: the batch's host (prompt_ids, prompt_mask, response_ids, response_mask)."""
        width, rows_per_micro, shards = self.pack_shape(rows, ids[0].shape[1], ids[2].shape[1],
                                                        tokens)
        fixed = self.bounds.micro_rows(mark_key, shards) if self.bounds is not None else 0
        return packed_micro_batches(*ids, idx, real, max_width=width,
                                    rows_per_micro=rows_per_micro, row_multiple=shards,
                                    response_floor=self.cfg.response_floor,
                                    marks=self.shape_marks, mark_key=mark_key, fixed_rows=fixed)

    def _packed_score(self, state, batch, ref, key, chunk, tokens, static, stored_old=None):
        """`score` over prefix-tree packed micro-batches of the valid rows (a token budget of
        `tokens` slots, or when 0 of `chunk` rows at the batch's width, each): the same scores,
        each shared prefix computed once; the value-std dropout masks are drawn per packed
        chunk; rows of `stored_old` get no old-pass head (no pass when nothing else reads)."""
        ids, real = host_ids(batch), host_values(batch.valid)
        stored = None if stored_old is None else np.pad(   # score's pad_rows: rows after it
            stored_old, (0, batch.num_rows - stored_old.shape[0]))
        if stored is not None and not (static["use_ref"] or self.cfg.critic_kind != "none"):
            real, stored = real & ~stored, None
        plan = self._plan(ids, np.arange(batch.num_rows), real, chunk, "score", tokens)
        scores = Scores(jnp.zeros_like(batch.old_logprobs), jnp.zeros_like(batch.ref_logprobs),
                        jnp.zeros_like(batch.values), jnp.zeros_like(batch.value_std))
        for j, mb in enumerate(plan):
            i, r = jnp.asarray(mb.idx), jnp.asarray(mb.real)
            chunk_rows = gather_chunk(batch, i, r, widths=(1, mb.response_width))
            new = score_rows(state.params, state.critic_params, ref, chunk_rows,
                             jax.random.fold_in(key, j), self._packed_inputs(
                                 mb, None if stored is None else slots_without_rows(mb, stored)),
                             **static)
            scores = scatter_scores(scores, i, r, new)
        return batch.replace(**scores._asdict())

    def train_on_batch(self, state: TrainState, batch: SampleBatch, adv: jax.Array,
                       weights: jax.Array, targets: jax.Array, key: jax.Array,
                       base: Params | None = None, on_policy: bool = False
                       ) -> tuple[TrainState, list[dict]]:
        """Epochs x mini-batches of optimizer steps on a scored batch with given advantages.

        Each mini-batch's rows are packed into a prefix tree (`prefix_tree.packed_micro_batches`)
        and run as micro-batches of P packed rows of W slots (`pack_shape`: the token budget
        cfg.micro_batch_tokens, or when 0 micro_batch_rows rows at the batch's width; shapes
        padded up to `shape_marks`), one
        `accumulate_micro` each, then `apply_step`: the per-row step up to float summation
        order, each shared prefix computed once. `per_row`: `train_minibatch` over micro-batches
        of micro_batch_rows rows at the batch's width.

        Args: batch scored (`score`); adv, weights, targets [R] f32; key: shuffling PRNGKey;
        base: the frozen base params when LoRA is on (else ignored); on_policy: the batch was
        scored without the old-logprob pass (`Trainer.on_policy`; must plan one mini-batch).
        Returns (state, per-step metric dicts of device scalars, each with host ints
        "computed_tokens" (the slots the forward ran over: packed rows x W, or rows x columns)
        and "real_tokens" (prompt + response tokens of its real rows); a mini-batch of only
        `inert.inert_rows` is not run and gives ``{"empty": True}``; the packed path computes
        no inert row). Does not advance state.step.
        """
        cfg = self.cfg
        m = cfg.micro_batch_rows
        # host_values: a multi-host global batch is gathered (every process plans the same steps).
        valid, kind = host_values(batch.valid), host_values(batch.kind)
        inert = inert_rows(adv, weights, cfg)
        ids = host_ids(batch)   # on the host once (every process: the same plan)
        pm, rm = ids[1], ids[3]
        n_tokens = np.sum(pm, axis=1) + np.sum(rm, axis=1)
        tp, tr = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        seed = int(jax.device_get(jax.random.randint(key, (), 0, 2 ** 31 - 1)))
        rng = np.random.default_rng(seed)
        base = base if self.lora else None
        out = []
        with self._ctx():
            for _ in range(cfg.ppo_epochs):
                for idx, real in minibatch_plan(valid, kind, cfg.mini_batch_size, m, rng):
                    # the rows that feed the loss (the packed path computes only those; the
                    # normalisers count every real row)
                    live = real if inert is None else real & ~inert[idx]
                    if not live.any():
                        out.append({"empty": True})   # no gradient: no optimizer step
                        continue
                    live = real if self.per_row else live
                    real_tokens = int(np.sum(n_tokens[idx[live]]))
                    inert_tokens = int(np.sum(n_tokens[idx[real & ~live]]))
                    if self.per_row:
                        mb, a, w, t = gather_rows(batch, adv, weights, targets, jnp.asarray(idx),
                                                  jnp.asarray(real))
                        step = minibatch_step(cfg)   # train_minibatch, state donated or not
                        state, met = step(state, mb, a, w, t, base, model=self.model, cfg=cfg,
                                          on_policy=on_policy)
                        # micro-batches holding a real row run at the batch's width
                        computed = int(real.reshape(-1, m).any(1).sum()) * m * (tp + tr)
                    else:
                        packed = self._plan(ids, idx, live, m, "train", cfg.micro_batch_tokens)
                        state, met = self._packed_step(state, batch, adv, weights, targets,
                                                       idx, real, packed, base, on_policy)
                        computed = sum(p.num_slots for p in packed)
                    out.append(dict(met, computed_tokens=computed, real_tokens=real_tokens,
                                    inert_tokens=inert_tokens))
        return state, out

    def _packed_step(self, state, batch, adv, weights, targets, idx, real,
                     packed: list[PackedMicroBatch], base, on_policy):
        """One optimizer step from prefix-tree packed micro-batches (`train_on_batch`): the
        whole mini-batch's normalisers, one `accumulate_micro` per
        packed row with the rows it carries, then `apply_step`."""
        cfg, model = self.cfg, self.model
        norms, n_values = minibatch_counts(batch, jnp.asarray(idx), jnp.asarray(real))
        carry = zero_carry(state.params, state.critic_params, cfg=cfg)
        for mb in packed:
            b, a, w, t = gather_micro(batch, adv, weights, targets, jnp.asarray(mb.idx),
                                      jnp.asarray(mb.real), widths=(1, mb.response_width))
            carry = accumulate_micro(carry, state.params, state.critic_params, b, a, w, t, norms,
                                     n_values, base, self._packed_inputs(mb), model=model,
                                     cfg=cfg, on_policy=on_policy)
        return apply_step(cfg)(state, carry, cfg=cfg)

    def update(self, state: TrainState, batch: SampleBatch, ref_params: Params | None = None
               ) -> tuple[TrainState, dict[str, float]]:
        """One iteration's update: score, advantages, epochs of mini-batch steps; step += 1.

        Redundant work is skipped (same result): all-padding columns are dropped
        (`trim_padding`, cfg.trim_padding), the old-logprob pass is not run when the update is
        exactly on-policy (`on_policy`; pi_old = the step's own logprobs under stop_gradient)
        and leaves out the rows no loss term reads (`inert.unread_rows`), the reference pass
        only runs when loss.kl_coef != 0.

        Args: state; batch: the iteration's SampleBatch (numpy or jax; any row count);
        ref_params: frozen initial policy params (needed when loss.kl_coef != 0, and always with
        LoRA, where they are the base the adapters ride on).
        Returns (new state, metrics: host floats — means over optimizer steps of the loss
        metrics, `skipped_steps` (non-finite steps not applied), `optimizer_steps`,
        `empty_steps` (mini-batches with no gradient, not run: `inert.inert_rows`),
        `perf/inert_tokens` (tokens of the rows the packed update did not compute),
        `perf/unscored_inert_rows` (rows the old-logprob pass left out, `inert.unread_rows`),
        advantage metrics of the estimator, `mismatch/sampler_abs` = mean |sampler - trainer| logprob
        over loss tokens, `kl/whole_batch` and `replay/*` (`replay_metrics`; the replay pool:
        docs/method.md §7.5)). Raises ValueError when kl_coef != 0 and ref_params is None."""
        rng, k_score, k_plan = jax.random.split(jnp.asarray(state.rng, jnp.uint32), 3)
        batch, draw = replay_draw(self.replay, batch, state, self.cfg)   # pool rows appended
        batch = fit_to_bounds(batch, None if self.per_row else self.bounds,   # packed path only
                              self.cfg.response_floor, self.score_chunk, self.cfg.trim_padding)
        on_policy = self.on_policy(batch) and not draw.rows   # replayed: pi_old is stored
        stored = draw.stored_old(batch.num_rows, self.cfg.replay.enabled)
        with self._ctx():   # on-policy too (no old pass then): one program set either way
            unread = None if self.per_row else unread_rows(draw.split_scored(batch)[1],
                                                           state.step, self.cfg)
        unread = None if on_policy else unread
        if unread is not None:      # rows whose pi_old no loss term reads: not scored
            stored = unread if stored is None else stored | unread
        scored, est = draw.split_scored(self.score(   # est: the iteration's own rows
            state, batch, ref_params, k_score, use_old=not on_policy, stored_old=stored))
        with self._ctx():
            adv, w, adv_m = advantages(est, state.step, algo=self.cfg.estimator_name,
                                       est=self.cfg.estimator)
        adv, w, targets = replay_merge(self.replay, draw, est, adv, w, adv_m, self.cfg)
        state, steps = self.train_on_batch(state, scored, adv, w, targets, k_plan, ref_params,
                                           on_policy=on_policy)
        state = state.replace(step=state.step + 1, rng=rng)
        metrics = update_metrics(steps, adv_m, est, on_policy, unread)
        metrics.update(replay_metrics(self.replay, draw, scored, est, on_policy, metrics, self.cfg))
        if metrics["skipped_steps"]:
            log.warning("iteration %d: skipped %d of %d optimizer steps with a non-finite loss or "
                        "gradient (params and optimizer state left unchanged)",
                        int(state.step), int(metrics["skipped_steps"]),
                        int(metrics["optimizer_steps"]))
        return state, metrics


__all__ = ["Trainer"]
