"""StraTA on a built-in text env (default `memory_key`, whose vault code is shown ONLY in the first
observation; envs_bridge/builtin.py). The CPU learning study's setting (studies/learning/run.py).

Command (CPU; behaviour cloning: 1500 steps, once, then cached):
    python sft.py   --config=configs/builtin.py:tiny           # warm start only (cached)
    python train.py --config=configs/builtin.py:tiny           # StraTA from the warm start
    python train.py --config=configs/builtin.py:tiny,grpo,matched   # GRPO, same episode budget
    python -m studies.learning.run                              # StraTA vs GRPO curves + PNG
Expected: under non-cumulative prompts (history window 2) the code scrolls out of the prompt
before the vault, so a policy without a strategy can only guess it (1 in 10 with the tiny
variant's 1-digit code, 1 in 1000 with 3); StraTA's strategy, written at step 1, can carry it.
Measured numbers: studies/learning/README.md.

Variants (comma-separated, configs/base.py:apply_variant): :tiny, an algo (:grpo, ...),
:matched, ablations, key=value (e.g. ``env.name=grid_nav``).
"""
from configs import base


def tiny(c):
    """CPU setting: tiny random Qwen2 shape + offline tokenizer, behaviour-cloning warm start."""
    c.workdir = "runs/builtin_tiny"
    c.iterations = 10
    c.model.path = ""
    c.model.preset = "tiny"
    c.model.dtype = "float32"
    c.model.tokenizer = "offline"
    c.model.remat = False
    c.model.warm_start = "sft"
    c.mesh = base.ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.env.max_steps = 8            # corridor 3-5 rooms + the code: optimal 4-6 steps
    c.env.code_digits = 1          # a policy that forgot the code guesses right 1 time in 10
    c.env.max_prompt_tokens = 512
    c.env.num_workers = 8
    c.rollout.tasks_per_batch = 4
    c.rollout.num_strategies = 2
    c.rollout.episodes_per_strategy = 4
    c.rollout.oversample = 2
    c.rollout.group_size = 8       # = N * M: the matched episode budget
    c.rollout.max_action_tokens = 32
    c.rollout.max_strategy_tokens = 48
    c.rollout.max_judge_tokens = 16
    c.optim.mini_batch_size = 64
    c.optim.micro_batch_rows = 16
    c.optim.lr = 1e-4              # from scratch: a larger step than a pretrained model's 1e-5
    c.loss.kl_coef = 0.0           # no KL term, so no reference-policy scoring pass (DAPO-style)
    c.ckpt.every = 5
    c.eval.every = 0
    # A shorter warm start (400 steps x 256 episodes) leaves the code digit at chance in every
    # row; 1500 steps x 512 episodes (once, cached) starts copying it into the strategy.
    c.sft.episodes = 512
    c.sft.steps = 1500
    c.sft.log_every = 100
    c.sft.lr = 5e-3
    c.sft.noise = 0.15


def get_config(arg: str | None = None):
    c = base.get_base_config()
    c.env.name = "memory_key"
    c.env.code_digits = 3          # memory_key only (other built-ins ignore it)
    c.env.code_attempts = 0        # memory_key: tries before the keypad locks (0 = unlimited;
                                   # 1 caps a policy without the code at chance)
    c.env.corridor_rooms = ""      # memory_key: "lo-hi" corridor lengths ("" = 3-5; longer = unseen worlds)
    c.env.max_steps = 10
    c.env.max_prompt_tokens = 1024
    c.adv.gigpo_step_norm = "mean_std_norm"
    c.workdir = "runs/builtin"
    return base.apply_variant(c, arg, tiny_fn=tiny)
