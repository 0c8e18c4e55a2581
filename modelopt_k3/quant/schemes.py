"""The format registry: one object per quantization format, owning everything that differs by format.

Three kinds of object, all immutable singletons:

* ``TensorFormat`` -- how one tensor role is quantized (``nvfp4``, ``fp8`` per-tensor, ``fp8_pb``
  128x128 block weight-only): its scale from an amax, its fake quant, the tensors it is exported as
  and their layout, its shape constraint and its shared-scale rule. The numerics are
  ``modelopt_k3.numerics``'; this module only chooses which call a format makes.
* ``Scheme`` -- what one Linear gets, named by its ModelOpt ``quant_algo`` (``NVFP4``,
  ``W4A16_NVFP4``, ``FP8``, ``FP8_PB_WO``): its weight and input ``TensorFormat``, its
  ``hf_quant_config`` entry, its ``quantization_config`` group (ModelOpt and compressed-tensors) and
  what serving engines ask of it (the method they load it with, the tensors they read).
* ``KvCacheFormat`` -- a KV-cache format (``fp8``): its scale numerics and config entries.

Recipes name formats by the registry keys (``TENSOR_FORMATS``, ``KV_CACHE_FORMATS``); the recipe
parser resolves each name here once (``QuantFormat``) and the objects travel from there to the
quantizers, the exporters, the streaming converter and the engine checks. Format names appear as
strings only as these keys and in serialized JSON. To add a format: a ``TensorFormat`` subclass
(numerics in ``numerics/``) and/or a ``Scheme`` registered below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics import fp8 as fp8n
from ..numerics import nvfp4 as nvn
from ..numerics.constants import FP8_BLOCK, NVFP4_BLOCK

# (suffix, dtype, shape) of one exported tensor of a quantized Linear.
TensorLayout = list[tuple[str, torch.dtype, tuple[int, ...]]]


class FormatError(ValueError):
    """A format name that is not registered; the message lists the registered ones."""


@dataclass(frozen=True, repr=False)
class TensorFormat:
    """How one tensor (a Linear's weight or input) is quantized. Subclasses hold the numerics calls."""

    name: str  # the recipe spelling (the registry key)
    # An amax-derived per-tensor scale (observed weights, calibrated inputs); False for block formats,
    # whose scales come from each block alone (nothing to observe or share).
    per_tensor_scale: bool = True
    in_features_multiple: int = 1  # in_features must be a multiple of this (the NVFP4 block)
    # Whether a shared-input group (quant/shared_inputs.py) shares this weight's global and input scales.
    shares_group_scales: bool = False
    # Whether a weight can be the lossless cast of MXFP4 source bytes (numerics/convert.py).
    casts_from_mxfp4: bool = False
    # The (rows, cols) block of a block-FP8 source (E4M3 codes, one multiplying scale per block) this format
    # holds byte for byte (``block_fp8_tensors``); None: it cannot.
    holds_block_fp8: tuple[int, int] | None = None
    quantizes_inputs: bool = True  # usable for a Linear's inputs
    group_size: int | None = None  # the ``group_size`` hf_quant_config writes for it
    # The exported tensor holding the per-tensor weight scale engines take the max of (None: block scales).
    global_scale_key: str | None = None
    # How serving engines merge differing per-tensor weight scales of fused pieces: True, dequantize and
    # requantize each piece to the max (FP8 ``requantize_with_max_scale``); False, read every piece with
    # the max and leave the block scales as written (NVFP4 ``process_weights_after_loading``).
    fused_requantized: bool = False

    def __repr__(self) -> str:
        return repr(self.name)

    def __str__(self) -> str:
        return self.name

    def scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The per-tensor scale (``weight_scale_2``/``weight_scale``/``input_scale``) of ``amax``."""
        raise NotImplementedError

    def fake_quant(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """``dequantize(quantize(x))`` as exported; ``scale`` broadcasts over ``x`` (None: block format)."""
        raise NotImplementedError

    def weight_tensors(self, weight: torch.Tensor, scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The ModelOpt tensors (``weight``, ``weight_scale``, ...) one quantized weight is exported as."""
        raise NotImplementedError

    def weight_layout(self, shape: tuple[int, int]) -> TensorLayout:
        """What ``weight_tensors`` returns for a weight ``[out, in]``, known before any value is computed."""
        raise NotImplementedError

    def cast_tensors(self, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor):
        """The exported tensors of a weight given as its codes and scales (the lossless MXFP4 cast);
        only formats with ``casts_from_mxfp4``."""
        raise NotImplementedError(f"{self.name} weights are not cast from MXFP4")

    def block_fp8_tensors(self, codes: torch.Tensor, scale_inv: torch.Tensor) -> dict[str, torch.Tensor]:
        """The exported tensors of a weight stored block-FP8 (``weight`` + ``weight_scale_inv`` under the block
        ``holds_block_fp8``), written as stored; only formats with ``holds_block_fp8``."""
        raise NotImplementedError(f"{self.name} weights do not hold block-FP8 source bytes")

    def matches_ct_args(self, args, role: str) -> bool:
        """Whether compressed-tensors ``QuantizationArgs`` (of a preset scheme's ``role``) mean this format."""
        raise NotImplementedError


@dataclass(frozen=True, repr=False)
class _Nvfp4(TensorFormat):
    """E2M1 codes, an E4M3 scale per 16 along in_features and an FP32 global scale (FORMATS.md NVFP4)."""

    def scale(self, amax: torch.Tensor) -> torch.Tensor:
        return nvn.nvfp4_global_scale(amax)

    # ``block_scale``: e4m3 block scales a weight calibrator chose (quant/calibrators); None derives them.
    def fake_quant(self, x: torch.Tensor, scale: torch.Tensor | None, block_scale=None) -> torch.Tensor:
        return nvn.nvfp4_fake_quant(x, scale, block_scale)

    def weight_tensors(self, weight: torch.Tensor, scale: torch.Tensor | None, block_scale=None) -> dict[str, torch.Tensor]:
        q = nvn.nvfp4_quantize(weight, scale, block_scale)
        return self.cast_tensors(q.packed, q.block_scale, q.global_scale)

    def cast_tensors(self, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor):
        return {
            "weight": packed,
            "weight_scale": block_scale,
            "weight_scale_2": global_scale.reshape(()).to(torch.float32),
        }

    def weight_layout(self, shape: tuple[int, int]) -> TensorLayout:
        out_f, in_f = shape
        return [
            ("weight", torch.uint8, (out_f, in_f // 2)),
            ("weight_scale", torch.float8_e4m3fn, (out_f, in_f // NVFP4_BLOCK)),
            ("weight_scale_2", torch.float32, ()),
        ]

    def matches_ct_args(self, args, role: str) -> bool:
        return (args.type == "float" and args.num_bits == 4 and _strategy(args) == "tensor_group"
                and args.group_size == NVFP4_BLOCK)


@dataclass(frozen=True, repr=False)
class _Fp8PerTensor(TensorFormat):
    """E4M3 values with one FP32 scale ``amax / 448`` per tensor."""

    def scale(self, amax: torch.Tensor) -> torch.Tensor:
        return fp8n.fp8_scale(amax)

    def fake_quant(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if scale is not None and scale.numel() > 1:  # [E, out, in] experts, one scale each ([E] or [E, 1, 1])
            return torch.stack([fp8n.fp8_fake_quant_per_tensor(w, s) for w, s in zip(x, scale.reshape(-1))])
        return fp8n.fp8_fake_quant_per_tensor(x, scale)

    def weight_tensors(self, weight: torch.Tensor, scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        w, s = fp8n.fp8_quantize_per_tensor(weight, scale)
        return {"weight": w, "weight_scale": s.reshape(()).to(torch.float32)}

    def weight_layout(self, shape: tuple[int, int]) -> TensorLayout:
        return [("weight", torch.float8_e4m3fn, tuple(shape)), ("weight_scale", torch.float32, ())]

    def matches_ct_args(self, args, role: str) -> bool:
        return args.type == "float" and args.num_bits == 8 and _strategy(args) == "tensor" and not args.dynamic


@dataclass(frozen=True, repr=False)
class _Fp8Block(TensorFormat):
    """128x128 block FP8, weight-only; partial edge blocks get their own amax-derived scale.

    ``weight_scale`` has ModelOpt's shape ``[ceil(out/128), 1, ceil(in/128), 1]`` (the amax of its
    block quantizer keeps the reduced dims: nvidia-modelopt 0.47.0
    ``TensorQuantizer._setup_for_blockquant`` reshapes to ``[R, 128, C, 128]``; vLLM's
    ``ModelOptFp8PbWoLinearMethod`` allocates exactly this shape).
    """

    def fake_quant(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            return fp8n.fp8_fake_quant_blockwise(x, block=FP8_BLOCK)
        return torch.stack([fp8n.fp8_fake_quant_blockwise(w, block=FP8_BLOCK) for w in x])  # [E, out, in]

    def weight_tensors(self, weight: torch.Tensor, scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        w, s = fp8n.fp8_quantize_blockwise(weight, block=FP8_BLOCK)
        return self.block_fp8_tensors(w, s)

    def block_fp8_tensors(self, codes: torch.Tensor, scale_inv: torch.Tensor) -> dict[str, torch.Tensor]:
        # The same numerics both ways (code * block scale in fp32), so a source's bytes are written unchanged:
        # its scales as fp32 (exact from bf16/fp16) in ModelOpt's [R, 1, C, 1] layout.
        return {"weight": codes, "weight_scale": scale_inv.to(torch.float32)[:, None, :, None].contiguous()}

    def weight_layout(self, shape: tuple[int, int]) -> TensorLayout:
        out_f, in_f = shape
        blocks = (-(-out_f // FP8_BLOCK), 1, -(-in_f // FP8_BLOCK), 1)  # partial edge blocks
        return [("weight", torch.float8_e4m3fn, (out_f, in_f)), ("weight_scale", torch.float32, blocks)]

    def matches_ct_args(self, args, role: str) -> bool:
        return (role == "weights" and args.type == "float" and args.num_bits == 8 and _strategy(args) == "block"
                and list(args.block_structure or []) == [FP8_BLOCK, FP8_BLOCK])


def _strategy(args) -> str:
    return getattr(args.strategy, "value", args.strategy)


NVFP4_TENSOR = _Nvfp4(
    "nvfp4", in_features_multiple=NVFP4_BLOCK, shares_group_scales=True, casts_from_mxfp4=True,
    group_size=NVFP4_BLOCK, global_scale_key="weight_scale_2",
)
# FP8 groups share too (issue 41), where ModelOpt 0.47's export skips them: every engine fuses q/k/v and gate/up
# into one parameter and requantizes unshared per-tensor FP8 scales to their max (``requantize_with_max_scale``, a
# second E4M3 rounding: 5.9% element error measured on the Qwen3-MoE stand-in). Quantizing with the max once is
# what the engines then read unchanged.
FP8_TENSOR = _Fp8PerTensor("fp8", global_scale_key="weight_scale", fused_requantized=True, shares_group_scales=True)
FP8_BLOCK_TENSOR = _Fp8Block("fp8_pb", per_tensor_scale=False, quantizes_inputs=False,
                             holds_block_fp8=(FP8_BLOCK, FP8_BLOCK))

TENSOR_FORMATS: dict[str, TensorFormat] = {f.name: f for f in (NVFP4_TENSOR, FP8_TENSOR, FP8_BLOCK_TENSOR)}
WEIGHT_FORMAT_NAMES = tuple(TENSOR_FORMATS)
INPUT_FORMAT_NAMES = tuple(name for name, f in TENSOR_FORMATS.items() if f.quantizes_inputs)


def tensor_format(name: str | TensorFormat, *, role: str = "weights") -> TensorFormat:
    """The registered format called ``name`` for ``role`` ("weights" or "inputs")."""
    if isinstance(name, TensorFormat):
        fmt = name
    elif name in TENSOR_FORMATS:
        fmt = TENSOR_FORMATS[name]
    else:
        names = WEIGHT_FORMAT_NAMES if role == "weights" else INPUT_FORMAT_NAMES
        raise FormatError(f"{role} {name!r} is not one of {list(names)}")
    if role == "inputs" and not fmt.quantizes_inputs:
        raise FormatError(f"inputs {fmt.name!r} is not one of {list(INPUT_FORMAT_NAMES)} or null")
    return fmt


def format_for_ct_args(args, role: str) -> TensorFormat | None:
    """The registered format compressed-tensors ``QuantizationArgs`` describe, or None."""
    return next((f for f in TENSOR_FORMATS.values() if f.matches_ct_args(args, role)), None)


# --------------------------------------------------------------------------- schemes (quant_algo)


@dataclass(frozen=True, repr=False)
class Scheme:
    """One ModelOpt ``quant_algo``: a weight format with an input format (None: weight-only)."""

    algo: str
    weights: TensorFormat
    inputs: TensorFormat | None
    # compressed-tensors preset this scheme is written as (None: that format cannot hold it).
    ct_preset: str | None = None
    # Whether ModelOpt's ``convert_hf_quant_config_format`` has a ``config_groups`` spelling for it.
    has_config_group: bool = True
    # The ModelOpt method vLLM/SGLang load a Linear of this algo with (their ``quant_algo`` dispatch).
    engine_method: str = ""

    def __repr__(self) -> str:
        return self.algo

    def layer_entry(self) -> dict:
        """One ``quantized_layers`` entry as ModelOpt 0.47 writes it (``process_layer_quant_config``).

        ``FP8_PB_WO`` is written upper-case, as ModelOpt's own Kimi-K3 converter writes it
        (NVIDIA/Model-Optimizer c985838ebceeeb75dad62a4fa1dc60301ca80f4d,
        ``examples/kimi/kimi_k3/quantize_to_nvfp4.py`` ``_build_hf_quant_config``); ModelOpt's generic
        export writes the format's internal name ``fp8_pb_wo``, which vLLM upper-cases anyway.
        """
        if self.weights.group_size is not None:
            return {"quant_algo": self.algo, "group_size": self.weights.group_size}
        return {"quant_algo": self.algo}

    def config_group_args(self, group_size: int | None) -> dict:
        """A ``config_groups`` entry (ModelOpt ``convert_hf_config.py`` ``_quant_algo_to_group_config``);
        ``group_size`` as the hf_quant_config entry gives it."""
        if not self.has_config_group:
            return {"quant_algo": self.algo}  # ModelOpt has no compressed-tensors spelling for it
        out: dict = {}
        if self.inputs is not None:
            out["input_activations"] = _config_args(self.inputs, group_size)
        out["weights"] = _config_args(self.weights, group_size)
        return out

    def layout(self, shape: tuple[int, int]) -> TensorLayout:
        """Every tensor one Linear ``[out, in]`` of this scheme is exported as (weight tensors, input_scale)."""
        layout = self.weights.weight_layout(shape)
        if self.inputs is not None:
            layout.append(("input_scale", torch.float32, ()))
        return layout


def _config_args(fmt: TensorFormat, group_size: int | None) -> dict:
    """ModelOpt's compressed-tensors-style arguments of one quantized tensor."""
    if fmt.group_size is not None:
        return {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size or fmt.group_size}
    return {"dynamic": False, "num_bits": 8, "type": "float"}


NVFP4 = Scheme("NVFP4", NVFP4_TENSOR, NVFP4_TENSOR, ct_preset="NVFP4", engine_method="nvfp4")
W4A16_NVFP4 = Scheme("W4A16_NVFP4", NVFP4_TENSOR, None, ct_preset="NVFP4A16", engine_method="w4a16_nvfp4")
FP8 = Scheme("FP8", FP8_TENSOR, FP8_TENSOR, engine_method="fp8")
FP8_PB_WO = Scheme("FP8_PB_WO", FP8_BLOCK_TENSOR, None, has_config_group=False, engine_method="fp8_pb")

SCHEMES: dict[str, Scheme] = {s.algo: s for s in (NVFP4, W4A16_NVFP4, FP8, FP8_PB_WO)}
_BY_TENSORS = {(s.weights, s.inputs): s for s in SCHEMES.values()}
_BY_ENGINE_METHOD = {s.engine_method: s for s in SCHEMES.values()}


def scheme_for(weights: TensorFormat, inputs: TensorFormat | None) -> Scheme:
    """The scheme of a weight format with an input format; FormatError when ModelOpt has none."""
    scheme = _BY_TENSORS.get((weights, inputs))
    if scheme is None:
        allowed = ", ".join(f"{s.weights}+{s.inputs or 'null'}" for s in SCHEMES.values())
        raise FormatError(
            f"weights={weights} with inputs={inputs or 'null'} has no ModelOpt quant_algo; "
            f"allowed (weights+inputs): {allowed}"
        )
    return scheme


def scheme_of_method(method: str) -> Scheme | None:
    """The scheme an engine method name (``Scheme.engine_method``, as ``check/`` records it) stands for."""
    return _BY_ENGINE_METHOD.get(method)


# --------------------------------------------------------------------------- KV cache


@dataclass(frozen=True, repr=False)
class KvCacheFormat:
    """A KV-cache format: one per-tensor scale per cache entry, ``k_scale``/``v_scale`` in the export."""

    name: str  # the recipe spelling
    algo: str  # hf_quant_config ``kv_cache_quant_algo``
    tensor: TensorFormat  # the numerics of the cached values

    def __repr__(self) -> str:
        return repr(self.name)

    def __str__(self) -> str:
        return self.name

    def scale_tensor(self, scale: torch.Tensor) -> torch.Tensor:
        """The exported ``k_scale``/``v_scale``: an fp32 scalar on the CPU."""
        return scale.reshape(()).to(torch.float32).cpu()

    def config_scheme(self) -> dict:
        """``config.json``'s ``kv_cache_scheme`` (ModelOpt ``convert_hf_quant_config_format``)."""
        return {"dynamic": False, "num_bits": 8, "type": "float"}


KV_FP8 = KvCacheFormat("fp8", "FP8", FP8_TENSOR)
KV_CACHE_FORMATS: dict[str, KvCacheFormat] = {KV_FP8.name: KV_FP8}
KV_CACHE_FORMAT_NAMES = tuple(KV_CACHE_FORMATS)
_KV_BY_ALGO = {f.algo: f for f in KV_CACHE_FORMATS.values()}


def kv_cache_format(name: str | KvCacheFormat) -> KvCacheFormat:
    if isinstance(name, KvCacheFormat):
        return name
    fmt = KV_CACHE_FORMATS.get(str(name).lower())
    if fmt is None:
        raise FormatError(f"kv_cache {name!r} is not supported; expected null or one of {list(KV_CACHE_FORMATS)}")
    return fmt


def kv_cache_named(algo: str | None) -> KvCacheFormat | None:
    """The KV-cache format a serialized ``kv_cache_quant_algo`` names, or None."""
    return _KV_BY_ALGO.get(str(algo).upper()) if algo else None
