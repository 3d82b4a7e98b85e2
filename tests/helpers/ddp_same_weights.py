"""Run a script's main() under torchrun, then check that every process ends with the same weights.

    torchrun --nproc_per_node 2 tests/helpers/ddp_same_weights.py grpo --max_steps 2 ...
"""
import importlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import common  # noqa: E402

script = importlib.import_module(sys.argv[1])
model = script.main(common.parse_config(script.Config, sys.argv[2:]))
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, flat)
if dist.get_rank() == 0:
    same = all(torch.equal(gathered[0], other) for other in gathered[1:])
    print(f"{dist.get_world_size()} processes, {flat.numel()} weights: {'identical' if same else 'DIFFERENT'}")
dist.destroy_process_group()
