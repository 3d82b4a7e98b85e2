"""The shape the design card promises: each RL script holds its own rollout and log-prob pass.

ppo.py, grpo.py and mix.py each define generate (the sampling loop) and completion_logprobs (the
scoring pass) with their speed-up helpers, so a reader follows a whole step without leaving the
file. common.py keeps the same functions for evaluation, sft.py and reward_model.py. The copies
must stay identical, letter for letter once `common.` is dropped, and the training loops must call
their own copies."""
import ast
import inspect
import os
import re

import common
import grpo
import mix
import ppo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLLOUT = ("generate", "completion_logprobs", "chunk_logprobs", "prompt_cache", "prompts_repeat")
RL_SCRIPTS = {"ppo.py": ppo, "grpo.py": grpo, "mix.py": mix}


def _source(function) -> str:
    return re.sub(r"\bcommon\.", "", inspect.getsource(function))


def test_rollout_copies_are_identical():
    for name in ROLLOUT:
        reference = _source(getattr(common, name))
        for script, module in RL_SCRIPTS.items():
            assert _source(getattr(module, name)) == reference, f"{script}'s {name} differs from common.py's"


def test_each_rl_step_calls_its_own_rollout_and_logprobs():
    """main of each RL script calls generate and completion_logprobs by their bare names (defined
    in the script itself), never common's copies."""
    for script, module in RL_SCRIPTS.items():
        tree = ast.parse(open(os.path.join(ROOT, script)).read())
        main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
        calls = [node.func for node in ast.walk(main) if isinstance(node, ast.Call)]
        bare = {f.id for f in calls if isinstance(f, ast.Name)}
        via_common = {f.attr for f in calls if isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "common"}
        assert {"generate", "completion_logprobs"} <= bare, script
        assert not ({"generate", "completion_logprobs"} & via_common), script
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert set(ROLLOUT) <= defined, script
