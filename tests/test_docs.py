"""The user-facing docs say what the code does: every relative link resolves, every module ARCHITECTURE.md names
exists, and every command in README.md and the topic pages runs here on the tiny models, or says in the page why
it cannot and still goes through the parser of the command line it names.

A command is a line of a ``bash`` block (continuations joined). How it is treated, in this order:

* **setup**: a ``pip install`` chain or ``pytest``: the environment this test runs in (``.ci/run`` builds it the
  same way) and the suite itself. Not run.
* **needs**: a comment ``# needs: WHY`` on the command's line, or above it in the block (it covers every command
  under it up to the next blank line), says the command cannot run here and names what it needs: a real
  checkpoint or export, GPUs, nodes or an engine. Not run. A command naming what this machine cannot have
  (``/ckpts/``, an upper-case placeholder such as ``CKPT``/``OUT``, ``...``, an engine's serve command) must
  carry the mark.
* **parsed**: an ``examples/hf_ptq.py`` command that ``RUN_HF_PTQ`` does not list. The pages hold 17 of them on
  the tiny stand-ins, 10 to 20 s each on 2 shared cores (about 4 min in all, against a 2 min budget for this
  file), so 5 run, one per distinct path: ``torchrun`` EP 2 on the embedded tiny Kimi-K3 (README's main
  command), one process with a recipe file (USAGE's mirror recipe), ``--layerwise`` under EP 2 (MEMORY), and a
  non-Kimi model, Qwen3-MoE, with GPTQ (CALIBRATION's pair, whose ``modelopt-k3-report --compare`` then runs).
  The calibration-free converter is not hf_ptq and runs wherever a page shows it. The 12 parsed ones are the 9
  per-model EP 2 runs of MODELS.md (``tests/models/*`` run the same pipeline per model), USAGE's copy of the
  main command and CALIBRATION's outlier pair (GPTQ, AWQ+GPTQ: ``tests/models/qwen3_moe/test_awq.py``).
* **dependent**: a command reading a parsed command's ``--export_path``. Not run.
* **run**: everything else, in page order, in one scratch directory per page (``examples/`` and ``recipes/``
  linked into it, as run from the repository root; ``MODELOPT_K3_CACHE``, the embedded tiny Kimi-K3's cache,
  shared by the pages). Each must exit 0, or the status an inline ``# exit N: WHY`` states.

Every command, run or not, is checked without running it too (the fast ``test_every_command_parses``): each of
this project's command lines it calls (``examples/hf_ptq.py``, a ``modelopt-k3-*`` script, ``-m
modelopt_k3.cli.*``) goes through that command line's own parser (hf_ptq's through ``PtqConfig`` too), its
``--qformat`` must be a preset and its ``--recipe`` resolve, and every repository path it names must exist: a
flag the CLI does not have, a bad value or a wrong path fails whether or not the command runs.

``python`` blocks run as scripts in the page's scratch directory. A block preceded by
``<!-- docs-test: skip: REASON -->`` (or ``fragment: REASON`` for Python) is not run; the reason is required.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _mp import free_port

REPO = Path(__file__).resolve().parents[1]
# The pages a user reads; DESIGN_NOTES.md (the index of decision records), PROVENANCE.md, ENGINE_CONFORMANCE.md
# and MUTATION.md (developer procedures that install engines or mutate the tree) are checked for links only.
USER_PAGES = ["README.md", *(f"docs/{p}.md" for p in (
    "USAGE", "MODELS", "SERVING", "SERVING_RULES", "MEMORY", "CALIBRATION", "REPORT", "CONVERT", "RELIABILITY", "ARCHITECTURE"))]
LINKED_PAGES = [*USER_PAGES, "docs/DESIGN_NOTES.md", "docs/PROVENANCE.md", "docs/ENGINE_CONFORMANCE.md",
                "docs/MUTATION.md", "benchmarks/README.md", *(str(p.relative_to(REPO)) for p in sorted((REPO / "docs/decisions").glob("*.md")))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|fragment):\s*(\S.*?)\s*-->")
# Above an output the page shows: the command (its start) whose run prints every row of the table that follows.
OUTPUT = re.compile(r"<!--\s*docs-test:\s*output of:\s*(\S.*?)\s*-->")
# What this machine cannot have: a command naming one of these must say why it is not run (``# needs: ...``).
REAL = re.compile(r"/ckpts/|\.\.\.|(?<![\w/.-])(?:CKPT|OUT|DIR|SRC|DST|EXPORT|RECIPE|R|W)(?![\w/.-])|"
                  r"^(?:vllm|trtllm-serve)\b|sglang\.launch_server")
SETUP = re.compile(r"^pip install|pytest")
NEEDS = re.compile(r"#\s*needs:\s*(\S.*?)\s*$")
# A reason names what is missing here.
NEEDED = re.compile(r"\b(?:checkpoint|export|GPUs?|nodes?|engine)\b")
EXPECT = re.compile(r"^#\s*exit (\d+):\s*\S")
HF_PTQ = "examples/hf_ptq.py"
HF_PTQ_MODULE = "modelopt_k3.cli.hf_ptq"
# The installed command lines, as pyproject.toml's [project.scripts] names them (3.10 has no tomllib).
SCRIPTS = dict(re.findall(r'^(modelopt-k3-\w+) = "([\w.]+):main"$',
                          (REPO / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0], re.M))
# Repository paths a command may name (the scratch directory links the first two).
REPO_DIRS = ("examples", "recipes", "scripts", "tools", "benchmarks", "tests")
LINKED = ("examples", "recipes")

# The hf_ptq commands that run, by (page, --export_path): one per distinct path (the module docstring says why
# not all, and which).
RUN_HF_PTQ = {
    ("README.md", "out-nvfp4"),            # torchrun EP 2, the embedded tiny Kimi-K3: the main command
    ("docs/USAGE.md", "out-mirror"),       # one process, a recipe by file path
    ("docs/MEMORY.md", "tiny-k3-lw"),      # --layerwise with a checkpoint dir, torchrun EP 2
    ("docs/CALIBRATION.md", "tiny-qwen3-max"),   # a non-Kimi model in one process: max ...
    ("docs/CALIBRATION.md", "tiny-qwen3-gptq"),  # ... and GPTQ, compared by modelopt-k3-report --compare
}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    marker: tuple[str, str] | None


@dataclass
class Command:
    text: str  # continuations joined, comments dropped
    block: Block
    needs: str | None = None  # the page's reason it cannot run here
    exit: int = 0  # the exit status the page states


def blocks(page: str, text: str | None = None) -> list[Block]:
    """The fenced code blocks of ``page`` (or of ``text``) with the docs-test marker just above each, if any."""
    out, lines = [], (REPO / page).read_text().splitlines() if text is None else text.splitlines()
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


def commands(block: Block) -> list[Command]:
    """The shell commands of a bash block with the ``# needs:`` mark over each and the ``# exit N:`` it states."""
    out, needs = [], None
    for line in re.sub(r"\\\n\s*", " ", block.text).splitlines():
        line = line.strip()
        if not line:
            needs = None  # a mark covers the commands under it up to the next blank line
            continue
        if line.startswith("#"):
            if m := NEEDS.search(line):
                needs = m[1]
            continue
        command, comment = _split_comment(line)
        mark = NEEDS.search(comment)
        expect = EXPECT.search(comment)
        out.append(Command(re.sub(r"\s+", " ", command), block, mark[1] if mark else needs,
                           int(expect[1]) if expect else 0))
    return out


