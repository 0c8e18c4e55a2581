"""Patch the checkpoint's own remote modeling code so its MoE block holds fused experts.

We do not vendor a copy of the modeling code: the block class is found in the module that the
checkpoint's ``auto_map`` class was loaded from (each checkpoint revision gets its own dynamic
module), and the module-level name ``KimiSparseMoeBlock`` is rebound to a subclass whose ``experts``
is a ``KimiK3Experts`` and whose ``moe_infer`` dispatches through transformers' experts interface.
Blocks built before the patch keep their class and therefore their own forward. The patch does not
depend on the run: a patched block holds every expert, and ``place_experts`` keeps one rank's block on
the built model's own instances, so models with different placements can live in one process.
Re-running is a no-op; everything is validated before anything is changed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from torch import nn

from ...checkpoint import CheckpointReader
from ...dist.placement import ExpertPlacement
from ...numerics.constants import MXFP4_BLOCK
from ...spec import PrepareContext, SpecError
from .converters import kimi_k3_converters
from .shims import apply_class_shims

BLOCK_CLASS = "KimiSparseMoeBlock"
EXPERT_CLASS = "KimiBlockSparseMLP"  # one routed expert of the remote code (kimi_k3_reference.md)
SUPPORTED_SOURCE_FORMATS = frozenset({"mxfp4-pack-quantized"})
_PATCH_FLAG = "_modelopt_k3_fused"


def find_block_module(model_cls: type) -> ModuleType:
    """The module of the checkpoint's remote code that defines the MoE block class."""
    package = model_cls.__module__.rpartition(".")[0]
    candidates = [sys.modules.get(model_cls.__module__)]
    candidates += [m for name, m in list(sys.modules.items()) if name.startswith(package + ".")]
    for module in candidates:
        block = getattr(module, BLOCK_CLASS, None) if module is not None else None
        if isinstance(block, type):
            original = getattr(block, "_modelopt_k3_original", block)
            if sys.modules.get(original.__module__) is not None:
                return sys.modules[original.__module__]
    raise SpecError(
        f"no module of {model_cls.__module__!r}'s remote code defines {BLOCK_CLASS}; "
        "is this a Kimi-K3 checkpoint?"
    )


def parse_source_scheme(config) -> str | None:
    """The compressed-tensors format of the routed experts, or None for an unquantized checkpoint."""
    qcfg = getattr(config, "quantization_config", None)
    if qcfg is None:
        text = getattr(config, "text_config", None)
        qcfg = getattr(text, "quantization_config", None)
    if qcfg is None:
        return None
    if not isinstance(qcfg, dict):
        qcfg = qcfg.to_dict() if hasattr(qcfg, "to_dict") else dict(qcfg)
    from compressed_tensors.quantization import QuantizationConfig

    try:
        parsed = QuantizationConfig.model_validate(qcfg)
    except Exception as e:  # pydantic raises its own ValidationError; report it as ours
        raise SpecError(f"cannot parse the checkpoint's quantization_config: {e}") from None
    if parsed.quant_method != "compressed-tensors":
        raise SpecError(f"quantization_config has quant_method {parsed.quant_method!r}, not 'compressed-tensors'")
    # The top-level format counts too (compressed-tensors picks the compressor by it); pydantic lets any string through.
    formats = {g.format or parsed.format for g in parsed.config_groups.values()} | {parsed.format}
    formats.discard(None)
    if not formats:
        formats = {parsed.format}
    unsupported = formats - SUPPORTED_SOURCE_FORMATS
    if unsupported or len(formats) != 1:
        raise SpecError(
            f"unsupported compressed scheme {sorted(map(str, formats))} in quantization_config; "
            f"Kimi-K3's converters decompress {sorted(SUPPORTED_SOURCE_FORMATS)}"
        )
    for name, group in parsed.config_groups.items():
        w = group.weights
        if w is None or (w.num_bits, str(w.type), w.group_size) != (4, "float", MXFP4_BLOCK):
            raise SpecError(f"quantization_config group {name!r} is not MXFP4 (4-bit float, group {MXFP4_BLOCK}): {w}")
    return formats.pop()


