"""start='template': ranks forked from the warm template (see template_process.py here, and
nbtrain/rank/template_main.py).

Safe where forking the kernel is not (CUDA initialised in it, libraries that refuse fork),
at fork speed. Falls back to plain spawn, saying why, when the template cannot start or does
not answer (stopped, hung).
"""
from __future__ import annotations

from ..common.transfer import pack_job
from .base import Job, ProcessLauncher, RankProcess, rank_environ
from .processes import SpawnLauncher, _Pipes
from .template_process import TemplateUnresponsive, template


class TemplateLauncher(ProcessLauncher):
    start = "template"
    local = True

    def __init__(self, payload: bytes | None = None):
        self._payload = payload  # the job, packed already (start_ranks_cleanly checked it pickles)

    def _prepare(self, job: Job) -> Job:
        if not job.live:
            job = job.with_options(payload=self._payload or pack_job(job.fn, job.args, job.kwargs))
        self.template = template()
        return job

    def _start(self, job, channel_env, pump, started) -> None:
        pipes = _Pipes(job.ranks, pump)
        try:
            for local, rank in enumerate(job.ranks):
                env = rank_environ(job, local, channel_env)
                pid = self.template.fork(env, job.first, job.live, list(pipes.write_ends[rank]))
                started.append(self._handle(pid, rank))
        finally:
            pipes.close_write_ends()

    def _handle(self, pid: int, rank: int) -> RankProcess:
        template = self.template

        def poll() -> int | None:
            code = template.exit_code(pid)
            if code is None and not template.alive():  # the template died: so did its ranks
                return -9
            return code

        return RankProcess([rank], pid, poll, lambda timeout: template.wait_exit(pid, timeout))


def start_ranks_cleanly(display, job: Job | None = None):
    """The launcher for ranks that must not be forks of the kernel: the template, or plain
    spawn (said in the display) when the template cannot start.

    Given the `job`, it is pickled first, so a job that cannot be sent starts nothing (not
    even the template, seconds of start-up for a launch that is refused anyway)."""
    payload = None if job is None or job.live else pack_job(job.fn, job.args, job.kwargs)
    try:
        template()
        return TemplateLauncher(payload)
    except TemplateUnresponsive as exc:
        display.note(f"the warm template cannot be used: {exc}; starting ranks with plain spawn instead")
        return SpawnLauncher(payload)
    except (RuntimeError, OSError) as exc:
        display.note(f"the warm template did not start ({exc}); starting ranks with plain spawn instead")
        return SpawnLauncher(payload)