def _split_comment(line: str) -> tuple[str, str]:
    """``line`` as (command, inline comment): an inline comment is two spaces or more, then ``#``."""
    m = re.match(r"^(.*?)\s{2,}(#.*)$", line)
    return (m[1], m[2]) if m else (line, "")


def cli_calls(command: str) -> Iterator[tuple[str, list[str]]]:
    """(module, arguments) for each of this project's command lines ``command`` runs (``&&`` chains included);
    a ``...`` word (arguments left out) is dropped."""
    for part in command.split("&&"):
        words = shlex.split(part)
        for i, word in enumerate(words):
            module, start = None, i + 1
            if word == HF_PTQ:
                module = HF_PTQ_MODULE
            elif word in SCRIPTS:
                module = SCRIPTS[word]
            elif word == "-m" and i + 1 < len(words) and words[i + 1].startswith("modelopt_k3.cli."):
                module, start = words[i + 1], i + 2
            if module:
                yield module, [w for w in words[start:] if w != "..."]
                break


def hf_ptq_args(command: str) -> list[str] | None:
    """The hf_ptq arguments of ``command``, None if it does not run ``examples/hf_ptq.py``."""
    return next((args for module, args in cli_calls(command) if module == HF_PTQ_MODULE), None)


def export_path(args: list[str]) -> str | None:
    return args[args.index("--export_path") + 1] if "--export_path" in args else None


@dataclass
class Item:
    how: str  # setup / needs / parsed / dependent / run / python / skip / fragment
    text: str
    block: Block
    exit: int = 0


