"""StraTA on ScienceWorld (docs/method.md §5, paper setting).

Command (paper setting, Qwen2.5-1.5B-Instruct, 8 GPUs or a TPU v4-32 slice; ~150 iterations):
    python train.py --config=configs/sciworld.py --config.model.path=/ckpt/Qwen2.5-1.5B-Instruct
Expected: ScienceWorld mean final score rises over training (the source reports 63.5 for
Qwen2.5-7B; swap the model path for the 7B setting, see docs/running.md).

Variants (comma-separated, see configs/base.py:apply_variant):
    :tiny        CPU smoke run, no downloads: a tiny Qwen2-shape model with the offline Qwen
                 tokenizer, behaviour-cloned on the gold paths of 2 ScienceWorld train tasks
                 (250 SFT steps, cached in runs/warm_start/<fingerprint>), then sigma=2, N=2, M=2, 4 env steps,
                 32 new tokens, 3 iterations; minutes on a laptop-class CPU (the warm start
                 once, then the iterations). Its figures:
                 benchmarks/results/tiny_main_job/README.md.
    :grpo / :gigpo / :rloo / :ppo / :dapo / :stapo    baselines (group_size episodes / task: 8; :tiny 4)
    :matched     baselines with the StraTA episode budget (group_size = N*M = 32)
    :vanilla / :diverse / :judgment / :full    StraTA ablations;  :mean   top-delta -> mean
"""
from configs import base

# Tasks of the tiny run: the two shortest gold paths in the AgentGym list
# (docs/method.md §11.1): find-non-living-thing (5 steps) and lifespan-longest-lived (6).
TINY_TASKS = ("find-non-living-thing", "lifespan-longest-lived")


def tiny(c):
    """The README's main job: real ScienceWorld end to end on a small CPU, no downloads."""
    c.workdir = "runs/sciworld_tiny"
    c.iterations = 3
    c.model.path = ""
    c.model.preset = "tiny"
    c.model.dtype = "float32"
    c.train.compute_dtype = "float32"
    c.rollout.sampler_dtype = "float32"
    c.model.tokenizer = "offline"
    c.model.remat = False
    # Behaviour cloning on the tiny tasks' gold paths first (strata_jax/training/sft/), so the
    # actions reach ScienceWorld from iteration 1; trained once, cached in sft.cache_dir
    # (runs/warm_start/<fingerprint>), which every variant and eval of this setting finds.
    c.model.warm_start = "sft"
    c.sft.episodes = 16
    c.sft.steps = 250
    c.sft.batch_size = 8
    c.sft.lr = 5e-3                # from scratch; pretrained checkpoints use ~1e-5
    c.sft.warmup_steps = 10
    c.sft.noise = 0.15
    c.mesh = base.ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.env.tasks = TINY_TASKS
    c.env.max_steps = 4
    c.env.max_prompt_tokens = 1024
    c.env.num_workers = 4
    c.rollout.tasks_per_batch = 2
    c.rollout.num_strategies = 2
    c.rollout.episodes_per_strategy = 2
    c.rollout.oversample = 2
    c.rollout.group_size = 4
    c.rollout.max_action_tokens = 32
    c.rollout.max_strategy_tokens = 32
    c.rollout.max_judge_tokens = 32
    c.optim.mini_batch_size = 64
    c.optim.micro_batch_rows = 16
    c.optim.lr = 1e-4
    c.ckpt.every = 1
    c.eval.every = 0
    # eval.py: 16 episodes per family (32 in all): a family's success rate moves in steps of
    # 1/16, its standard error at most 0.125
    c.eval.max_tasks = 0
    c.eval.episodes_per_family = 16


def get_config(arg: str | None = None):
    c = base.get_base_config()
    c.env.name = "scienceworld"
    c.env.max_steps = 30
    c.env.max_prompt_tokens = 4096
    c.adv.gigpo_step_norm = "mean_norm"
    c.workdir = "runs/sciworld"
    return base.apply_variant(c, arg, tiny_fn=tiny)
