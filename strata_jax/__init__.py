"""strata-jax: pure-JAX RL for LLM agents on long-horizon text environments.

Data flow (one iteration):  rollout (sampler <-> envs_bridge) -> SampleBatch -> advantages
-> losses -> sharded update -> metrics / checkpoints.  Subpackages:

- ``models``      Qwen2 / Qwen2.5 decoder and KV cache, HF and GGUF loading, export, the model
                  fetcher, tokenizer, LoRA.
- ``sampling``    batched KV-cache sampler: jitted prefill + one decode loop, shared prefixes.
- ``rollout``     agent loop: prompts, strategy sampling (FPS), episodes, self-judgment, revision.
- ``algos``       the batch contract, advantage estimators and losses (pure functions), and the
                  algorithm table.
- ``training``    train state, scoring, update steps, Trainer, critic, checkpoints, behaviour
                  cloning (``training.sft``).
- ``evaluation``  the eval protocol, its test-time strategy scaling, eval.py's job.

Run assembly (what train.py / eval.py / sft.py call): ``cli`` (flags, one-line errors),
``config`` (the strict config reader), ``validation`` (checks before anything is built),
``experiment`` (builds a run from a config), ``warm_start`` (the cached behaviour-cloning warm
start). Beside them: ``metrics`` (JSONL + TensorBoard), ``trajectories`` (the episode viewer),
``sharding`` and ``distributed`` (meshes, multi-host). The envs live in the top-level
``envs_bridge`` package.
"""

__version__ = "0.1.0"
