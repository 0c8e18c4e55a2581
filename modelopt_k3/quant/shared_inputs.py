"""Shared-input groups: which Linears read the very same input tensor, found from the model's own code.

ModelOpt's export (nvidia-modelopt 0.47.0, ``modelopt/torch/export/unified_export_hf.py``
``collect_shared_input_modules`` / ``_fuse_shared_input_modules``; the same code is in
NVIDIA/Model-Optimizer at cc2c21837faa2e58f597d69e0f850bcef0e05567) runs a dummy forward with a
forward hook on every quantized Linear and groups the Linears by the identity of ``input[0]``;
serving engines fuse exactly such groups (KDA q/k/v/f_a/b/g, MLA q_a + kv_a + g, gate/up) and read
one global scale for the fused weight. We do the same, once, on a tiny configuration of the
checkpoint's own classes (``QuantSpec.probe_model`` shrinks it), and keep the result as rules that
do not mention layer indices, so that they apply to the real checkpoint's names without a forward of
the real model (the streaming converter never builds it).

Identity, not equal values: ``KimiSparseMoeBlock`` feeds ``routed_expert_down_proj`` a *view* of the
hidden state that the shared experts read, so it is not in their group -- as in ModelOpt's export
(checked by running ModelOpt 0.47 on the tiny Kimi-K3).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


@dataclass(frozen=True, order=True)
class SharedInputRule:
    """Under every module matching ``parent`` (``*`` = any layer index), ``members`` read one input."""

    parent: str
    members: tuple[str, ...]

    def matches(self, parent: str) -> bool:
        return re.fullmatch(re.escape(self.parent).replace(r"\*", r"\d+"), parent) is not None


def record_shared_inputs(model: nn.Module, run: Callable[[nn.Module], None]) -> list[tuple[str, ...]]:
    """Names of the ``nn.Linear`` modules that received the identical input tensor during ``run``."""
    seen: dict[int, tuple[torch.Tensor, list[str]]] = {}  # id -> (tensor kept alive, readers)
    handles = []

    def hook(name: str):
        def record(module, args):
            if args and isinstance(args[0], torch.Tensor):
                seen.setdefault(id(args[0]), (args[0], []))[1].append(name)

        return record

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(hook(name)))
    try:
        with torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    groups = {tuple(dict.fromkeys(names)) for _, names in seen.values()}
    return sorted(g for g in groups if len(g) > 1)


def _common_parent(names: tuple[str, ...]) -> str:
    parts = [n.split(".") for n in names]
    common: list[str] = []
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    return ".".join(common[: min(len(p) for p in parts) - 1])


def rules_from_groups(groups: Iterable[tuple[str, ...]], prefix: str = "") -> tuple[SharedInputRule, ...]:
    """Index-free rules from concrete groups; ``prefix`` maps probe names onto checkpoint names."""
    rules = set()
    for group in groups:
        parent = _common_parent(group)
        cut = len(parent) + 1 if parent else 0
        members = tuple(sorted(name[cut:] for name in group))
        rules.add(SharedInputRule(_INDEX.sub("*", prefix + parent), members))
    return tuple(sorted(rules))


def apply_rules(rules: Iterable[SharedInputRule], linears: Iterable[str]) -> list[tuple[str, ...]]:
    """Concrete groups over the checkpoint's Linear names: a rule applies under a parent whose
    children include every member (the members it finds, in rule order)."""
    linears = set(linears)
    parents: set[str] = set()
    for name in linears:
        for i in range(len(name)):
            if name[i] == ".":
                parents.add(name[:i])
    parents.add("")
    groups: list[tuple[str, ...]] = []
    claimed: set[str] = set()
    for rule in sorted(rules, key=lambda r: -len(r.members)):  # the most specific rule first
        for parent in sorted(parents):
            if not rule.matches(parent):
                continue
            names = tuple(f"{parent}.{m}" if parent else m for m in rule.members)
            if all(n in linears for n in names) and not claimed & set(names):
                groups.append(names)
                claimed.update(names)
    return sorted(groups)


_DISCOVERED: dict[tuple[str, str], tuple[SharedInputRule, ...]] = {}


class ProbeError(RuntimeError):
    """The checkpoint's own code could not run the probe forward; the message names why."""


def discover_shared_inputs(spec, model_cls: type, config) -> tuple[SharedInputRule, ...]:
    """Rules for a checkpoint, from one probe forward of ``spec.quant.probe_model``'s tiny model.

    Cached per model class and configuration: the probe runs once per process and checkpoint. It runs
    on the GPU when there is one (remote code whose kernels need one, as the real Kimi-K3's fla
    kernels do, cannot run it on a CPU). Routed experts are left out: their sharing rules are the
    spec's (``shared_scale_groups``).
    """
    key = (f"{model_cls.__module__}.{model_cls.__qualname__}", config.to_json_string(use_diff=False))
    if key not in _DISCOVERED:
        if spec.quant.probe_model is None:
            raise ValueError(f"model_type {spec.model_type!r} has no probe_model: its shared-input groups are unknown")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, prefix = spec.quant.probe_model(model_cls, config, device)
        text = getattr(model.config, "get_text_config", None)  # a VLM's vocabulary is its text config's
        vocab = (text() if text else model.config).vocab_size
        ids = torch.arange(4, device=device).remainder(vocab)[None]
        try:
            groups = record_shared_inputs(model, lambda m: m(input_ids=ids, use_cache=False))
        except Exception as exc:
            raise ProbeError(
                f"the shared-input probe could not run a forward of {model_cls.__name__}'s code on {device} "
                f"(a tiny configuration): {type(exc).__name__}: {exc}"
            ) from exc
        expert = re.compile(spec.experts.key_regex)
        dense = [g for g in groups if not any(expert.match(f"{prefix}{n}.weight") for n in g)]
        _DISCOVERED[key] = rules_from_groups(dense, prefix)
    return _DISCOVERED[key]
