"""What a rank shows in the notebook beyond its printed lines: rich display, bars, log records.

`show_in_notebook` runs in every rank, however it was started (`loop.serve`):
- **Rich display.** `IPython.display.display()` (HTML, images, any MIME bundle), display ids and
  their updates (`update_display`, `handle.update()`) and `clear_output()` travel over the channel
  as ("display" | "update_display", rank, data, metadata, transient) and ("clear_output", rank,
  wait); the notebook shows them in the running cell. A rank forked from the kernel inherits the
  kernel's shell, whose publisher writes to the kernel's sockets (ipykernel drops what a fork
  sends there): it gets this publisher instead. A rank without a shell gets a plain
  `InteractiveShell` with it when its code imports IPython (~15 ms, only then).
- **Bars.** A rank is no notebook front end: tqdm's notebook bars (what `tqdm.auto` picks in a
  rank forked from the kernel) draw text, and rich draws as on a terminal, not with ipywidgets
  that cannot cross processes. The notebook shows their redrawn lines as one live line per rank
  (`common/lines.py`).
- **Log records** carry `record.rank`; a rank's records, like its prints, reach the cell tagged
  `[rank N]` (`process.redirect_output` points streams inherited from the kernel at the rank's).

The rank side never imports IPython, tqdm's notebook module or rich itself (a rank that never uses
them pays nothing; they may not even be installed where ranks run): each is changed only once
something in the rank imported it, found in `sys.modules` or caught as its import finishes.
"""
from __future__ import annotations

import logging
import pickle
import sys
import types

from ..common import protocol
from ..common.import_hooks import when_imported

log = logging.getLogger(__name__)

# tqdm.notebook.tqdm_notebook's own members: without them it is the text tqdm it derives from.
_TQDM_NOTEBOOK_MEMBERS = ("status_printer", "display", "colour", "__init__", "__iter__", "update", "close", "clear",
                          "reset")


def show_in_notebook(link, rank: int) -> None:
    when_imported("IPython", lambda _: _publish_through(link))
    when_imported("tqdm.notebook", _text_tqdm)
    when_imported("rich.console", _rich_as_terminal)
    rich = sys.modules.get("rich")
    if getattr(rich, "_console", None) is not None:  # made in the kernel before the fork: it believes it is in Jupyter
        rich._console = None  # type: ignore[union-attr]  # set, so rich is there (getattr above)
    _tag_records(rank)


# -- rich display ------------------------------------------------------------------------------

def _publish_through(link) -> None:
    """The rank's shell publishes over the channel: the kernel's inherited one, or a new plain one."""
    shells = sys.modules["IPython.core.interactiveshell"]
    if shells.InteractiveShell.initialized():
        shell = shells.InteractiveShell.instance()
    else:
        config = sys.modules["traitlets.config"].Config()
        config.HistoryManager.enabled = False  # no sqlite file shared by every rank
        # A module of its own: the shell fills its namespace (In, Out, exit...), and the rank's
        # __main__ (a live rank's namespace) stays the user's.
        shell = shells.InteractiveShell.instance(config=config, user_module=types.ModuleType("__nbtrain_shell__"))
    shell.display_pub = _channel_publisher(shell, link)


def _channel_publisher(shell, link):
    base = sys.modules["IPython.core.displaypub"].DisplayPublisher

    class ChannelPublisher(base):
        """Sends what the rank displays to the notebook, which shows it in the running cell."""

        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
            self._validate_data(data, metadata)
            kind = protocol.UpdateDisplay if update else protocol.Display
            message = kind(link.rank, data, metadata or {}, transient or {})
            try:
                pickle.dumps(message)
            except Exception:  # display data should be JSON-able; what is not must not break the channel
                message = kind(link.rank, {"text/plain": str(data.get("text/plain", ""))}, {}, transient or {})
            _flush_streams()  # what the rank printed before it comes first
            link.emit(message)

        def clear_output(self, wait=False):
            _flush_streams()
            link.emit(protocol.ClearOutput(link.rank, bool(wait)))

    return ChannelPublisher(shell=shell)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


# -- bars --------------------------------------------------------------------------------------

def _text_tqdm(notebook) -> None:
    """tqdm's notebook bar becomes the text bar it derives from, in this rank: bars already
    bound to it (tqdm.auto in a rank forked from the kernel, Lightning's) draw text lines,
    which the notebook shows as one live line. Its widgets could not cross processes."""
    cls = notebook.tqdm_notebook
    if "_nbtrain_text" in vars(cls):
        return
    for name in _TQDM_NOTEBOOK_MEMBERS:
        if name in vars(cls):
            delattr(cls, name)

    def __init__(self, *args, display=True, **kwargs):  # noqa: N807 - the one argument only the notebook bar takes
        super(cls, self).__init__(*args, **kwargs)

    cls.__init__ = __init__
    cls._nbtrain_text = True


def _rich_as_terminal(console) -> None:
    """rich in a rank is no Jupyter front end (its live displays would be ipywidgets made in another
    process), and its consoles on the rank's own stdout and stderr draw as on a terminal: the
    notebook shows those redraws as one live block."""
    console._is_jupyter = lambda: False
    cls = console.Console
    detect = cls.is_terminal.fget
    if getattr(detect, "_nbtrain", False):
        return

    def is_terminal(self) -> bool:
        if (self._force_terminal is None and self._file is None and "TTY_COMPATIBLE" not in self._environ
                and "FORCE_COLOR" not in self._environ):
            return True
        return detect(self)

    is_terminal._nbtrain = True  # type: ignore[attr-defined]  # a mark on the function, which mypy does not model
    cls.is_terminal = property(is_terminal, doc=detect.__doc__)


# -- log records -------------------------------------------------------------------------------

def _tag_records(rank: int) -> None:
    """Every log record made in this rank carries `record.rank` (for formats: `%(rank)s`)."""
    make = logging.getLogRecordFactory()
    make = getattr(make, "_nbtrain_inner", make)  # set once: a second call only changes the rank

    def record(*args, **kwargs):
        made = make(*args, **kwargs)
        made.rank = rank
        return made

    record._nbtrain_inner = make  # type: ignore[attr-defined]  # a mark on the function, which mypy does not model
    logging.setLogRecordFactory(record)