def classify(page: str, text: str | None = None) -> list[Item]:
    """How this test treats every command of ``page`` (the module docstring's rule, in its order)."""
    out, exports = [], []
    for block in blocks(page, text):
        if block.lang not in ("bash", "python"):
            continue
        if block.marker:
            out.append(Item(block.marker[0], block.text, block))
            continue
        if block.lang == "python":
            out.append(Item("python", block.text, block))
            continue
        for cmd in commands(block):
            args = hf_ptq_args(cmd.text)
            if SETUP.search(cmd.text):
                how = "setup"
            elif cmd.needs:
                how = "needs"
            elif args is not None and (page, export_path(args)) not in RUN_HF_PTQ:
                how = "parsed"
                if export_path(args):
                    exports.append(export_path(args))
            elif any(re.search(rf"(?<![\w-]){re.escape(e)}(?![\w-])", cmd.text) for e in exports):
                how = "dependent"
            else:
                how = "run"
            out.append(Item(how, cmd.text, block, cmd.exit))
    return out


def shown_outputs(page: str) -> list[tuple[int, str, list[str]]]:
    """(line, command start, table rows) for every output ``page`` shows under a ``docs-test: output of:`` mark."""
    out, lines = [], (REPO / page).read_text().splitlines()
    for n, line in enumerate(lines):
        if m := OUTPUT.search(line):
            first = next(k for k in range(n + 1, len(lines)) if lines[k].startswith("|"))
            last = next((k for k in range(first, len(lines)) if not lines[k].startswith("|")), len(lines))
            out.append((n + 1, m[1], lines[first:last]))
    return out


def unmarked_real(page: str, text: str | None = None) -> list[str]:
    """Commands naming what this machine cannot have, without the page's ``# needs:`` reason."""
    return [f"{page}:{c.block.line}: {c.text!r}" for b in blocks(page, text) if b.lang == "bash" and not b.marker
            for c in commands(b) if REAL.search(c.text) and not c.needs and not SETUP.search(c.text)]


def parse_problems(command: str) -> list[str]:
    """What is wrong with ``command``'s use of this project's command lines, without running it."""
    from modelopt_k3.recipe.finder import RecipeRoots
    from modelopt_k3.recipe.model import RecipeError
    from modelopt_k3.run.plan import PtqConfig, qformat_names

    problems = []
    for module, args in cli_calls(command):
        try:
            ns = importlib.import_module(module).build_parser().parse_args(args)
        except SystemExit as e:
            problems.append(f"{module} does not parse it (exit {e.code})")
            continue
        if module == HF_PTQ_MODULE:
            PtqConfig.from_namespace(ns)
        recipe, qformat = getattr(ns, "recipe", None), getattr(ns, "qformat", None)
        if recipe is None and qformat is not None and qformat not in qformat_names():
            problems.append(f"--qformat {qformat} is no preset")
        if recipe and not re.fullmatch(r"[A-Z_]+", str(recipe)):
            try:
                RecipeRoots.current().find_recipe(REPO / recipe if (REPO / recipe).is_file() else recipe)
            except RecipeError as e:
                problems.append(str(e).split(":")[0])
    problems += [f"no {w} in the repository" for w in shlex.split(command.replace("&&", " "))
                 if w.split("/")[0] in REPO_DIRS and "/" in w and not (REPO / w).exists()]
    return problems


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


def test_every_test_the_design_docs_cite_exists() -> None:
    # ARCHITECTURE.md and the decision records name the tests that hold each invariant: a renamed or deleted test
    # must not leave a record pointing at nothing. ``path::name`` (a ``Class::name`` counts by its last part).
    pages = ["docs/ARCHITECTURE.md", *(str(p.relative_to(REPO)) for p in sorted((REPO / "docs/decisions").glob("*.md")))]
    cited = {(page, path, name) for page in pages
             for path, name in re.findall(r"`?(tests/[\w/]+\.py)((?:::\w+)+)", (REPO / page).read_text())}
    assert cited, "the design docs cite their tests"
    missing = [f"{page}: {path}{name}" for page, path, name in sorted(cited)
               if not (REPO / path).exists()
               or not re.search(rf"^\s*(?:async )?def {name.split('::')[-1]}\b|^class {name.split('::')[-1]}\b",
                                (REPO / path).read_text(), re.M)]
    assert not missing, missing


def _brace_expansions(word: str) -> list[str]:
    """``a_{x,y}`` -> ``a_x``, ``a_y`` (one brace group, as the recipes tree writes a family)."""
    m = re.search(r"\{([^{}]+)\}", word)
    return [word] if m is None else [word[:m.start()] + part + word[m.end():] for part in m[1].split(",")]


