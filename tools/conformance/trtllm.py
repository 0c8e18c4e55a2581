"""TensorRT-LLM replayed, not only read: its own Kimi-K3 quantization / name-resolution functions run over exports.

No TensorRT-LLM wheel with Kimi-K3 can be installed here (PyPI has a stub), so this takes a TensorRT-LLM source
tree the user provides (``--trtllm_src DIR``) and never imports it as a package: from each pinned file it parses
exactly the definitions ``PINNED`` names (``ast``), checks each one's fingerprint (sha256 of ``ast.unparse`` of
the definition without docstrings: the code that runs, not its comments, docstrings or formatting) and executes
them unmodified in a namespace whose other names are either definitions from the same tree or the stubs of ``drivers/stub_list.STUBS["trtllm"]``
(one line of why each). Nothing of TensorRT-LLM is in this repository: the pins are hashes.

Per export it then does what TensorRT-LLM's loader does with the export's configs (``replay_export``):
``ModelConfig.from_pretrained``'s quant-config steps on hf_quant_config.json (``read_modelopt_quant_config``,
``warn_if_inline_diverges`` against config.json's ``quantization_config``, ``_build_modelopt_quant_config``: algos
canonicalized, ``FP8_PB_WO`` -> ``FP8_BLOCK_SCALES``, per-layer ``QuantConfig``s), then per decoder layer, as
``KimiLinearDecoderLayer.__init__`` / ``KimiMLARuntime.__init__`` / ``KimiK3MoERuntime.__init__`` call them: ``resolve_attention_quant_config`` for KDA q/k/v/g/o or MLA
q_a/kv_a/q_b/kv_b/g/o, ``KimiK3MoERuntime._resolve_routed_quant_config`` and ``_k3_expert_ckpt_spec`` for the
routed experts. Each call's answer (the quant algo, or the exception with TensorRT-LLM's own message) is compared
with what ``modelopt-k3-check --engine trtllm`` resolves for the same call (``models/kimi_k3/serving.py``:
``trt_attention_algo``, ``trt_routed_algo``, the excluded-bank rule); the tensor headers add what the resolved
config then meets (the stored format of each resolved projection, the expert tensors TensorRT-LLM's spec names).

What this does not replay: the layers' weight loading (``_Fp8BlockScaleWeightReadLinear``, the KDA module's FP8
all-or-none and 128-alignment checks, ``load_weights``): those classes need CUDA and were not in the pinned
files. The check's refusals from those rules show in each cell's check column, not as disagreements.

``python -m tools.conformance.trtllm --trtllm_src DIR [--work W] [--out O] [--cells a,b] [--update_committed]``;
exits 1 on any disagreement, 2 on a bad argument (one line, before anything is built).
"""

from __future__ import annotations
import __future__

import ast
import copy
import enum
import fnmatch
import hashlib
import json
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .matrix import CELLS, CONVERTER_DEFAULT, MIRROR, TINY_MODELS, Cell

