"""The explorer and the trainer of async_rl.py as two processes, and what passes between them
(Trinity-RFT's layout, from its code: the notes give only MIX's two buffers; docs/async.md). No loss
or gradient is computed here; the schedule decides which weights sample each batch.

    schedule       which weights version samples each batch (sync_interval, sync_offset, max_staleness),
                   and which versions the trainer publishes
    Pair           the two processes' torch.distributed group (gloo, rank 0 the trainer, rank 1 the
                   explorer): objects (a batch of experiences, held-out scores) and weights sent between
                   them; a send never waits for the other side, a receive does. Once the two have
                   met, a peer that died stops this one with one sentence (PeerStopped), not a hang;
                   before they meet, the launcher or torchrun stops the one left waiting (or, started
                   by hand, --pair_timeout_minutes does).
    launch         `python async_rl.py` starts the two processes itself; under torchrun (2 processes, on
                   one machine or two) torchrun has started them.

The group is built from torch.distributed's own store and gloo process group, not by
init_process_group: the trainer's run machinery (lib/harness.py) reads the default group as the
trainer's data-parallel processes, and the explorer is not one of them.
"""
import contextlib
import datetime
import os
import pickle
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

TRAINER, EXPLORER = 0, 1  # the two ranks
NAMES = ("the trainer", "the explorer")
STOP_GRACE_SECONDS = 10  # launch: how long a process may outlive its failed peer
START, EXPERIENCE, SCORES, WEIGHTS = 1, 2, 3, 4  # message tags: each kind arrives in the order it was sent