def make_fused_block(original: type) -> type:
    """A subclass of the remote MoE block whose experts are one ``KimiK3Experts`` holding every expert."""
    # Imported when a model is built: transformers' experts interface imports torch's compiler stack (~0.5 s),
    # which the streaming converter and the checks never use.
    from .experts import KimiK3Experts

    class FusedKimiSparseMoeBlock(original):
        _modelopt_k3_fused = True
        _modelopt_k3_original = original

        def __init__(self, config, *args, **kwargs):
            with _one_expert_module(sys.modules[original.__module__]):
                super().__init__(config, *args, **kwargs)
            act_fn = self.experts[0].act_fn  # the remote SituAndMul with this config's betas
            self.experts = KimiK3Experts(
                config,
                num_experts=config.num_experts,
                hidden_dim=config.routed_expert_hidden_size or config.hidden_size,
                intermediate_dim=config.moe_intermediate_size,
                act_fn=act_fn,
            )
            # One expert module stood for all while building: none may be kept twice (shared by two owners).
            kept = [id(m) for _, m in self.named_modules(remove_duplicate=False)]
            if len(kept) != len(set(kept)):
                raise SpecError(f"{original.__name__} keeps one {EXPERT_CLASS} in two places; cannot fuse it")

        def moe_infer(self, x, topk_ids, topk_weight):
            # Same contract as the remote moe_infer: latent x [N, Dl], global ids, fp32 weights.
            return self.experts(x, topk_ids, topk_weight)

        def moe_train(self, x, topk_ids, topk_weight):
            return self.experts(x, topk_ids, topk_weight)

    FusedKimiSparseMoeBlock.__name__ = FusedKimiSparseMoeBlock.__qualname__ = BLOCK_CLASS
    FusedKimiSparseMoeBlock.__module__ = original.__module__
    return FusedKimiSparseMoeBlock


@contextmanager
def _one_expert_module(module: ModuleType) -> Iterator[None]:
    """While the remote block builds its per-expert list (replaced right after by the fused experts, of
    which only ``act_fn`` is kept), build one expert module per distinct set of arguments and hand it back
    for every other expert.

    Building every expert (three ``nn.Linear`` each, ~60 per layer in the tiny model, 384 per layer in
    Kimi-K3) is the one part of building on meta that grows with the expert count; nothing of it survives.
    """
    cls = getattr(module, EXPERT_CLASS, None)
    if not isinstance(cls, type):
        yield
        return
    built: dict[tuple, nn.Module] = {}

    def one_per_arguments(config, *args, **kwargs):
        key = (id(config), args, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = cls(config, *args, **kwargs)
        return built[key]

    setattr(module, EXPERT_CLASS, one_per_arguments)
    try:
        yield
    finally:
        setattr(module, EXPERT_CLASS, cls)


def _packed_experts(ctx: PrepareContext) -> bool:
    """Whether the routed experts are stored MXFP4-packed: as the caller's source check found, else checked here."""
    if ctx.packed_experts is not None:
        return ctx.packed_experts
    if ctx.checkpoint is None:
        raise SpecError("Kimi-K3 prepare needs the checkpoint path (to validate its experts before patching)")
    from ...checkpoint.source_check import (
        check_experts,  # not checked by the caller (load_pretrained checks first)
    )
    from . import KIMI_K3_SPEC

    with CheckpointReader(ctx.checkpoint) as reader:
        return check_experts(reader.headers(), ctx.config.to_dict(), KIMI_K3_SPEC).packed_experts


def checkpoint_converters(ctx: PrepareContext) -> list:
    """The spec's conversion mapping (``LoadingSpec.converters``): per-expert w1/w3 -> ``gate_up_proj``, w2 ->
    ``down_proj``, decoding MXFP4 when the experts are stored packed."""
    return kimi_k3_converters(packed=_packed_experts(ctx))


def prepare(ctx: PrepareContext) -> None:
    if ctx.checkpoint is None:
        raise SpecError("Kimi-K3 prepare needs the checkpoint path (to validate its experts before patching)")
    module = find_block_module(ctx.model_cls)
    text_config = getattr(ctx.config, "text_config", ctx.config)
    scheme = parse_source_scheme(ctx.config)
    packed = _packed_experts(ctx)
    if packed and scheme is None:
        raise SpecError("routed experts are stored MXFP4-packed but the config has no quantization_config")

    apply_class_shims(ctx.model_cls)  # the hub's transformers-4-era calls, where this transformers needs them
    current = getattr(module, BLOCK_CLASS)
    original = getattr(current, "_modelopt_k3_original", current)
    if not getattr(current, _PATCH_FLAG, False):
        setattr(module, BLOCK_CLASS, make_fused_block(original))
    # transformers validates the implementation while the model is constructed and, for remote-code
    # classes, rejects grouped_mm (its check greps the class source for the decorator). Construct with
    # eager; set_experts_implementation() installs the plan's choice on the built model.
    text_config._experts_implementation = "eager"


def unprepare(model_cls: type) -> None:
    """Restore the remote block class (tests and long-lived processes that switch plans)."""
    module = find_block_module(model_cls)
    current = getattr(module, BLOCK_CLASS)
    setattr(module, BLOCK_CLASS, getattr(current, "_modelopt_k3_original", current))


def place_experts(model: nn.Module, placement: ExpertPlacement) -> None:
    """Keep ``placement``'s experts in every fused MoE block of ``model`` (``ExpertsSpec.place_experts``).

    The block's own ``ep_size``/``ep_rank``/``experts_per_rank`` (the remote code's names) follow it.
    """
    for block in model.modules():
        if getattr(type(block), _PATCH_FLAG, False):
            block.experts.place(placement)
            block.ep_size, block.ep_rank = placement.ep_size, placement.ep_rank
            block.experts_per_rank = placement.per_rank
