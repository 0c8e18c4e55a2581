"""Generator for a tiny Kimi-K3 stand-in checkpoint directory (the fixture every test uses).

The directory looks like the real one: config.json with auto_map and the real-style MXFP4
quantization_config inside text_config, the remote code, a tokenizer, sharded safetensors with an
index, routed experts stored only as MXFP4 `weight_packed`/`weight_scale`, F32 tensors where the
real checkpoint has them, and `A_log` stored `[head_dim]` zero-padded although the code declares
`[num_heads]`. Weights are deterministic in `seed` and in each tensor's name. In every MoE layer one
expert's w3 and another's w1 have a larger top E8M0 exponent than their partner (`raised_gate_up_expert`),
so a shared w1/w3 scale taken from one projection alone gives a different answer.

The remote code comes in two variants (`remote_code=`): "hub" (default), the transformers-4-era API calls
the hub's files make, which break on transformers 5.x without our shims; and "transformers5", the same
code with llm-compressor's compatibility edits (the calls rewritten for transformers 5). The default is
what a user downloads from the hub.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from modelopt_k3.testing.tokenizer import make_byte_tokenizer

REMOTE_CODE_DIR = Path(__file__).parent / "remote_code"
REMOTE_CODE_FILES = ("configuration_kimi_k3.py", "modeling_kimi_linear.py", "modeling_kimi_k3.py")

# "transformers5" variant: (file, hub line(s), rewritten line(s)), each applied exactly once. These are the
# edits llm-compressor's vendored copy lists in its header for transformers 5 compatibility.
TRANSFORMERS5_EDITS: tuple[tuple[str, str, str], ...] = (
    (
        "modeling_kimi_linear.py",
        "from transformers.utils.generic import OutputRecorder, check_model_inputs\n",
        "from transformers.utils.generic import check_model_inputs\n"
        "from transformers.utils.output_capturing import OutputRecorder\n",
    ),
    (
        "modeling_kimi_linear.py",
        "    def get_mask_sizes(self, cache_position: torch.Tensor, layer_idx: int) -> tuple[int, int]:\n"
        '        """(kv_length, kv_offset) of the mask; transformers 4 hands over the cache_position tensor."""\n'
        "        new_tokens = len(cache_position)\n",
        "    def get_query_offset(self, layer_idx: int = 0) -> int:\n"
        "        return self.get_seq_length(layer_idx)\n\n"
        "    def get_mask_sizes(self, cache_position: int | torch.Tensor, layer_idx: int) -> tuple[int, int]:\n"
        '        """(kv_length, kv_offset) of the mask; transformers 5 passes the query length as an int."""\n'
        "        new_tokens = cache_position if isinstance(cache_position, int) else len(cache_position)\n",
    ),
    (
        "modeling_kimi_linear.py",
        "        # Hub behaviour: flash attention is imposed, whatever the caller asked for.\n"
        '        requested = getattr(config, "_attn_implementation", None)\n'
        "        if requested is not None:\n"
        "            if requested != FLASH:\n"
        '                logger.warning_once(f"KimiLinearModel: attention implementation {requested!r} replaced by {FLASH}")\n'
        '            config._attn_implementation = "flash_attention_2"\n',
        "        # flash_attention_2 only where flash-attn is installed.\n"
        "        from transformers.utils import is_flash_attn_2_available\n\n"
        '        requested = getattr(config, "_attn_implementation", None)\n'
        '        if requested not in (None, "flash_attention_2") or not is_flash_attn_2_available():\n'
        '            config._attn_implementation = requested if requested not in (None, "flash_attention_2") else "eager"\n'
        "        else:\n"
        '            config._attn_implementation = "flash_attention_2"\n',
    ),
    (
        "modeling_kimi_linear.py",
        "            input_embeds=inputs_embeds,\n"
        "            attention_mask=attention_mask,\n"
        "            cache_position=cache_position,\n",
        "            inputs_embeds=inputs_embeds,\n"
        "            attention_mask=attention_mask,\n",
    ),
    (
        "modeling_kimi_linear.py",
        '    _tied_weights_keys = ["lm_head.weight"]\n',
        '    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}\n',
    ),
    (
        "modeling_kimi_k3.py",
        "    def tie_weights(self):\n        return self.language_model.tie_weights()\n",
        "    def tie_weights(self, **kwargs):\n        return self.language_model.tie_weights(**kwargs)\n",
    ),
)
REMOTE_CODE_VARIANTS = ("hub", "transformers5")

# Special tokens follow the 256 byte tokens of the tokenizer.
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, MEDIA_TOKEN_ID = 256, 257, 258, 259

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    # 1-indexed, as in the real config: layers 0-2 KDA, layer 3 MLA.
    "kda_layers": [1, 2, 3],
    "full_attn_layers": [4],
    "linear_num_heads": 2,
    "linear_head_dim": 32,
    "short_conv_kernel_size": 4,
    "gate_lower_bound": -5.0,
    "use_full_rank_gate": True,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 64,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "routed_expert_hidden_size": 64,
    "latent_moe_use_norm": True,
    "attn_res_block_size": 2,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "num_expert_group": 1,
    "topk_group": 1,
    "mla_use_output_gate": True,
    # vision tower / projector (never executed by text-only forwards, but present with real names)
    "vt_hidden_size": 32,
    "vt_num_hidden_layers": 1,
    "vt_num_attention_heads": 2,
    "vt_intermediate_size": 64,
    "qkv_hidden_size": 32,
    "patch_size": 14,
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "mm_hidden_size": 32,
}

MXFP4_GROUP = 32
# Tensors the real checkpoint stores in F32 (everything else dense is BF16).
_F32_SUFFIXES = (".A_log", ".dt_bias", ".e_score_correction_bias", "_conv1d.weight", ".o_norm.weight")


def mxfp4_quantization_config(ignore: list[str]) -> dict[str, Any]:
    """The checkpoint's compressed-tensors MXFP4 quantization_config (FORMATS.md)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": MXFP4_GROUP,
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "torch.uint8",
                },
            }
        },
        "ignore": ignore,
    }


