"""envs_bridge: text environments stepped outside jit (docs/design.md §8, docs/method.md §11).

Public API: Task, Env, TextEnv, PromptPieces, EnvError (base); register_env, make_env,
list_envs (registry); parse_action (parsing); TaskSampler (sampler); EnvPool, StepOutcome,
Ticket (pool). Adapters: envs_bridge.scienceworld_env, .alfworld_env,
.agentgym_http, .builtin (imported lazily by the registry).
"""
from envs_bridge.base import Env, EnvError, PromptPieces, Task, TextEnv
from envs_bridge.parsing import ParsedAction, contains_cjk, parse_action
from envs_bridge.pool import EnvPool, StepOutcome, Ticket
from envs_bridge.registry import get_env_factory, list_envs, make_env, register_env
from envs_bridge.task_sampler import TaskSampler

__all__ = [
    "Env", "EnvError", "PromptPieces", "Task", "TextEnv", "ParsedAction", "contains_cjk", "parse_action",
    "EnvPool", "StepOutcome", "Ticket", "get_env_factory", "list_envs", "make_env",
    "register_env", "TaskSampler",
]
