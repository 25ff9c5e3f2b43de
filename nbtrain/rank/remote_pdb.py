"""pdb for a rank, through the notebook: the rank has no terminal, so the prompt and what pdb
writes travel to the notebook on the rank's channel, and what the user types comes back as `Stdin`
(`loop.py` queues it). Used after a failure (`Ranks.debug`), for `breakpoint()` in a live rank's code,
and to look at a stuck rank's frames (continue and step refused there). `loop` below is the rank's
`loop.RankLoop`: its channel, its `stdin` queue and its Context.
"""
from __future__ import annotations

from ..common import protocol
from ..common.tracebacks import package_path


class RemoteDebugger:
    """pdb whose prompt and input travel through the notebook (the rank has no terminal)."""

    def __new__(cls, loop, stuck: bool = False):
        import pdb

        def cannot_run(self, arg):
            self.message(f"*** rank {loop.ctx.rank}'s code is stuck here: nothing can run in these frames. Look "
                         "with where, up, down, p, pp, ll; q ends.")
            return 0

        class _Debugger(pdb.Pdb):
            if stuck:  # continue and step would return to frames blocked in C: say so, stay at the prompt
                do_c = do_cont = do_continue = do_n = do_next = do_s = do_step = cannot_run
                do_r = do_return = do_unt = do_until = do_j = do_jump = cannot_run

            def __init__(self):
                io = _DebugIO(loop)
                super().__init__(stdin=io, stdout=io, nosigint=True)
                self.use_rawinput = False
                self.prompt = f"(Pdb rank {loop.ctx.rank}) "
                self.typed: list[str] = []

            def precmd(self, line):
                if self.typed and line == self.typed[0]:  # a command given in advance: shown as if typed
                    self.typed.pop(0)
                    self.message(f"{self.prompt}{line}")
                return super().precmd(line)

            def setup(self, frame, tb):
                # Open at the innermost frame of the user's own code (torch's F.linear is rarely
                # what to look at); `down` still reaches the library frames below it.
                super().setup(frame, tb)
                for index in range(len(self.stack) - 1, -1, -1):
                    if package_path(self.stack[index][0].f_code.co_filename) is None:
                        self.curindex = index
                        self.curframe = self.stack[index][0]
                        self.curframe_locals = self.curframe.f_locals
                        break

        return _Debugger()


class _DebugIO:
    def __init__(self, loop):
        self.loop = loop
        self._text = ""

    def write(self, text: str) -> int:
        self._text += text
        if "\n" in self._text:
            done, self._text = self._text.rsplit("\n", 1)
            self.loop.link.emit(protocol.Output(self.loop.link.rank, "debug", done))
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        prompt, self._text = self._text, ""
        self.loop.link.emit(protocol.Prompt(self.loop.link.rank, prompt))
        return self.loop.stdin.get() + "\n"