def test_the_recipes_readme_lists_every_recipe() -> None:
    """recipes/README.md's tree names every preset and model recipe (it once listed only Kimi-K3's and DeepSeek-V3's
    model recipes), and nothing that is not there."""
    text = (REPO / "recipes/README.md").read_text()
    tree = text[text.index("```\nrecipes/\n"):]
    tree = tree[:tree.index("```", 4)]
    listed, folder = set(), ""
    for line in tree.splitlines()[1:]:
        first = line.split()[0] if line.strip() else ""
        if first in ("presets/", "models/"):
            folder = first
        elif folder and re.fullmatch(r"[\w.{},/-]+", first) and line.startswith("    ") and not line.startswith(" " * 8):
            listed.update(folder + name for name in _brace_expansions(first))
    stored = {str(p.relative_to(REPO / "recipes").with_suffix("")) for sub in ("presets", "models")
              for p in (REPO / "recipes" / sub).rglob("*.yaml")}
    assert listed == stored, {"not listed": sorted(stored - listed), "listed, no file": sorted(listed - stored)}


def test_every_marked_block_says_why() -> None:
    for page in USER_PAGES:
        for block in blocks(page):
            assert block.marker is None or block.marker[1], f"{page}:{block.line}"


def test_every_command_block_is_a_bash_block() -> None:
    # An unlabelled block of commands would be neither run nor parsed.
    commandlike = re.compile(rf"^(?:torchrun|python|pip|{'|'.join(SCRIPTS)})\b", re.M)
    unlabelled = [f"{page}:{b.line}" for page in USER_PAGES for b in blocks(page)
                  if b.lang not in ("bash", "python") and commandlike.search(b.text)]
    assert not unlabelled, unlabelled


def test_every_command_not_run_says_why() -> None:
    unmarked = [c for page in USER_PAGES for c in unmarked_real(page)]
    assert not unmarked, f"say why with '# needs: ...' (a real checkpoint, GPUs, an engine): {unmarked}"
    vague = [f"{page}:{b.line}: {c.needs!r}" for page in USER_PAGES for b in blocks(page) if b.lang == "bash"
             for c in commands(b) if c.needs and not NEEDED.search(c.needs)]
    assert not vague, f"a '# needs:' reason names what is missing here: {vague}"


def test_the_readme_is_a_quick_start() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    # The two set-up commands, verbatim as .ci/run and a new user run them.
    assert readme.count("pip install torch==2.13.0 && pip install -e") == 2
    ci = (REPO / ".ci/run").read_text()
    assert "pip install -q torch==2.13.0" in ci and 'pip install -q -e ".[test]"' in ci


@pytest.mark.parametrize("page", USER_PAGES)
def test_every_command_parses(page: str) -> None:
    problems = [f"{page}:{i.block.line}: {i.text!r}: {p}" for i in classify(page)
                if i.block.lang == "bash" and i.how not in ("skip",) for p in parse_problems(i.text)]
    assert not problems, problems


def test_every_listed_hf_ptq_command_is_in_its_page() -> None:
    ran = {(page, export_path(hf_ptq_args(i.text))) for page in USER_PAGES for i in classify(page)
           if i.how == "run" and hf_ptq_args(i.text) is not None}
    assert ran == RUN_HF_PTQ, RUN_HF_PTQ - ran
    # The docstring's counts are the pages' (tiny-model hf_ptq commands: those not marked as needing more).
    tiny = [i for page in USER_PAGES for i in classify(page)
            if i.how in ("run", "parsed") and hf_ptq_args(i.text) is not None]
    said = re.search(r"The pages hold (\d+) of them.*?so (\d+) run.*?The (\d+) parsed ones", __doc__, re.S)
    assert said and [int(n) for n in said.groups()] == [len(tiny), len(ran), len(tiny) - len(ran)], said


def test_every_shown_output_is_of_a_command_that_runs() -> None:
    shown = [(page, line, start) for page in USER_PAGES for line, start, rows in shown_outputs(page) if rows]
    assert shown, "MEMORY.md shows the tiny plan's table"
    for page, line, start in shown:
        assert any(i.how == "run" and i.text.startswith(start) for i in classify(page)), f"{page}:{line}: {start!r}"


