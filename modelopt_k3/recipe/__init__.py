"""YAML quantization recipes: the data model (``model``), the file finder (``finder``) and the parser (``parser``).

A recipe says, by fnmatch-style patterns on the checkpoint's module names, which
format each quantizable Linear gets. Patterns match the whole name, case-sensitively,
and ``*`` spans dots: ``*.block_sparse_moe.gate`` matches
``language_model.model.layers.1.block_sparse_moe.gate`` but not ``...shared_experts.gate_proj``.
Entries are applied in order and the LAST matching entry wins; a name no entry
matches stays BF16.

Schema of a recipe file (recipes/README.md has the same text with examples)::

    description: free text                  # optional
    imports: [units/some_unit]              # optional; spliced BEFORE quant_cfg[0]
    algorithm: max                          # optional, default max; or {method: mse, ...} (recipe/algorithm.py)
    kv_cache: fp8                           # optional: null (default) | fp8
    calibrate_all_experts: false            # optional, default false
    quant_cfg:                              # list of entries and imports
      - pattern: "*"                        # required
        weights: nvfp4                      # nvfp4 | fp8 | fp8_pb
        inputs: nvfp4                       # required with weights: nvfp4 | fp8 | null (weight-only)
        input_amax: 2688.0                  # optional constant activation amax (no calibration)
        must_match: false                   # optional: error if it matches no quantizable module
        reason: text                        # optional note (shown in the summary)
      - pattern: "*.block_sparse_moe.gate"
        enable: false                       # leave BF16; takes no format keys
        reason: router
      - pattern: "*.mlp.*"
        scheme: NVFP4                       # alias: a compressed-tensors preset name, instead of weights/inputs
      - import: units/default_disabled      # splice that file's entries HERE

Import rule: an import's entries are spliced in where the import stands. The top-level
``imports`` list stands before ``quant_cfg[0]``; an ``- import: X`` item stands at its own
position in ``quant_cfg``. Since later entries win, put ``- import: units/default_disabled``
after a ``"*"`` entry so that the disabled entries override it. An imported file is a unit: it
may hold only ``description``, ``imports`` and ``quant_cfg``. Import paths (with or without
``.yaml``) starting with ``.`` are relative to the importing file; others are looked up in the
recipes roots, then relative to the importing file. Absolute paths are taken as they are.

Format combinations and the ModelOpt ``quant_algo`` each exports as (``QuantFormat.algo``):

    weights  inputs  quant_algo
    nvfp4    nvfp4   NVFP4         W4A4, per-16 E4M3 block scales + FP32 global scale
    nvfp4    null    W4A16_NVFP4   weight-only NVFP4
    fp8      fp8     FP8           per-tensor E4M3 weights and inputs
    fp8_pb   null    FP8_PB_WO     128x128 block FP8 weights, weight-only (edge blocks may be partial)

Other combinations are refused: ModelOpt has no name for per-tensor FP8 weight-only, its
FP8_PB_REAL uses dynamic per-group inputs that this project does not produce, and nothing
here writes W4A8_NVFP4_FP8.
"""


from .finder import RecipeRoots, available_presets, recipes_roots
from .model import (
    DISABLED,
    FP8,
    FP8_PB_WO,
    INPUT_FORMATS,
    KV_CACHE_FORMATS,
    NVFP4,
    W4A16_NVFP4,
    WEIGHT_FORMATS,
    QuantFormat,
    Recipe,
    RecipeEntry,
    RecipeError,
)
from .parser import load_recipe, parse_overrides, recipe_from_dict

__all__ = [
    "DISABLED",
    "FP8",
    "FP8_PB_WO",
    "INPUT_FORMATS",
    "KV_CACHE_FORMATS",
    "NVFP4",
    "W4A16_NVFP4",
    "WEIGHT_FORMATS",
    "QuantFormat",
    "Recipe",
    "RecipeEntry",
    "RecipeError",
    "RecipeRoots",
    "available_presets",
    "load_recipe",
    "parse_overrides",
    "recipe_from_dict",
    "recipes_roots",
]
