"""Run a script's main() under torchrun, then check that every process ends with the same weights.

    torchrun --nproc_per_node 2 tests/helpers/ddp_same_weights.py grpo --max_steps 2 ...
    torchrun --nproc_per_node 2 tests/helpers/ddp_same_weights.py runs.json

runs.json: several runs one after another in the same processes (one start-up, one process group), a list of
[script, arg, arg, ...]; rank 0 announces each with a line `=== run <i>` before its own output.
"""
import importlib
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import common  # noqa: E402
from lib import distributed  # noqa: E402

if sys.argv[1].endswith(".json"):
    with open(sys.argv[1]) as f:
        runs = json.load(f)
else:
    runs = [sys.argv[1:]]
distributed.setup()  # the process group first, so that rank 0 alone prints the markers
for i, (name, *args) in enumerate(runs):
    if len(runs) > 1 and dist.get_rank() == 0:
        print(f"=== run {i}", flush=True)
    script = importlib.import_module(name)
    model = script.main(common.parse_config(script.Config, args))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    if dist.get_rank() == 0:
        same = all(torch.equal(gathered[0], other) for other in gathered[1:])
        print(f"{dist.get_world_size()} processes, {flat.numel()} weights: {'identical' if same else 'DIFFERENT'}",
              flush=True)
dist.destroy_process_group()