def _text_config(s: dict[str, Any]) -> dict[str, Any]:
    keys = [
        "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "num_experts", "num_experts_per_token", "moe_intermediate_size", "num_shared_experts",
        "first_k_dense_replace", "moe_layer_freq", "routed_expert_hidden_size", "latent_moe_use_norm",
        "attn_res_block_size", "hidden_act", "activation_situ_beta", "activation_situ_linear_beta",
        "rms_norm_eps", "tie_word_embeddings", "moe_router_activation_func", "moe_renormalize",
        "routed_scaling_factor", "num_expert_group", "topk_group", "mla_use_output_gate",
    ]  # fmt: skip
    cfg = {k: s[k] for k in keys}
    cfg.update(
        model_type="kimi_linear",
        architectures=["KimiLinearForCausalLM"],
        head_dim=s["hidden_size"] // s["num_attention_heads"],
        mla_use_nope=True,
        linear_attn_config={
            "kda_layers": list(s["kda_layers"]),
            "full_attn_layers": list(s["full_attn_layers"]),
            "num_heads": s["linear_num_heads"],
            "head_dim": s["linear_head_dim"],
            "short_conv_kernel_size": s["short_conv_kernel_size"],
            "gate_lower_bound": s["gate_lower_bound"],
            "use_full_rank_gate": s["use_full_rank_gate"],
        },
        use_grouped_topk=True,
        topk_method="noaux_tc",
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        use_cache=True,
        initializer_range=0.02,
        max_position_embeddings=4096,
        rope_theta=50000.0,
        num_nextn_predict_layers=0,
        dtype="bfloat16",
    )
    return cfg


def _vision_config(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "patch_size": s["patch_size"],
        "init_pos_emb_height": s["init_pos_emb_height"],
        "init_pos_emb_width": s["init_pos_emb_width"],
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "vt_num_attention_heads": s["vt_num_attention_heads"],
        "vt_num_hidden_layers": s["vt_num_hidden_layers"],
        "vt_hidden_size": s["vt_hidden_size"],
        "vt_intermediate_size": s["vt_intermediate_size"],
        "qkv_hidden_size": s["qkv_hidden_size"],
        "norm_type": "rmsnorm",
        "attn_bias": False,
        "patch_embed_proj_bias": False,
        "mlp_type": "mlp2",
        "linear_bias": False,
        "activation_func": "gelu_pytorch_tanh",
        "pos_emb_interpolation_mode": "bilinear",
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": s["mm_hidden_size"],
        "projector_hidden_act": "gelu",
        "text_hidden_size": s["hidden_size"],
        "projector_ln_eps": 1e-5,
        "_attn_implementation": "eager",
    }


def checkpoint_config(s: dict[str, Any]) -> dict[str, Any]:
    """config.json for resolved sizes ``s`` (without the quantization_config, which needs the module tree)."""
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        "text_config": _text_config(s),
        "vision_config": _vision_config(s),
        "ignore_index": -100,
        "media_placeholder_token_id": MEDIA_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _is_routed_expert(name: str) -> bool:
    return ".block_sparse_moe.experts." in name


