"""Engine rules on fused layers, each shown to fire on the one thing it is about (and not without it).

* A fused group (layer 0's dense ``gate_up_proj``) with one ``weight_scale_2`` but different ``input_scale``
  per piece: vLLM and SGLang quantize the shared input with the max, so the check must say "different
  numbers"; with equal input scales the same export loads correctly.
* vLLM's K3 keeps KDA's fused ``in_proj_qkvgfab`` BF16: a recipe that quantizes every piece of it (so no
  mixed-format rule can fire instead) is refused for vLLM up front, naming that rule.

The base export is the calibration-free experts-only conversion (seconds); layer 0's MLP tensors are
written here from the source weights, so these tests do not depend on what the exporters write for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_emulation import edit_export, quantized_modules

from modelopt_k3 import check_export, convert_checkpoint
from modelopt_k3.check import DIFFERENT, LOADS, EngineRefusal, check_recipe_for_engines, scan_export
from modelopt_k3.export.modelopt_format import config_quantization_config, hf_quant_config
from modelopt_k3.models.kimi_k3.manifest import KIMI_K3_MANIFEST
from modelopt_k3.quant.schemes import NVFP4_TENSOR
from modelopt_k3.recipe import recipe_from_dict
from modelopt_k3.testing.reference import read_checkpoint

pytestmark = pytest.mark.slow  # a whole-checkpoint conversion and a few engine checks of it

LM = "language_model.model"
MLP0 = f"{LM}.layers.0.mlp"
KDA0 = f"{LM}.layers.0.self_attn"
KDA_PIECES = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")  # vLLM's in_proj_qkvgfab


@pytest.fixture(scope="module")
def experts_only(tiny_wide_ckpt: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fused_rules") / "experts_only"
    return convert_checkpoint(tiny_wide_ckpt, out, "models/moonshotai/Kimi-K3/nvfp4_experts", progress=False).dst


def _bf16_linears(export: Path) -> list[str]:
    layout, reader = scan_export(export)
    reader.close()
    return sorted(n for n, lin in layout.linears.items() if lin.fmt == "bf16")


def _with_mlp0_w4a4(base: Path, dst: Path, tiny_wide_ckpt: Path, input_scales: dict[str, float]) -> Path:
    """``base`` plus layer 0's dense MLP as NVFP4 W4A4: gate/up share one weight_scale_2 (their max amax) and
    take the given input scales; down_proj its own."""
    src = read_checkpoint(tiny_wide_ckpt)
    weights = {p: src[f"{MLP0}.{p}.weight"].float() for p in ("gate_proj", "up_proj", "down_proj")}
    gate_up = torch.maximum(weights["gate_proj"].abs().amax(), weights["up_proj"].abs().amax()) / (6 * 448)
    add = {}
    for proj, w in weights.items():
        scale = gate_up if proj != "down_proj" else w.abs().amax() / (6 * 448)
        add.update({f"{MLP0}.{proj}.{k}": t for k, t in NVFP4_TENSOR.weight_tensors(w, scale).items()})
        add[f"{MLP0}.{proj}.input_scale"] = torch.tensor(input_scales.get(proj, 0.03), dtype=torch.float32)
    mlp0 = {f"{MLP0}.{p}" for p in weights}
    kept = [m for m in _bf16_linears(base) if m not in mlp0]
    # The manifest the exporters would write for these formats (the one writer decides single vs mixed).
    algos = dict.fromkeys(quantized_modules(base) | mlp0, "NVFP4")
    manifest = hf_quant_config(algos, kv_cache=None, unquantized=kept, naming=KIMI_K3_MANIFEST)

    def rewrite(hf_q: dict, cfg_q: dict) -> None:
        hf_q.clear()
        hf_q.update(manifest["quantization"])
        cfg_q.clear()
        cfg_q.update(config_quantization_config(manifest))

    return edit_export(base, dst, add=add, quant=rewrite)


def test_fused_pieces_with_different_input_scales_serve_different_numbers(experts_only, tiny_wide_ckpt, tmp_path):
    same = _with_mlp0_w4a4(experts_only, tmp_path / "same", tiny_wide_ckpt, {"gate_proj": 0.01, "up_proj": 0.01})
    report = check_export(same, ("vllm", "sglang"))
    assert {e: r.verdict for e, r in report.results.items()} == {"vllm": LOADS, "sglang": LOADS}

    differ = _with_mlp0_w4a4(experts_only, tmp_path / "differ", tiny_wide_ckpt, {"gate_proj": 0.01, "up_proj": 0.025})
    report = check_export(differ, ("vllm", "sglang"))
    assert {e: r.verdict for e, r in report.results.items()} == {"vllm": DIFFERENT, "sglang": DIFFERENT}
    for engine in ("vllm", "sglang"):
        (dev,) = report.results[engine].deviations
        assert dev.module == f"{MLP0}.gate_up_proj", dev
        assert "input_scale differ across gate_proj, up_proj" in dev.what and dev.rule == "fused-scales-max", dev
        assert dev.error == pytest.approx(0.025 / 0.01 - 1, rel=1e-6)  # gate's input read with up's scale


def test_vllm_refuses_a_recipe_quantizing_kdas_fused_projection(tiny_wide_ckpt: Path):
    recipe = recipe_from_dict({"quant_cfg": [
        {"import": "units/default_disabled"},
        *({"pattern": f"*.layers.0.self_attn.{p}", "weights": "nvfp4", "inputs": None} for p in KDA_PIECES),
    ]}, name="kda0_nvfp4")
    with pytest.raises(EngineRefusal) as err:
        check_recipe_for_engines(tiny_wide_ckpt, recipe, "vllm")
    text = str(err.value)
    assert text.startswith("recipe kda0_nvfp4 cannot be served as calibrated by vllm:\nvllm:\n"), text
    # The fused parameter's first piece, refused by the keep-BF16 rule itself.
    assert f"refuses {KDA0}.q_proj.weight:" in text and "fuses KDA q/k/v/g/f_a/b into in_proj_qkvgfab" in text
