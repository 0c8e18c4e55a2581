"""transformers compatibility shims for Kimi-K3's remote code.

The hub's modeling files were written against transformers 4.56+ and call APIs that later releases
changed. Every shim here is *detected*: from the checkpoint's own source (parsed with ``ast``, never
edited: the files on disk and in transformers' module cache stay as shipped) or from its loaded classes,
against the installed transformers; it is applied only where the two disagree, and none changes what the
model computes. They come in two phases:

* **import** (``apply_import_shims(checkpoint)``, before the remote files execute): the fla-core names on
  CPU (``fla_cpu``, only without Triton), and transformers names the files import from where an older
  release kept them. An ``import`` statement in the remote file resolves against transformers' own module
  object, so such an alias is necessarily process-wide; it only ever *adds* a missing name.
* **class** (``apply_class_shims(model_cls)``, after import, before construction; run by ``prepare``):
  wrappers installed on the classes and module globals of the checkpoint's own dynamic module, which
  nothing outside that checkpoint's code uses. Each returns the name of what it applied.

Versions below are where the hub's call stopped working; the break notes come from the transformers
changes named next to them.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .fla_cpu import install_fla_cpu

logger = logging.getLogger(__name__)
_SHIM_FLAG = "_modelopt_k3_shim"


# ----------------------------------------------------------------------------------------------
# Import phase
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportAlias:
    """``module.name`` made importable from ``source`` when the remote code imports it and it is missing."""

    module: str
    name: str
    source: tuple[str, str]
    since: str


IMPORT_ALIASES = (
    # 5.12: OutputRecorder moved from transformers.utils.generic to transformers.utils.output_capturing.
    ImportAlias(
        "transformers.utils.generic", "OutputRecorder", ("transformers.utils.output_capturing", "OutputRecorder"), "5.12"
    ),
    # check_model_inputs became a deprecated alias of merge_with_config_defaults (5.x); for releases without it.
    ImportAlias(
        "transformers.utils.generic", "check_model_inputs", ("transformers.utils.generic", "merge_with_config_defaults"), "5.x"
    ),
    # PytorchGELUTanh was renamed GELUTanh; the K3 file aliases it itself, the alias covers other revisions.
    ImportAlias("transformers.activations", "PytorchGELUTanh", ("transformers.activations", "GELUTanh"), "5.x"),
)


def remote_code_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's own Python files (its remote code)."""
    return sorted(Path(checkpoint).glob("*.py"))


def imported_names(sources: Iterable[str]) -> set[tuple[str, str]]:
    """``(module, name)`` for every ``from module import name`` in the given sources (absolute imports)."""
    found: set[tuple[str, str]] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update((node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update((alias.name, "") for alias in node.names)
    return found


def apply_import_shims(checkpoint: str | Path) -> list[str]:
    """Make the checkpoint's remote code importable here; returns what was applied.

    ``checkpoint`` is the directory holding the remote ``.py`` files (read, never modified).
    """
    imports = imported_names(p.read_text() for p in remote_code_files(Path(checkpoint)))
    applied = []
    if any(module == "fla" or module.startswith("fla.") for module, _ in imports) and install_fla_cpu():
        applied.append("fla_cpu")
    for alias in IMPORT_ALIASES:
        if (alias.module, alias.name) in imports and _add_alias(alias):
            applied.append(f"{alias.module}.{alias.name}")
    return applied


def _add_alias(alias: ImportAlias) -> bool:
    module = importlib.import_module(alias.module)
    if hasattr(module, alias.name):
        return False
    try:
        value = getattr(importlib.import_module(alias.source[0]), alias.source[1])
    except (ImportError, AttributeError):
        return False  # nothing to alias to: the remote import fails with transformers' own message
    setattr(module, alias.name, value)
    return True


# ----------------------------------------------------------------------------------------------
# Class phase
# ----------------------------------------------------------------------------------------------


def remote_modules(model_cls: type) -> list[ModuleType]:
    """The loaded modules of ``model_cls``'s dynamic package (its checkpoint's remote code)."""
    package = model_cls.__module__.rpartition(".")[0]
    names = sorted(n for n, m in list(sys.modules.items()) if m is not None and n.startswith(package + "."))
    return [sys.modules[n] for n in names]


def apply_class_shims(model_cls: type) -> list[str]:
    """Install every class-level shim the checkpoint's code needs on this transformers; idempotent."""
    applied: list[str] = []
    for module in remote_modules(model_cls):
        tree = _module_tree(module)
        for shim in CLASS_SHIMS:
            applied += shim(module, tree)
    if applied:
        logger.info("transformers compatibility shims for %s: %s", model_cls.__module__, ", ".join(applied))
    return applied


def _module_tree(module: ModuleType) -> ast.Module | None:
    try:
        return _parse(inspect.getsource(module))
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=16)
def _parse(source: str) -> ast.Module:
    """The syntax tree of a remote module's source, parsed once per source text (every load asks; the
    shims only read the tree)."""
    return ast.parse(source)


def _own_classes(module: ModuleType) -> list[type]:
    return [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]


def _marked(fn: Callable) -> Callable:
    setattr(fn, _SHIM_FLAG, True)
    return fn


def _accepted(fn: Callable) -> tuple[set[str], bool]:
    """Parameter names ``fn`` accepts and whether it takes ``**kwargs``."""
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params}, any(p.kind is p.VAR_KEYWORD for p in params)


