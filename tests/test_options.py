"""A run's options and the training function's keywords never collide silently: a keyword the
function cannot take is refused in the notebook, before anything starts, naming the option it
resembles (issue: `launch(train, devices=2, stal=30)` failed in every rank 3.6 s later)."""
import functools

import pytest

import nbtrain
from nbtrain.notebook.run.options import RUN_OPTIONS, refuse_foreign_keywords


def train(lr, epochs=1):
    return lr * epochs


def test_a_misspelt_option_is_refused_naming_the_option_it_resembles():
    with pytest.raises(TypeError) as caught:
        nbtrain.launch(train, 0.1, devices=2, stal=30)
    said = str(caught.value)
    assert "train() takes no keyword 'stal'" in said
    assert "Did you mean launch's option stall=?" in said
    assert "Nothing was started." in said


def test_a_keyword_like_no_option_lists_the_options():
    with pytest.raises(TypeError, match=r"takes no keyword 'colour'.*own options are: strategy, start, devices"):
        nbtrain.launch(train, 0.1, devices=2, colour="red")


def test_missing_or_surplus_arguments_are_refused_with_the_signature():
    with pytest.raises(TypeError, match=r"do not fit train\(lr, epochs=1\): missing a required argument: 'lr'"):
        nbtrain.launch(train, devices=2)
    with pytest.raises(TypeError, match=r"do not fit train\(lr, epochs=1\): too many positional arguments"):
        nbtrain.launch(train, 1, 2, 3, devices=2)


def test_what_the_function_can_take_passes():
    refuse_foreign_keywords(train, (0.1,), {"epochs": 3}, "launch")
    refuse_foreign_keywords(lambda **anything: None, (), {"stal": 30}, "launch")  # it takes any keyword
    refuse_foreign_keywords(functools.partial(train, 0.1), (), {"epochs": 2}, "launch")
    refuse_foreign_keywords(print, (1, 2), {"sep": " "}, "launch")  # no signature to read: its own error says it

    def decorated(*args, **kwargs):  # a decorator's wrapper takes what it likes, whatever __wrapped__ says
        return train(*args[:1])
    decorated.__wrapped__ = train
    refuse_foreign_keywords(decorated, (0.1,), {"injected": True}, "launch")


def test_submit_refuses_before_writing_anything(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(TypeError, match="Did you mean submit's option stall=?"):
        nbtrain.submit(train, 0.1, devices=2, stal=30, run_dir=run_dir)
    assert not run_dir.exists() and list(tmp_path.iterdir()) == []


def test_submit_declares_every_option_launch_takes():
    import inspect
    launch_takes = set(inspect.signature(nbtrain.launch).parameters) - {"fn", "args", "kwargs"}
    assert launch_takes == set(RUN_OPTIONS)
    assert launch_takes - {"wait"} <= set(inspect.signature(nbtrain.submit).parameters)  # submit never waits
