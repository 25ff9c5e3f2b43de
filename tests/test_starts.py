"""The one table of start= words: a placement registered there is reachable from every front end."""
import pytest
from IPython.core.magic_arguments import magic_arguments, parse_argstring

import nbtrain
from nbtrain.notebook.ipython.magic_options import run_options
from nbtrain.notebook.run import starts
from nbtrain.notebook.run.choices import words
from nbtrain.placements.processes import SpawnLauncher

used: list[str] = []


class CountedSpawn(SpawnLauncher):
    """A new placement as a contributor would add one: plain spawn that notes each start."""
    start = "counted"

    def _start(self, job, channel_env, pump, started):
        used.append(job.start)
        super()._start(job, channel_env, pump, started)


@pytest.fixture
def counted():
    starts.register(starts.Start("counted", lambda display, job: CountedSpawn()))
    used.clear()
    yield
    starts.unregister("counted")


def objective(trial):
    return trial.suggest_float("x", 0.0, 1.0)


def test_a_registered_start_is_a_word_every_front_end_accepts(counted):
    assert words(start="counted").start == "counted"
    assert "counted" in starts.STARTS and "counted" in starts.LIVE_STARTS

    @magic_arguments()
    @run_options
    def magic(line):
        """%%nbtrain's options."""

    assert parse_argstring(magic, "--start counted").start == "counted"  # the magics' argparse reads the table
    starts.unregister("counted")
    with pytest.raises(ValueError, match="start='counted' is not known. Accepted: 'auto', 'fork', 'template', "
                                         "'spawn', 'torchrun'"):
        words(start="counted")
    with pytest.raises(ValueError, match="give a new name"):
        starts.register(starts.Start("auto", lambda display, job: CountedSpawn()))


@pytest.mark.slow
def test_a_registered_placement_starts_launch_live_ranks_and_sweep_trials(counted, no_leftovers, tmp_path):
    result = nbtrain.launch(lambda: nbtrain.context().rank, strategy="ddp", start="counted", devices=1,
                            accelerator="cpu", progress=False)
    assert result.value == 0
    with nbtrain.Ranks(devices=1, accelerator="cpu", start="counted", progress=False) as ranks:
        assert ranks.placement == "counted" and ranks.eval("1") == [1]
    study = nbtrain.sweep(objective, trials=1, devices=1, accelerator="cpu", start="counted", progress=False,
                          run_dir=tmp_path)
    assert len(study.study.trials) == 1 and study.study.trials[0].value is not None
    assert used == ["counted"] * 3
