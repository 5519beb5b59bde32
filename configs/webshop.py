"""StraTA on WebShop through an AgentGym WebShop server (docs/method.md §5 and §11.3).

Start the AgentGym webshop server yourself (it needs the WebShop product data), then:
    python train.py --config=configs/webshop.py --config.env.server_url=http://127.0.0.1:36001
Expected (7B): success ~84.2%, score ~91.2 (source). Variants as in configs/sciworld.py.
"""
from configs import base


def get_config(arg: str | None = None):
    c = base.get_base_config()
    c.env.name = "webshop"
    c.env.server_url = "http://127.0.0.1:36001"
    c.env.max_steps = 15
    c.env.max_prompt_tokens = 4096
    c.adv.gigpo_step_norm = "mean_norm"
    c.workdir = "runs/webshop"
    return base.apply_variant(c, arg)
