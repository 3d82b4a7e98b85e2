"""A Python process that imports torch, transformers and the other libraries once, then forks a child for
each script run the tests ask for (tests/conftest.py's `start` and `run`): the child is `python script args`
from the moment the libraries are imported, without the ~6 s a new interpreter spends importing them.

None of this repository's modules are imported here, so each child imports common.py, lib/ and the script
afresh, as a new interpreter does, and ends as one does: an uncaught exception or `sys.exit("error: ...")`
prints to its stderr and exits 1, the script's atexit functions run.

Protocol, one line at a time: this process says `ready` once its imports are done; the test process writes
a request as JSON (argv, cwd, env, stdout and stderr file paths); this process answers `pid N` once the child
is forked and `exit N CODE` when it ends (CODE as subprocess gives it: negative for a signal). It stops when
its stdin closes.
"""
import gc
import json
import os
import select
import sys

import datasets  # noqa: F401  (the libraries the scripts import)
import matplotlib.pyplot  # noqa: F401
import numpy  # noqa: F401
import peft  # noqa: F401
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import tqdm  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaForCausalLM  # noqa: F401


def run_child(request: dict):
    """In the forked child: the script's files, directory, environment and argv, then the script as __main__.
    Never returns: the script's end (or its exception) ends the interpreter."""
    import runpy

    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
        opened = os.open(path, flags)
        if opened != fd:  # fd 0 is free (the requests' pipe was closed), so the first open may land on it
            os.dup2(opened, fd)
            os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def main():
    requests_in, answers = 0, os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing printed here can mix into the answers
    answers.write("ready\n")
    pending = b""
    while True:
        while True:  # report the children that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            answers.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
        readable, _, _ = select.select([requests_in], [], [], 0.01)
        if not readable:
            continue
        data = os.read(requests_in, 1 << 16)
        if not data:  # the test process is gone
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            answers.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                answers.close()
                os.close(requests_in)
                run_child(request)
            answers.write(f"pid {pid}\n")


if __name__ == "__main__":
    # Speed: the libraries' objects, imported once here, are moved out of the garbage collector's generations, so
    # a child's collections no longer scan them (about 0.7 s of a 10 s grpo.py run here); they live as long as the
    # process anyway.
    gc.freeze()
    main()
