"""Run several scripts' main() one after another in the same torchrun processes (one start-up and one
process group for all of them), each announced on rank 0 by a line `=== run <i>`.

    torchrun --nproc_per_node 2 tests/helpers/run_mains.py runs.json

runs.json: a list of [script, arg, arg, ...], e.g. [["grpo", "--max_steps", "2", "--output_dir", "out/a"]].
"""
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import common  # noqa: E402
from lib import distributed  # noqa: E402

distributed.setup()  # the process group first, so that rank 0 alone prints the markers
with open(sys.argv[1]) as f:
    runs = json.load(f)
for i, (name, *args) in enumerate(runs):
    if distributed.is_main_process():
        print(f"=== run {i}", flush=True)
    script = importlib.import_module(name)
    script.main(common.parse_config(script.Config, args))
