"""What the scripts share besides common.py: read rollout.py first, the rest only when a script's
call leads there.

    rollout.py       the rollout and the log-prob pass: how the policy writes, and the log-probability
                     it gives each token (most scripts call these two)
    harness.py       the machinery of a training run: the output folder, checkpoints and --resume,
                     the evaluation schedule, the NaN stop, logging (no number of the algorithm)
    distributed.py   several processes under torchrun: DDP, FSDP, the sums and means over processes
    checks.py        bad input stopped in one sentence: before anything is written, or at the step
                     where a non-finite score appears
    synchronizer.py  async_rl.py's two processes, the explorer and the trainer: which weights sample
                     each batch, and the batches, weights and scores sent between them
    steps.py         a worked answer's steps (its lines, then the answer), their exact labels on the
                     shipped arithmetic, and the token that ends each: what process rewards read
"""
