"""Attach quantizers to dense Linears and to fused experts modules.

Dense ``nn.Linear``: the instance's class becomes ``QuantLinear`` (same parameters, same names), whose
forward quantizes its input and weight. Fused experts (any module following transformers' experts
interface): quantizers are submodules; the gate/up input is quantized before dispatch (a forward
pre-hook, so under ``torch_a2a`` the origin rank quantizes what it sends), the down input inside
``_apply_gate`` (which every interface implementation calls between the two projections), and in
``quant`` mode the fused weights are swapped for their fake-quantized values for the duration of
the forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..models.packed_experts import experts_device, is_packed, packed_weight_amax
from .quantizer import TensorQuantizer


class QuantLinear(nn.Linear):
    """``nn.Linear`` with ``input_quantizer`` and ``weight_quantizer`` (either may be None)."""

    input_quantizer: TensorQuantizer | None
    weight_quantizer: TensorQuantizer | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quantizer is not None:
            x = self.input_quantizer(x)
        weight = self.weight
        if self.weight_quantizer is not None and self.weight_quantizer.mode == "quant":
            weight = self.weight_quantizer.fake_quant(weight)
        return nn.functional.linear(x, weight, self.bias)


def attach_linear(module: nn.Linear, weight_fmt: str, input_fmt: str | None, input_amax: float | None) -> None:
    if type(module) is not nn.Linear:
        raise TypeError(f"only plain nn.Linear can be quantized, got {type(module).__name__}")
    module.__class__ = QuantLinear
    device = module.weight.device
    module.weight_quantizer = TensorQuantizer(weight_fmt, role="weight").to(device)
    module.input_quantizer = (
        TensorQuantizer(input_fmt, role="input", constant_amax=input_amax).to(device) if input_fmt else None
    )
    if weight_fmt != "fp8_pb":
        module.weight_quantizer.observe(module.weight)


class ExpertsQuantState(nn.Module):
    """Quantizers of one fused experts module, held as ``experts.quant``.

    ``weight[param]``: per-expert amax ``[E_local]`` (for ``gate_up_proj`` the max over gate and up
    rows, so w1 and w3 of an expert share ``weight_scale_2``). ``input[param]``: one scalar per MoE
    layer and projection (FORMATS.md: every expert of a layer shares ``input_scale``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.ModuleDict()
        self.input = nn.ModuleDict()
        self.calibrate_all_experts = False


def _swap_params(module: nn.Module, replacements: dict[str, torch.Tensor]):
    @contextmanager
    def ctx():
        saved = {name: module._parameters[name] for name in replacements}
        try:
            for name, value in replacements.items():
                module._parameters[name] = value  # a plain tensor: read-only use during this forward
            yield
        finally:
            module._parameters.update(saved)

    return ctx()


def attach_experts(
    experts: nn.Module,
    formats: dict[str, tuple[str | None, str | None, float | None]],
    input_param_order: tuple[str, str] = ("gate_up_proj", "down_proj"),
    source=None,
) -> ExpertsQuantState:
    """``formats``: fused param -> (weight fmt, input fmt, constant input amax); None fmt = not quantized.

    ``source``: an ``Mxfp4ExpertSource`` when the checkpoint stores these experts MXFP4-packed; NVFP4
    weights are then the lossless cast of the source bytes. Packed-resident experts take weight amax
    from their blocks and fake-quantize each decoded chunk (``weight_transforms``).
    """
    packed = is_packed(experts)
    device = experts_device(experts) if packed else experts.down_proj.device
    state = ExpertsQuantState().to(device)
    n = experts.num_experts
    for param, (w_fmt, i_fmt, i_amax) in formats.items():
        if w_fmt is None:
            continue
        q = TensorQuantizer(w_fmt, role="weight", amax_shape=(n,)).to(device)
        if w_fmt != "fp8_pb":
            if packed:
                q.fold_amax(packed_weight_amax(experts, param))  # equal to the decoded weights' amax
            else:
                q.observe(getattr(experts, param), reduce_dims=(1, 2))
        if source is not None and w_fmt == "nvfp4":
            q.use_source(source, param)
        state.weight[param] = q
        if packed:
            experts.weight_transforms[param] = _chunk_fake_quant(q)
        if i_fmt is not None:
            state.input[param] = TensorQuantizer(i_fmt, role="input", constant_amax=i_amax).to(device)
    experts.quant = state
    first, second = input_param_order

    def pre_hook(module, args, kwargs):
        q = state.input[first] if first in state.input else None
        if q is None:
            return None
        return (q(args[0]), *args[1:]), kwargs

    experts.register_forward_pre_hook(pre_hook, with_kwargs=True)

    class_apply_gate = type(experts)._apply_gate

    def apply_gate(gate_up_out: torch.Tensor) -> torch.Tensor:
        out = class_apply_gate(experts, gate_up_out)
        q = state.input[second] if second in state.input else None
        return q(out) if q is not None else out

    experts._apply_gate = apply_gate
    if packed:
        return state  # the decode applies the weight transforms; there are no parameters to swap

    class_forward = type(experts).forward

    def forward(hidden_states, top_k_index, top_k_weights):
        swaps = {
            name: q.fake_quant(getattr(experts, name), expert_dim=True)
            for name, q in state.weight.items()
            if q.mode == "quant"
        }
        with _swap_params(experts, swaps):
            return class_forward(experts, hidden_states, top_k_index, top_k_weights)

    experts.forward = forward
    return state


def _chunk_fake_quant(q: TensorQuantizer):
    """A packed module's weight transform: the decoded chunk, fake-quantized while ``q`` is in quant mode."""

    def transform(decoded: torch.Tensor, rows: slice) -> torch.Tensor:
        return q.fake_quant(decoded, expert_dim=True, rows=rows) if q.mode == "quant" else decoded

    return transform


def iter_quantizers(model: nn.Module):
    """(name, quantizer) for every TensorQuantizer in the model."""
    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer):
            yield name, module


def set_mode(model: nn.Module, mode: str, *, role: str | None = None) -> None:
    for _, q in iter_quantizers(model):
        if role is None or q.role == role:
            q.mode = mode
