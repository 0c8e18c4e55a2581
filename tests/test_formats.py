"""The format registry (modelopt_k3/quant/schemes.py): numerics bit for bit against ``numerics/``, config
entries equal to what the exporter wrote before the registry, names resolved once, and no format-name
string comparison anywhere else in the package."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from modelopt_k3.numerics import fp8 as fp8n
from modelopt_k3.numerics import nvfp4 as nvn
from modelopt_k3.quant import schemes as formats
from modelopt_k3.quant.quantizer import TensorQuantizer
from modelopt_k3.quant.schemes import (
    FP8,
    FP8_BLOCK_TENSOR,
    FP8_PB_WO,
    FP8_TENSOR,
    KV_FP8,
    NVFP4,
    NVFP4_TENSOR,
    SCHEMES,
    TENSOR_FORMATS,
    W4A16_NVFP4,
)
from modelopt_k3.recipe import QuantFormat, load_recipe

PACKAGE = Path(__file__).resolve().parent.parent / "modelopt_k3"
GOLDEN = Path(__file__).resolve().parent / "data" / "modelopt_0_47_golden.json"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _tensors_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)


def _nvfp4_reference(w, amax):
    gs = nvn.nvfp4_global_scale(amax)
    q = nvn.nvfp4_quantize(w, gs)
    tensors = {"weight": q.packed, "weight_scale": q.block_scale,
               "weight_scale_2": q.global_scale.reshape(()).to(torch.float32)}
    return gs, nvn.nvfp4_fake_quant(w, gs), tensors


def _fp8_reference(w, amax):
    scale = fp8n.fp8_scale(amax)
    q, s = fp8n.fp8_quantize_per_tensor(w, scale)
    return scale, fp8n.fp8_fake_quant_per_tensor(w, scale), {"weight": q, "weight_scale": s.reshape(()).float()}


def _fp8_block_reference(w, amax):
    q, s = fp8n.fp8_quantize_blockwise(w, block=128)
    tensors = {"weight": q, "weight_scale": s.float()[:, None, :, None].contiguous()}
    return None, fp8n.fp8_fake_quant_blockwise(w, block=128), tensors


# The numerics module's own calls, per registered format: a new format must add its row here.
REFERENCE = {"nvfp4": _nvfp4_reference, "fp8": _fp8_reference, "fp8_pb": _fp8_block_reference}


def test_every_tensor_format_has_a_reference():
    assert set(TENSOR_FORMATS) == set(REFERENCE)


@pytest.mark.parametrize("name", list(TENSOR_FORMATS))
@pytest.mark.parametrize("shape", [(32, 64), (200, 272)])  # 200x272: partial 128-blocks for fp8_pb
def test_tensor_format_numerics_equal_the_numerics_module(name, shape):
    fmt = TENSOR_FORMATS[name]
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7)).mul(3).to(torch.bfloat16)
    amax = w.float().abs().amax()
    scale, fake, tensors = REFERENCE[name](w, amax)
    mine_scale = fmt.scale(amax) if fmt.per_tensor_scale else None
    if scale is not None:
        assert _same(mine_scale, scale)
    assert _same(fmt.fake_quant(w, mine_scale), fake)
    written = fmt.weight_tensors(w, mine_scale)
    assert _tensors_same(written, tensors)
    assert [(k, t.dtype, tuple(t.shape)) for k, t in written.items()] == fmt.weight_layout(shape)


def test_block_fake_quant_of_stacked_experts_is_per_expert():
    x = torch.randn(3, 130, 140).to(torch.bfloat16)
    want = torch.stack([fp8n.fp8_fake_quant_blockwise(e, block=128) for e in x])
    assert _same(FP8_BLOCK_TENSOR.fake_quant(x, None), want)
    q = TensorQuantizer(FP8_BLOCK_TENSOR, role="weight", amax_shape=(3,))
    assert _same(q.fake_quant(x, expert_dim=True), want)


def test_quantizer_uses_the_registry_numerics_per_expert():
    x = torch.randn(2, 16, 32).to(torch.bfloat16)
    q = TensorQuantizer(NVFP4_TENSOR, role="weight", amax_shape=(2,))
    q.observe(x, reduce_dims=(1, 2))
    gs = nvn.nvfp4_global_scale(x.float().abs().amax(dim=(1, 2)))
    assert _same(q.scale(), gs)
    assert _same(q.fake_quant(x, expert_dim=True), nvn.nvfp4_fake_quant(x, gs.view(-1, 1, 1)))


def test_quantizer_refuses_a_name():
    with pytest.raises(RuntimeError, match="registry format"):
        TensorQuantizer("nvfp4", role="weight")


FP4_ARGS = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
FP8_ARGS = {"dynamic": False, "num_bits": 8, "type": "float"}
# What export/modelopt_format.py wrote per quant_algo before the registry (63bc0a1 layer_entry/_group_args).
ENTRIES = {
    "NVFP4": ({"quant_algo": "NVFP4", "group_size": 16}, {"input_activations": FP4_ARGS, "weights": FP4_ARGS},
              "NVFP4"),
    "W4A16_NVFP4": ({"quant_algo": "W4A16_NVFP4", "group_size": 16}, {"weights": FP4_ARGS}, "NVFP4A16"),
    "FP8": ({"quant_algo": "FP8"}, {"input_activations": FP8_ARGS, "weights": FP8_ARGS}, None),
    "FP8_PB_WO": ({"quant_algo": "FP8_PB_WO"}, {"quant_algo": "FP8_PB_WO"}, None),
}


@pytest.mark.parametrize("algo", list(ENTRIES))
def test_scheme_config_entries_as_exported_before(algo):
    entry, group, ct_preset = ENTRIES[algo]
    scheme = SCHEMES[algo]
    assert scheme.layer_entry() == entry
    assert scheme.config_group_args(entry.get("group_size")) == group
    assert scheme.ct_preset == ct_preset


def test_schemes_registered_are_the_tested_ones():
    assert list(SCHEMES) == list(ENTRIES)
    assert [SCHEMES[a] for a in ENTRIES] == [NVFP4, W4A16_NVFP4, FP8, FP8_PB_WO]


def test_w4a16_entry_equals_modelopt_0_47():
    golden = json.loads(GOLDEN.read_text())["w4a16_nvfp4_hf_quant_config"]
    entry = W4A16_NVFP4.layer_entry()
    assert {k: golden[k] for k in entry} == entry


def test_kv_cache_format():
    assert KV_FP8.tensor is FP8_TENSOR and KV_FP8.algo == "FP8"
    scale = fp8n.fp8_scale(torch.tensor(3.5))
    assert _same(KV_FP8.scale_tensor(scale), scale.reshape(()).float())
    assert KV_FP8.config_scheme() == FP8_ARGS
    assert formats.kv_cache_named("fp8") is KV_FP8 and formats.kv_cache_named(None) is None


def test_recipe_names_resolve_once_to_registry_objects():
    fmt = QuantFormat("nvfp4", None)
    assert fmt.weights is NVFP4_TENSOR and fmt.inputs is None and fmt.scheme is W4A16_NVFP4
    assert QuantFormat(NVFP4_TENSOR, None) == fmt
    recipe = load_recipe("nvfp4", overrides={"kv_cache": "fp8"})
    assert recipe.kv_cache is KV_FP8
    resolved = {e.format.scheme for e in recipe.entries if e.format.enabled}
    assert resolved and resolved <= set(SCHEMES.values())
    with pytest.raises(ValueError, match="no ModelOpt quant_algo"):
        QuantFormat("fp8", "nvfp4")
    with pytest.raises(ValueError, match="inputs 'fp8_pb' is not one of"):
        QuantFormat("fp8_pb", "fp8_pb")


def _registered_names() -> set[str]:
    names = set(TENSOR_FORMATS) | set(SCHEMES) | {s.engine_method for s in SCHEMES.values()}
    names |= set(formats.KV_CACHE_FORMATS) | {k.algo for k in formats.KV_CACHE_FORMATS.values()}
    return {n.lower() for n in names} | {"fp8_pb_wo"}


def _literals(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for elt in node.elts:
            yield from _literals(elt)


def format_name_comparisons(root: Path) -> list[str]:
    """``file:line`` of every comparison (==, !=, in, not in) against a registered format's name outside
    the registry (and the stand-in remote code, which is not ours)."""
    names = _registered_names()
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "quant" / "schemes.py" or "remote_code" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                hits = [v for side in (node.left, *node.comparators) for v in _literals(side) if v.lower() in names]
                if hits:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {hits}")
    return found


def test_no_format_name_comparisons_outside_the_registry(tmp_path):
    assert format_name_comparisons(PACKAGE) == []
    # The scan itself finds what it must.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text('def f(x):\n    return x.fmt == "fp8_pb" or x in ("NVFP4", "y")\n')
    assert len(format_name_comparisons(tmp_path / "pkg")) == 2


def test_model_adapters_do_not_import_the_quantization_layer():
    for path in sorted((PACKAGE / "models").rglob("*.py")):
        if "remote_code" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # The format registry (quant/schemes.py, a primitive below the quantization layer) is allowed.
            if isinstance(node, ast.ImportFrom) and node.module and not node.module.endswith("quant.schemes"):
                assert not node.module.lstrip(".").startswith("quant") and ".quant." not in f".{node.module}.", path


def test_export_formats_resolve_once_and_refuse_unknown_names():
    from modelopt_k3.cli.hf_ptq import build_parser
    from modelopt_k3.export.layouts import COMPRESSED_TENSORS, EXPORT_FORMATS, MODELOPT, export_format

    assert export_format("modelopt") is MODELOPT and export_format(COMPRESSED_TENSORS) is COMPRESSED_TENSORS
    assert MODELOPT.engine_checked and not COMPRESSED_TENSORS.engine_checked
    with pytest.raises(ValueError, match="supported: \\['modelopt', 'compressed-tensors'\\]"):
        export_format("gguf")
    # The CLI lists the names without importing the registry (no torch before argument parsing).
    action = next(a for a in build_parser()._actions if a.dest == "export_format")
    assert list(action.choices) == list(EXPORT_FORMATS)


def test_export_format_names_are_resolved_in_two_entry_points_only():
    """The CLI (``hf_ptq.run``) and the library call (``export_checkpoint``) turn a name into its object;
    everything after them (preflight, engine checks, writer) takes the object."""
    callers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "export_format"
    )
    assert callers == ["cli/hf_ptq.py", "export/model_export.py"]


def test_export_format_says_what_it_cannot_hold():
    from modelopt_k3.export.layouts import COMPRESSED_TENSORS, MODELOPT
    from modelopt_k3.quant.schemes import KV_CACHE_FORMATS

    assert MODELOPT.unexpressible({"NVFP4", "FP8_PB_WO"}, KV_CACHE_FORMATS["fp8"]) is None
    assert COMPRESSED_TENSORS.unexpressible({"NVFP4"}, None) is None
    assert "FP8_PB_WO" in COMPRESSED_TENSORS.unexpressible({"NVFP4", "FP8_PB_WO"}, None)
    assert "kv_cache=fp8" in COMPRESSED_TENSORS.unexpressible({"NVFP4"}, KV_CACHE_FORMATS["fp8"])


# compressed-tensors preset schemes -> our formats: (weights, inputs); "-" where the preset has none.
CT_PRESETS = {
    "NVFP4": ("nvfp4", "nvfp4"), "NVFP4A16": ("nvfp4", "-"), "FP8": ("fp8", "fp8"), "FP8_BLOCK": ("fp8_pb", None),
    "FP8_DYNAMIC": (None, None), "MXFP4": (None, None), "MXFP8": (None, None), "W4A16": (None, "-"),
    "W8A8": (None, None), "UNQUANTIZED": ("-", "-"),
}
# A field changed to a value each format's rule must refuse (compressed-tensors QuantizationArgs fields).
CT_CHANGES = {
    "nvfp4": {"type": "int", "num_bits": 8, "strategy": "group", "group_size": 32},
    "fp8": {"type": "int", "num_bits": 4, "strategy": "channel", "dynamic": True},
    "fp8_pb": {"type": "int", "num_bits": 4, "strategy": "channel", "block_structure": [64, 128]},
}


def _ct_format(args, role: str) -> str | None:
    if args is None:
        return "-"
    fmt = formats.format_for_ct_args(args, role)
    return fmt.name if fmt is not None else None


def test_compressed_tensors_presets_map_to_the_formats_whose_every_field_they_have():
    """A compressed-tensors scheme names our format only when all of that format's fields agree: each
    matching preset stops matching when any one of them changes (and block FP8 is weights-only)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    for preset, want in CT_PRESETS.items():
        scheme = preset_name_to_scheme(preset, ["Linear"])
        got = (_ct_format(scheme.weights, "weights"), _ct_format(scheme.input_activations, "inputs"))
        assert got == want, preset
        for args, role, name in ((scheme.weights, "weights", want[0]), (scheme.input_activations, "inputs", want[1])):
            for field, value in CT_CHANGES.get(name, {}).items():
                assert _ct_format(args.model_copy(update={field: value}), role) is None, (preset, role, field)
    assert _ct_format(preset_name_to_scheme("FP8_BLOCK", ["Linear"]).weights, "inputs") is None