# 5.0: PreTrainedModel.init_weights calls tie_weights(recompute_mapping=False) (transformers#42270); a 4.x
# override `tie_weights(self)` raises TypeError at construction.
def shim_tie_weights(module: ModuleType, tree: ast.Module | None) -> list[str]:
    from transformers import PreTrainedModel

    wanted, _ = _accepted(PreTrainedModel.tie_weights)
    wanted.discard("self")
    applied = []
    for cls in _own_classes(module):
        original = cls.__dict__.get("tie_weights")
        if not issubclass(cls, PreTrainedModel) or original is None or getattr(original, _SHIM_FLAG, False):
            continue
        names, var_kw = _accepted(original)
        dropped = wanted - names
        if var_kw or not dropped:
            continue

        @functools.wraps(original)
        def tie_weights(self, *args, _original=original, _dropped=frozenset(dropped), **kwargs):
            return _original(self, *args, **{k: v for k, v in kwargs.items() if k not in _dropped})

        cls.tie_weights = _marked(tie_weights)
        applied.append(f"{cls.__name__}.tie_weights")
    return applied


# 5.0: _tied_weights_keys is a {target: source} mapping; a 4.x list (keys tied to the input embeddings)
# raises AttributeError ('list' object has no attribute 'keys') in save_pretrained and tied configs.
def shim_tied_weights_keys(module: ModuleType, tree: ast.Module | None) -> list[str]:
    applied = []
    for cls in _own_classes(module):
        keys = cls.__dict__.get("_tied_weights_keys")
        if not isinstance(keys, (list, tuple)):
            continue
        cls._tied_weights_keys = property(functools.partial(_tied_to_input_embeddings, keys=tuple(keys)))
        applied.append(f"{cls.__name__}._tied_weights_keys")
    return applied


def _tied_to_input_embeddings(self, keys: tuple[str, ...]) -> dict[str, str]:
    """4.x meaning of a list: each key is tied to the input embedding weight."""
    embedding = self.get_input_embeddings().weight
    source = next(name for name, p in self.named_parameters(remove_duplicate=False) if p is embedding)
    return {key: source for key in keys}


# 5.9: create_causal_mask renamed `input_embeds` to `inputs_embeds` (transformers#43916) and dropped
# `cache_position` (transformers#44181). `past_key_values` -> `cache` is handled by transformers' own
# deprecation wrapper until 5.40; renamed here only once nothing accepts it any more.
def shim_mask_functions(module: ModuleType, tree: ast.Module | None) -> list[str]:
    if tree is None:
        return []
    applied = []
    for name, fn in list(vars(module).items()):
        if not callable(fn) or getattr(fn, "__module__", "") != "transformers.masking_utils":
            continue
        if getattr(fn, _SHIM_FLAG, False):
            continue
        renames, dropped = _mask_call_fixes(fn, _call_keywords(tree, name))
        if renames or dropped:
            setattr(module, name, _marked(_renaming(fn, renames, dropped)))
            applied.append(f"{name}({', '.join(sorted([*renames, *dropped]))})")
    return applied


def _mask_call_fixes(fn: Callable, used: set[str]) -> tuple[dict[str, str], frozenset[str]]:
    """The keyword renames and drops that make the remote code's calls of ``fn`` valid."""
    accepted, _ = _accepted(fn)  # follows __wrapped__: the real parameters
    deprecation_wrapped = hasattr(fn, "__wrapped__")
    renames, dropped = {}, set()
    if "input_embeds" in used and "input_embeds" not in accepted and "inputs_embeds" in accepted:
        renames["input_embeds"] = "inputs_embeds"
    if "past_key_values" in used and "past_key_values" not in accepted and not deprecation_wrapped and "cache" in accepted:
        renames["past_key_values"] = "cache"
    if "cache_position" in used and "cache_position" not in accepted:
        dropped.add("cache_position")
    return renames, frozenset(dropped)


