import os
import queue

import psutil
import pytest


@pytest.fixture
def no_leftovers():
    """After the test: no child process, no new open file descriptor, MASTER_PORT not leaked."""
    import nbtrain.template

    me = psutil.Process()
    had_template = nbtrain.template.template(start=False) is not None
    fds_before = me.num_fds()
    yield
    if not had_template:  # a template the test started is the kernel's by design: stopping it must leave nothing
        nbtrain.template.stop()
    children = [c for c in me.children(recursive=True) if not _is_template(c)]
    assert not children, f"processes left behind: {[(c.pid, c.name()) for c in children]}"
    assert me.num_fds() <= fds_before, f"file descriptors leaked: {fds_before} -> {me.num_fds()}"
    assert "MASTER_PORT" not in os.environ


def _is_template(process) -> bool:
    import nbtrain.template

    running = nbtrain.template.template(start=False)
    return running is not None and process.pid == running.process.pid


class Kernel:
    """A real Jupyter kernel (the same python as the tests) driven through jupyter_client."""

    def __init__(self):
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3")

    def run(self, code: str, timeout: float = 120, answers: list[str] | None = None):
        """Execute a cell; return (stdout text, stderr text, error content or None, results).

        `answers`: lines typed at the cell's `input()` prompts (pdb's included), in order;
        the prompts are kept in `self.prompts`.
        """
        out, err, results, error = [], [], [], None
        self.prompts, pending = [], list(answers or [])

        def stdin_hook(msg):
            self.prompts.append(msg["content"]["prompt"])
            self.client.input(pending.pop(0) if pending else "q")

        def hook(msg):
            nonlocal error
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (out if content["name"] == "stdout" else err).append(content["text"])
            elif kind in ("execute_result", "display_data"):
                results.append(content["data"])
            elif kind == "error":
                error = content

        self.client.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=answers is not None,
                                        stdin_hook=stdin_hook)
        return "".join(out), "".join(err), error, results

    def value(self, expression: str):
        out, err, error, _ = self.run(f"print(repr(({expression})))")
        assert error is None, error
        return eval(out.strip())

    def close(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    yield k
    k.close()
