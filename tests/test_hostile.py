"""Hostile use, kept fixed: each section is one item of issue 17, tried as a user would."""
import inspect

import pytest

import nbtrain
from nbtrain import devices as devices_module

slow = pytest.mark.slow


def two_ranks_report():
    ctx = nbtrain.context()
    return ctx.rank, ctx.world_size


# -- 7. an absurd CPU rank count is refused before anything starts --------------------------

def test_a_million_cpu_ranks_is_refused_before_anything_starts(no_leftovers):
    with pytest.raises(ValueError) as info:
        nbtrain.launch(two_ranks_report, devices=10**6, accelerator="cpu", strategy="ddp_fork", progress=False)
    message = str(info.value)
    assert "devices=1000000" in message and "more than this machine can run" in message
    assert "NBTRAIN_MAX_CPU_RANKS=1000000" in message  # how to oversubscribe on purpose


@slow
def test_the_cpu_rank_limit_can_be_overridden(monkeypatch, no_leftovers):
    monkeypatch.setenv("NBTRAIN_MAX_CPU_RANKS", "1")
    with pytest.raises(ValueError, match="the limit is 1"):
        nbtrain.launch(two_ranks_report, devices=2, accelerator="cpu", strategy="ddp_fork", progress=False)
    monkeypatch.setenv("NBTRAIN_MAX_CPU_RANKS", "2")
    result = nbtrain.launch(two_ranks_report, devices=2, accelerator="cpu", strategy="ddp_fork", progress=False,
                            timeout=60)
    assert result.values == [(0, 2), (1, 2)]
    monkeypatch.setenv("NBTRAIN_MAX_CPU_RANKS", "many")
    with pytest.raises(ValueError, match="NBTRAIN_MAX_CPU_RANKS='many': give a positive int"):
        nbtrain.launch(two_ranks_report, devices=2, accelerator="cpu", progress=False)


def test_the_default_cpu_rank_limit_scales_with_cores():
    assert devices_module.cpu_rank_limit(2, {}) == 16  # the floor
    assert devices_module.cpu_rank_limit(64, {}) == 256
    assert devices_module.cpu_rank_limit(2, {"NBTRAIN_MAX_CPU_RANKS": "100"}) == 100


# -- 8. the public parsers take their arguments by keyword too --------------------------------

WRAPPED = [getattr(devices_module, name) for name in dir(devices_module)
           if not name.startswith("_") and hasattr(getattr(devices_module, name), "__wrapped__")]


def test_parse_devices_by_keyword():
    assert nbtrain.parse_devices(2, available=4) == [0, 1]
    assert nbtrain.parse_devices(devices="1, 3", available=4) == [1, 3]
    with pytest.raises(ValueError, match=r"devices=\[9\]: GPU 9 is not visible"):
        nbtrain.parse_devices(devices=[9], available=4)
    assert devices_module.parse_cpu_devices(devices=3, cores=2) == 3
    with pytest.raises(TypeError):  # a wrong call is still a wrong call
        nbtrain.parse_devices(2, avail=4)


@pytest.mark.parametrize("wrapped", WRAPPED, ids=lambda f: f.__name__)
def test_every_wrapped_parser_shows_its_own_signature(wrapped):
    assert {f.__name__ for f in WRAPPED} >= {"parse_devices", "parse_cpu_devices"}
    assert inspect.signature(wrapped) == inspect.signature(wrapped.__wrapped__)
    first, second = inspect.signature(wrapped).parameters
    assert first == "devices"
    assert wrapped.__doc__ == wrapped.__wrapped__.__doc__


# -- 5. script mode leaves no torchelastic_* directory behind --------------------------------

def where_torchrun_logs():
    import os
    import sys
    import tempfile

    return os.path.dirname(os.path.abspath(sys.argv[0])), os.environ.get("TORCHELASTIC_ERROR_FILE"), \
        os.environ.get("TMPDIR"), tempfile.gettempdir()


@slow
def test_a_script_launch_leaves_no_torchelastic_directory(tmp_path, monkeypatch, no_leftovers):
    import os
    import tempfile

    private = tmp_path / "tmp"  # this test's own TMPDIR: torchrun's default log dir would land here
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    result = nbtrain.launch(where_torchrun_logs, strategy="ddp", devices=2, accelerator="cpu", progress=False,
                            timeout=120)
    for job_dir, error_file, rank_tmpdir, rank_gettempdir in result.values:
        assert job_dir.startswith(str(private))
        assert error_file and error_file.startswith(job_dir + os.sep)  # torchrun's log dir was in the job dir
        assert rank_tmpdir == rank_gettempdir == str(private)  # the ranks still see the kernel's TMPDIR
    assert os.listdir(private) == []  # no torchelastic_*, no job dir
