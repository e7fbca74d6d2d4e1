"""Every code block of README.md and docs/*.md runs, or says why not.

The rule (CONTRIBUTING.md, "Docs that run"): the blocks of one document run in order, in one fresh folder, with
tiny shapes. A block is classified by the HTML comment on the line before its fence, else by its language:

- `<!-- doc: run ... -->`: run it. A `bash` block runs line by line in a shell (`oneiter` is this checkout's;
  `tests/model_files/...` is the repository's, as from its root);
  a `python` block is executed in-process (a block whose first line is a comment naming a Python file, as
  `# my_model.py`, is also saved under that name, for the commands after it). `given FILE FILE...` in the marker
  puts those small recordings (and `report.html`) in the folder first. The python blocks of a document share one
  namespace, in order; they find `model`, `opt`, `x`, `y` and `loss_fn` defined (a small MLP with plain SGD): the
  names a snippet of a training loop takes from the user's code. Files stay in the folder for the blocks after
  (so two blocks of a document write different names).
- `<!-- doc: output -->`: the real output (stdout, and warnings as Python shows them) of the last block run before
  it must contain each of this block's lines, in order, with every number allowed to differ.
- `<!-- doc: skip: REASON -->`: not run, and the reason is stated (a device this machine has not, a full-size
  model, an install, a file tree).
- no comment: `python` blocks run, `toml` blocks must load as a tolerance file; any other block must carry a
  comment, so a new shell example cannot slip in unchecked.

Blocks marked `slow` (`<!-- doc: run, slow -->`) belong to the slow tests. A block marked `needs MODULE`
(`<!-- doc: run, needs torchtitan -->`) needs an optional package CI does not install: its document is skipped,
with that reason, where the module cannot be imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import record_small, replay, run_cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*doc:\s*(.*?)\s*-->\s*$")
NUMBER = re.compile(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?x?")


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    text: str
    marker: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def action(self) -> str:
        if self.marker:
            return self.marker.split(":")[0].split(",")[0].split()[0]
        return {"python": "run", "toml": "toml"}.get(self.lang, "unmarked")

    @property
    def needs(self) -> list[str]:
        found = re.search(r"\bneeds ([\w. ]+)", self.marker)
        return found[1].split() if found else []

    @property
    def given(self) -> list[str]:
        found = re.search(r"\bgiven ([\w. ]+)", self.marker)
        return found[1].split() if found else []


def blocks_of(doc: Path) -> list[Block]:
    lines, found, i = doc.read_text(encoding="utf-8").split("\n"), [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if re.match(r"^\s*```\s*$", lines[j]))
        indent = len(fence[1])
        text = "\n".join(line[indent:] for line in lines[i + 1:end])
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        found.append(Block(doc, i + 1, fence[2], text, marker[1] if marker else ""))
        i = end + 1
    return found


ALL = [b for doc in DOCS for b in blocks_of(doc)]


def test_every_block_runs_or_says_why_not():
    for block in ALL:
        assert block.action in ("run", "output", "skip", "toml"), (
            f"{block.where}: a {block.lang or 'plain'} block needs a `<!-- doc: run -->`, `output` or `skip: REASON` "
            f"comment on the line before it (tests/test_docs_run.py)")
        if block.action == "skip":
            reason = block.marker.partition(":")[2].strip()
            assert len(reason) > 10, f"{block.where}: a skipped block states why (`<!-- doc: skip: REASON -->`)"
    assert sum(b.action == "run" for b in ALL) >= 14  # not a rule that could pass with nothing run


# -- what the blocks are given ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def given_files(tmp_path_factory, resnet_ref):
    """Small recordings under the names the docs use: a ResNet-18 reference (ref.h5, cpu.h5), a bf16 replay of it
    (npu.h5), a tiny LLaMA recorded --against cpu (bf16.h5), and the HTML report of ref vs npu."""
    folder = tmp_path_factory.mktemp("doc_files")
    shutil.copy(resnet_ref, folder / "ref.h5")
    shutil.copy(resnet_ref, folder / "cpu.h5")
    replay(resnet_ref, folder / "npu.h5", amp="bf16", isolate=False)
    record_small(folder / "bf16.h5", "llama_tiny", amp="bf16", against="cpu", batch_size=1)
    assert run_cli("compare", folder / "ref.h5", folder / "npu.h5", "--html", folder / "report.html").exit_code == 1
    return folder


def _namespace() -> dict:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return {"__name__": "__doc__", "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "x": torch.randn(4, 8), "y": torch.randint(0, 4, (4,)),
            "loss_fn": lambda out, labels: torch.nn.functional.cross_entropy(out, labels)}


def _shown_as_python_does(message, category, filename, lineno, file=None, line=None):
    """Python's default display (`formatwarning`, which oneiter's `warn` sets for its own category) to stderr;
    `warnings._showwarning_orig` would hand it to pytest's recorder, which replaces the display under pytest."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _run_python(block: Block, folder: Path, namespace: dict) -> str:
    first = block.text.split("\n", 1)[0]
    saved = re.fullmatch(r"# ([\w/]+\.py).*", first)
    if saved:
        (folder / saved[1]).parent.mkdir(parents=True, exist_ok=True)
        (folder / saved[1]).write_text(block.text + "\n")
    out = io.StringIO()
    sys.path.insert(0, str(folder))
    try:
        # what a user sees: stdout, and warnings as Python shows them (pytest would only record them)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = _shown_as_python_does
            exec(compile(block.text, block.where, "exec"), namespace)  # noqa: S102 - the docs' own code
    finally:
        sys.path.remove(str(folder))
    return out.getvalue()


