"""The conformance matrix: which exports the engines' own loaders are run on, and how each is built.

Every cell is an export of a model's tiny stand-in (its spec's ``stand_in``, through ``testing.make_tiny``:
Kimi-K3 for the default cells, Qwen3-MoE, GPT-OSS, DeepSeek-V3 or Qwen3.5-MoE for the ``qwen3*``, ``gpt_oss*``,
``deepseek_v3*`` and ``qwen3_5_moe*`` cells; ``TINY_MODELS``, checked against the registry's model types), written under a scratch
work directory, never inside an existing export: the presets through ``hf_ptq`` (calibrated), the
converter's default and the mirror recipe through ``convert_checkpoint`` (calibration-free), the same
on a 128-wide variant (flashinfer's weight shuffle, which SGLang's NVFP4 MoE post-processing runs, needs
routed-expert rows that are multiples of 128; the default tiny model's 64 are not), and copies of the
converter's export that break one engine rule each (the cases ``tests/check/test_engines.py`` builds).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
CONVERTER_DEFAULT = "models/moonshotai/Kimi-K3/nvfp4_experts"
MIRROR = "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention"
LM = "language_model.model"
# The real model's MLA head sizes: vLLM 0.33's MLA prefill backends accept only those (and 192/64/256),
# so a smaller tiny model stops vLLM before any weight is read.
MLA_SIZES = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
# Routed-expert rows (w13: 2 x moe_intermediate_size, w2: routed_expert_hidden_size) a multiple of 128.
WIDE_SIZES = {"moe_intermediate_size": 128, "routed_expert_hidden_size": 128}
# The tiny Qwen3-MoE stand-in as generated (one mlp_only_layers layer, hidden 64: w2 rows 64) and an all-MoE
# variant with hidden 128 (w2 rows 128; w13 rows are 2 x 32 padded to 64 = 128 either way).
QWEN3_WIDE_SIZES = {"mlp_only_layers": [], "hidden_size": 128}
# The DeepSeek-V3 stand-in (block FP8, hub layout) with the real model's MLA head sizes (vLLM's MLA backends, as
# for Kimi-K3 above); its other widths are the generator's (kv_a_proj_with_mqa 128 + 64 = 192 rows: a partial
# 128-row FP8 block, as DeepSeek-V3's 576).
DEEPSEEK_V3_SIZES = {"source": "block_fp8", **MLA_SIZES}
# GLM-5 with the real model's MLA head sizes and latent width (kv_lora_rank 512: vLLM 0.33 builds GLM-5's attention
# as DeepSeek-V3.2's sparse MLA, whose backends accept only a 576-wide latent + rope head) and indexer head width.
# Hidden 128: the routed experts' w2 rows, which SGLang's flashinfer_trtllm NVFP4 MoE post-processing needs % 128.
GLM_MOE_DSA_SIZES = {**MLA_SIZES, "kv_lora_rank": 512, "index_head_dim": 128, "hidden_size": 128}
# Nemotron-H with 8 Mamba groups and 128-row expert GEMMs: SGLang 0.5.23 builds the mixer with config.mamba_n_groups
# (default 8), which no transformers-written config holds (it writes n_groups), so the stand-in's 2 groups do not fit
# its conv1d (the released Nemotron-3 checkpoints have n_groups 8); and its flashinfer_trtllm NVFP4 MoE
# post-processing sizes each expert's interleaved block scales as unpadded (rows % 128, scale columns % 4), which the
# non-gated w1 [moe_intermediate_size, latent / 16] and w2 [latent, moe_intermediate_size / 16] meet at 128 / 128.
NEMOTRON_H_WIDE_SIZES = {"n_groups": 8, "moe_intermediate_size": 128, "moe_latent_size": 128}
# The stand-in's 2 Mamba groups with 128-row expert GEMMs (for the mamba_n_groups edit below).
NEMOTRON_H_WIDE_G2_SIZES = {"moe_intermediate_size": 128, "moe_latent_size": 128}
# Qwen3.5-MoE with head_dim 32: the stand-in's mrope_section [2, 1, 1] is a quarter (partial_rotary_factor) of a
# 32-wide head's rotary half, which vLLM's MRotaryEmbedding asserts; hidden 128 makes the routed experts' w2 rows
# 128, as SGLang's flashinfer_trtllm NVFP4 MoE post-processing needs (WIDE_SIZES above).
QWEN3_5_MOE_SIZES = {"text": {"head_dim": 32, "hidden_size": 128}}
# Kimi-K2.5 (hub layout: INT4 experts, MoonViT) with the real model's MLA head sizes in its text model.
KIMI_K25_SIZES = {"text": MLA_SIZES}
TINY_VARIANTS = {"default": MLA_SIZES, "wide": {**MLA_SIZES, **WIDE_SIZES},
                 "qwen3": {}, "qwen3-wide": QWEN3_WIDE_SIZES, "gpt_oss": {}, "deepseek_v3": DEEPSEEK_V3_SIZES,
                 "nemotron_h": {}, "nemotron_h-wide": NEMOTRON_H_WIDE_SIZES,
                 "nemotron_h-wide-g2": NEMOTRON_H_WIDE_G2_SIZES,
                 "kimi_k25": KIMI_K25_SIZES, "minimax_m2": {}, "glm_moe_dsa": GLM_MOE_DSA_SIZES,
                 "qwen3_5_moe": QWEN3_5_MOE_SIZES}
# Which stand-in generator each variant is built with (its config.json's model_type picks the drivers).
TINY_MODELS = {"default": "kimi_k3", "wide": "kimi_k3", "qwen3": "qwen3_moe", "qwen3-wide": "qwen3_moe",
               "gpt_oss": "gpt_oss", "deepseek_v3": "deepseek_v3", "nemotron_h": "nemotron_h",
               "nemotron_h-wide": "nemotron_h",
               "nemotron_h-wide-g2": "nemotron_h", "kimi_k25": "kimi_k25",
               "minimax_m2": "minimax_m2", "glm_moe_dsa": "glm_moe_dsa",
               "qwen3_5_moe": "qwen3_5_moe"}
GPT_OSS_CONVERTER_DEFAULT = "models/openai/gpt-oss/nvfp4_experts"
MLP0_FP8_PB = {"quant_cfg": [{"pattern": f"{LM}.layers.0.mlp.*", "weights": "fp8_pb", "inputs": None}]}


@dataclass(frozen=True)
class Cell:
    """One export of the matrix. ``how``: ``hf_ptq`` (a calibrated preset), ``convert`` (a recipe through
    the converter) or ``broken`` (``base``'s export with ``edit`` applied to a copy)."""

    id: str
    how: str
    recipe: str
    tiny: str = "default"  # a TINY_VARIANTS key
    base: str | None = None
    # hf_ptq cells: run with ``--qformat`` (the model's own recipe for it, ``RecipesSpec.qformat``) instead of
    # ``--recipe``; ``recipe`` then names the recipe that qformat resolves to (``test_conformance_harness``).
    qformat: str | None = None
    edit: str | None = None
    about: str = ""
    # hf_ptq cells: ``--kv_cache_qformat`` (the recipe's ``kv_cache`` override: ``cell_recipe``).
    kv_cache_qformat: str | None = None
    tags: tuple[str, ...] = field(default=())


CELLS: tuple[Cell, ...] = (
    Cell("preset-nvfp4", "hf_ptq", "presets/nvfp4", about="hf_ptq --qformat nvfp4 (the default)"),
    Cell("preset-nvfp4_experts_only", "hf_ptq", "presets/nvfp4_experts_only", about="hf_ptq --qformat nvfp4_experts_only"),
    Cell("preset-w4a16_nvfp4", "hf_ptq", "presets/w4a16_nvfp4", about="hf_ptq --qformat w4a16_nvfp4"),
    Cell("preset-fp8", "hf_ptq", "presets/fp8", about="hf_ptq --qformat fp8"),
    Cell("preset-trtllm", "hf_ptq", "presets/trtllm", about="hf_ptq --recipe presets/trtllm (what TensorRT-LLM serves)"),
    Cell("convert-default", "convert", CONVERTER_DEFAULT, about="modelopt-k3-convert's default recipe"),
    Cell("convert-mirror", "convert", MIRROR, about="the Kimi-K3 mirror recipe through the converter"),
    Cell("wide-preset-nvfp4", "hf_ptq", "presets/nvfp4", tiny="wide",
         about="hf_ptq --qformat nvfp4 on the 128-wide tiny model (SGLang post-processing reachable)"),
    Cell("wide-convert-default", "convert", CONVERTER_DEFAULT, tiny="wide",
         about="the converter's default on the 128-wide tiny model"),
    Cell("wide-convert-mirror", "convert", MIRROR, tiny="wide", about="the mirror recipe on the 128-wide tiny model"),
    Cell("broken-w3-scale", "broken", CONVERTER_DEFAULT, tiny="wide", base="wide-convert-default", edit="w3_scale",
         about="layer 1 expert 2's w3 weight_scale_2 doubled (w1/w3 no longer share the global scale)"),
    Cell("broken-latent-nvfp4", "broken", CONVERTER_DEFAULT, tiny="wide", base="wide-convert-default", edit="latent_nvfp4",
         about="layer 1's routed_expert_down_proj written NVFP4 (both engines build it unquantized)"),
    Cell("broken-kv-scales", "broken", CONVERTER_DEFAULT, tiny="wide", base="wide-convert-default", edit="kv_scales",
         about="FP8 KV-cache scales on the MLA layer (no such parameter in either K3 class)"),
    Cell("broken-no-quant-config", "broken", CONVERTER_DEFAULT, tiny="wide", base="wide-convert-default", edit="no_quant_config",
         about="config.json without quantization_config and producer.name modelopt_k3"),
    Cell("mlp0-fp8_pb", "convert", "inline:mlp0_fp8_pb",
         about="layer 0's dense MLP 128x128 block FP8 (FP8_PB_WO), scales [nr, 1, nc, 1] as ModelOpt writes"),
    Cell("broken-fp8_pb-2d-scale", "broken", "inline:mlp0_fp8_pb", base="mlp0-fp8_pb", edit="fp8_pb_2d",
         about="the FP8_PB_WO export with its block scales written [nr, nc]"),
    # Qwen3-MoE (issue 30): the default stand-in (mlp_only_layers [1], hidden 64) and the all-MoE 128-wide one.
    *(Cell(f"{tiny}-{kind}", "hf_ptq", recipe, tiny=tiny, qformat=qformat, about=f"Qwen3-MoE: {how} ({what})")
      for tiny, what in (("qwen3", "the stand-in: layer 1 in mlp_only_layers, hidden 64"),
                         ("qwen3-wide", "all layers MoE, hidden 128"))
      for kind, recipe, qformat, how in (
          ("qformat-nvfp4", "presets/nvfp4_default", "nvfp4", "hf_ptq --qformat nvfp4 (attention NVFP4)"),
          ("recipe-nvfp4", "presets/nvfp4", None, "hf_ptq --recipe presets/nvfp4 (attention BF16)"),
          ("qformat-w4a16_nvfp4", "presets/w4a16_nvfp4", "w4a16_nvfp4", "hf_ptq --qformat w4a16_nvfp4"))),
    # GPT-OSS (issue 30): the calibrated NVFP4 export (attention and experts) and the converter's default (experts
    # only, everything else as the MXFP4 source stores it), both per-expert.
    Cell("gpt_oss-qformat-nvfp4", "hf_ptq", "models/openai/gpt-oss/nvfp4", tiny="gpt_oss", qformat="nvfp4",
         about="GPT-OSS: hf_ptq --qformat nvfp4 (attention and routed experts NVFP4, per-expert)"),
    Cell("gpt_oss-convert-default", "convert", GPT_OSS_CONVERTER_DEFAULT, tiny="gpt_oss",
         about="GPT-OSS: modelopt-k3-convert's default (routed experts NVFP4 per expert by the lossless MXFP4 cast)"),
    # DeepSeek-V3 (issue 32): the block-FP8 stand-in through its --qformat nvfp4 recipe, without and with FP8 KV scales.
    Cell("deepseek_v3-qformat-nvfp4", "hf_ptq", "models/deepseek-ai/DeepSeek-V3/nvfp4", tiny="deepseek_v3",
         qformat="nvfp4", about="DeepSeek-V3: hf_ptq --qformat nvfp4 on the block-FP8 stand-in (MLA kept BF16, o_proj "
                                "and MLPs NVFP4)"),
    Cell("deepseek_v3-qformat-nvfp4-kv_fp8", "hf_ptq", "models/deepseek-ai/DeepSeek-V3/nvfp4", tiny="deepseek_v3",
         qformat="nvfp4", kv_cache_qformat="fp8",
         about="DeepSeek-V3: hf_ptq --qformat nvfp4 --kv_cache_qformat fp8 (one MLA KV scale per layer)"),
    # Kimi-K2.5 (issue 40): the INT4 stand-in through its --qformat nvfp4 recipe (routed experts only; vision carried).
    Cell("kimi_k25-qformat-nvfp4", "hf_ptq", "models/moonshotai/Kimi-K2.5/nvfp4", tiny="kimi_k25", qformat="nvfp4",
         about="Kimi-K2.5: hf_ptq --qformat nvfp4 on the INT4 stand-in (routed experts NVFP4; vision tower as stored)"),
    # MiniMax-M2 (issue 40): the block-FP8 stand-in through its --qformat nvfp4 recipe (routed experts only).
    Cell("minimax_m2-qformat-nvfp4", "hf_ptq", "models/MiniMaxAI/MiniMax-M2/nvfp4", tiny="minimax_m2", qformat="nvfp4",
         about="MiniMax-M2: hf_ptq --qformat nvfp4 on the block-FP8 stand-in (routed experts NVFP4, w1/w3/w2)"),
    # GLM-5 (issue 40): the BF16 stand-in with its MTP layer through its --qformat nvfp4 recipe (routed experts only).
    Cell("glm_moe_dsa-qformat-nvfp4", "hf_ptq", "models/zai-org/GLM-5/nvfp4", tiny="glm_moe_dsa", qformat="nvfp4",
         about="GLM-5: hf_ptq --qformat nvfp4 (routed experts NVFP4; MLA, DSA indexer, shared experts, MTP BF16)"),
    Cell("glm_moe_dsa-qformat-nvfp4-release_config", "broken", "models/zai-org/GLM-5/nvfp4", tiny="glm_moe_dsa",
         base="glm_moe_dsa-qformat-nvfp4", edit="glm5_release_config",
         about="GLM-5: the same export with the release config.json's topk_method / scoring_func / moe_layer_freq "
               "(transformers' config class, which the stand-in is written with, has none of them)"),
    # Qwen3.5-MoE (issue 40): the VLM stand-in through its --qformat nvfp4 recipe (routed experts only).
    Cell("qwen3_5_moe-qformat-nvfp4", "hf_ptq", "models/Qwen/Qwen3.5-MoE/nvfp4", tiny="qwen3_5_moe", qformat="nvfp4",
         about="Qwen3.5-MoE: hf_ptq --qformat nvfp4 (routed experts NVFP4; GDN, attention, shared expert, vision, "
               "MTP BF16)"),
    Cell("qwen3_5_moe-qformat-nvfp4-release_config", "broken", "models/Qwen/Qwen3.5-MoE/nvfp4", tiny="qwen3_5_moe",
         base="qwen3_5_moe-qformat-nvfp4", edit="qwen3_5_release_vision_config",
         about="Qwen3.5-MoE: the same export with the release config.json's vision_config.deepstack_visual_indexes []"),
    # Nemotron-H (issue 40): the BF16 stand-in (Mamba-2 / attention / latent MoE, MTP) through its --qformat nvfp4
    # recipe (routed experts only).
    Cell("nemotron_h-qformat-nvfp4", "hf_ptq", "models/nvidia/Nemotron-3/nvfp4_experts", tiny="nemotron_h",
         qformat="nvfp4", about="Nemotron-H: hf_ptq --qformat nvfp4 (routed experts NVFP4; Mamba, attention, latent "
                                "projections, shared expert, MTP BF16)"),
    Cell("nemotron_h-wide-qformat-nvfp4", "hf_ptq", "models/nvidia/Nemotron-3/nvfp4_experts", tiny="nemotron_h-wide",
         qformat="nvfp4", about="Nemotron-H: hf_ptq --qformat nvfp4 on the stand-in with 8 Mamba groups (the released "
                                "checkpoints', SGLang's default mamba_n_groups) and 128-row expert GEMMs"),
    Cell("nemotron_h-wide-g2-qformat-nvfp4", "hf_ptq", "models/nvidia/Nemotron-3/nvfp4_experts",
         tiny="nemotron_h-wide-g2", qformat="nvfp4",
         about="Nemotron-H: hf_ptq --qformat nvfp4 on the stand-in's 2 Mamba groups with 128-row expert GEMMs"),
    Cell("nemotron_h-wide-g2-qformat-nvfp4-mamba_n_groups", "broken", "models/nvidia/Nemotron-3/nvfp4_experts",
         tiny="nemotron_h-wide-g2", base="nemotron_h-wide-g2-qformat-nvfp4", edit="mamba_n_groups",
         about="Nemotron-H: the same export with mamba_n_groups = n_groups in config.json (what SGLang reads)"),
    # Issue 43: AWQ (folded into the norms) and AWQ then GPTQ on both Qwen3-MoE stand-ins, beside their max exports
    # (<tiny>-qformat-nvfp4, presets/nvfp4_default): they must load wherever those do (the 128-wide one is the one
    # SGLang's NVFP4 MoE post-processing accepts).
    *(Cell(f"{tiny}-recipe-{name}", "hf_ptq", f"presets/{name}", tiny=tiny,
           about=f"Qwen3-MoE: hf_ptq --recipe presets/{name} ({what}; no pre_quant_scale; {shape})")
      for tiny, shape in (("qwen3", "hidden 64"), ("qwen3-wide", "all MoE, hidden 128"))
      for name, what in (("nvfp4_default_awq", "AWQ scales folded into the preceding norms, then max"),
                         ("nvfp4_default_awq_gptq", "AWQ folded, then GPTQ"))),
)
# Cells whose engine rows are not observed yet (tests/data/engine_conformance.json holds only what an engine's own
# loader was seen to do); the harness test holds their recipes to what hf_ptq resolves. A cell moves into CELLS once
# `python -m tools.conformance --cells <id> --update_committed` has recorded it.
PENDING_CELLS: tuple[Cell, ...] = ()
CELL_BY_ID = {c.id: c for c in CELLS}


def tiny_checkpoint(root: Path, tiny: str) -> Path:
    """The tiny source of a cell: the stand-in of its model type (``TINY_MODELS``, the spec's ``stand_in``;
    generated once under ``root``; same seed, same bytes)."""
    from modelopt_k3.testing import make_tiny

    path = root / f"tiny-{tiny}"
    if not (path / INDEX).exists():
        make_tiny(TINY_MODELS[tiny], path, overwrite=True, **TINY_VARIANTS[tiny])
    return path


def recipe_of(name: str):
    """A cell's recipe: a recipe name, or ``inline:<name>`` for the matrix's own inline recipes."""
    from modelopt_k3.recipe import load_recipe, recipe_from_dict

    if name == "inline:mlp0_fp8_pb":
        return recipe_from_dict(MLP0_FP8_PB, name="mlp0_fp8_pb")
    return load_recipe(name)


def cell_recipe(cell: Cell):
    """The recipe a cell's export is made with: ``recipe_of(cell.recipe)`` with what its flags change
    (``--kv_cache_qformat``: the ``kv_cache`` override, as ``PtqConfig.recipe_overrides``)."""
    from modelopt_k3.recipe import load_recipe

    if cell.kv_cache_qformat:
        return load_recipe(cell.recipe, overrides={"kv_cache": cell.kv_cache_qformat})
    return recipe_of(cell.recipe)


def build_export(cell: Cell, root: Path, built: dict[str, Path], *, reuse: bool = False) -> Path:
    """Write ``cell``'s export under ``root/exports`` (replacing an older one) and return its path.
    ``reuse``: keep an export a previous build finished (its ``<id>.built`` stamp beside it)."""
    dst = root / "exports" / cell.id
    stamp = dst.with_name(f"{cell.id}.built")
    if reuse and stamp.exists() and dst.exists():
        built[cell.id] = dst
        return dst
    stamp.unlink(missing_ok=True)
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if cell.how == "broken":
        base = built.get(cell.base) or build_export(CELL_BY_ID[cell.base], root, built, reuse=reuse)
        EDITS[cell.edit](base, dst)
    elif cell.how == "convert":
        from modelopt_k3.convert import convert_checkpoint

        convert_checkpoint(tiny_checkpoint(root, cell.tiny), dst, recipe_of(cell.recipe), progress=False)
    elif cell.how == "hf_ptq":
        from modelopt_k3.cli import hf_ptq

        which = ["--qformat", cell.qformat] if cell.qformat else ["--recipe", cell.recipe]
        rc = hf_ptq.main(["--pyt_ckpt_path", str(tiny_checkpoint(root, cell.tiny)), "--trust_remote_code",
                          *which, *(["--kv_cache_qformat", cell.kv_cache_qformat] if cell.kv_cache_qformat else []),
                          "--calib_size", "4", "--calib_seq", "32", "--no_progress",
                          "--export_path", str(dst)])
        if rc != 0:
            raise RuntimeError(f"hf_ptq exited {rc} for {cell.id}")
    else:
        raise ValueError(f"cell {cell.id}: unknown how={cell.how!r}")
    stamp.write_text(f"{cell}\n")
    built[cell.id] = dst
    return dst


# ----------------------------------------------------------------------------------- broken copies


def copy_with(src: Path, dst: Path, *, tensors: dict[str, torch.Tensor] | None = None,
              quant: Callable[[dict, dict], None] | None = None, config: Callable[[dict], None] | None = None) -> Path:
    """A copy of export ``src`` at ``dst`` with ``tensors`` replaced or added (new ones go into the first
    shard); ``quant(hf_quant_config["quantization"], config["quantization_config"])`` and ``config(config)``
    edit the JSON files in place. ``src`` is only read."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX).read_text())
    where = index["weight_map"]
    first = min(where.values())
    changed: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in (tensors or {}).items():
        where.setdefault(key, first)
        changed.setdefault(where[key], {})[key] = value.contiguous()
    for shard, new in changed.items():
        with safe_open(str(dst / shard), framework="pt") as f:
            kept = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
            meta = f.metadata()
        save_file({**kept, **new}, str(dst / shard), metadata=meta)
    (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    cfg = json.loads((dst / "config.json").read_text())
    if quant is not None:
        hf = json.loads((dst / "hf_quant_config.json").read_text())
        quant(hf["quantization"], cfg["quantization_config"])
        (dst / "hf_quant_config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if config is not None:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


def _read(export: Path, key: str) -> torch.Tensor:
    shard = json.loads((export / INDEX).read_text())["weight_map"][key]
    with safe_open(str(export / shard), framework="pt") as f:
        return f.get_tensor(key)


def _w3_scale(src: Path, dst: Path) -> Path:
    key = f"{LM}.layers.1.block_sparse_moe.experts.2.w3.weight_scale_2"
    return copy_with(src, dst, tensors={key: _read(src, key) * 2})


def _latent_nvfp4(src: Path, dst: Path) -> Path:
    from modelopt_k3.quant.schemes import NVFP4_TENSOR

    module = f"{LM}.layers.1.block_sparse_moe.routed_expert_down_proj"
    w = _read(src, f"{module}.weight").float()
    new = {f"{module}.{k}": v for k, v in NVFP4_TENSOR.weight_tensors(w, w.abs().amax() / (6 * 448)).items()}
    new[f"{module}.input_scale"] = torch.tensor(0.01)  # its "weight" (BF16) is replaced by the packed codes

    def unexclude(hf: dict, cfg: dict) -> None:
        for q, key in ((hf, "exclude_modules"), (cfg, "ignore")):
            q[key] = [m for m in q.get(key) or [] if m != module]

    return copy_with(src, dst, tensors=new, quant=unexclude)


def _kv_scales(src: Path, dst: Path) -> Path:
    attn = f"{LM}.layers.3.self_attn"

    def fp8_kv(hf: dict, cfg: dict) -> None:
        hf["kv_cache_quant_algo"] = "FP8"
        cfg["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "dynamic": False}

    return copy_with(src, dst, tensors={f"{attn}.k_proj.k_scale": torch.tensor(0.25),
                                        f"{attn}.v_proj.v_scale": torch.tensor(0.25)}, quant=fp8_kv)


def _no_quant_config(src: Path, dst: Path) -> Path:
    out = copy_with(src, dst, config=lambda cfg: cfg.pop("quantization_config"))
    hf = json.loads((out / "hf_quant_config.json").read_text())
    hf["producer"]["name"] = "modelopt_k3"
    (out / "hf_quant_config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def _fp8_pb_2d(src: Path, dst: Path) -> Path:
    keys = [k for k in json.loads((src / INDEX).read_text())["weight_map"]
            if k.startswith(f"{LM}.layers.0.mlp.") and k.endswith(".weight_scale")]
    flat = {}
    for k in keys:
        s = _read(src, k)
        flat[k] = s.reshape(s.shape[0], s.shape[2]) if s.dim() == 4 else s
    return copy_with(src, dst, tensors=flat)


def _manifest_edit(edit: Callable[[dict, bool], None]) -> Callable[[Path, Path], Path]:
    """A broken copy whose only change is ``edit(quantization, flat)`` applied to both manifests (hf_quant_config.json's
    ``quantization``, ``flat`` False; config.json's ``quantization_config``, ``flat`` True: ``ignore``, not
    ``exclude_modules``)."""
    def apply(src: Path, dst: Path) -> Path:
        return copy_with(src, dst, quant=lambda hf, cfg: (edit(hf, False), edit(cfg, True)))
    return apply


def _attn_alias_conflict(q: dict, flat: bool) -> None:
    """The ``model.`` alias of layer 0's KDA q_proj declared NVFP4, its other spellings kept FP8_PB_WO."""
    layers = q.get("quantized_layers") or {}
    name = "model.layers.0.self_attn.q_proj"
    if name in layers:
        layers[name] = {"quant_algo": "NVFP4", "group_size": 16}


def _kda_fp8_partial(q: dict, flat: bool) -> None:
    """Layer 0's KDA o_proj no longer declared (every spelling): q/k/v/g FP8_PB_WO, o_proj unquantized."""
    layers = q.get("quantized_layers") or {}
    for name in [n for n in layers if n.endswith("layers.0.self_attn.o_proj")]:
        del layers[name]


def _bank_excluded(q: dict, flat: bool) -> None:
    """Layer 1's routed-expert bank named in the exclusions (its quantized_layers entries kept)."""
    key = "ignore" if flat else "exclude_modules"
    q[key] = [*(q.get(key) or []), f"{LM}.layers.1.block_sparse_moe.experts"]


def _attn_fp8_group64(q: dict, flat: bool) -> None:
    """Layer 0's FP8_PB_WO attention entries (every spelling) given ``group_size`` 64 (not 128x128 blocks)."""
    layers = q.get("quantized_layers") or {}
    for name in [n for n in layers if ".layers.0.self_attn." in f".{n}"]:
        layers[name] = {**layers[name], "group_size": 64}


def _bank_excluded_subtree(q: dict, flat: bool) -> None:
    """Layer 1's routed-expert bank excluded as a subtree, ``<bank>.*`` (one of the forms ModelOpt writes)."""
    key = "ignore" if flat else "exclude_modules"
    q[key] = [*(q.get(key) or []), f"{LM}.layers.1.block_sparse_moe.experts.*"]


# What the released GLM-5 config.json (zai-org/GLM-5) holds beyond transformers' GlmMoeDsaConfig, which the stand-in
# is written with: the DeepSeek-V2 classes both engines build GLM-5 with read them (models/glm_moe_dsa/serving.py).
GLM5_RELEASE_CONFIG = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}


