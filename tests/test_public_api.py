"""nbtrain's public names: what `nbtrain.__all__` holds, their docstrings, and the earlier names that moved."""
import importlib
import inspect
import re
import warnings

import pytest

import nbtrain

# The classes a notebook user holds: every public method and property is documented.
CLASSES = [*(getattr(nbtrain, name) for name in ("Result", "Run", "Ranks", "Context", "Slurm", "Ray", "Profile",
                                                  "TensorBoard", "MLflow", "WandB", "WorkerError", "MapError")),
           importlib.import_module("nbtrain.notebook.many.sweep").Sweep]
SECTION_RULE = set("-")


def sections(doc: str) -> dict[str, list[str]]:
    """A numpydoc docstring's sections: each header is a line underlined by dashes."""
    lines, found, name = doc.splitlines(), {}, None
    for i, line in enumerate(lines):
        if line.strip() and set(line.strip()) == SECTION_RULE:
            continue
        below = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if line.strip() and below and set(below) == SECTION_RULE:
            name = line.strip()
            found[name] = []
        elif name is not None:
            found[name].append(line)
    return found


def documented(entries: list[str]) -> set[str]:
    """The names a Parameters section describes: its lines at the entries' indent, `name : type`
    or `name` (`*args`, `a, b : int` too)."""
    lines = [line for line in entries if line.strip()]
    if not lines:
        return set()
    indent = min(len(line) - len(line.lstrip()) for line in lines)
    names = set()
    for line in lines:
        if len(line) - len(line.lstrip()) == indent:
            head = line.strip().split(" : ")[0]
            names |= {part.strip().lstrip("*") for part in head.split(",")}
    return names


def parameters(obj) -> list[str]:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values() if p.name not in ("self",
                                                                            "cls") and not p.name.startswith("_")]


def check_documented(obj, where: str, needs_returns: bool) -> list[str]:
    doc = inspect.getdoc(obj)
    if not doc or not doc.strip():
        return [f"{where}: no docstring"]
    problems = []
    found = sections(doc)
    missing = [p for p in parameters(obj) if p not in documented(found.get("Parameters", []))]
    if missing:
        problems.append(f"{where}: Parameters does not name {missing}")
    if needs_returns and "Returns" not in found:
        problems.append(f"{where}: no Returns section")
    for pointer in re.findall(r"module's docstring|[Ss]ee the module|nbtrain/[\w/]+\.py", doc):
        problems.append(f"{where}: points elsewhere ({pointer!r}) instead of saying it")
    return problems


def test_the_public_names_are_at_most_26_and_each_one_is_there():
    # 25 was the bound; the 26th is NbtrainError, the one base a user catches every run's error by.
    assert len(nbtrain.__all__) <= 26
    assert sorted(nbtrain.__all__) == nbtrain.__all__
    for name in nbtrain.__all__:
        assert getattr(nbtrain, name) is not None


def test_every_public_name_documents_each_parameter_and_what_it_returns():
    problems = []
    for name in nbtrain.__all__:
        obj = getattr(nbtrain, name)
        problems += check_documented(obj, f"nbtrain.{name}", needs_returns=not inspect.isclass(obj))
    assert not problems, "\n".join(problems)


def test_every_public_method_of_the_public_classes_is_documented():
    problems = []
    for cls in CLASSES:
        class_name = cls.__name__
        for name in dir(cls):
            if name.startswith("_"):
                continue
            member = inspect.getattr_static(cls, name)
            if isinstance(member, property):
                if not inspect.getdoc(getattr(cls, name)):
                    problems.append(f"{class_name}.{name}: a property with no docstring")
            elif isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
                method = getattr(cls, name)
                if getattr(method, "__module__", "").startswith("nbtrain"):
                    problems += check_documented(method, f"{class_name}.{name}", needs_returns=False)
    assert not problems, "\n".join(problems)


def test_help_reads_the_docstring():
    text = inspect.getdoc(nbtrain.launch)
    assert text.startswith("Run ``fn(*args, **kwargs)`` on every rank")
    assert "start : {'auto', 'fork', 'template', 'spawn', 'torchrun'}, default 'auto'" in text
    assert "Returns\n-------\nResult" in text and "Raises\n------\nWorkerError" in text


MOVED = {"parse_devices": "nbtrain.common.devices", "plan_devices": "nbtrain.common.devices",
         "DevicePlan": "nbtrain.common.devices", "ensure_pci_bus_order": "nbtrain.common.devices",
         "Gpu": "nbtrain.common.inventory", "GpuProcess": "nbtrain.common.inventory",
         "StaticInventory": "nbtrain.common.inventory", "use_inventory": "nbtrain.common.inventory",
         "find_free_gpus": "nbtrain.common.inventory", "UnpicklableError": "nbtrain.common.errors",
         "Finding": "nbtrain.common.pickling", "ForkUnsafeError": "nbtrain.common.preflight",
         "install_cuda_init_hook": "nbtrain.common.preflight", "GpuPicker": "nbtrain.display.picker",
         "spawn": "nbtrain.notebook.dropins", "notebook_launcher": "nbtrain.notebook.dropins",
         "environment": "nbtrain.notebook.ipython.env", "Rank": "nbtrain.notebook.live.ranks", "Sweep": "nbtrain.notebook.many.sweep",
         "rank_zero_only": "nbtrain.rank.context"}


