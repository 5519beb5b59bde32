"""strata-jax: pure-JAX RL for LLM agents on long-horizon text environments.

Data flow (one iteration):  rollout (sampler <-> envs_bridge) -> SampleBatch -> advantages
-> losses -> sharded train step -> checkpoints / metrics.  Subpackages:

- ``models``    Qwen2 / Qwen2.5 decoder, config parsing, HF checkpoint loading and export, tokenizer.
- ``sampling``  batched KV-cache sampler: jitted prefill + decode loop.
- ``rollout``   agent loop: prompts, strategy sampling (FPS), episodes, self-judgment.
- ``algos``     advantage estimators and losses, pure jitted functions.
- ``training``  train state, update step, critic, reference model, checkpoints, metrics.
"""

__version__ = "0.1.0"