def _glm5_release_config(src: Path, dst: Path) -> Path:
    """The export with ``GLM5_RELEASE_CONFIG`` added to its config.json (as an export of the release would carry)."""
    return copy_with(src, dst, config=lambda cfg: cfg.update(GLM5_RELEASE_CONFIG))


def _qwen3_5_release_vision_config(src: Path, dst: Path) -> Path:
    """The export with the release config.json's ``vision_config.deepstack_visual_indexes: []`` (Qwen3.5 has no
    deepstack mergers; transformers' vision config class writes no such key, SGLang then defaults to three)."""
    return copy_with(src, dst, config=lambda cfg: cfg["vision_config"].update(deepstack_visual_indexes=[]))


def _mamba_n_groups(src: Path, dst: Path) -> Path:
    """The export with ``mamba_n_groups`` = its ``n_groups`` in config.json (the key SGLang's Nemotron-H reads)."""
    return copy_with(src, dst, config=lambda cfg: cfg.update(mamba_n_groups=cfg["n_groups"]))


EDITS: dict[str, Callable[[Path, Path], Path]] = {
    "mamba_n_groups": _mamba_n_groups,
    "qwen3_5_release_vision_config": _qwen3_5_release_vision_config,
    "glm5_release_config": _glm5_release_config,
    "bank_excluded_subtree": _manifest_edit(_bank_excluded_subtree),
    "attn_fp8_group64": _manifest_edit(_attn_fp8_group64),
    "attn_alias_conflict": _manifest_edit(_attn_alias_conflict),
    "kda_fp8_partial": _manifest_edit(_kda_fp8_partial),
    "bank_excluded": _manifest_edit(_bank_excluded),
    "w3_scale": _w3_scale,
    "latent_nvfp4": _latent_nvfp4,
    "kv_scales": _kv_scales,
    "no_quant_config": _no_quant_config,
    "fp8_pb_2d": _fp8_pb_2d,
}
