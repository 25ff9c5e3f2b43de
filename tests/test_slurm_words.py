"""What SLURM writes in a job's stderr when a task ends badly, read into the line a user sees
(`slurm_says`): srun's task reports and slurmstepd's cancellation notes, as SLURM writes them."""
import pytest

from nbtrain.placements.clusters.slurm_words import _srun_words, _task_numbers, slurm_says


@pytest.mark.parametrize("spec, numbers", [
    ("1", {1}), ("0-3", {0, 1, 2, 3}), ("0,2-3", {0, 2, 3}), ("5,7", {5, 7}), ("x", set()), ("2-y", set()),
])
def test_srun_task_lists(spec, numbers):
    assert _task_numbers(spec) == numbers


@pytest.mark.parametrize("what, words", [
    ("Exited with exit code 3", "exited with code 3"),
    ("Killed", "Signal 9 (SIGKILL)"),
    ("Segmentation fault (core dumped)", "Signal 11 (SIGSEGV)"),
    ("Terminated", "Signal 15 (SIGTERM)"),
    ("Out Of Memory", "Out Of Memory (says srun)"),  # words nbtrain does not know: srun's own, said to be
])
def test_srun_words_read_as_nbtrain_says_them(what, words):
    assert _srun_words(what) == words


STDERR = """\
[rank 1] Traceback (most recent call last):
srun: error: node2: task 1: Exited with exit code 3
srun: error: node1: tasks 0,2-3: Killed
srun: Terminating StepId=42.0
"""


def test_each_task_gets_its_own_line_of_srun_s_report():
    assert slurm_says(STDERR, "42", 1) == "SLURM job 42, task 1 on node2: exited with code 3"
    assert slurm_says(STDERR, "42", 0) == "SLURM job 42, task 0 on node1: Signal 9 (SIGKILL)"
    assert slurm_says(STDERR, "42", 3) == "SLURM job 42, task 3 on node1: Signal 9 (SIGKILL)"
    assert slurm_says(STDERR, "42", 4) is None  # srun said nothing of it
    assert slurm_says("", "42", 0) is None


@pytest.mark.parametrize("line, words", [
    ("slurmstepd: error: *** JOB 42 ON node1 CANCELLED AT 2026-11-26T01:02:03 ***",
     "SLURM job 42 was cancelled at 2026-11-26T01:02:03 (scancel)"),
    ("slurmstepd: error: *** STEP 42.0 ON node1 CANCELLED AT 2026-11-26T01:02:03 DUE TO TIME LIMIT ***",
     "SLURM job 42 was cancelled at 2026-11-26T01:02:03 due to time limit"),
    ("slurmstepd: error: *** JOB 42 ON gpu-7 CANCELLED AT 2026-11-26T01:02:03 DUE TO PREEMPTION ***",
     "SLURM job 42 was cancelled at 2026-11-26T01:02:03 due to preemption"),
])
def test_a_cancellation_is_what_every_task_reads(line, words):
    text = STDERR + line + "\n"
    assert slurm_says(text, "42", 1) == words  # before srun's report of the task it ended
    assert slurm_says(text, "42", 7) == words