@functools.lru_cache(maxsize=64)
def _call_keywords(tree: ast.Module, func_name: str) -> frozenset[str]:
    """Keywords the module's calls of ``func_name`` pass (per tree, which ``_parse`` keeps: once per source)."""
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if callee == func_name:
                used.update(k.arg for k in node.keywords if k.arg)
    return frozenset(used)


def _renaming(fn: Callable, renames: dict[str, str], dropped: frozenset[str]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for old, new in renames.items():
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
        for key in dropped:
            kwargs.pop(key, None)
        return fn(*args, **kwargs)

    return wrapper


# 5.9: masking asks the cache for get_query_offset(layer) and passes get_mask_sizes an int query length
# instead of the cache_position tensor (transformers#44181); a 4.x custom cache has neither.
def shim_cache_protocol(module: ModuleType, tree: ast.Module | None) -> list[str]:
    from transformers.cache_utils import Cache

    if not hasattr(Cache, "get_query_offset"):
        return []
    applied = []
    for cls in _own_classes(module):
        if not hasattr(cls, "get_mask_sizes") or hasattr(cls, "get_query_offset") or issubclass(cls, Cache):
            continue
        cls.get_query_offset = _marked(_query_offset)
        cls.get_mask_sizes = _marked(_mask_sizes_from_length(cls.get_mask_sizes))
        applied.append(f"{cls.__name__}.get_query_offset/get_mask_sizes")
    return applied


def _query_offset(self, layer_idx: int = 0) -> int:
    """What 5.x's Cache.get_query_offset returns: the tokens already seen (the old cache_position[0])."""
    return self.get_seq_length(layer_idx)


def _mask_sizes_from_length(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_mask_sizes(self, cache_position: Any, layer_idx: int) -> tuple[int, int]:
        if isinstance(cache_position, int):  # rebuild the tensor the 4.x protocol passed
            past = self.get_seq_length(layer_idx)
            cache_position = torch.arange(past, past + cache_position)
        return original(self, cache_position, layer_idx)

    return get_mask_sizes


# Not a transformers break: the hub's KimiLinearModel.__init__ overrides any attention implementation with
# flash_attention_2, which fails at the first MLA forward wherever flash-attn is absent (every CPU run).
_FLASH = "flash_attention_2"


def shim_forced_flash_attention(module: ModuleType, tree: ast.Module | None) -> list[str]:
    if tree is None:
        return []
    applied = []
    classes = {cls.__name__: cls for cls in _own_classes(module)}
    for name in _classes_forcing_flash(tree):
        cls = classes.get(name)
        if cls is None or getattr(cls.__init__, _SHIM_FLAG, False):
            continue
        cls.__init__ = _marked(_keep_requested_attention(cls.__init__))
        applied.append(f"{name}.__init__(flash_attention_2)")
    return applied


@functools.lru_cache(maxsize=16)
def _classes_forcing_flash(tree: ast.Module) -> tuple[str, ...]:
    """Classes whose ``__init__`` sets ``<x>._attn_implementation = "flash_attention_2"`` without first
    checking that flash-attn is available (no enclosing ``if`` calls an ``...avail...`` function)."""
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "__init__" and _forces_flash(fn.body, checked=False):
                found.append(cls.name)
    return tuple(found)


def _forces_flash(body: list[ast.stmt], checked: bool) -> bool:
    for stmt in body:
        if isinstance(stmt, ast.Assign) and not checked and _assigns_flash(stmt):
            return True
        if isinstance(stmt, ast.If):
            guarded = checked or _calls_availability_check(stmt.test)
            if _forces_flash(stmt.body, guarded) or _forces_flash(stmt.orelse, guarded):
                return True
    return False


def _assigns_flash(stmt: ast.Assign) -> bool:
    return (
        any(isinstance(t, ast.Attribute) and t.attr == "_attn_implementation" for t in stmt.targets)
        and isinstance(stmt.value, ast.Constant)
        and stmt.value.value == _FLASH
    )


def _calls_availability_check(test: ast.expr) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if "avail" in callee:
                return True
    return False


def _keep_requested_attention(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        from transformers.utils import is_flash_attn_2_available

        requested = getattr(config, "_attn_implementation", None)
        original(self, config, *args, **kwargs)
        if config._attn_implementation == _FLASH and requested != _FLASH and not is_flash_attn_2_available():
            config._attn_implementation = requested or "eager"

    return __init__


CLASS_SHIMS: tuple[Callable[[ModuleType, ast.Module | None], list[str]], ...] = (
    shim_tie_weights,
    shim_tied_weights_keys,
    shim_mask_functions,
    shim_cache_protocol,
    shim_forced_flash_attention,
)
