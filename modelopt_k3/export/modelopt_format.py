"""The ModelOpt Hugging Face checkpoint format (``quant_method: "modelopt"``), tensor by tensor.

Pure functions: given what was quantized, ``hf_quant_config.json`` and the ``quantization_config`` for
``config.json`` (each layer's entry is its registry ``Scheme``'s; the tensors of one quantized Linear
are its ``TensorFormat``'s, ``modelopt_k3/quant/schemes.py``). Both the model exporter and the
calibration-free streaming converter write through these.
"""

from __future__ import annotations

import bisect
import fnmatch
import re
from collections.abc import Iterable, Mapping

import torch

from .. import __version__
from ..quant.schemes import SCHEMES, KvCacheFormat, kv_cache_named
from ..spec import ManifestNaming

# The layout this module writes is nvidia-modelopt 0.47.0's; engines check the producer's name.
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.47.0"}


def input_scale_tensor(scale: torch.Tensor) -> torch.Tensor:
    return scale.detach().reshape(()).to(torch.float32).cpu()


def summarize_exclusions(unquantized: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """ModelOpt's ``exclude_modules``: each unquantized module as its shortest dotted prefix wildcard
    that matches no quantized module (nvidia-modelopt 0.47.0 ``quant_utils.py``
    ``_prefix_wildcard_summarize_exclude_modules``): ``a.b*`` when nothing quantized starts with ``a.b``,
    else ``a.b.*`` when nothing quantized is ``a.b`` or starts with ``a.b.``, else deeper, else the name.
    """
    names = sorted(set(quantized))
    exact = set(names)

    def starts(prefix: str) -> bool:  # does a quantized name start with ``prefix``?
        i = bisect.bisect_left(names, prefix)
        return i < len(names) and names[i].startswith(prefix)

    out: set[str] = set()
    for name in unquantized:
        choice = name
        for i, char in enumerate(name):
            if char != ".":
                continue
            head = name[:i]
            if not starts(head):
                choice = head + "*"
                break
            if head not in exact and not starts(head + "."):
                choice = head + ".*"
                break
        out.add(choice)
    return sorted(out)


def hf_quant_config(
    layer_algos: Mapping[str, str], *, kv_cache: KvCacheFormat | None, unquantized: Iterable[str],
    recipe: str | None = None, naming: ManifestNaming | None = None,
) -> dict:
    """``hf_quant_config.json``: the one manifest writer of ``hf_ptq``, the converter and the check's plan.

    One format: ModelOpt 0.47's fields (``get_quant_config``): ``quant_algo``, ``kv_cache_quant_algo``,
    its ``group_size`` and the summarized ``exclude_modules``. Several formats -- or, for a model whose
    engines key routed experts by bank (``naming``), routed experts alone -- ``MIXED_PRECISION`` as
    ModelOpt's own Kimi-K3 converter writes it (``mixed_manifest``). ``producer`` names the layout
    (engines' fallback parsers check its name); this tool's identity goes in ``modelopt_k3``, a key no
    engine reads.
    """
    algos = sorted(set(layer_algos.values()))
    quant: dict = {"quant_algo": None, "kv_cache_quant_algo": kv_cache.algo if kv_cache else None}
    if len(algos) == 1 and not _experts_only(layer_algos, naming):
        quant.update(SCHEMES[algos[0]].layer_entry())
        quant["exclude_modules"] = summarize_exclusions(unquantized, layer_algos)
    elif algos:
        quant["quant_algo"] = "MIXED_PRECISION"
        quant.update(mixed_manifest(layer_algos, unquantized, naming))
    ours = {"name": "modelopt_k3", "version": __version__}
    if recipe:
        ours["recipe"] = recipe
    return {"producer": dict(MODELOPT_PRODUCER), "quantization": quant, "modelopt_k3": ours}


def _experts_only(layer_algos: Mapping[str, str], naming: ManifestNaming | None) -> bool:
    """Only routed experts are quantized, in a model whose engines find their format per bank: TensorRT-LLM's
    K3 loader reads it from ``quantized_layers`` only, so such an export must be ``MIXED_PRECISION``."""
    if naming is None or not layer_algos:
        return False
    bank = re.compile(naming.expert_bank_regex)
    return all(bank.fullmatch(name) for name in layer_algos)


def mixed_manifest(layer_algos: Mapping[str, str], unquantized: Iterable[str], naming: ManifestNaming | None) -> dict:
    """``MIXED_PRECISION``'s ``group_size``, ``quantized_layers`` and ``exclude_modules``.

    Without ``naming``: one entry per quantized Linear. With it: one entry per routed-expert bank whose
    experts share one algo (per expert otherwise), per quantized dense Linear and per engine fused module
    whose members all have one algo; each under every spelling ``naming.aliases`` gives. ``exclude_modules``:
    the summarized unquantized modules and the model's ``never_quantized`` patterns that match nothing
    quantized, each in every spelling.
    """
    unquantized = sorted(set(unquantized))
    spell = naming.aliases if naming else (lambda name: [name])
    entries = _bank_entries(layer_algos, naming) if naming else dict(layer_algos)
    if naming:
        entries.update(_fused_entries(layer_algos, unquantized, naming))
    layers: dict[str, dict] = {}
    for name, algo in sorted(entries.items()):
        for alias in spell(name):
            layers.setdefault(alias, SCHEMES[algo].layer_entry())
    patterns = summarize_exclusions(unquantized, layer_algos)
    if naming:
        spelled = set(layers)
        patterns += [p for p in naming.never_quantized if not any(fnmatch.fnmatchcase(q, a) for a in spell(p)
                                                                  for q in spelled)]
    exclude = list(dict.fromkeys(alias for p in patterns for alias in spell(p)))
    out: dict = {}
    group_sizes = sorted({g for a in entries.values() if (g := SCHEMES[a].weights.group_size)})
    if len(group_sizes) == 1:  # the NVFP4 group (vLLM's and SGLang's mixed configs read it per entry too)
        out["group_size"] = group_sizes[0]
    out["quantized_layers"] = layers
    out["exclude_modules"] = exclude
    return out


def _bank_entries(layer_algos: Mapping[str, str], naming: ManifestNaming) -> dict[str, str]:
    """Dense Linears as they are; routed experts as their bank when every expert of it has one algo."""
    bank_re = re.compile(naming.expert_bank_regex)
    out: dict[str, str] = {}
    banks: dict[str, dict[str, str]] = {}
    for name, algo in layer_algos.items():
        m = bank_re.fullmatch(name)
        if m is None:
            out[name] = algo
        else:
            banks.setdefault(m["bank"], {})[name] = algo
    for bank, members in banks.items():
        algos = set(members.values())
        out.update({bank: algos.pop()} if len(algos) == 1 else members)
    return out


def _fused_entries(layer_algos: Mapping[str, str], unquantized: list[str], naming: ManifestNaming) -> dict[str, str]:
    """``parent.<fused>`` for each engine fused module whose members present under ``parent`` are all
    quantized with one algo (a member left unquantized, or two algos, and the engine must not be told one)."""
    present: dict[str, dict[str, str | None]] = {}
    for name in unquantized:
        parent, _, last = name.rpartition(".")
        present.setdefault(parent, {})[last] = None
    for name, algo in layer_algos.items():
        parent, _, last = name.rpartition(".")
        present.setdefault(parent, {})[last] = algo
    out: dict[str, str] = {}
    for parent, children in present.items():
        for fused, members in naming.fused:
            algos = {children[m] for m in members if m in children}
            if len(algos) == 1 and None not in algos:
                out[f"{parent}.{fused}"] = algos.pop()
    return out


def _group_args(entry: dict) -> dict:
    """A ``config_groups`` entry for one ``quantized_layers``/top-level entry (the scheme's spelling)."""
    return SCHEMES[entry["quant_algo"]].config_group_args(entry.get("group_size"))


def config_quantization_config(hf_quant: dict) -> dict:
    """``config.json``'s ``quantization_config``: ModelOpt 0.47's ``convert_hf_quant_config_format``.

    ``quant_method`` is ``modelopt_mixed`` for ``MIXED_PRECISION``, as ModelOpt's own Kimi-K3
    converter writes it (``_rewrite_config_json``, commit above): SGLang picks its mixed-precision
    config by that name; vLLM accepts both.
    """
    q = hf_quant["quantization"]
    algo = q["quant_algo"]
    out: dict = {}
    if algo == "MIXED_PRECISION":
        by_entry: dict[tuple, list[str]] = {}
        for name, entry in q["quantized_layers"].items():
            by_entry.setdefault(tuple(sorted(entry.items())), []).append(name)
        out["config_groups"] = {
            f"group_{i}": {**_group_args(dict(key)), "targets": sorted(names)} for i, (key, names) in enumerate(by_entry.items())
        }
        out["quantized_layers"] = q["quantized_layers"]
    elif algo and SCHEMES[algo].has_config_group:
        out["config_groups"] = {"group_0": {**_group_args(q), "targets": ["Linear"]}}
    out["ignore"] = q.get("exclude_modules", [])
    if algo:
        out["quant_algo"] = algo
    kv_cache = kv_cache_named(q.get("kv_cache_quant_algo"))
    if kv_cache is not None:
        out["kv_cache_scheme"] = kv_cache.config_scheme()
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt_mixed" if algo == "MIXED_PRECISION" else "modelopt"
    return out


def strip_source_quantization(config: dict) -> dict:
    """A copy of ``config.json`` without the source checkpoint's (compressed-tensors) scheme."""
    config = dict(config)
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        text = dict(config["text_config"])
        text.pop("quantization_config", None)
        config["text_config"] = text
    return config
