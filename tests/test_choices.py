"""strategy= and start=: the words, the earlier names, and the pair each request resolves to (no process)."""
import pytest

from nbtrain.common.devices import plan_devices
from nbtrain.notebook.run import choices
from nbtrain.notebook.run.choices import ALIASES, Words, choose, words


def cpu(n=2, nodes=1):
    return plan_devices(n, "cpu", None, nodes)


def pair(strategy="auto", start="auto", options=None, plan=None):
    choice = choose(words(strategy, start, options), plan or cpu())
    return choice.strategy, choice.start


@pytest.mark.parametrize("old, new", [
    ("ddp_fork", ("ddp", "fork")), ("ddp_notebook", ("ddp", "fork")), ("fork", ("ddp", "fork")),
    ("ddp_spawn", ("ddp", "template")), ("spawn", ("ddp", "template")), ("ddp_script", ("ddp", "torchrun")),
])
def test_every_earlier_name_is_a_strategy_and_a_start(old, new):
    asked = words(old)
    assert (asked.strategy, asked.start) == new == pair(old)
    assert asked.aliases == (f"strategy={old!r} is strategy={new[0]!r}, start={new[1]!r} (the earlier name still "
                             "works)",)
    assert set(ALIASES) == {"ddp_fork", "ddp_notebook", "fork", "ddp_spawn", "spawn", "ddp_script"}


def test_the_template_option_is_a_start():
    assert pair("ddp_spawn", options={"template": False}) == ("ddp", "spawn")
    assert pair(options={"template": True}) == ("ddp", "template")
    asked = words("ddp_spawn", "auto", {"template": False})
    assert asked.options is None  # nothing else given: no torchrun settings, so no torchrun
    assert asked.aliases[-1] == "launcher_options={'template': False} is start='spawn' (the earlier way still works)"


def test_the_new_words_resolve_as_the_readme_table_says(monkeypatch):
    monkeypatch.setattr(choices, "fork_blocker", lambda: None)
    assert pair() == ("ddp", "fork") and pair("ddp") == ("ddp", "fork") and pair("fsdp") == ("fsdp", "fork")
    assert pair(plan=cpu(1)) == ("single", "kernel")  # one device, both 'auto': in this kernel
    assert pair(start="fork", plan=cpu(1)) == ("ddp", "fork")  # a start asked for: a rank process, DDP on one rank
    assert pair("dp", plan=cpu(1)) == ("dp", "kernel")
    assert pair(options={"launcher": "accelerate"}) == ("ddp", "torchrun")  # torchrun's settings: torchrun
    assert pair(options={}) == ("ddp", "torchrun")
    assert pair("fsdp", plan=plan_devices(2, "cpu", None, 2)) == ("fsdp", "torchrun")  # several machines
    assert pair("deepspeed") == ("deepspeed", "torchrun")
    for start in ("fork", "template", "spawn", "torchrun"):
        assert pair("ddp", start) == ("ddp", start) and pair(start=start) == ("ddp", start)
        assert pair("fsdp", start) == ("fsdp", start)
    monkeypatch.setattr(choices, "fork_blocker", lambda: "CUDA is already initialised in this kernel")
    choice = choose(words("fsdp"), cpu())
    assert (choice.strategy, choice.start) == ("fsdp", "template")
    assert choice.note == ("fsdp on 2 CPU ranks, gloo (started by template, chosen by start='auto'), not fork: CUDA is "
                           "already initialised in this kernel")
    assert choose(words("fsdp", "fork"), cpu()).note is None  # asked for: refused by the launch itself, by name