def _ignore_list(module_types: dict[str, str]) -> list[str]:
    """Like the real ignore list: every plain Linear except routed experts, latent projections and
    the AttnRes projections (stored plain but not named, as in the real checkpoint), plus routers."""
    ignore = []
    for name, kind in module_types.items():
        if kind == "KimiMoEGate":
            ignore.append(name)
        elif kind == "Linear" and not _is_routed_expert(name):
            if ".routed_expert_" in name or name.endswith("_res_proj"):
                continue
            ignore.append(name)
    return ignore


def _build_meta_model(config_dict: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """Instantiate the stand-in remote code on the meta device: parameter names/shapes come from it.

    The stand-in imports fla-core's kernels and makes the hub's transformers-4-era calls, so it needs the
    same import and class shims here as when a checkpoint is loaded.
    """
    from modelopt_k3.models.kimi_k3.shims import apply_class_shims, apply_import_shims

    apply_import_shims(REMOTE_CODE_DIR)
    from modelopt_k3.testing.remote_code.configuration_kimi_k3 import KimiK3Config
    from modelopt_k3.testing.remote_code.modeling_kimi_k3 import KimiK3ForConditionalGeneration

    apply_class_shims(KimiK3ForConditionalGeneration)

    cfg = copy.deepcopy(config_dict)
    for key in ("model_type", "architectures", "auto_map", "transformers_version"):
        cfg.pop(key, None)
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(KimiK3Config(**cfg))
    module_types = {name: type(mod).__name__ for name, mod in model.named_modules() if name}
    return model, module_types


def _tensor_generator(seed: int, name: str) -> torch.Generator:
    # Per-tensor seeding: a tensor's values depend only on (seed, name, shape), not on other sizes.
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _stored_shape(name: str, shape: tuple[int, ...], linear_head_dim: int) -> tuple[int, ...]:
    """The shape the real checkpoint stores: ``A_log`` as ``[head_dim]`` although declared ``[num_heads]``."""
    return (linear_head_dim,) if name.endswith(".A_log") else shape


def _dense_value(name: str, shape: tuple[int, ...], gen: torch.Generator, num_kda_heads: int) -> torch.Tensor:
    """A numerically sane fp32 value for a dense parameter (later cast to BF16/F32)."""
    if name.endswith(".A_log"):
        # [head_dim]; the code reads the first num_heads entries; the rest are zero as in the real checkpoint.
        value = torch.zeros(shape)
        value[:num_kda_heads] = torch.empty(num_kda_heads).uniform_(1.0, 16.0, generator=gen).log()
        return value
    randn = torch.randn(shape, generator=gen)
    if name.endswith(".dt_bias"):
        return 0.1 * randn
    if name.endswith(".e_score_correction_bias"):
        return 0.02 * randn  # small: keeps the expert load roughly balanced
    if name.endswith("pos_emb.weight"):
        return 0.02 * randn
    if name.endswith("norm.weight") or name.endswith(("layernorm.weight", ".norm0.weight", ".norm1.weight")):
        return 1.0 + 0.05 * randn
    if name.endswith("embed_tokens.weight"):
        return randn
    if name.endswith("_conv1d.weight"):
        return randn / math.sqrt(shape[-1])
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return randn / math.sqrt(fan_in)


def _mxfp4_expert_weight(
    out_features: int, in_features: int, gen: torch.Generator, raised: bool = False
) -> dict[str, torch.Tensor]:
    """Random packed E2M1 codes + E8M0 exponents whose decoded values have std ~ 1/sqrt(in).

    ``raised``: the first block's exponent is base + 2, one above what the jitter reaches
    (``raised_gate_up_expert``); the random draws are the same either way.
    """
    if in_features % MXFP4_GROUP:
        raise ValueError(f"expert in_features {in_features} must be a multiple of {MXFP4_GROUP}")
    packed = torch.randint(0, 256, (out_features, in_features // 2), generator=gen, dtype=torch.uint8)
    # Make sure every one of the 16 nibble codes appears (low and high) at least once.
    codes = torch.arange(16, dtype=torch.uint8)
    n = min(16, packed.numel())
    packed.view(-1)[:n] = (codes[:n] | (codes.flip(0)[:n] << 4)).to(torch.uint8)
    # E2M1 codes drawn uniformly have RMS ~2.9: scale by 2^-e with 2^e ~ 2.9*sqrt(in), jitter +-1.
    base = 127 - round(math.log2(2.9 * math.sqrt(in_features)))
    jitter = torch.randint(-1, 2, (out_features, in_features // MXFP4_GROUP), generator=gen)
    if raised:
        jitter.view(-1)[0] = 2
    scale = (base + jitter).to(torch.uint8)
    return {"weight_packed": packed, "weight_scale": scale}


_GATE_UP_RE = re.compile(r"\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<proj>w[13])\.weight$")


def raised_gate_up_expert(layer: int, num_experts: int) -> dict[str, int]:
    """Per MoE layer, the expert whose w3 (``"w3"``) and the one whose w1 (``"w1"``, when there are two
    experts or more) hold one E8M0 exponent above the jitter range of ``_mxfp4_expert_weight``.

    Why: with jitter alone w1 and w3 of every expert share their largest exponent, so nothing could tell
    an expert's shared ``weight_scale_2`` (the max over w1 and w3) from w1's or w3's own. These experts
    make the max come from w3 in one and from w1 in another, in every layer.
    """
    raised = {"w3": layer % num_experts}
    if num_experts > 1:
        raised["w1"] = (layer + num_experts // 2) % num_experts
    return raised


def _raised(name: str, num_experts: int) -> bool:
    """Whether routed-expert parameter ``name`` is one ``raised_gate_up_expert`` picks."""
    m = _GATE_UP_RE.search(name)
    return m is not None and raised_gate_up_expert(int(m["layer"]), num_experts).get(m["proj"]) == int(m["e"])


def _checkpoint_tensors(
    model: Any, seed: int, num_kda_heads: int, linear_head_dim: int, num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) in module-tree order; routed experts as weight_packed/weight_scale pairs.

    Parameters only: the model's buffers are all non-persistent (never in a checkpoint).
    """
    for name, param in model.named_parameters():
        gen = _tensor_generator(seed, name)
        shape = _stored_shape(name, tuple(param.shape), linear_head_dim)
        if _is_routed_expert(name):
            if not name.endswith(".weight"):
                raise AssertionError(f"unexpected routed-expert parameter {name}")
            prefix = name[: -len(".weight")]
            mx = _mxfp4_expert_weight(shape[0], shape[1], gen, raised=_raised(name, num_experts))
            for suffix, tensor in mx.items():
                yield f"{prefix}.{suffix}", tensor
            continue
        value = _dense_value(name, shape, gen, num_kda_heads)
        dtype = torch.float32 if name.endswith(_F32_SUFFIXES) else torch.bfloat16
        yield name, value.to(dtype).contiguous()


_EXPERT_RE = re.compile(r"^(.*\.experts\.\d+)\.")


def _write_shards(
    tensors: list[tuple[str, torch.Tensor]], path: Path, max_shard_size: int | None, whole_experts: bool = False
) -> dict[str, Any]:
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    # Default: about three shards, so multi-shard handling is always exercised.
    limit = max_shard_size if max_shard_size is not None else total // 3 + 1
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for group in _shard_units(tensors, whole_experts):
        size = sum(t.numel() * t.element_size() for _, t in group)
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].extend(group)
        used += size
    if len(shards) < 2:
        raise ValueError(
            f"max_shard_size={max_shard_size} gives a single shard; the fixture needs at least 2"
        )
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(dict(shard), str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys((k for k, _ in shard), fname))
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def write_stand_in(path: Path, tensors: list[tuple[str, torch.Tensor]], config: dict[str, Any], *, vocab_size: int,
                   max_shard_size: int | None, sort_config_keys: bool = False) -> Path:
    """What every transformers-class stand-in writes: its shards and index, ``config.json``,
    ``generation_config.json`` and the byte tokenizer (the token ids above)."""
    from .tokenizer import make_byte_tokenizer

    index = _write_shards(tensors, path, max_shard_size)
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=sort_config_keys) + "\n")
    generation = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    make_byte_tokenizer(path, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID,
                        media_token_id=MEDIA_TOKEN_ID, vocab_size=vocab_size)
    return path


def _shard_units(tensors: list[tuple[str, torch.Tensor]], whole_experts: bool) -> list[list[tuple[str, torch.Tensor]]]:
    """What a shard boundary may not cut: each tensor alone, or (``whole_experts``) each routed expert's
    consecutive tensors together, as the real release stores them (ModelOpt's own converter needs w1
    and w3 of an expert in one shard)."""
    units: list[list[tuple[str, torch.Tensor]]] = []
    last = None
    for key, tensor in tensors:
        m = _EXPERT_RE.match(key) if whole_experts else None
        group = m.group(1) if m else None
        if group is not None and group == last:
            units[-1].append((key, tensor))
        else:
            units.append([(key, tensor)])
        last = group
    return units


def remote_code_source(fname: str, variant: str = "hub") -> str:
    """The text of one remote-code file in the given variant (see TRANSFORMERS5_EDITS)."""
    text = (REMOTE_CODE_DIR / fname).read_text()
    if variant == "hub":
        return text
    for target, old, new in TRANSFORMERS5_EDITS:
        if target == fname:
            if text.count(old) != 1:
                raise AssertionError(f"{fname}: the transformers5 edit does not match exactly once: {old!r}")
            text = text.replace(old, new)
    return text


def _resolve_sizes(sizes: dict[str, Any]) -> dict[str, Any]:
    unknown = set(sizes) - set(TINY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny Kimi-K3 setting(s) {sorted(unknown)}; known: {sorted(TINY_DEFAULTS)}")
    s = {**TINY_DEFAULTS, **sizes}
    n = s["num_hidden_layers"]
    if (
        "kda_layers" not in sizes
        and "full_attn_layers" not in sizes
        and n != TINY_DEFAULTS["num_hidden_layers"]
    ):
        # Keep the default pattern for other depths: last layer MLA, the rest KDA.
        s["kda_layers"] = list(range(1, n))
        s["full_attn_layers"] = [n]
    elif "full_attn_layers" not in sizes:
        s["full_attn_layers"] = [i for i in range(1, n + 1) if i not in s["kda_layers"]]
    if s["linear_num_heads"] > s["linear_head_dim"]:
        raise ValueError("linear_num_heads must be <= linear_head_dim: A_log is stored with head_dim entries")
    for key in ("routed_expert_hidden_size", "moe_intermediate_size", "hidden_size"):
        if s[key] is not None and s[key] % MXFP4_GROUP:
            raise ValueError(f"{key}={s[key]} must be a multiple of {MXFP4_GROUP} (MXFP4 group size)")
    return s


def generator_fingerprint() -> str:
    """A digest of everything that decides the generated files (this generator, the stand-in remote
    code, the tokenizer builder): a cached checkpoint is reused only while it is unchanged."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for source in sorted([here / "tiny.py", here / "tokenizer.py", *(here / "remote_code").glob("*.py")]):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:12]


def fresh_dir(path: str | Path, overwrite: bool) -> Path:
    """An empty directory at ``path`` for a generated checkpoint; a non-empty one is replaced only with
    ``overwrite``."""
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True to replace it)")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def make_tiny_kimi_k3(
    path: str | Path,
    *,
    seed: int = 0,
    overwrite: bool = False,
    max_shard_size: int | None = None,
    remote_code: str = "hub",
    whole_experts: bool = False,
    **sizes: Any,
) -> Path:
    """Write a tiny Kimi-K3 stand-in checkpoint into `path` and return it.

    `sizes` overrides TINY_DEFAULTS (e.g. num_experts=64, num_hidden_layers=6). The same seed and
    sizes give byte-identical files. `max_shard_size` is in bytes (default: about 3 shards).
    `remote_code` picks the remote-code variant: "hub" (default) or "transformers5" (module docstring).
    `whole_experts`: shards are never cut inside one routed expert (the default cuts anywhere, so that
    w1/w3 split across shards is exercised).
    """
    if remote_code not in REMOTE_CODE_VARIANTS:
        raise ValueError(f"remote_code={remote_code!r}; choose one of {list(REMOTE_CODE_VARIANTS)}")
    path = fresh_dir(path, overwrite)
    s = _resolve_sizes(sizes)

    config = checkpoint_config(s)
    text_cfg = config["text_config"]
    model, module_types = _build_meta_model(config)
    text_cfg["quantization_config"] = mxfp4_quantization_config(_ignore_list(module_types))

    tensors = list(_checkpoint_tensors(model, seed, s["linear_num_heads"], s["linear_head_dim"], s["num_experts"]))
    index = _write_shards(tensors, path, max_shard_size, whole_experts)
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation_config = {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }
    (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    for fname in REMOTE_CODE_FILES:
        (path / fname).write_text(remote_code_source(fname, remote_code))
    make_byte_tokenizer(
        path,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        media_token_id=MEDIA_TOKEN_ID,
        vocab_size=s["vocab_size"],
    )
    return path
