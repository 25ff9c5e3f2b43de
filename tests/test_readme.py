"""Every ```python block in README.md runs as written, in order, in one real Jupyter kernel.

A block that needs something CPU CI lacks comes right after a comment line naming it:

    <!-- readme-test: requires gpu -->

and runs only where that is available; elsewhere its test is skipped, saying what was missing.
Add a requirement by adding an entry to REQUIREMENTS.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = re.compile(r"<!--\s*readme-test:\s*requires\s+(?P<names>[\w\s,|-]+?)\s*-->")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _nvml_sees_a_gpu() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


# name -> (is it available here?, what it means when it is not)
REQUIREMENTS = {
    "gpu": (_nvml_sees_a_gpu, "no NVIDIA GPU visible through NVML"),
    "ray": (lambda: importlib.util.find_spec("ray") is not None, "ray is not installed"),
    "slurm": (lambda: shutil.which("sbatch") is not None and bool(os.environ.get("SLURM_CONF")),
              "no SLURM here (needs sbatch on PATH and SLURM_CONF set)"),
}


@dataclass(frozen=True)
class Block:
    line: int             # 1-based line of the opening fence in README.md
    code: str
    requires: tuple[str, ...]


def marker_requirements(html: str) -> tuple[str, ...] | None:
    found = MARKER.search(html)
    return None if found is None else tuple(n for n in re.split(r"[\s,|]+", found["names"]) if n)


def parse_readme(text: str) -> tuple[list[Block], list[str]]:
    """(the python blocks in order, mistakes in readme-test comments)."""
    blocks, mistakes = [], []
    tokens = MarkdownIt("commonmark").parse(text)
    for i, token in enumerate(tokens):
        previous, following = tokens[i - 1] if i else None, tokens[i + 1] if i + 1 < len(tokens) else None
        if token.type == "html_block" and "readme-test" in token.content:
            where = f"README.md line {token.map[0] + 1}"
            names = marker_requirements(token.content)
            if names is None:
                mistakes.append(f"{where}: write it as <!-- readme-test: requires gpu --> "
                                f"(known requirements: {', '.join(REQUIREMENTS)})")
            elif unknown := [n for n in names if n not in REQUIREMENTS]:
                mistakes.append(f"{where}: unknown requirement {', '.join(unknown)}; known: "
                                f"{', '.join(REQUIREMENTS)} (add one to REQUIREMENTS in tests/test_readme.py)")
            if following is None or following.type != "fence" or following.info.split()[:1] != ["python"]:
                mistakes.append(f"{where}: a readme-test comment must come right before a ```python block")
        if token.type == "fence" and token.info.split()[:1] == ["python"]:
            requires = ()
            if previous is not None and previous.type == "html_block":
                requires = marker_requirements(previous.content) or ()
            blocks.append(Block(token.map[0] + 1, token.content, requires))
    return blocks, mistakes


BLOCKS, MISTAKES = parse_readme(README.read_text())


def test_readme_test_comments_are_well_formed():
    assert not MISTAKES, "\n".join(MISTAKES)


def test_the_parser_finds_blocks_and_their_requirements():
    text = ("# t\n\n```python\na = 1\n```\n\n<!-- readme-test: requires gpu, ray -->\n```python\nb = 2\n```\n"
            "```bash\nnot run\n```\n<!-- readme-test: requires quantum -->\n```python\nc = 3\n```\n"
            "<!-- readme-test: requires gpu -->\n```text\n%magic\n```\n")
    blocks, mistakes = parse_readme(text)
    assert [(b.line, b.code, b.requires) for b in blocks] == [
        (3, "a = 1\n", ()), (8, "b = 2\n", ("gpu", "ray")), (15, "c = 3\n", ("quantum",))]
    assert mistakes == [
        "README.md line 14: unknown requirement quantum; known: gpu, ray, slurm "
        "(add one to REQUIREMENTS in tests/test_readme.py)",
        "README.md line 18: a readme-test comment must come right before a ```python block"]


class ReadmeKernel:
    """A real kernel of this environment, started in an empty directory, with text progress."""

    def __init__(self, cwd: Path):
        from jupyter_client.manager import start_new_kernel

        env = {**os.environ, "NBTRAIN_PROGRESS": "text"}  # plain lines: quick, and readable on failure
        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(cwd), env=env)

    def run(self, code: str, timeout: float = 300) -> tuple[int | None, dict | None]:
        """(execution count, error content or None)."""
        error = None

        def hook(msg):
            nonlocal error
            if msg["msg_type"] == "error":
                error = msg["content"]

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=False)
        return reply["content"].get("execution_count"), error

    def close(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def readme_kernel(tmp_path_factory, local_slurm):
    # After the session's SLURM cluster (where one can run): the kernel inherits its SLURM_CONF.
    kernel = ReadmeKernel(tmp_path_factory.mktemp("readme"))
    yield kernel
    kernel.close()


def failure_report(block: Block, count: int | None, error: dict) -> str:
    traceback = ANSI.sub("", "\n".join(error.get("traceback") or [f"{error['ename']}: {error['evalue']}"]))
    # IPython names the failing line of the cell; point at the same line in README.md.
    lines = re.findall(rf"Cell In\[{count}\], line (\d+)", traceback) if count is not None else []
    at = f" (README.md line {block.line + int(lines[-1])})" if lines else ""
    return f"README.md line {block.line}: this python block failed with {error['ename']}{at}:\n{traceback}"


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{b.line}" for b in BLOCKS])
def test_readme_block_runs(readme_kernel, block):
    unknown = [name for name in block.requires if name not in REQUIREMENTS]
    if unknown:
        pytest.fail(f"README.md line {block.line} requires {', '.join(unknown)}, which tests/test_readme.py "
                    f"does not know (known: {', '.join(REQUIREMENTS)})", pytrace=False)
    missing = [REQUIREMENTS[name][1] for name in block.requires if not REQUIREMENTS[name][0]()]
    if missing:
        pytest.skip(f"README.md line {block.line} requires {', '.join(block.requires)}: {'; '.join(missing)}")
    count, error = readme_kernel.run(block.code)
    if error is not None:
        pytest.fail(failure_report(block, count, error), pytrace=False)


@pytest.mark.slow
def test_a_failing_block_is_reported_at_its_readme_line(readme_kernel):
    block = Block(line=40, code="def check(n):\n    raise ValueError(f'bad {n}')\n\ncheck(3)\n", requires=())
    count, error = readme_kernel.run(block.code)
    assert error is not None and error["ename"] == "ValueError"
    report = failure_report(block, count, error)
    assert report.startswith("README.md line 40: this python block failed with ValueError (README.md line 42):\n")
    assert "ValueError: bad 3" in report and "\x1b[" not in report
