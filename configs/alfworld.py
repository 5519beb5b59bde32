"""StraTA on ALFWorld (docs/method.md §5; needs the ALFWorld game data: set ALFWORLD_DATA).

Command (Qwen2.5-1.5B/7B-Instruct on 8 GPUs or a TPU slice; 150 iterations):
    python train.py --config=configs/alfworld.py --config.model.path=/ckpt/Qwen2.5-7B-Instruct
Expected: success rate rising towards the source's 90.7% (1.5B) / 93.1% (7B).
Variants as in configs/sciworld.py (grpo, gigpo, matched, vanilla, ...).
"""
from configs import base


def get_config(arg: str | None = None):
    c = base.get_base_config()
    c.env.name = "alfworld"
    c.env.max_steps = 50
    c.env.max_prompt_tokens = 2048
    c.adv.gigpo_step_norm = "mean_std_norm"
    c.workdir = "runs/alfworld"
    return base.apply_variant(c, arg)
