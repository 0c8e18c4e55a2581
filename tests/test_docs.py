"""The user-facing docs say what the code does: every relative link resolves, every module ARCHITECTURE.md names
exists, and every command in README.md and the topic pages either runs here on the tiny models or is classified,
by a rule this file states, as one that cannot.

How a command (a line of a ``bash`` block, continuations joined) is treated, in this order:

* **real**: it names a checkpoint this machine cannot have or a service it cannot start (``/ckpts/``, an
  upper-case placeholder such as ``CKPT``/``OUT``/``DIR``, ``...``, an engine's serve command, ``pip install``
  and ``pytest``: the set-up commands ``.ci/run`` itself runs): not run.
* **parsed**: ``examples/hf_ptq.py`` (under ``python`` or ``torchrun``): its arguments go through the real parser
  and ``PtqConfig`` (a typo or a bad value fails here), but the run is not repeated (tens of seconds each on
  the tiny models; ``tests/test_main_command.py`` and the per-model tests run the same pipeline). A later command
  that reads its ``--export_path`` is *dependent* and not run either.
* **run**: everything else, in page order, in one scratch directory per page, and must exit 0.

``python`` blocks run as scripts in the page's scratch directory unless marked as a fragment. A block preceded by
``<!-- docs-test: skip: REASON -->`` (or ``fragment: REASON`` for Python) is not run; the reason is required.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The pages a user reads; DESIGN_NOTES.md (the decision log), ENGINE_CONFORMANCE.md and MUTATION.md (developer
# procedures that install engines or mutate the tree) are checked for links only.
USER_PAGES = ["README.md", *(f"docs/{p}.md" for p in (
    "USAGE", "MODELS", "SERVING", "SERVING_RULES", "MEMORY", "CALIBRATION", "REPORT", "CONVERT", "RELIABILITY", "ARCHITECTURE"))]
LINKED_PAGES = [*USER_PAGES, "docs/DESIGN_NOTES.md", "docs/ENGINE_CONFORMANCE.md", "docs/MUTATION.md",
                "benchmarks/README.md", *(str(p.relative_to(REPO)) for p in sorted((REPO / "docs/decisions").glob("*.md")))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|fragment):\s*(\S.*?)\s*-->")
REAL = re.compile(r"/ckpts/|\.\.\.|(?<![\w/.-])(?:CKPT|OUT|DIR|SRC|DST|EXPORT|R|W)(?![\w/.-])|^(?:vllm|trtllm-serve)\b|"
                  r"sglang\.launch_server|^pip install|pytest")
HF_PTQ = "examples/hf_ptq.py"


@dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    marker: tuple[str, str] | None


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of ``page`` with the docs-test marker just above each, if any."""
    out, lines = [], (REPO / page).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        above = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.search(above)
        out.append(Block(page, i + 1, m[1], "\n".join(lines[i + 1:j]), (marker[1], marker[2]) if marker else None))
        i = j + 1
    return out


def commands(text: str) -> list[str]:
    """The shell commands of a bash block: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s{2,}#.*$", "", line).strip()  # an inline comment: two spaces or more, then #
        if line and not line.startswith("#"):
            out.append(re.sub(r"\s+", " ", line))
    return out


def hf_ptq_args(command: str) -> list[str] | None:
    """The hf_ptq arguments of ``command``, None if it does not run ``examples/hf_ptq.py``."""
    words = shlex.split(command, comments=True)
    if HF_PTQ not in words:
        return None
    return words[words.index(HF_PTQ) + 1:]


def classify(page: str) -> list[tuple[str, str, Block]]:
    """(how, command, block) for every command of ``page``: how is real / parsed / dependent / run / skip /
    fragment / python."""
    out, exports = [], []
    for block in blocks(page):
        if block.lang not in ("bash", "python"):
            continue
        if block.marker:
            out.append((block.marker[0], block.text, block))
            continue
        if block.lang == "python":
            out.append(("python", block.text, block))
            continue
        for cmd in commands(block.text):
            args = hf_ptq_args(cmd)
            if REAL.search(cmd):
                how = "real"
            elif args is not None:
                how = "parsed"
                if "--export_path" in args:
                    exports.append(args[args.index("--export_path") + 1])
            elif any(re.search(rf"(?<![\w-]){re.escape(e)}(?![\w-])", cmd) for e in exports):
                how = "dependent"
            else:
                how = "run"
            out.append((how, cmd, block))
    return out


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in LINKED_PAGES:
        path = REPO / page
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"^[a-z]+://|^mailto:|^#", target):
                continue
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                broken.append(f"{page}: {target}")
    assert not broken, broken


def test_every_module_the_architecture_names_exists() -> None:
    text = (REPO / "docs/ARCHITECTURE.md").read_text()
    paths = set(re.findall(r"`((?:modelopt_k3|tests|scripts|tools)/[\w/.]+?)`", text))
    assert len(paths) > 20, "ARCHITECTURE.md names the files it describes"
    missing = [p for p in sorted(paths) if not (REPO / p).exists()]
    assert not missing, missing
    for dotted in sorted(set(re.findall(r"`(modelopt_k3(?:\.\w+)+)`", text))):
        importlib.import_module(dotted)


def test_every_marked_block_says_why() -> None:
    for page in USER_PAGES:
        for block in blocks(page):
            assert block.marker is None or block.marker[1], f"{page}:{block.line}"


def test_the_readme_is_a_quick_start() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    # The two set-up commands, verbatim as .ci/run and a new user run them.
    assert readme.count("pip install torch==2.13.0 && pip install -e") == 2


@pytest.mark.parametrize("page", USER_PAGES)
def test_hf_ptq_commands_parse(page: str) -> None:
    from modelopt_k3.cli.hf_ptq import build_parser
    from modelopt_k3.run.plan import PtqConfig

    for how, cmd, block in classify(page):
        if how == "parsed":
            try:
                PtqConfig.from_namespace(build_parser().parse_args(hf_ptq_args(cmd)))
            except SystemExit as e:
                raise AssertionError(f"{page}:{block.line}: {cmd!r} does not parse (exit {e.code})") from None


def test_the_classification_is_the_rule_the_docstring_states() -> None:
    said = {(how, cmd) for how, cmd, _ in classify("docs/MODELS.md")}
    assert ("parsed", "torchrun --nproc_per_node 2 examples/hf_ptq.py --pyt_ckpt_path tiny-gpt-oss --qformat nvfp4 "
            "--export_path tiny-gpt-oss-nvfp4") in said
    assert ("run", "modelopt-k3-convert --src tiny-gpt-oss --dst tiny-gpt-oss-conv") in said
    readme = {(how, cmd) for how, cmd, _ in classify("README.md")}
    assert ("dependent", "modelopt-k3-check out-nvfp4") in readme
    assert all(how == "real" for how, cmd in readme if "/ckpts/" in cmd or cmd.startswith("pip install"))


@pytest.mark.slow
@pytest.mark.parametrize("page", USER_PAGES)
def test_every_runnable_command_runs(page: str, tmp_path: Path) -> None:
    env = {**os.environ, "MODELOPT_K3_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    ran = 0
    for how, cmd, block in classify(page):
        if how == "run":
            proc = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
        elif how == "python":
            proc = subprocess.run([sys.executable, "-c", cmd], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=600)
        else:
            continue
        assert proc.returncode == 0, f"{page}:{block.line}: {cmd[:200]!r}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        ran += 1
    if page in ("docs/MODELS.md", "docs/MEMORY.md", "docs/USAGE.md"):
        assert ran, f"{page}: its tiny-model commands ran"