# The definitions replayed, per file of the TensorRT-LLM tree: qualified name -> its fingerprint (sha256 of its
# ast.unparse without docstrings).
# Read from the code index (no single commit of NVIDIA/TensorRT-LLM in it holds them all; see SOURCES).
PINNED: dict[str, dict[str, str]] = {
    "tensorrt_llm/quantization/modelopt_config.py": {
        "is_modelopt_quant_config": "ee38de93efc47bb0fd3970bdccd5927f62c5c4e8eb9d3f0d94d939966071de7a",
        "_KV_SCHEME_DICT_MAP": "9633ceb4c372ff8ac924f15b858544616ca4a201d8e3ee9add9414fb44c79237",
        "_KV_SCHEME_STRING_ALGOS": "762df0ca3a89f0f41578d31fb33cf19d61b893247b7f936934f3c7e8d446de78",
        "_QUANT_ALGO_ALIASES": "5b0e4963641bad53acceb6a02a50c5d0e138b8290d71aed454feb8c32ba254f5",
        "canonicalize_quant_algo": "aa216eee109e4ad9baa68cbc14e62fb16a63e6e4a53fc55f48f44841ba18fc54",
        "_canonicalize_algos": "6a8beb2ffb983125448f3af8693cc6c8ddf93179afaaeee96541b882326b8b55",
        "_kv_cache_scheme_to_algo": "ce940d452e4c2324c3a83a74aa30f7c0606f10c4499f5a72069b9dc3469bf922",
        "warn_if_inline_diverges": "6d118b2a902bdb7981aa8ec8b56122a710485e7f46013958b0a4c61e11cecb8b",
        "read_modelopt_quant_config": "231492e8fe4fdb07231199e4d1cb222ac2add92543ca23bd26a18f899fbdabd1",
    },
    "tensorrt_llm/models/modeling_utils.py": {
        "QuantConfig.is_module_excluded_from_quantization": "fb85ea0fcecf421f8aee41ad6a6f4c9316776ad7c7904ebad75f97b1ade98d1e",
    },
    "tensorrt_llm/_torch/model_config.py": {
        "ModelConfig._build_modelopt_quant_config": "5bc4abc864c6eeba89e9079e40005faf44122b16f7b43f84fab3ce92bc9b5897",
    },
    "tensorrt_llm/_torch/models/modeling_kimi_linear.py": {
        "_get_text_config": "65888a1fa8e865a3fe21b983e7c2f0e4c523fc354aecc0853fb92cfd9a53928c",
        "_is_kda_layer": "6e6050ff467bd5b0c75157f74218e7ae1699d4ed27fbef2d4f41c77f4e36cdda",
        "_is_mla_layer": "4b16b0f246f3bb2076170e15a4e84b8bc23ccc5c7fcd87f24dbbd4ecdc467af1",
        "_K3_ROUTED_EXPERT_KEY_PREFIXES": "a170ca8eaf976e78fe6a70023731df8410750b6c7ee92268dfeba9c2fd96243e",
        "_K3_ROUTED_EXPERT_KEY_SUFFIXES": "802198ac400ed73967fd1dafb9dea8a74ed36bcc83786d2bfea3b968ad6e83d4",
        "_K3_ROUTED_EXPERT_MODULE_PREFIXES": "b03741d0948280ece3c96c1d17d052c86361673299e215bdfa122d47059c953f",
        "_K3_DEFAULT_ROUTED_QUANT_ALGO": "672827a6cc5afbcc47666d7bd6124a7e9ab69ffbfe1ee05c034cb5d5b217d0d8",
        "_load_packed_mxfp4_expert": "b04565dab52a48e392700f1c3fab2ba81f63a7fa419ad9b6eaefea15c5ccf5a0",
        "_load_nvfp4_expert": "fc99fdf0a51483095773c57df7d475d677bf5681111e7a76bcc74ddf8fe73633",
        "_K3ExpertCkptSpec": "477099dae425fdff7a24f8b7dbaf7344f6be689a3d9aa1c723dc1dec65adfb05",
        "_K3_EXPERT_CKPT_SPECS": "c4c5426e462bc18efe3139860d149130754ca4352e8a999076df4e02b7f61960",
        "_k3_expert_ckpt_spec": "2834dde7d14b99684c9fc9fb290455397bfdde81c9c876f0ecbccd477251030e",
        "KimiK3MoERuntime._resolve_routed_quant_config": "d0601d7b48708202418189bee791f8edafcf75ceaad476b6f9be04dcf2cb3967",
        "resolve_attention_quant_config": "7163427d7bcdfd5fc3dffb70dba3930392d3d7613227d7364508e9658ca17fee",
    },
}
# Where each file's definitions were read (the code index; file-version ids where it names no commit).
SOURCES = {
    "tensorrt_llm/quantization/modelopt_config.py":
        "code index file version 57422422330 (7,542 characters; NVIDIA/TensorRT-LLM holds the path at 2edf354d)",
    "tensorrt_llm/models/modeling_utils.py":
        "code index file version 57035009897 (the QuantConfig with the ancestor walk and the '.*' parent rule)",
    "tensorrt_llm/_torch/model_config.py":
        "JunyiXu-nv/TensorRT-LLM @ 10d0af85c38509b15e3ce9985824d53e13155d8c (also ModelConfig.from_pretrained, whose "
        "quant-config steps _quant_configs follows)",
    "tensorrt_llm/_torch/models/modeling_kimi_linear.py":
        "code index file version 68334583009 (145,529 characters: the newest K3 loader the index holds, the one "
        "models/kimi_k3/serving.py cites; its repository and commit are not recorded there)",
}
# TensorRT-LLM's K3 architectures resolve moe_backend AUTO to TRTLLM (ModelConfig.resolve_moe_backend).
MOE_BACKEND = "TRTLLM"
# The three manifest edits issue 30 names, on top of the matrix's Kimi-K3 cells (matrix.EDITS builds them).
MANIFEST_CELLS: tuple[Cell, ...] = (
    Cell("manifest-attn-alias-conflict", "broken", MIRROR, tiny="wide", base="wide-convert-mirror",
         edit="attn_alias_conflict",
         about="the mirror's layer-0 KDA q_proj declared NVFP4 under its model. alias, FP8_PB_WO under the others"),
    Cell("manifest-attn-fp8-group64", "broken", MIRROR, tiny="wide", base="wide-convert-mirror",
         edit="attn_fp8_group64", about="the mirror's layer-0 FP8_PB_WO attention entries with group_size 64"),
    Cell("manifest-kda-fp8-partial", "broken", MIRROR, tiny="wide", base="wide-convert-mirror", edit="kda_fp8_partial",
         about="the mirror with layer 0's KDA o_proj undeclared: q/k/v/g FP8_PB_WO, o_proj unquantized"),
    Cell("manifest-bank-excluded", "broken", CONVERTER_DEFAULT, tiny="wide", base="wide-convert-default",
         edit="bank_excluded", about="the converter's default with layer 1's routed-expert bank in exclude_modules"),
    Cell("manifest-bank-excluded-subtree", "broken", CONVERTER_DEFAULT, tiny="wide", base="wide-convert-default",
         edit="bank_excluded_subtree",
         about="the same bank excluded as a subtree, `<bank>.*` (TensorRT-LLM's '.*' rule matches the bank itself)"),
)
# The Kimi-K3 cells only: the replayed functions are TensorRT-LLM's Kimi-K3 loader's.
REPLAY_CELLS: tuple[Cell, ...] = (*(c for c in CELLS if TINY_MODELS[c.tiny] == "kimi_k3"), *MANIFEST_CELLS)
REPLAY_CELL_BY_ID = {c.id: c for c in REPLAY_CELLS}
JSON_NAME, DOC_NAME = "trtllm_replay.json", "TRTLLM_REPLAY.md"
KDA = ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj")  # KimiLinearDecoderLayer.__init__ projection_names
MLA = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "g_proj", "o_proj")  # KimiMLARuntime.__init__
# The calls a replay records, and their keys in the committed rows (``call_key``).
ATTN, EXPERTS = "resolve_attention_quant_config", "_k3_expert_ckpt_spec(_resolve_routed_quant_config)"
CONFIGS = "ModelConfig.from_pretrained's quant configs"
KEY_OF = {ATTN: "attn", EXPERTS: "experts", CONFIGS: "configs"}