# ---------------------------------------------------------------------------------------------
# The schedule: who samples with which weights
# ---------------------------------------------------------------------------------------------
def version_for_batch(i: int, sync_interval: int, sync_offset: int, max_staleness: int | None = None) -> int:
    """The weights version that samples batch i (i = 1, 2, ...; the trainer's step i trains on it,
    starting from version i - 1; version k = the weights after k trainer steps). The explorer takes new
    weights at every sync_interval-th batch and runs sync_offset batches ahead of the trainer, so its weights are
    sync_offset or more versions behind (Trinity-RFT's names):

        v(i) = max(0, sync_interval * floor((i - 1 - sync_offset) / sync_interval))
        with max_staleness s:  v(i) = max(v(i), i - 1 - s)     (the explorer waits for that version)

    sync_interval 1, sync_offset 0: v(i) = i - 1, every batch from the newest weights: the synchronous
    loop. sync_offset 1: v(i) = i - 2 from batch 2 on, one batch sampled while the trainer trains on the
    one before."""
    version = max(0, (i - 1 - sync_offset) // sync_interval * sync_interval)
    return version if max_staleness is None else max(version, i - 1 - max_staleness)


def staleness(i: int, *schedule) -> int:
    """How many updates the weights that sampled batch i are behind the trainer's at step i:
    (i - 1) - v(i). 0: on-policy."""
    return i - 1 - version_for_batch(i, *schedule)


def published_versions(max_steps: int, eval_steps: int, *schedule) -> list[int]:
    """The versions the trainer sends the explorer, in order: those that sample a batch, and those
    the held-out evaluation scores (every eval_steps, and the last), version 0 first."""
    sampling = {version_for_batch(i, *schedule) for i in range(1, max_steps + 1)}
    evaluated = {k for k in range(1, max_steps + 1) if k % eval_steps == 0 or k == max_steps}
    return sorted(sampling | evaluated | {0})


# ---------------------------------------------------------------------------------------------
# The pair's group and its messages
# ---------------------------------------------------------------------------------------------
class PeerStopped(SystemExit):
    """The other process stopped (its own message says why): this one stops too, with one sentence."""


class Pair:
    """This process's end of the pair: a torch.distributed gloo group of two processes. send_object and
    send_weights return at once (the message leaves while this process works on); receive_object and
    receive_weights wait for theirs. Messages of one tag arrive in the order they were sent."""

    def __init__(self, rank: int, address: str, port: int, timeout_minutes: float):
        self.rank, self.peer = rank, 1 - rank
        self.peer_name = NAMES[1 - rank]
        self.pending = []  # sends in flight, with the buffers they read (kept alive until sent)
        timeout = datetime.timedelta(minutes=timeout_minutes)
        # Under torchrun its agent already serves a store at MASTER_ADDR:MASTER_PORT: both join it as clients.
        serves = rank == TRAINER and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        with self.watch():
            store = dist.TCPStore(address, port, 2, serves, timeout=timeout)
            self.group = dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2, timeout)

    @contextlib.contextmanager
    def watch(self):
        """Turn a failed receive or send (the peer's connection closed) into PeerStopped."""
        try:
            yield
        except RuntimeError as error:  # gloo: "Connection closed by peer", "Connection reset by peer", a timeout
            if "imeout" in str(error) or "imed out" in str(error):
                raise PeerStopped(f"error: {NAMES[self.rank]} waited --pair_timeout_minutes for {self.peer_name} and "
                                  "stops (is it stuck, or was it never started?)") from None
            raise PeerStopped(f"error: {self.peer_name} stopped, so {NAMES[self.rank]} stops too (its message above "
                              "says why; --resume continues from the last checkpoint, if one was written)") from None

    def send_object(self, obj, tag: int):
        """Send any picklable object (a batch, scores): its size, then its bytes."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        with self.watch():
            self.pending += [(self.group.send([size], self.peer, tag), size),
                             (self.group.send([data], self.peer, tag), data)]
        self.pending = [(work, buffer) for work, buffer in self.pending if not work.is_completed()]

    def receive_object(self, tag: int):
        size = torch.zeros(1, dtype=torch.int64)
        with self.watch():
            self.group.recv([size], self.peer, tag).wait()
            data = torch.empty(int(size), dtype=torch.uint8)
            self.group.recv([data], self.peer, tag).wait()
        return pickle.loads(data.numpy().tobytes())

    def send_weights(self, weights: torch.Tensor):
        """weights: one flat CPU tensor (flat_weights), sent as it is: the receiver knows its size."""
        with self.watch():
            self.pending.append((self.group.send([weights], self.peer, WEIGHTS), weights))

    def receive_weights(self, into: torch.Tensor) -> torch.Tensor:
        with self.watch():
            self.group.recv([into], self.peer, WEIGHTS).wait()
        return into

    def close(self):
        """Wait until every message sent has left (the peer received it); the group goes with the process."""
        with self.watch():
            for work, _ in self.pending:
                work.wait()
        self.pending = []


def flat_weights(model) -> torch.Tensor:
    """The trained parameters (all, or LoRA's adapters) as one flat float32 CPU tensor: what a weights
    version is, on the wire and in a checkpoint."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters() if p.requires_grad])


@torch.no_grad()
def load_flat_weights(model, weights: torch.Tensor):
    """The inverse of flat_weights: copy them into the model's trained parameters, in place."""
    start = 0
    for p in (p for p in model.parameters() if p.requires_grad):
        p.copy_(weights[start:start + p.numel()].view_as(p))
        start += p.numel()


# ---------------------------------------------------------------------------------------------
# The two processes
# ---------------------------------------------------------------------------------------------
def role() -> tuple[int, str, int] | None:
    """(rank, address, port) of this process when it is one of the pair (torchrun's variables, or
    launch's), removed from the environment so the trainer's run machinery sees one process;
    None in a plain `python async_rl.py`, which launches the pair."""
    if "RANK" not in os.environ:
        return None
    rank, world_size = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE", "2"))
    if world_size != 2:
        raise SystemExit(f"error: async_rl.py runs one trainer and one explorer, two processes; torchrun started "
                         f"{world_size} (torchrun --nproc_per_node 2, or --nnodes 2 --nproc_per_node 1 across two "
                         "machines)")
    for name in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"):
        os.environ.pop(name, None)
    return rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def launch() -> int:
    """Start this script twice, as the trainer (rank 0) and the explorer (rank 1), with torchrun's
    variables, each with half the CPU's threads unless OMP_NUM_THREADS says otherwise, and wait for both.
    When one stops with an error, the other stops on its next message (Pair.watch); one still running
    STOP_GRACE_SECONDS later (waiting to meet a peer that died first, or in a long step) is stopped here,
    as torchrun stops the rest of a group whose process failed. Returns the first non-zero exit status."""
    with socket.socket() as s:  # a free port for the pair's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    processes = [subprocess.Popen([sys.executable, *sys.argv],
                                  env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "OMP_NUM_THREADS": threads})
                 for rank in (TRAINER, EXPLORER)]
    failed_at = None
    try:
        while any(p.poll() is None for p in processes):
            if failed_at is None and any(p.poll() for p in processes):  # one stopped with an error
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > STOP_GRACE_SECONDS:
                for rank, p in enumerate(processes):
                    if p.poll() is None:
                        p.terminate()
                        print(f"error: {NAMES[1 - rank]} stopped, and {NAMES[rank]} had not stopped "
                              f"{STOP_GRACE_SECONDS} s later, so it was stopped", file=sys.stderr)
            time.sleep(0.1)
    except KeyboardInterrupt:  # Ctrl-C reached the children too: let them stop
        pass
    codes = [p.wait() for p in processes]
    return next((1 if code < 0 else code for code in codes if code), 0)  # < 0: killed by a signal
