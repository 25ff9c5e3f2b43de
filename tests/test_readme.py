"""Every ```python block in README.md runs as written, in order, in one real Jupyter kernel; so
does every block of the site's pages (docs/*.md), page after page in the order of the site's table
of contents (docs/index.md), in a second kernel, as a reader goes through them.

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

from conftest import start_kernel

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
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
    line: int             # 1-based line of the opening fence in its file
    code: str
    requires: tuple[str, ...]
    file: str = "README.md"


def marker_requirements(html: str) -> tuple[str, ...] | None:
    found = MARKER.search(html)
    return None if found is None else tuple(n for n in re.split(r"[\s,|]+", found["names"]) if n)


def parse_readme(text: str, file: str = "README.md") -> tuple[list[Block], list[str]]:
    """(the python blocks in order, mistakes in readme-test comments)."""
    blocks, mistakes = [], []
    tokens = MarkdownIt("commonmark").parse(text)
    for i, token in enumerate(tokens):
        previous, following = tokens[i - 1] if i else None, tokens[i + 1] if i + 1 < len(tokens) else None
        if token.type == "html_block" and "readme-test" in token.content:
            where = f"{file} line {token.map[0] + 1}"
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
            blocks.append(Block(token.map[0] + 1, token.content, requires, file))
    return blocks, mistakes


def docs_pages() -> list[Path]:
    """docs/*.md in the order of docs/index.md's tables of contents (a page outside them last)."""
    listed = re.findall(r"^([\w-]+)$", (DOCS / "index.md").read_text(), flags=re.M)
    pages = sorted(p for p in DOCS.glob("*.md") if p.name != "README.md")  # README.md: how to build, not a page
    return sorted(pages, key=lambda p: listed.index(p.stem) if p.stem in listed else len(listed))


def parse_docs() -> tuple[list[Block], list[str]]:
    blocks, mistakes = [], []
    for page in docs_pages():
        found, wrong = parse_readme(page.read_text(), f"docs/{page.name}")
        blocks += found
        mistakes += wrong
    return blocks, mistakes


BLOCKS, MISTAKES = parse_readme(README.read_text())
DOCS_BLOCKS, DOCS_MISTAKES = parse_docs()


def test_readme_test_comments_are_well_formed():
    assert not MISTAKES + DOCS_MISTAKES, "\n".join(MISTAKES + DOCS_MISTAKES)


def test_every_docs_page_is_in_the_table_of_contents_and_runs_in_its_order():
    index = (DOCS / "index.md").read_text()
    outside = [p.name for p in docs_pages() if p.stem != "index" and not re.search(rf"^{p.stem}$", index, re.M)]
    assert not outside, f"docs pages not in docs/index.md's table of contents: {outside}"
    order = [p.stem for p in docs_pages()]
    assert order.index("getting-started") < order.index("trackers") < order.index("live-ranks")  # they use its train
    files = {b.file for b in DOCS_BLOCKS}
    assert {"docs/getting-started.md", "docs/launching.md", "docs/long-runs.md"} <= files


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
        env = {**os.environ, "NBTRAIN_PROGRESS": "text"}  # plain lines: quick, and readable on failure
        self.manager, self.client = start_kernel(cwd=str(cwd), env=env)

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
    # IPython names the failing line of the cell; point at the same line in the file.
    lines = re.findall(rf"Cell In\[{count}\], line (\d+)", traceback) if count is not None else []
    at = f" ({block.file} line {block.line + int(lines[-1])})" if lines else ""
    return f"{block.file} line {block.line}: this python block failed with {error['ename']}{at}:\n{traceback}"


@pytest.fixture(scope="module")
def docs_kernel(tmp_path_factory, local_slurm):
    kernel = ReadmeKernel(tmp_path_factory.mktemp("docs"))
    yield kernel
    kernel.close()


def run_block(kernel: ReadmeKernel, block: Block) -> None:
    unknown = [name for name in block.requires if name not in REQUIREMENTS]
    if unknown:
        pytest.fail(f"{block.file} line {block.line} requires {', '.join(unknown)}, which tests/test_readme.py "
                    f"does not know (known: {', '.join(REQUIREMENTS)})", pytrace=False)
    missing = [REQUIREMENTS[name][1] for name in block.requires if not REQUIREMENTS[name][0]()]
    if missing:
        pytest.skip(f"{block.file} line {block.line} requires {', '.join(block.requires)}: {'; '.join(missing)}")
    count, error = kernel.run(block.code)
    if error is not None:
        pytest.fail(failure_report(block, count, error), pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{b.line}" for b in BLOCKS])
def test_readme_block_runs(readme_kernel, block):
    run_block(readme_kernel, block)


@pytest.mark.slow
@pytest.mark.parametrize("block", DOCS_BLOCKS, ids=[f"{b.file}:{b.line}" for b in DOCS_BLOCKS])
def test_docs_block_runs(docs_kernel, block):
    run_block(docs_kernel, block)


@pytest.mark.slow
def test_a_failing_block_is_reported_at_its_readme_line(readme_kernel):
    block = Block(line=40, code="def check(n):\n    raise ValueError(f'bad {n}')\n\ncheck(3)\n", requires=())
    count, error = readme_kernel.run(block.code)
    assert error is not None and error["ename"] == "ValueError"
    report = failure_report(block, count, error)
    assert report.startswith("README.md line 40: this python block failed with ValueError (README.md line 42):\n")
    assert "ValueError: bad 3" in report and "\x1b[" not in report