def test_the_earlier_names_still_work_saying_once_what_to_use_and_when_they_go(monkeypatch):
    monkeypatch.setattr(nbtrain, "_warned", set())  # as in a fresh kernel
    for name, module in MOVED.items():
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            first = getattr(nbtrain, name)
            again = getattr(nbtrain, name)
        assert first is again is getattr(importlib.import_module(module), name), name
        assert [w.category for w in said] == [DeprecationWarning], (name, said)
        message = str(said[0].message)
        assert message.startswith(f"nbtrain.{name} is deprecated and will be removed in nbtrain {nbtrain.REMOVED_IN}; ")
        # Only public names, or a drop-in's documented import, never an internal module to import from.
        assert "nbtrain.common" not in message and ("from " not in message or module == "nbtrain.notebook.dropins")
        assert said[0].filename == __file__  # said at the line that used the name
        assert name not in dir(nbtrain) and name not in nbtrain.__all__, name


def test_the_shims_are_gone_and_unknown_names_say_so():
    with pytest.raises(ModuleNotFoundError):
        __import__("nbtrain.template")
    with pytest.raises(ModuleNotFoundError):
        __import__("nbtrain.script_rank")
    with pytest.raises(AttributeError, match="module 'nbtrain' has no attribute 'lanch'"):
        nbtrain.lanch  # noqa: B018 (reading the attribute is what raises)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the public names never warn
        for name in nbtrain.__all__:
            getattr(nbtrain, name)


def test_the_check_finds_what_a_docstring_leaves_out():
    def half(fn, *args, devices=2, **kwargs):
        """Half a docstring.

        Parameters
        ----------
        fn : callable
            The function.
        *args
            Its arguments.

        See nbtrain/notebook/run/launch.py for the rest.
        """

    assert check_documented(half, "half", needs_returns=True) == [
        "half: Parameters does not name ['devices', 'kwargs']", "half: no Returns section",
        "half: points elsewhere ('nbtrain/notebook/run/launch.py') instead of saying it"]


def test_a_result_pickled_before_start_existed_reads_an_empty_start():
    import pickle

    result = nbtrain.Result(1, [1, 2], [], 0.5, "ddp", devices="2 CPU ranks, gloo", start="fork")
    older = pickle.loads(pickle.dumps(result))
    del older.__dict__["start"]  # as an earlier release pickled it
    assert older.start == "" and repr(older).startswith("Result(strategy='ddp', devices='2 CPU ranks, gloo'")
    assert repr(result).startswith("Result(strategy='ddp', start='fork', devices=")


def test_every_error_nbtrain_raises_for_a_run_shares_one_base():
    """``except nbtrain.NbtrainError`` catches what a run can raise, a failed map item too, while each
    stays the built-in kind it was (earlier ``except RuntimeError/OSError/TypeError`` still catch)."""
    from nbtrain.common.errors import UnpicklableError
    from nbtrain.common.preflight import ForkUnsafeError
    from nbtrain.common.private import IncompleteWrite, NotYours
    from nbtrain.notebook.run.pool import PoolBroken
    from nbtrain.placements.clusters.ray import RayGone
    from nbtrain.placements.clusters.slurm import SlurmJobError
    from nbtrain.placements.template_process import TemplateUnresponsive
    from nbtrain.rank.checkpoint import CheckpointError
    from nbtrain.rank.compat import NestedLaunchError
    from nbtrain.rank.trackers import TrackerError

    kinds = {nbtrain.WorkerError: RuntimeError, nbtrain.MapError: RuntimeError, UnpicklableError: TypeError,
             ForkUnsafeError: RuntimeError, IncompleteWrite: OSError, NotYours: PermissionError,
             PoolBroken: RuntimeError, RayGone: RuntimeError, SlurmJobError: RuntimeError,
             TemplateUnresponsive: RuntimeError, CheckpointError: OSError, NestedLaunchError: RuntimeError,
             TrackerError: RuntimeError}
    for error, kind in kinds.items():
        assert issubclass(error, nbtrain.NbtrainError) and issubclass(error, kind), error
    failed = nbtrain.WorkerError.from_failure(1, "KeyError: 'x'", original=KeyError("x"))
    assert isinstance(failed, nbtrain.NbtrainError) and isinstance(failed, KeyError)