@pytest.mark.parametrize("strategy, start, options, plan, message", [
    ("dp", "fork", None, cpu(1), "strategy='dp' with start='fork': 'dp' runs in this kernel"),
    ("dp", "auto", {"launcher": "accelerate"}, cpu(1), "strategy='dp' with start='auto': 'dp' runs in this kernel"),
    ("dp", "auto", None, cpu(2), "strategy='dp' runs one process; on CPU it cannot use 2 devices"),
    ("deepspeed", "template", None, cpu(), "strategy='deepspeed' with start='template': DeepSpeed's own launcher"),
    ("deepspeed", "auto", None, cpu(1, 2), "num_nodes=2 needs strategy='ddp' or 'fsdp'"),
    ("ddp", "fork", None, cpu(1, 2), "num_nodes=2 with start='fork': several machines meet through torchrun's"),
    ("ddp", "spawn", {"node_rank": 0}, cpu(), "launcher_options={'node_rank': 0} with start='spawn': they are "
                                              "torchrun's settings"),
    ("ddp", "auto", {"launcher": "deepspeed"}, cpu(), "launcher='deepspeed' runs strategy='deepspeed'"),
    ("deepspeed", "auto", {"launcher": "torchrun"}, cpu(), "strategy='deepspeed' runs under DeepSpeed's launcher"),
])
def test_combinations_that_cannot_run_are_refused_naming_both(strategy, start, options, plan, message):
    with pytest.raises(ValueError) as refused:
        choose(words(strategy, start, options), plan)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("strategy, start, options, message", [
    ("ddp_forked", "auto", None, "strategy='ddp_forked' is not known. Accepted: 'auto', 'ddp', 'fsdp', 'dp', "
                                 "'deepspeed' (earlier names, still understood: 'ddp_fork', 'ddp_notebook'"),
    ("ddp", "forkserver", None, "start='forkserver' is not known. Accepted: 'auto', 'fork', 'template', 'spawn', "
                                "'torchrun'"),
    ("ddp", None, None, "start=None is not known"),
    ("ddp_fork", "template", None, "strategy='ddp_fork' with start='template': 'ddp_fork' is the earlier name of "
                                   "strategy='ddp', start='fork'; give strategy='ddp', start='template'."),
    ("ddp", "fork", {"template": True}, "launcher_options={'template': True} with start='fork': the option is the "
                                        "earlier way to say start='template'; give start= alone."),
    ("ddp", "auto", {"template": "no"}, "launcher_options={'template': 'no'}: give True (start='template') or False"),
])
def test_unknown_or_contradicting_words_are_refused(strategy, start, options, message):
    with pytest.raises(ValueError) as refused:
        words(strategy, start, options)
    assert message in str(refused.value)


def test_an_alias_is_said_once_per_kernel(monkeypatch, capsys):
    monkeypatch.setattr(choices, "_said", set())
    said = []
    words("ddp_spawn").say(said.append)
    words("ddp_spawn").say(said.append)
    words("spawn").say()  # no display: printed
    assert said == ["strategy='ddp_spawn' is strategy='ddp', start='template' (the earlier name still works)"]
    assert capsys.readouterr().out == ("nbtrain: strategy='spawn' is strategy='ddp', start='template' (the earlier "
                                       "name still works)\n")
    assert Words("ddp", "fork", None).aliases == ()  # the new words are said by nobody


@pytest.mark.parametrize("use, strategy, start, resolved", [
    ("live", "auto", "spawn", ("ddp", "spawn")), ("live", "fsdp", "template", ("fsdp", "template")),
    ("slot", "auto", "auto", ("ddp", "template")), ("slot", "fsdp", "auto", ("fsdp", "torchrun")),
    ("slot", "ddp", "spawn", ("ddp", "spawn")),
])
def test_one_resolver_answers_for_live_ranks_and_slots(use, strategy, start, resolved):
    choice = choose(words(strategy, start), None, use)
    assert (choice.strategy, choice.start) == resolved


@pytest.mark.parametrize("use, strategy, start, refusal", [
    ("live", "auto", "torchrun", "start='torchrun': live ranks start by 'auto', 'fork', 'template', 'spawn'; "
                                 "torchrun runs a script to its end"),
    ("live", "dp", "auto", "strategy='dp': live ranks wrap models with 'auto', 'ddp', 'fsdp'"),
    ("slot", "auto", "fork", "start='fork' with strategy='auto': runs in slots start from threads, and a fork of "
                             "this kernel from a thread can hang"),
    ("slot", "deepspeed", "auto", "strategy='deepspeed': runs in slots take 'auto' or 'ddp'"),
    ("elsewhere", "auto", "auto", "use='elsewhere'"),
])
def test_one_resolver_refuses_what_a_use_cannot_take(use, strategy, start, refusal):
    with pytest.raises(ValueError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        choose(words(strategy, start), None, use)
