"""How a rank's traceback reads in the notebook: library frames folded, the raising frame kept."""
import traceback

import torch

from nbtrain.common.errors import WorkerError
from nbtrain.common.tracebacks import fold_library_frames


def mismatched_forward():
    model = torch.nn.Sequential(torch.nn.Linear(20, 4))
    return model(torch.randn(8, 19))  # fails inside torch, several frames down


def a_real_traceback() -> str:
    try:
        mismatched_forward()
    except RuntimeError as exc:
        return "".join(traceback.format_exception(exc))
    raise AssertionError("did not fail")


def test_library_frames_fold_and_the_raising_frame_stays_with_a_short_path():
    full = a_real_traceback()
    folded = fold_library_frames(full)
    assert full.count('File "') > 3  # the fixture is what the issue saw: torch's frames in the way
    assert "in mismatched_forward" in folded and "return model(torch.randn(8, 19))" in folded  # ours, whole
    assert "frames in torch" in folded
    assert 'File "torch/nn/modules/linear.py"' in folded  # where it raised, from the package on
    assert "site-packages" not in folded
    assert folded.splitlines()[-1] == full.splitlines()[-1]  # the error itself
    assert len(folded.splitlines()) < len(full.splitlines())


def test_chained_tracebacks_keep_each_raising_frame():
    try:
        try:
            mismatched_forward()
        except RuntimeError as exc:
            raise ValueError("while building the batch") from exc
    except ValueError as exc:
        full = "".join(traceback.format_exception(exc))
    folded = fold_library_frames(full)
    assert folded.count('File "torch/nn/modules/linear.py"') == 1
    assert "The above exception was the direct cause" in folded and "ValueError: while building" in folded


def test_a_traceback_without_library_frames_is_unchanged():
    text = ('Traceback (most recent call last):\n  File "/home/me/train.py", line 3, in <module>\n'
            '    boom()\nZeroDivisionError: division by zero')
    assert fold_library_frames(text) == text


def test_worker_error_shows_the_folded_traceback_and_keeps_the_full_one():
    full = a_real_traceback()
    error = WorkerError(1, "RuntimeError: mat1 and mat2 shapes cannot be multiplied", full)
    assert error.traceback == full
    assert "frames in torch" in str(error) and "site-packages" not in str(error)
    assert "frames in torch" in "\n".join(error._render_traceback_())


def test_a_stack_listed_most_recent_first_keeps_the_running_frame():
    import site

    lib = site.getsitepackages()[0]
    dump = ("Current thread 0x00007f (most recent call first):\n"
            f'  File "{lib}/torch/distributed/rendezvous.py", line 199 in _create_c10d_store\n'
            f'  File "{lib}/torch/distributed/rendezvous.py", line 280 in _env_rendezvous_handler\n'
            f'  File "{lib}/torch/distributed/distributed_c10d.py", line 1892 in init_process_group\n'
            '  File "/home/me/notebook_helpers.py", line 4 in hangs\n')
    folded = fold_library_frames(dump).splitlines()
    assert folded == ["Current thread 0x00007f (most recent call first):",
                      '  File "torch/distributed/rendezvous.py", line 199 in _create_c10d_store',
                      "  ... 2 frames in torch",
                      '  File "/home/me/notebook_helpers.py", line 4 in hangs']


def test_py_spy_output_loses_its_colours_and_long_paths():
    import nbtrain
    from nbtrain.common.tracebacks import plain_native_stack

    own = nbtrain.__file__.replace("__init__.py", "rank/context.py")
    text = f"\x1b[32mpoll\x1b[0m (\x1b[36mlibc.so.6\x1b[0m)\nbarrier ({own}:203)"
    assert plain_native_stack(text) == "poll (libc.so.6)\nbarrier (nbtrain/rank/context.py:203)"
