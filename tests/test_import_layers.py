"""No arrow from a lower layer to a higher one (issue 27): every module's imports, parsed (ast), against the
layers docs/ARCHITECTURE.md names ("The layers"). Function-level and TYPE_CHECKING imports count too: a
lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "modelopt_k3"

# Bottom to top. A module is in the layer of the longest prefix that names it; it may import its own layer
# and any layer below. Keep in step with docs/ARCHITECTURE.md "The layers".
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("contract", ("modelopt_k3", "modelopt_k3.spec", "modelopt_k3.numerics")),
    ("primitives", ("modelopt_k3.quant.schemes", "modelopt_k3.files", "modelopt_k3.data")),
    ("recipe", ("modelopt_k3.recipe",)),
    ("checkpoint", ("modelopt_k3.checkpoint",)),
    ("dist", ("modelopt_k3.dist",)),
    ("experts", ("modelopt_k3.experts",)),
    ("quant", ("modelopt_k3.quant",)),
    ("export", ("modelopt_k3.export",)),
    ("memory", ("modelopt_k3.memory",)),
    ("plan", ("modelopt_k3.run", "modelopt_k3.run.plan")),
    ("load", ("modelopt_k3.load",)),
    ("run", ("modelopt_k3.convert", "modelopt_k3.report", "modelopt_k3.layerwise")),
    ("check", ("modelopt_k3.check",)),
    ("preflight", ("modelopt_k3.run.preflight", "modelopt_k3.memory.preflight")),
    ("models", ("modelopt_k3.models", "modelopt_k3.testing")),
    ("tools", ("modelopt_k3.cli",)),
)

# Known upward arrows: none (the last, dist.a2a -> packed_experts, went with the experts/ package). An entry
# here must name an arrow that exists (a test checks), and a new one needs its reason beside it.
EXCEPTIONS: set[tuple[str, str]] = set()

_RANK = {prefix: (i, name) for i, (name, prefixes) in enumerate(LAYERS) for prefix in prefixes}


def layer_of(module: str) -> tuple[int, str]:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        found = _RANK.get(".".join(parts[:n]))
        if found is not None and (n > 1 or module == "modelopt_k3"):
            return found
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to docs/ARCHITECTURE.md)")


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    return imports_in(path.read_text(), *_module_name(path))


def imports_in(source_text: str, module: str, is_package: bool) -> set[str]:
    """The ``modelopt_k3`` modules ``module``'s source imports (relative imports resolved; ``from pkg import
    sub`` is ``pkg.sub``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source_text)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            subs = {f"{source}.{a.name}" for a in node.names if _is_module(f"{source}.{a.name}")}
            found |= subs if len(subs) == len(node.names) else subs | {source}
    return {m for m in found if m == "modelopt_k3" or m.startswith("modelopt_k3.")}


def arrows_from(module: str, imported: set[str]) -> list[str]:
    rank, name = layer_of(module)
    return [f"{module} ({name}) -> {target} ({layer_of(target)[1]})" for target in sorted(imported)
            if layer_of(target)[0] > rank and (module, target) not in EXCEPTIONS]


def upward_arrows() -> list[str]:
    arrows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "remote_code" in path.parts:  # the stand-in's copy of the checkpoint's own code (no package imports)
            continue
        arrows += arrows_from(_module_name(path)[0], imports_of(path))
    return arrows


def test_no_lower_layer_imports_a_higher_one():
    arrows = upward_arrows()
    assert not arrows, "upward imports:\n" + "\n".join(arrows)


def test_the_exception_is_still_an_arrow():
    # An exception that no longer happens is stale: delete it (the coordinator does at merge).
    for module, target in EXCEPTIONS:
        path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        assert path.is_file() and target in imports_of(path), f"stale exception {module} -> {target}: delete it"


def test_the_layers_are_the_ones_the_architecture_names():
    notes = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = notes.split("## The layers", 1)[1].split("\n## ", 1)[0]
    for name, prefixes in LAYERS:
        assert f"**{name}**" in section, f"layer {name} is not named in docs/ARCHITECTURE.md 'The layers'"
        for prefix in prefixes:
            spelled = "`modelopt_k3`" if prefix == "modelopt_k3" else f"`{prefix.removeprefix('modelopt_k3.')}`"
            assert spelled in section, f"{prefix} (layer {name}) is not listed in docs/ARCHITECTURE.md 'The layers'"


def test_the_checker_sees_an_upward_arrow():
    # The parser resolves what a lower module imports, relative or absolute, at any depth: planted upward
    # imports are found, and a same-layer or downward one is not.
    assert layer_of("modelopt_k3.quant.schemes")[1] == "primitives" and layer_of("modelopt_k3.quant.api")[1] == "quant"
    assert layer_of("modelopt_k3.cli.hf_ptq")[1] == "tools"
    planted = ("from ..quant import schemes\nfrom . import nvfp4\nimport modelopt_k3.spec\n"
               "def f():\n    from modelopt_k3.load import load_pretrained\n")
    module = "modelopt_k3.numerics._planted"
    assert arrows_from(module, imports_in(planted, module, False)) == [
        "modelopt_k3.numerics._planted (contract) -> modelopt_k3.load (load)",
        "modelopt_k3.numerics._planted (contract) -> modelopt_k3.quant.schemes (primitives)",
    ]
    assert arrows_from("modelopt_k3.cli.x", imports_in(planted, "modelopt_k3.cli.x", False)) == []
