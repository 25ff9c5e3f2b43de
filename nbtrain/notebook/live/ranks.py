"""Live ranks: start N ranks once, then run code, objects and functions on them, cell after cell.

    ranks = nbtrain.Ranks(devices=2)                  # process group ready on every rank
    ranks.exec("model = ctx.setup(Net())")            # state kept between calls
    result = ranks.run(train_epoch, 3)                # a notebook function, the rank's names as globals
    ranks.pull("loss"); ranks.push(lr=3e-4); ranks.eval("ctx.rank")
    ranks[1].debug()                                  # pdb in rank 1's last failure
    ranks.close()                                     # or restart(), or `with nbtrain.Ranks(...) as ranks:`

Built on the same pool, channel, Context, display and errors as `launch`: a live pool is one
whose ranks serve commands until closed (see run/pool.py and nbtrain/rank/loop.py). Their
lifetime, and the path each command takes, is `lifetime.py`'s; what a call sends is checked by
`payloads.py` before any rank sees it.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import types

from ...common.errors import UnpicklableError
from ...common.pickling import explain_pickling
from ...common.tensor_files import RankFiles
from ...common.transfer import PUSH_FILES, pack_push
from ...display import make_display
from ..run.background import SteerablePool, run_in_background
from ..run.insight import instrument
from ..run.options import refuse_foreign_keywords
from ..run.result import Result
from .lifetime import RanksLifetime
from .payloads import check_push_names, pack_call, syntax_error
from .ranks_map import map_on_ranks

_exec_count = itertools.count(1)


class Ranks(RanksLifetime):
    """Live ranks: started once, then code, objects and functions run on them, cell after cell.

    Each rank keeps its namespace (``ctx`` is its `Context`, the process group is ready) until
    `close`; ``%%ranks`` cells run on the last Ranks started. A rank's failure is a `WorkerError`
    and ``%debug`` (or `debug`) opens pdb in that rank; Ctrl-C interrupts the ranks, which keep
    their state. ``with nbtrain.Ranks(...) as ranks:`` closes them at the end.

    >>> ranks = nbtrain.Ranks(devices=2)                    # doctest: +SKIP
    >>> ranks.exec("model = ctx.setup(Net())")              # doctest: +SKIP
    >>> result = ranks.run(train_epoch, 3)                  # doctest: +SKIP

    Parameters
    ----------
    devices : int, str or list, default 'auto'
        As for `launch`; with ``cluster``, ranks per node.
    accelerator : {'auto', 'gpu', 'cpu'}, default 'auto'
        As for `launch`.
    backend : str, optional
        The process group's backend; default nccl on GPUs, gloo on CPU.
    timeout : float, optional
        The default limit, in seconds, of each call; None (the default): none, a cell may run for hours.
    strategy : {'auto', 'ddp', 'fsdp'}, default 'auto'
        How ``ctx.setup(module)`` wraps a model on them ('auto' is 'ddp').
    start : {'auto', 'fork', 'template', 'spawn'}, default 'auto'
        Where the ranks come from, as for `launch`: 'auto' forks the kernel when that is safe,
        else the warm template. ('torchrun' runs a script to its end: not for live ranks.)
    progress : bool or str, default True
        The live view of each call, as for `launch`; False also leaves out the line saying the
        ranks are ready.
    cluster : Slurm or Ray, optional
        Start them there: ``devices`` ranks on each of ``num_nodes`` nodes.
    num_nodes : int, default 1
        Nodes, with ``cluster``.
    stall : float or False, optional
        As for `launch`, for each call: seconds without progress on any rank before the cell says
        where each rank is and whom the others wait for (the call goes on). None: the default.

    Raises
    ------
    ValueError
        A setting is not accepted (a strategy or start live ranks do not take, devices that are
        not there); nothing was started.
    NbtrainError
        start='fork' while CUDA is initialised in this kernel (also a RuntimeError).
    WorkerError
        A rank failed to start.
    """


    def __getitem__(self, rank: int) -> Rank:
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank!r}: these live ranks are 0 .. {self.world_size - 1}.")
        return Rank(self, rank)


    # -- the calls -----------------------------------------------------------------------
    def exec(self, code: str, *, ranks: list[int] | None = None, timeout: float | None = None,
             _namespace: dict | None = None, _filename: str | None = None, _show: bool = False) -> None:
        """Run code in every rank's namespace, as a cell there; its names stay.

        Names the code reads that a rank lacks are taken from the caller's namespace (modules as
        imports), never overwriting the rank's own.

        Parameters
        ----------
        code : str
            Python source.
        ranks : list of int, optional
            Run on these ranks only; default every rank.
        timeout : float, optional
            Seconds before the call is stopped, with every rank's stack; default the Ranks' own.

        Returns
        -------
        None

        Raises
        ------
        SyntaxError
            The code is not Python; no rank ran it.
        WorkerError
            A rank failed (``%debug`` opens pdb there).
        TypeError
            ``code`` is not a str.
        """
        if not isinstance(code, str):
            raise TypeError(f"exec(code) takes Python source as a str, got {type(code).__name__}.")
        namespace = _namespace if _namespace is not None else sys._getframe(1).f_globals
        filename = _filename or f"<ranks exec {next(_exec_count)}>"
        mistake = syntax_error(code, filename, "exec")
        if mistake:  # found here, before any rank sees the code: nothing ran
            raise mistake
        state = self._command("exec", code, filename, _show, ranks=ranks, timeout=timeout, namespace=namespace)
        if _show:
            for rank in sorted(state.values):
                if state.values[rank] is not None:
                    print(f"[rank {rank}] {state.values[rank]}" if len(state.ranks) > 1 else state.values[rank])

    def eval(self, expression: str, *, ranks: list[int] | None = None, timeout: float | None = None) -> list:
        """An expression's value on every rank.

        Parameters
        ----------
        expression : str
            A Python expression, evaluated in each rank's namespace.
        ranks : list of int, optional
            Run on these ranks only; default every rank.
        timeout : float, optional
            Seconds before the call is stopped, with every rank's stack; default the Ranks' own.

        Returns
        -------
        list
            Each rank's value, in rank order.

        Raises
        ------
        SyntaxError
            Not an expression; no rank ran it.
        WorkerError
            A rank failed.
        TypeError
            ``expression`` is not a str.
        """
        if not isinstance(expression, str):
            raise TypeError(f"eval(expression) takes Python source as a str, got {type(expression).__name__}.")
        mistake = syntax_error(expression, "<nbtrain eval>", "eval")
        if mistake:  # found here, before any rank sees the code
            raise mistake
        state = self._command("eval", expression, ranks=ranks, timeout=timeout, namespace=sys._getframe(1).f_globals)
        return [state.values.get(r) for r in sorted(state.ranks)]

    def push(self, *, ranks: list[int] | None = None, **objects) -> None:
        """Put objects into every rank's namespace, by name (dill: notebook classes and lambdas travel).

        Large tensors go through shared memory, mapped by every rank on this machine.

        Parameters
        ----------
        ranks : list of int, optional
            Run on these ranks only; default every rank.
        **objects
            The objects, by the names they get on the ranks: ``push(lr=3e-4, data=batch)``.

        Returns
        -------
        None

        Raises
        ------
        TypeError
            Nothing to push.
        ValueError
            A name that is not an identifier, or one the ranks keep (``ctx``).
        NbtrainError
            An object cannot be sent (also a TypeError); the message names the part.
        """
        check_push_names(objects)
        files = self._push_files()
        try:
            try:
                payload = pack_push(objects, files)
            except Exception as exc:
                raise UnpicklableError(f"the objects pushed to the ranks ({', '.join(objects)})",
                                       explain_pickling(objects, "dill", "objects"), detail=str(exc)) from exc
            self._command("push", payload, ranks=ranks)
        finally:
            if files is not None:
                files.discard()  # each rank has mapped its copy-on-write view by now, or failed

    def _push_files(self) -> RankFiles | None:
        """Where a push's large tensors go: shared memory that ranks on this machine map."""
        pool = self._pool
        if pool is None or pool.remote or not pool.files or not pool.files.prefixes:
            return None
        return RankFiles.from_environ(PUSH_FILES, {**os.environ, **pool.files.environ})  # NBTRAIN_SHARED_MEMORY=0 too

    def pull(self, name: str, *, ranks: list[int] | None = None) -> list:
        """A variable's value from every rank (models come back on the CPU, unwrapped).

        Parameters
        ----------
        name : str
            The variable's name on the ranks.
        ranks : list of int, optional
            Run on these ranks only; default every rank.

        Returns
        -------
        list
            Each rank's value, in rank order.

        Raises
        ------
        ValueError
            ``name`` is not a variable name.
        WorkerError
            A rank lacks it, or its value cannot travel back.
        """
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"pull(name) takes a variable name such as 'loss', got {name!r}.")
        state = self._command("pull", name, ranks=ranks)
        return [state.values.get(r) for r in sorted(state.ranks)]

    def run(self, fn, *args, progress=None, timeout: float | None = None, ranks: list[int] | None = None,
            trackers=None, profile=None, run_dir=None, wait: bool = True, **kwargs):
        """``fn(*args, **kwargs)`` on every rank, with the rank's namespace as its globals.

        So ``fn`` sees ``model``, ``opt``... defined on the ranks; names it reads that a rank lacks
        come from the notebook. Shown with the live view, as a launch is. With ``wait=False`` it
        runs in the background, steered as ``launch(..., wait=False)``'s run is (docs/steering.md).

        Parameters
        ----------
        fn : function
            A Python function (defined in the notebook, say).
        *args
            Positional arguments for ``fn``.
        progress : bool or str, optional
            The live view, as for `launch`; default the Ranks' own.
        timeout : float, optional
            Seconds before the call is stopped, with every rank's stack; default the Ranks' own.
        ranks : list of int, optional
            Run on these ranks only; default every rank.
        trackers : str, tracker or list, optional
            As for `launch`.
        profile : bool or Profile, optional
            As for `launch`.
        run_dir : str or Path, optional
            As for `launch`.
        wait : bool, default True
            False: return at once a handle (``result()``, ``pause()``, ``set()``, ``stop()``...,
            as ``launch(..., wait=False)`` returns) while ``fn`` runs on the ranks; until it ends
            these ranks take no other command, and ``cancel()`` interrupts it as Ctrl-C would.
        **kwargs
            Keyword arguments for ``fn``.

        Returns
        -------
        Result
            As `launch` returns it (``start`` reads 'live (fork)' and the like); with
            ``wait=False``, the run's handle.

        Raises
        ------
        WorkerError
            A rank failed.
        TypeError
            ``fn`` is not a Python function.
        NbtrainError
            ``fn`` or its arguments cannot be sent (also a TypeError); the message names the part.
        ValueError
            ``ranks`` with trackers or a profile (they need every rank).
        """
        if not isinstance(fn, types.FunctionType):
            raise TypeError(f"run(fn, ...) takes a Python function, got {type(fn).__name__}; "
                            "for other callables, push them and call them with exec().")
        refuse_foreign_keywords(fn, args, kwargs, "run", ("progress", "timeout", "ranks", "trackers", "profile",
                                                          "run_dir", "wait"))
        if not isinstance(wait, bool):
            raise TypeError(f"run(wait={wait!r}): give True (return the Result when fn ends) or False (return a "
                            "handle at once, fn going on in the background).")
        wrapped = instrument(fn, args, kwargs, trackers=trackers, profile=profile, run_dir=run_dir, plan=self.plan,
                             strategy=f"live ({self.placement})")
        insight = None
        if wrapped is not fn:
            if ranks is not None:
                raise ValueError(f"ranks={ranks!r} with trackers or a profile: they run on every rank together "
                                 "(rank 0's tracker run is shared), so leave ranks=None.")
            insight = dataclasses.replace(wrapped, fn=None)  # the settings; the rank has its own fn
        payload = pack_call(fn, args, kwargs, insight)
        display = make_display(self.progress if progress is None else progress)

        def call(shown) -> Result:
            state = self._command("call", payload, ranks=ranks, timeout=timeout, namespace=fn.__globals__,
                                  display=shown, title=f"{fn.__qualname__} on live ranks")
            return Result.from_state(state, self.strategy, self.plan.describe(), f"live ({self.placement})")

        if wait:
            return call(display)
        self._refuse_while_running()
        targets = list(range(self.world_size)) if ranks is None else [ranks] if type(ranks) is int else list(ranks)
        assert isinstance(self._pool, SteerablePool), "live ranks' pools are steerable"
        self._background = run_in_background(self._pool, call, display, targets)
        return self._background

    def map(self, fn, items, *, batch_size: int = 1, run_dir=None, progress=None, timeout: float | None = None) -> list:
        """``[fn(item) for item in items]`` on these ranks, results in input order.

        Each rank takes the next items whenever it is free, and ``fn`` runs with the rank's
        namespace as its globals (a model loaded or trained there is used as it is). The ranks
        keep their state.

        Parameters
        ----------
        fn : function
            The function.
        items : iterable
            What to map over.
        batch_size : int, default 1
            As for `map`.
        run_dir : str or Path, optional
            As for `map`.
        progress : bool or str, optional
            As for `launch`; default the Ranks' own.
        timeout : float, optional
            Seconds before the call is stopped, with every rank's stack; default the Ranks' own.

        Returns
        -------
        list
            ``fn``'s result for each item, in input order.

        Raises
        ------
        MapError
            An item failed: its index, traceback and the results so far.
        TypeError
            ``fn`` is not a Python function.
        """
        return map_on_ranks(self, fn, items, batch_size=batch_size, run_dir=run_dir, timeout=timeout,
                            progress=self.progress if progress is None else progress)

    def profile(self, fn, *args, profile=True, **kwargs):
        """`run` with torch.profiler on every rank: the Result's ``profile`` is the table.

        Parameters
        ----------
        fn : function
            As for `run`.
        *args
            As for `run`.
        profile : bool or Profile, default True
            What to record.
        **kwargs
            As for `run`.

        Returns
        -------
        Result
        """
        return self.run(fn, *args, profile=profile, **kwargs)


class Rank:
    """One live rank: the same calls as `Ranks`, with single values."""

    def __init__(self, ranks: Ranks, rank: int):
        self._ranks, self.rank = ranks, rank

    def exec(self, code: str, *, timeout: float | None = None) -> None:
        self._ranks.exec(code, ranks=[self.rank], timeout=timeout, _namespace=sys._getframe(1).f_globals)

    def eval(self, expression: str, *, timeout: float | None = None):
        state = self._ranks._command("eval", expression, ranks=[self.rank], timeout=timeout,
                                     namespace=sys._getframe(1).f_globals)
        return state.values.get(self.rank)

    def push(self, **objects) -> None:
        self._ranks.push(ranks=[self.rank], **objects)

    def pull(self, name: str):
        return self._ranks.pull(name, ranks=[self.rank])[0]

    def run(self, fn, *args, **kwargs):
        return self._ranks.run(fn, *args, ranks=[self.rank], **kwargs)

    def debug(self, commands: list[str] | None = None) -> None:
        self._ranks.debug(self.rank, commands)

    def __repr__(self) -> str:
        return f"Rank({self.rank} of {self._ranks!r})"