def _run_bash(block: Block, folder: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=folder, env=env, capture_output=True,
                         text=True, timeout=300)
    # a verdict's exit code (1: diverged) is an answer, not a failure; anything else is
    assert res.returncode in (0, 1), f"{block.where} exited {res.returncode}:\n{res.stderr[-2000:]}"
    return res.stdout


def _check_output(block: Block, real: str) -> None:
    def plain(text: str) -> str:
        return NUMBER.sub("N", " ".join(text.split()))

    lines = [plain(line) for line in real.splitlines()]
    at = 0
    for want in block.text.splitlines():
        want = plain(want)
        if not want or want == "...":
            continue
        hit = next((k for k in range(at, len(lines)) if want in lines[k]), None)
        assert hit is not None, f"{block.where}: not in the real output: {want!r}\nreal:\n{real}"
        at = hit + 1


def _check_toml(block: Block, folder: Path) -> None:
    from oneiter.judge.measure.tolerance_file import load_tolerance_file

    path = folder / "doc.toml"
    path.write_text(block.text + "\n")
    load_tolerance_file(path)


def _run_doc(doc: Path, folder: Path, given: Path, monkeypatch) -> None:
    (folder / "tests").symlink_to(ROOT / "tests")  # `-m tests/model_files/hf_llama.py:build`, as from the root
    monkeypatch.chdir(folder)
    monkeypatch.setenv("ONEITER_NO_PROGRESS", "1")
    last, namespace = "", _namespace()  # the python blocks of one document share one namespace, in order
    for block in blocks_of(doc):
        for name in block.given:
            shutil.copy(given / name, folder / name)
        if block.action == "toml":
            _check_toml(block, folder)
        elif block.action == "output":
            _check_output(block, last)
        elif block.action == "run":
            last = _run_python(block, folder, namespace) if block.lang == "python" else _run_bash(block, folder)


def _param(doc: Path):
    slow = any(b.action == "run" and "slow" in b.marker for b in blocks_of(doc))
    marks = [pytest.mark.slow] if slow else []
    missing = sorted({m for b in blocks_of(doc) if b.action == "run" for m in b.needs
                      if importlib.util.find_spec(m) is None})
    if missing:
        marks.append(pytest.mark.skip(reason=f"{doc.name} runs {', '.join(missing)}, which is not installed "
                                             f"(optional: pip install {' '.join(missing)})"))
    return pytest.param(doc, id=str(doc.relative_to(ROOT)), marks=marks)


@pytest.mark.parametrize("doc", [_param(d) for d in DOCS if any(b.action != "skip" for b in blocks_of(d))])
def test_the_blocks_of_a_document_run(doc, given_files, tmp_path, monkeypatch):
    _run_doc(doc, tmp_path, given_files, monkeypatch)