def test_usage_names_every_hf_ptq_flag() -> None:
    from modelopt_k3.cli.hf_ptq import build_parser

    usage = (REPO / "docs/USAGE.md").read_text()
    flags = [o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert [f for f in flags if not re.search(rf"`{f}[` ]", usage)] == []


def test_a_wrong_command_fails() -> None:
    page = "\n".join(["```bash", "python examples/hf_ptq.py --qformat nvfp4 --calib_sz 8", "```",
                      "```bash", "python examples/hf_ptq.py --qformat nvfp4x", "```",
                      "```bash", "python examples/hf_ptq.py --recipe recipes/presets/nvfp4x.yaml", "```",
                      "```bash", "modelopt-k3-plan --pyt_ckpt_path tiny-k3 --world_size two", "```",
                      "```bash", "torchrun --nproc_per_node 2 examples/hf_ptqx.py --qformat nvfp4", "```",
                      "```bash", "torchrun --nproc_per_node 8 examples/hf_ptq.py --pyt_ckpt_path /ckpts/Kimi-K3", "```",
                      "```bash", "python examples/hf_ptq.py --recipe recipes/presets/nvfp4.yaml", "```"])
    items = classify("wrong.md", page)
    assert [bool(parse_problems(i.text)) for i in items] == [True, True, True, True, True, False, False]
    assert unmarked_real("wrong.md", page) == ["wrong.md:16: 'torchrun --nproc_per_node 8 examples/hf_ptq.py "
                                               "--pyt_ckpt_path /ckpts/Kimi-K3'"]
    marked = page.replace("torchrun", "# needs: the real checkpoint and 8 GPUs\ntorchrun")
    assert not unmarked_real("wrong.md", marked)
    assert [i.how for i in classify("wrong.md", marked)][5] == "needs"


def test_the_classification_is_the_rule_the_docstring_states() -> None:
    assert {"modelopt-k3-ptq", "modelopt-k3-convert", "modelopt-k3-check"} <= set(SCRIPTS)
    said = {(i.how, i.text) for i in classify("docs/MODELS.md")}
    assert ("parsed", "torchrun --nproc_per_node 2 examples/hf_ptq.py --pyt_ckpt_path tiny-gpt-oss --qformat nvfp4 "
            "--export_path tiny-gpt-oss-nvfp4") in said
    assert ("run", "modelopt-k3-convert --src tiny-gpt-oss --dst tiny-gpt-oss-conv") in said
    readme = [(i.how, i.text, i.exit) for i in classify("README.md")]
    assert ("run", "torchrun --nproc_per_node 2 examples/hf_ptq.py --qformat nvfp4 --export_path out-nvfp4 "
            "--overwrite", 0) in readme
    assert ("run", "modelopt-k3-check out-nvfp4", 1) in readme
    assert all(how == "needs" for how, cmd, _ in readme if "/ckpts/" in cmd)
    assert all(how == "setup" for how, cmd, _ in readme if cmd.startswith("pip install"))
    calibration = {(i.how, i.text) for i in classify("docs/CALIBRATION.md")}
    assert ("dependent", "modelopt-k3-report --compare q3o-gptq q3o-awq-gptq") in calibration
    assert ("run", "modelopt-k3-report --compare tiny-qwen3-max tiny-qwen3-gptq") in calibration


def _runs_torchrun(page: str) -> bool:
    return any(i.how == "run" and i.text.startswith("torchrun") for i in classify(page))


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded tiny Kimi-K3's cache, shared by the pages (the caller's, when it sets one)."""
    return os.environ.get("MODELOPT_K3_CACHE") or str(tmp_path_factory.mktemp("tiny-cache"))


@pytest.mark.parametrize("page", [
    pytest.param(p, marks=pytest.mark.multiprocess if _runs_torchrun(p) else pytest.mark.slow) for p in USER_PAGES])
def test_every_runnable_command_runs(page: str, tmp_path: Path, tiny_cache: str) -> None:
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "MODELOPT_K3_CACHE": tiny_cache, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    ran, printed = 0, {}
    for item in classify(page):
        # torchrun's --master_port default (29500) would collide with any other run on this machine.
        run_env = {**env, "PET_MASTER_PORT": str(free_port())}
        if item.how == "run":
            argv = ["bash", "-c", item.text]
        elif item.how == "python":
            argv = [sys.executable, "-c", item.text]
        else:
            continue
        proc = subprocess.run(argv, cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == item.exit, (f"{page}:{item.block.line}: {item.text[:200]!r} exited "
                                              f"{proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        printed[item.text] = proc.stdout.splitlines()
        ran += 1
    for line, start, rows in shown_outputs(page):
        stdout = next(out for text, out in printed.items() if text.startswith(start))
        assert [r for r in rows if r not in stdout] == [], f"{page}:{line}: not what {start!r} prints now"
    if page in ("docs/MODELS.md", "docs/MEMORY.md", "docs/USAGE.md", "README.md"):
        assert ran, f"{page}: its tiny-model commands ran"
