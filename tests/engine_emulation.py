"""Test helpers for the engine checks: edit an export on disk, and read it the way vLLM does.

``vllm_reading(rb)`` turns an independent read-back of an export (``export.test_model_export.read_export``:
FORMATS.md in plain torch) into what vLLM's Kimi-K3 class computes with: its fused parameters take the
max ``weight_scale_2``/``input_scale`` of their pieces and dequantize every piece with it (block scales as
written), its routed experts read w3 with w1's ``weight_scale_2`` and quantize each GEMM's input with the
layer's max ``input_scale``, and KV-cache scales go through its ``maybe_remap_kv_scale_name``. The fused
groups come from the check's own vLLM rules (``VLLM_K3``): the test proves that what passes the check is
numerically what was calibrated.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from export.test_model_export import EXPERT_RE, ReadBack, decode_nvfp4
from safetensors import safe_open
from safetensors.torch import save_file

from modelopt_k3.check.engines.vllm import VLLM
from modelopt_k3.models.kimi_k3.serving import VLLM_K3

INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------------- editing exports


def edit_export(
    src: Path,
    dst: Path,
    *,
    add: dict[str, torch.Tensor] | None = None,
    drop: set[str] | frozenset[str] = frozenset(),
    quant: Callable[[dict, dict], None] | None = None,
) -> Path:
    """Copy export ``src`` to ``dst``, adding/replacing tensors (``add``) and removing ``drop``; ``quant``
    edits (``hf_quant_config["quantization"]``, ``config["quantization_config"]``) in place."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX).read_text())
    weight_map: dict[str, str] = index["weight_map"]
    add = dict(add or {})
    home = sorted(set(weight_map.values()))[0]
    files = {f for k, f in weight_map.items() if k in add or k in drop} | ({home} if add else set())
    for fname in files:
        with safe_open(str(dst / fname), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}  # noqa: SIM118
            metadata = f.metadata()
        for key, value in add.items():
            if weight_map.get(key, home) == fname:
                tensors[key] = value.detach().clone().contiguous()
                weight_map[key] = fname
        save_file(tensors, str(dst / fname), metadata=metadata)
    for key in drop:
        weight_map.pop(key, None)
    (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if quant is not None:
        hf = json.loads((dst / "hf_quant_config.json").read_text())
        config = json.loads((dst / "config.json").read_text())
        quant(hf["quantization"], config["quantization_config"])
        (dst / "hf_quant_config.json").write_text(json.dumps(hf, indent=2) + "\n")
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def set_exclude(hf_q: dict, cfg_q: dict, exclude: list[str]) -> None:
    hf_q["exclude_modules"] = cfg_q["ignore"] = sorted(exclude)


def quantized_modules(export: Path) -> set[str]:
    index = json.loads((export / INDEX).read_text())["weight_map"]
    return {k.rpartition(".")[0] for k in index if k.endswith(".weight_scale")}


# ----------------------------------------------------------------------------------- vLLM's reading


def _fused_groups(names: set[str]) -> list[list[str]]:
    by_parent: dict[str, set[str]] = {}
    for name in names:
        parent, _, last = name.rpartition(".")
        by_parent.setdefault(parent, set()).add(last)
    groups = []
    for parent, children in by_parent.items():
        for fused in VLLM_K3.fused:
            if set(fused.pieces) <= children:
                groups.append([f"{parent}.{p}" for p in fused.pieces])
    return groups


def vllm_reading(rb: ReadBack) -> tuple[ReadBack, dict[str, str | None]]:
    """(the read-back as vLLM's K3 computes with it, KV scale -> the parameter vLLM loads it into)."""
    t = rb.tensors
    state, inputs = dict(rb.state_dict), dict(rb.input_scales)
    dense = {m for m in rb.algos if not EXPERT_RE.match(m)}
    for group in _fused_groups(dense):
        assert {rb.algos[m] for m in group} <= {"NVFP4", "W4A16_NVFP4"}, group  # what the tests export
        top = max(t[f"{m}.weight_scale_2"] for m in group)
        for m in group:  # block scales as written, the group's max global scale
            state[f"{m}.weight"] = decode_nvfp4(t[f"{m}.weight"], t[f"{m}.weight_scale"], top)
        if all(m in inputs for m in group):
            top_in = max(inputs[m][1] for m in group)
            inputs.update({m: (inputs[m][0], top_in) for m in group})
    layers: dict[str, dict[int, dict[str, str]]] = {}
    for m in rb.algos:
        match = EXPERT_RE.match(m)
        if match:
            layers.setdefault(match["layer"], {}).setdefault(int(match["e"]), {})[match["proj"]] = m
    for experts in layers.values():
        for projs in experts.values():  # w13_weight_scale_2[:, 0]: w1's global scale for both halves
            w3 = projs["w3"]
            state[f"{w3}.weight"] = decode_nvfp4(t[f"{w3}.weight"], t[f"{w3}.weight_scale"],
                                                 t[f"{projs['w1']}.weight_scale_2"])
        for gemm in (("w1", "w3"), ("w2",)):  # one input scale per layer and GEMM: the max
            members = [projs[p] for projs in experts.values() for p in gemm if projs[p] in inputs]
            if members:
                top_in = max(inputs[m][1] for m in members)
                inputs.update({m: (inputs[m][0], top_in) for m in members})
    kv = {}
    for name in (k for k in t if k.endswith((".k_scale", ".v_scale"))):
        target, exists = VLLM.remap_kv_scale(name, set())  # vLLM's K3 MLA has no KV-scale parameter
        kv[name] = target if exists else None
    return replace(rb, state_dict=state, input_scales=inputs), kv