class TreeError(ValueError):
    """The TensorRT-LLM tree is not the pinned code (one line)."""


# ----------------------------------------------------------------------------------------- the tree


def _without_docstrings(node: ast.AST) -> ast.AST:
    """A copy of ``node`` whose functions and classes have no docstring (what runs is the same)."""
    node = copy.deepcopy(node)
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub.body:
            first = sub.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                sub.body = sub.body[1:] or [ast.Pass()]
    return node


def fingerprint(node: ast.AST) -> str:
    """sha256 of the definition's code: ``ast.unparse`` without docstrings (comments and formatting never count)."""
    return hashlib.sha256(ast.unparse(_without_docstrings(node)).encode()).hexdigest()


def _definitions(tree: ast.Module) -> dict[str, ast.stmt]:
    out: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef):
                        out[f"{node.name}.{sub.name}"] = sub
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
    return out


def load_tree(root: Path, pinned: dict[str, dict[str, str]] = PINNED) -> dict[str, dict[str, ast.stmt]]:
    """The pinned definitions of ``root`` (a TensorRT-LLM checkout), each checked against its fingerprint."""
    root = Path(root)
    if not root.is_dir():
        raise TreeError(f"--trtllm_src {root}: not a directory (a TensorRT-LLM source tree; see docs/ENGINE_CONFORMANCE.md)")
    found: dict[str, dict[str, ast.stmt]] = {}
    for rel, names in pinned.items():
        path = root / rel
        if not path.is_file():
            raise TreeError(f"--trtllm_src {root}: no {rel}; the replay needs the pinned TensorRT-LLM files "
                            "(docs/ENGINE_CONFORMANCE.md, 'TensorRT-LLM replay')")
        try:
            defs = _definitions(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        except (SyntaxError, UnicodeDecodeError) as e:
            raise TreeError(f"--trtllm_src {root}: {rel} does not parse ({e.__class__.__name__}: {e})") from None
        found[rel] = {}
        for name, want in names.items():
            node = defs.get(name)
            if node is None:
                raise TreeError(f"--trtllm_src {root}: {rel} defines no {name}; not the pinned TensorRT-LLM code")
            got = fingerprint(node)
            if got != want:
                raise TreeError(f"--trtllm_src {root}: {rel} {name} is not the pinned code (sha256 {got[:12]}, "
                                f"pinned {want[:12]}); check out the pinned TensorRT-LLM or re-pin deliberately")
            found[rel][name] = node
    return found


def _run(nodes: list[ast.stmt], ns: dict[str, Any], filename: str, *, future_annotations: bool) -> None:
    """Execute TensorRT-LLM's own definitions, unmodified, into ``ns``."""
    flags = __future__.annotations.compiler_flag if future_annotations else 0
    code = compile(ast.Module(body=nodes, type_ignores=[]), filename, "exec", flags=flags, dont_inherit=True)
    exec(code, ns)  # noqa: S102 -- the pinned TensorRT-LLM definitions, fingerprint-checked in load_tree


# ----------------------------------------------------------------------------------------- the stubs


class QuantAlgo(str, enum.Enum):
    """Stub of ``tensorrt_llm.quantization.mode.QuantAlgo`` (a StrEnum whose values are its names)."""

    W8A16 = "W8A16"
    W4A16 = "W4A16"
    W4A16_AWQ = "W4A16_AWQ"
    W4A8_AWQ = "W4A8_AWQ"
    W8A16_GPTQ = "W8A16_GPTQ"
    W4A16_GPTQ = "W4A16_GPTQ"
    W8A8_SQ_PER_CHANNEL = "W8A8_SQ_PER_CHANNEL"
    FP8 = "FP8"
    FP8_PER_CHANNEL_PER_TOKEN = "FP8_PER_CHANNEL_PER_TOKEN"
    FP8_BLOCK_SCALES = "FP8_BLOCK_SCALES"
    INT8 = "INT8"
    MIXED_PRECISION = "MIXED_PRECISION"
    NVFP4 = "NVFP4"
    W4A16_NVFP4 = "W4A16_NVFP4"
    W4A8_NVFP4_FP8 = "W4A8_NVFP4_FP8"
    W4A8_MXFP4_FP8 = "W4A8_MXFP4_FP8"
    W4A8_MXFP4_MXFP8 = "W4A8_MXFP4_MXFP8"
    W4A16_MXFP4 = "W4A16_MXFP4"
    NO_QUANT = "NO_QUANT"

    def __str__(self) -> str:  # a StrEnum formats as its value
        return self.value


class QuantConfigBase:
    """Stub of ``QuantConfig``'s fields and defaults (a pydantic StrictBaseModel in TensorRT-LLM); its
    ``is_module_excluded_from_quantization`` is TensorRT-LLM's own, attached in ``build_namespace``."""

    def __init__(self, **fields: Any) -> None:
        self.quant_algo = None
        self.kv_cache_quant_algo = None
        self.group_size: int | None = 128
        self.exclude_modules: list[str] | None = None
        self.has_zero_point = False
        self.pre_quant_scale = False
        for k, v in fields.items():
            if not hasattr(self, k):
                raise TypeError(f"QuantConfig has no field {k!r}")
            setattr(self, k, v)


class Log:
    """Stub of ``tensorrt_llm.logger.logger``: keeps what TensorRT-LLM logs."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def _say(self, level: str, msg: str, *args: Any, **_: Any) -> None:
        self.lines.append(f"{level}: {msg % args if args else msg}")

    def debug(self, msg: str, *args: Any, **kw: Any) -> None:
        self._say("debug", msg, *args, **kw)

    def info(self, msg: str, *args: Any, **kw: Any) -> None:
        self._say("info", msg, *args, **kw)

    def warning(self, msg: str, *args: Any, **kw: Any) -> None:
        self._say("warning", msg, *args, **kw)

    info_once = info
    warning_once = warning


def _cached_file(path_or_repo: str, filename: str, **_: Any) -> str:
    """Stub of ``transformers.utils.hub.cached_file`` for a local checkpoint directory."""
    path = Path(path_or_repo) / filename
    if not path.is_file():
        raise OSError(f"{path_or_repo} does not appear to have a file named {filename}")
    return str(path)


@dataclass
class Replayed:
    """TensorRT-LLM's functions, executed from the tree; the stubs they see; what they logged."""

    fn: dict[str, Any]
    QuantConfig: type
    log: Log


def build_namespace(defs: dict[str, dict[str, ast.stmt]]) -> Replayed:
    log = Log()
    mo_path, mu_path = "tensorrt_llm/quantization/modelopt_config.py", "tensorrt_llm/models/modeling_utils.py"
    mc_path, mk_path = "tensorrt_llm/_torch/model_config.py", "tensorrt_llm/_torch/models/modeling_kimi_linear.py"
    mo: dict[str, Any] = {"__name__": "tensorrt_llm.quantization.modelopt_config", "Any": Any, "Dict": dict,
                          "Optional": typing.Optional, "logger": log}
    _run(list(defs[mo_path].values()), mo, mo_path, future_annotations=False)

    mu: dict[str, Any] = {"__name__": "tensorrt_llm.models.modeling_utils", "fnmatch": fnmatch, "re": re}
    _run([defs[mu_path]["QuantConfig.is_module_excluded_from_quantization"]], mu, mu_path, future_annotations=False)
    quant_config = type("QuantConfig", (QuantConfigBase,), {
        "is_module_excluded_from_quantization": mu["is_module_excluded_from_quantization"]})

    transformers = SimpleNamespace(utils=SimpleNamespace(hub=SimpleNamespace(cached_file=_cached_file)))
    mc: dict[str, Any] = {"__name__": "tensorrt_llm._torch.model_config", "json": json, "QuantConfig": quant_config,
                          "QuantAlgo": QuantAlgo, "canonicalize_quant_algo": mo["canonicalize_quant_algo"],
                          "read_modelopt_quant_config": mo["read_modelopt_quant_config"],
                          "transformers": transformers, "logger": log}
    _run(list(defs[mc_path].values()), mc, mc_path, future_annotations=False)
    model_config = type("ModelConfig", (), {"_build_modelopt_quant_config": mc["_build_modelopt_quant_config"]})
    mc["ModelConfig"] = model_config

    mk: dict[str, Any] = {"__name__": "tensorrt_llm._torch.models.modeling_kimi_linear", "copy": copy,
                          "QuantAlgo": QuantAlgo, "QuantConfig": quant_config, "logger": log,
                          "NamedTuple": typing.NamedTuple, "Tuple": tuple, "Callable": typing.Callable,
                          "Optional": typing.Optional}
    _run(list(defs[mk_path].values()), mk, mk_path, future_annotations=True)
    fn = {"_build_modelopt_quant_config": model_config._build_modelopt_quant_config,
          **{k: mo[k] for k in ("read_modelopt_quant_config", "is_modelopt_quant_config", "warn_if_inline_diverges")},
          **{k: mk[k] for k in ("_get_text_config", "_is_kda_layer", "_is_mla_layer", "_k3_expert_ckpt_spec",
                                "resolve_attention_quant_config")},
          "_resolve_routed_quant_config": mk["_resolve_routed_quant_config"]}
    return Replayed(fn, quant_config, log)


# ----------------------------------------------------------------------------------------- one export


def _algo(value: Any) -> str | None:
    return None if value is None else str(getattr(value, "value", value))


def _raised(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def replay_export(r: Replayed, export: Path) -> dict:
    """What TensorRT-LLM's functions answer for ``export``: ``calls`` (each with ``value`` or ``raised``)."""
    r.log.lines.clear()
    config = json.loads((export / "config.json").read_text())
    out: dict[str, Any] = {"calls": []}
    hf, inline = export / "hf_quant_config.json", config.get("quantization_config")
    try:
        qc, per_layer = _quant_configs(r, export, hf, inline, out)
    except Exception as e:  # TensorRT-LLM refused the configs themselves
        out["calls"].append({"call": CONFIGS, "raised": _raised(e)})
        return _finish(out, r)
    out["quant_algo"] = _algo(qc.quant_algo)
    model_config = SimpleNamespace(quant_config=qc, quant_config_dict=per_layer)
    text = config.get("text_config")
    pretrained = SimpleNamespace(**{**config, "text_config": SimpleNamespace(**text) if isinstance(text, dict) else text})
    cfg = r.fn["_get_text_config"](pretrained)
    for layer in range(cfg.num_hidden_layers):
        kda, mla = r.fn["_is_kda_layer"](cfg, layer), r.fn["_is_mla_layer"](cfg, layer)
        for proj in (KDA if kda else MLA) if kda != mla else ():
            call = {"call": ATTN, "layer": layer, "proj": proj}
            try:
                call["value"] = _algo(r.fn["resolve_attention_quant_config"](model_config, layer, proj).quant_algo)
            except Exception as e:
                call["raised"] = _raised(e)
            out["calls"].append(call)
        # KimiLinearDecoderLayer.__init__'s is_moe
        if (cfg.num_experts is not None and layer >= cfg.first_k_dense_replace
                and layer % getattr(cfg, "moe_layer_freq", 1) == 0):
            call = {"call": EXPERTS, "layer": layer}
            try:
                routed = r.fn["_resolve_routed_quant_config"](model_config, layer)
                spec = r.fn["_k3_expert_ckpt_spec"](routed.quant_algo)
                call["value"], call["kinds"] = _algo(routed.quant_algo), list(spec.kinds)
            except Exception as e:
                call["raised"] = _raised(e)
            out["calls"].append(call)
    return _finish(out, r)


def _quant_configs(r: Replayed, export: Path, hf: Path, inline: Any, out: dict) -> tuple[Any, Any]:
    """``ModelConfig.from_pretrained``'s quant-config steps (JunyiXu-nv/TensorRT-LLM @ 10d0af85): hf_quant_config.json
    normalized by ``read_modelopt_quant_config``, ``warn_if_inline_diverges`` against config.json's
    ``quantization_config``, ``_build_modelopt_quant_config``; config.json's own config (``load_hf_quant_config``,
    whose ModelOpt branch is those same two functions) when there is no file, or when the file sets no global
    quant_algo. Other formats than ModelOpt's are not replayed (no matrix export has one)."""
    build, read = r.fn["_build_modelopt_quant_config"], r.fn["read_modelopt_quant_config"]

    def inline_configs() -> tuple[Any, Any]:
        if not r.fn["is_modelopt_quant_config"](inline):
            raise NotImplementedError(f"config.json quantization_config {str(inline)[:80]!r}: not a ModelOpt config "
                                      "(load_hf_quant_config's other branches are not replayed)")
        return build(read(inline), str(export), MOE_BACKEND)

    if hf.is_file():
        out["quant_source"] = "hf_quant_config.json"
        normalized = read(json.loads(hf.read_text()))
        r.fn["warn_if_inline_diverges"](normalized, inline, source_file="hf_quant_config.json")
        qc, per_layer = build(normalized, str(export), MOE_BACKEND)
        if qc.quant_algo is None and inline is not None:
            inline_qc, inline_layers = inline_configs()
            if inline_qc.quant_algo is not None:
                out["quant_source"] = "config.json (hf_quant_config.json sets no global quant_algo)"
                qc = inline_qc
                if inline_layers is not None:
                    per_layer = inline_layers if per_layer is None else {**inline_layers, **per_layer}
        return qc, per_layer
    if inline is not None:
        out["quant_source"] = "config.json quantization_config"
        return inline_configs()
    out["quant_source"] = "none (unquantized)"
    return r.QuantConfig(), None


def _finish(out: dict, r: Replayed) -> dict:
    raised = [c for c in out["calls"] if "raised" in c]
    out["outcome"] = "raises" if raised else "resolves"
    if raised:
        out["first_raised"] = raised[0]["raised"]
    out["log"] = [line for line in r.log.lines if not line.startswith("debug")][:10]
    return out


# ----------------------------------------------------------------------------------------- the check's side


def check_calls(layout, calls: list[dict]) -> list[dict]:
    """What ``modelopt-k3-check``'s TensorRT-LLM rules resolve for each of ``calls`` (same keys)."""
    from modelopt_k3.check.engines.base import Refuse
    from modelopt_k3.models.kimi_k3 import serving as s

    q, per_layer = s.trt_quant_of(layout), s._trt_per_layer_algos(layout)
    out = []
    for call in calls:
        mine = {k: call[k] for k in ("call", "layer", "proj") if k in call}
        if call["call"] == ATTN:
            try:
                mine["value"] = s.trt_attention_algo(q, call["layer"], call["proj"])
            except Refuse as e:
                mine["raised"] = e.refusal.reason
        elif call["call"] == EXPERTS:
            algo = trt_algo_routed(s, q, per_layer, call["layer"])
            if algo is None or algo not in s.TRT_EXPERT_FORMATS:
                mine["raised"] = ("excluded bank (no quant_algo)" if algo is None
                                  else f"routed experts {algo}: not in {sorted(s.TRT_EXPERT_FORMATS)}")
            else:
                mine["value"] = algo
        else:  # the configs themselves: the check has no rule that refuses them
            mine["value"] = "parsed"
        out.append(mine)
    return out


def trt_algo_routed(s, q, per_layer: dict[str, str], layer: int) -> str | None:
    """The check's routed-expert resolution: None for an excluded bank (``replay_trtllm``'s order)."""
    return None if s._trt_bank_excluded(q, layer) else s.trt_routed_algo(per_layer, layer)



def call_key(call: dict) -> str:
    """``attn <layer> <proj>``, ``experts <layer>`` or ``configs``: one call's key in the committed rows."""
    return " ".join([KEY_OF[call["call"]], *(str(call[k]) for k in ("layer", "proj") if k in call)])


def calls_of(keys) -> list[dict]:
    """The calls the committed keys name (``call_key``'s inverse)."""
    call_of = {v: k for k, v in KEY_OF.items()}
    out = []
    for key in keys:
        kind, *rest = key.split(" ")
        call: dict[str, Any] = {"call": call_of[kind]}
        if rest:
            call["layer"] = int(rest[0])
        if len(rest) > 1:
            call["proj"] = rest[1]
        out.append(call)
    return out


def answer(call: dict) -> str:
    """One call's answer as the committed rows spell it: ``raises ...``, ``unquantized`` or the algo."""
    if "raised" in call:
        return f"raises {call['raised']}"
    return "unquantized" if call.get("value") is None else str(call["value"])


def agree(a: str, b: str) -> bool:
    """Two answers agree: both raise (their messages are each side's own), or both resolve to the same algo."""
    return a.startswith("raises") == b.startswith("raises") and (a.startswith("raises") or a == b)


def compare(replayed: list[dict], checked: list[dict]) -> list[str]:
    """The calls where the replay and the check answer differently (a raise vs a value, or two values)."""
    out = []
    for a, b in zip(replayed, checked):
        where = " ".join(str(a[k]) for k in ("call", "layer", "proj") if k in a)
        if ("raised" in a) != ("raised" in b):
            out.append(f"{where}: TensorRT-LLM {a.get('raised') or a.get('value')!r}, check "
                       f"{b.get('raised') or b.get('value')!r}")
        elif "raised" not in a and a["value"] != b["value"]:
            out.append(f"{where}: TensorRT-LLM resolves {a['value']!r}, check {b['value']!r}")
    return out


def header_notes(layout, calls: list[dict]) -> list[tuple[str, str]]:
    """What the resolved configs meet in the export's headers, as (module scope, note): a projection stored in
    another format than the one it resolved to, expert tensors that TensorRT-LLM's spec names but the export lacks.
    Either makes TensorRT-LLM's weight loading fail there, so the check must refuse something in that scope."""
    from modelopt_k3.quant.schemes import FP8_PB_WO

    notes = []
    by_suffix: dict[str, Any] = {}
    for name, linear in layout.linears.items():
        m = re.search(r"layers\.(\d+)\.self_attn\.(\w+)$", name)
        if m:
            by_suffix[f"{m[1]}.{m[2]}"] = linear
    names = set(layout.tensors) if hasattr(layout, "tensors") else set()
    for call in calls:
        if "value" not in call:
            continue
        if call["call"] == ATTN:
            linear = by_suffix.get(f"{call['layer']}.{call['proj']}")
            want = FP8_PB_WO.engine_method if call["value"] else "bf16"
            if linear is not None and linear.fmt != want:
                notes.append((f"layers.{call['layer']}.self_attn.",
                              f"layer {call['layer']} {call['proj']}: resolves {call['value'] or 'unquantized'}, "
                              f"stored {linear.fmt}"))
        elif call.get("kinds") and names:
            missing = [k for k in call["kinds"]
                       if not any(n.endswith(f"layers.{call['layer']}.block_sparse_moe.experts.0.w1.{k}") for n in names)]
            if missing:
                notes.append((f"layers.{call['layer']}.block_sparse_moe.experts.",
                              f"layer {call['layer']} experts: TensorRT-LLM's {call['value']} spec reads "
                              f"{', '.join(missing)}; the export has none"))
    return notes


def run_cell(r: Replayed, cell: Cell, export: Path) -> dict:
    from modelopt_k3.check import check_export
    from modelopt_k3.check.layout import scan_export

    replayed = replay_export(r, export)
    layout, reader = scan_export(export)
    with reader:
        checked = check_calls(layout, replayed["calls"])
        notes = header_notes(layout, replayed["calls"])
    full = check_export(export, ("trtllm",)).results["trtllm"]
    differ = compare(replayed["calls"], checked)
    differ += [f"headers: {note}, but the check refuses nothing under {scope}" for scope, note in notes
               if not any(scope in refusal.tensor for refusal in full.refusals)]
    trt_warns = any("group_size:" in line for line in replayed["log"] if line.startswith("warning"))
    check_warns = any("group_size" in w for w in full.warnings)
    if trt_warns != check_warns:
        differ.append(f"group_size warning: TensorRT-LLM {'warns' if trt_warns else 'does not warn'} "
                      f"(warn_if_inline_diverges), the check {'warns' if check_warns else 'does not'}")
    if replayed["outcome"] == "raises" and full.verdict != "refuses":
        differ.append(f"TensorRT-LLM raises ({replayed['first_raised'][:120]}), the check says {full.verdict!r}")
    replay_keys = ("outcome", "first_raised", "quant_source", "quant_algo", "log")
    return {"id": cell.id, "how": cell.how, "recipe": cell.recipe, "tiny": cell.tiny, "about": cell.about,
            "replay": {k: replayed[k] for k in replay_keys if k in replayed},
            "calls": {call_key(a): answer(a) for a in replayed["calls"]},
            "headers": [note for _, note in notes],
            "check": {"verdict": full.verdict,
                      **({"first": f"{full.refusals[0].tensor}: {full.refusals[0].reason}"[:400]}
                         if full.refusals else {})},
            "disagreements": differ}


def replay_matrix(defs: dict[str, dict[str, ast.stmt]], work: Path, cell_ids: list[str] | None, *,
                  reuse_exports: bool, say=print) -> dict:
    """The replay of every cell (or of ``cell_ids``) with the definitions ``load_tree`` checked."""
    from .drivers.stub_list import STUBS
    from .matrix import build_export

    r = build_namespace(defs)
    built: dict[str, Path] = {}
    rows = []
    for cell in REPLAY_CELLS:
        if cell_ids and cell.id not in cell_ids:
            continue
        say(f"[trtllm replay] {cell.id}")
        rows.append(run_cell(r, cell, build_export(cell, work, built, reuse=reuse_exports)))
    return {"sources": [{"file": f, "read": SOURCES[f], "definitions": sorted(PINNED[f])} for f in PINNED],
            "stubs": [{"name": n, "why": w} for n, w in STUBS["trtllm"]], "cells": rows}


# ----------------------------------------------------------------------------------------- report


def markdown(replay: dict) -> str:
    """The report's generated TensorRT-LLM section (``report.markdown`` appends it)."""
    from .report import REPLAY_SECTION

    lines = [REPLAY_SECTION, "",
             "Generated by `python -m tools.conformance.trtllm --trtllm_src DIR`: TensorRT-LLM's own Kimi-K3 "
             "quantization and name-resolution functions, parsed from the given tree, fingerprint-checked and run "
             "unmodified over each export's hf_quant_config.json / config.json, per decoder layer as the model's "
             "constructors call them; each answer is compared with what `modelopt-k3-check --engine trtllm` resolves "
             "for the same call. **raises** / **resolves** is TensorRT-LLM's outcome; the check column is its full "
             "verdict (which also covers weight loading, not replayed).", "",
             "| cell | TensorRT-LLM replay | check | calls that disagree |", "|---|---|---|---|"]
    for row in replay["cells"]:
        first = f" (`{row['replay']['first_raised'][:140]}`)" if row["replay"].get("first_raised") else ""
        lines.append(f"| `{row['id']}` | {row['replay']['outcome']}{first} | {row['check']['verdict']} | "
                     f"{len(row['disagreements'])} |")
    n = sum(len(r["disagreements"]) for r in replay["cells"])
    lines += ["", f"Disagreements: {n}.", ""]
    for row in replay["cells"]:
        if row["disagreements"] or row["headers"] or row["replay"]["outcome"] == "raises":
            lines.append(f"- `{row['id']}` ({row['about']}):")
            lines += [f"  - disagrees: {d}" for d in row["disagreements"]]
            lines += [f"  - headers: {h}" for h in row["headers"][:4]]
            if row["check"].get("first"):
                lines.append(f"  - check: {row['check']['first'][:220]}")
    lines += ["", "Replayed definitions (pinned by the sha256 of their `ast.unparse` without docstrings, `tools/conformance/trtllm.py` "
                  "`PINNED`):", ""]
    for src in replay["sources"]:
        lines.append(f"- `{src['file']}` ({src['read']}): " + ", ".join(f"`{d}`" for d in src["definitions"]))
    lines += ["", "Stubs (everything else the replayed code names):", ""]
    lines += [f"- `{s['name']}`: {s['why']}" for s in replay["stubs"]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- command


def parse_args(argv: list[str] | None = None):
    import argparse

    p = argparse.ArgumentParser(prog="python -m tools.conformance.trtllm",
                                description="Run TensorRT-LLM's own Kimi-K3 quantization/name-resolution functions "
                                            "(from a TensorRT-LLM source tree) over the conformance exports and "
                                            "compare with modelopt-k3-check --engine trtllm; exits 1 on any "
                                            "disagreement.")
    p.add_argument("--trtllm_src", type=Path, required=True,
                   help="a TensorRT-LLM source tree holding the pinned definitions (docs/ENGINE_CONFORMANCE.md)")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "modelopt_k3" / "conformance",
                   help="scratch directory for the tiny checkpoints and the exports")
    p.add_argument("--cells", default=None, help=f"comma-separated subset of: {', '.join(REPLAY_CELL_BY_ID)}")
    p.add_argument("--reuse_exports", action="store_true",
                   help="keep the exports a previous run under --work finished building (same code only)")
    p.add_argument("--out", type=Path, default=Path("conformance-out"),
                   help=f"directory for the results ({JSON_NAME}, {DOC_NAME}); the committed files are untouched")
    p.add_argument("--update_committed", action="store_true",
                   help="also write the TensorRT-LLM rows into the committed matrix and report (a --cells subset "
                        "updates its rows)")
    args = p.parse_args(argv)
    args.cell_ids = [c.strip() for c in args.cells.split(",") if c.strip()] if args.cells is not None else None
    if args.cell_ids is not None:
        unknown = [c for c in args.cell_ids if c not in REPLAY_CELL_BY_ID]
        if unknown or not args.cell_ids:
            p.error(f"--cells: unknown cell id(s) {unknown or args.cells!r}; known: {', '.join(REPLAY_CELL_BY_ID)}")
    try:
        args.tree = load_tree(args.trtllm_src)
    except TreeError as e:
        p.error(str(e))
    from modelopt_k3.files.paths import OWNED_RECORD, DestinationError, check_owned_dir

    try:
        check_owned_dir(args.out, [JSON_NAME, DOC_NAME, OWNED_RECORD], flag="--out")
    except DestinationError as e:
        p.error(str(e))
    return args


def merge_replay(old: dict | None, fresh: dict) -> dict:
    """``old``'s rows with ``fresh``'s replacing them (``REPLAY_CELLS`` order)."""
    rows = {r["id"]: r for r in (old or {}).get("cells", [])}
    rows.update({r["id"]: r for r in fresh["cells"]})
    rank = {c: i for i, c in enumerate(REPLAY_CELL_BY_ID)}
    return {**fresh, "cells": sorted(rows.values(), key=lambda r: (rank.get(r["id"], len(rank)), r["id"]))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from modelopt_k3.files.paths import write_owned

    from .report import write_report
    from .run import COMMITTED_DOC, COMMITTED_JSON

    replay = replay_matrix(args.tree, args.work, args.cell_ids, reuse_exports=args.reuse_exports)
    write_owned(args.out, {JSON_NAME: (json.dumps(replay, indent=1) + "\n").encode(),
                           DOC_NAME: (markdown(replay) + "\n").encode()}, flag="--out")
    print(f"wrote {args.out / JSON_NAME} and {args.out / DOC_NAME}")
    if args.update_committed:
        doc = json.loads(COMMITTED_JSON.read_text())
        doc["trtllm_replay"] = merge_replay(doc.get("trtllm_replay") if args.cell_ids else None, replay)
        write_report(doc, COMMITTED_JSON, COMMITTED_DOC, order=[c.id for c in CELLS],
                     keep_sections_of=COMMITTED_DOC, generated=doc.get("generated"))
        print(f"updated {COMMITTED_JSON} and {COMMITTED_DOC}")
    found = [(r["id"], d) for r in replay["cells"] for d in r["disagreements"]]
    if found:
        print(f"{len(found)} disagreement(s) between TensorRT-LLM's functions and modelopt-k3-check: "
              + "; ".join(f"{c}: {d}" for c, d in found), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
