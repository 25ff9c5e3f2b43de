"""The rank side of strategy "ddp": what a rank started by torchrun (or accelerate, deepspeed)
does before and after the command loop every rank runs (`nbtrain.rank.loop.serve`).

The launcher (`nbtrain/placements/script.py`) writes a bootstrap script into the launch's private
directory; the bootstrap calls `rank_main`, which points the rank's output at the notebook's
named pipes, reads the job, and hands a failure to the launcher while restarts remain.
"""
from __future__ import annotations

import os
import sys
import traceback

from ..common import protocol
from ..common.transfer import unpack_job
from .loop import serve
from .process import die_with_parent, enable_stacks, limit_threads, redirect_output
from .rendezvous import STORE_VAR

PAYLOAD = "job.pkl"  # the dill payload, in the launch's private directory


def pipe_name(stream: str, local_rank) -> str:
    """The named pipe the notebook reads for one local rank's stdout or stderr."""
    return f"{stream}-{local_rank}"


def rank_main(job_dir: str, parent: int) -> None:
    """A rank started by the launcher (pid `parent`): output to the notebook's pipes, then the
    job; exits."""
    die_with_parent(parent)
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1"))  # DeepSpeed's launcher's name for it
    local = os.environ["LOCAL_RANK"]
    out, err = (_open_pipe(os.path.join(job_dir, pipe_name(stream, local))) for stream in ("stdout", "stderr"))
    redirect_output(out, err)
    os.close(out)
    os.close(err)
    enable_stacks()
    limit_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
    with open(os.path.join(job_dir, PAYLOAD), "rb") as f:
        payload = f.read()

    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) and STORE_VAR not in os.environ:
        _fresh_keys_per_attempt()  # on one node, the private store has a file per attempt already

    def load_job():
        fn, args, kwargs = unpack_job(payload)
        return (_leave_to_launcher(fn) if _restarts_left() else fn), args, kwargs

    _exit(serve(protocol.Run(0, True, load_job), once=True, exits=True))


def _exit(code: int) -> None:
    """Exit after the report: Python's atexit handlers run (loggers flush), C++ static
    destructors do not. Under torch 2.13 a gloo rank often aborts in them ("terminate called
    without an active exception"), and torchrun would then stop peers still reporting."""
    import atexit

    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: B036 - a failing handler must not keep the rank alive
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _open_pipe(path: str) -> int:
    # Non-blocking open fails at once if the notebook is not reading; writes then block as usual.
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    os.set_blocking(fd, True)
    return fd


def _restarts_left() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))


def _fresh_keys_per_attempt() -> None:
    """A restarted rank's `init_process_group("...")` (env://) gets keys of its own attempt.

    With static rendezvous torchrun keeps one store across restarts, and the keys the failed
    attempt left there (its ranks' gloo addresses) make the new attempt hang or connect to
    dead peers. Wrapping env:// in a per-attempt PrefixStore covers user code and Lightning
    alike, which call init_process_group themselves.
    """
    import torch.distributed as dist

    registry = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers  # no public way to wrap one
    original, attempt = registry["env"], os.environ["TORCHELASTIC_RESTART_COUNT"]

    def per_attempt(url, **kwargs):
        for store, rank, world_size in original(url, **kwargs):
            yield dist.PrefixStore(f"nbtrain/attempt_{attempt}", store), rank, world_size

    registry["env"] = per_attempt


def _leave_to_launcher(fn):
    """While restarts remain, a failure is torchrun's to handle: say it on stderr and exit
    without reporting an error, which would end the whole launch."""

    def attempt(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code in (None, 0):
                raise
            failed = exc
        except BaseException as exc:
            failed = exc
        traceback.print_exception(type(failed), failed, failed.__traceback__.tb_next)  # from the user's frame
        count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print(f"nbtrain: rank {os.environ['RANK']} failed in attempt {count + 1} of "
              f"{int(os.environ['TORCHELASTIC_MAX_RESTARTS']) + 1}; the launcher restarts the ranks.",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    return attempt
