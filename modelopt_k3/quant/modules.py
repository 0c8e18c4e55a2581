"""Attach quantizers to dense Linears and to fused experts modules, through declared hooks only.

Dense ``nn.Linear``: stays an ``nn.Linear``; ``input_quantizer``/``weight_quantizer`` submodules and
forward hooks quantize its input and, in ``quant`` mode, swap its weight for the fake-quantized
value for the duration of the forward. Fused experts (any module following transformers' experts
interface whose class declares ``down_input_hook``): quantizers are submodules; the gate/up input is
quantized before dispatch (a forward pre-hook, so under ``torch_a2a`` the origin rank quantizes what
it sends), the down input through the class's ``down_input_hook`` (its ``_apply_gate``, which every
interface implementation calls between the two projections, applies it), and in ``quant`` mode the
fused weights are swapped for their fake-quantized values for the duration of the forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..experts.packed import experts_device, is_packed, packed_weight_amax
from .quantizer import TensorQuantizer
from .schemes import TensorFormat


def _swap_during_forward(module: nn.Module, replacements: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Forward hooks that replace ``module``'s parameters by ``replacements()`` (plain tensors, read-only
    use) for one forward and restore them afterwards, also when the forward raises."""
    saved: list[dict[str, nn.Parameter]] = []

    def swap_in(mod, args):
        values = replacements()
        saved.append({name: mod._parameters[name] for name in values})
        mod._parameters.update(values)

    def swap_back(mod, args, output):
        mod._parameters.update(saved.pop())

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_back, always_call=True)


def _quantize_first_input(quantizer: Callable[[], TensorQuantizer | None]):
    """A forward pre-hook quantizing the first positional argument with ``quantizer()`` (when not None)."""

    def hook(module, args, kwargs):
        q = quantizer()
        if q is None:
            return None
        return (q(args[0]), *args[1:]), kwargs

    return hook


def attach_linear(module: nn.Linear, weight_fmt: TensorFormat, input_fmt: TensorFormat | None,
                  input_amax: float | None) -> None:
    if type(module) is not nn.Linear:
        raise TypeError(f"only plain nn.Linear can be quantized, got {type(module).__name__}")
    device = module.weight.device
    module.weight_quantizer = TensorQuantizer(weight_fmt, role="weight").to(device)
    module.input_quantizer = (
        TensorQuantizer(input_fmt, role="input", constant_amax=input_amax).to(device) if input_fmt else None
    )
    if weight_fmt.per_tensor_scale:
        module.weight_quantizer.observe(module.weight)
    module.register_forward_pre_hook(_quantize_first_input(lambda: module.input_quantizer), with_kwargs=True)
    wq = module.weight_quantizer
    _swap_during_forward(module, lambda: {"weight": wq.fake_quant(module.weight)} if wq.mode == "quant" else {})


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


def attach_experts(
    experts: nn.Module,
    formats: dict[str, tuple[TensorFormat | None, TensorFormat | None, float | None]],
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
        if w_fmt.per_tensor_scale:
            if packed:
                q.fold_amax(packed_weight_amax(experts, param))  # equal to the decoded weights' amax
            else:
                q.observe(getattr(experts, param), reduce_dims=(1, 2))
        if source is not None and w_fmt.casts_from_mxfp4:
            q.use_source(source, param)
        state.weight[param] = q
        if packed:
            experts.weight_transforms[param] = _chunk_fake_quant(q)
        if i_fmt is not None:
            state.input[param] = TensorQuantizer(i_fmt, role="input", constant_amax=i_amax).to(device)
    if not hasattr(type(experts), "down_input_hook"):
        raise TypeError(f"{type(experts).__name__} declares no down_input_hook (the down projection's input "
                        "transform its _apply_gate applies): its inputs cannot be quantized")
    experts.quant = state
    first, second = input_param_order
    experts.register_forward_pre_hook(_quantize_first_input(lambda: state.input[first] if first in state.input
                                                            else None), with_kwargs=True)
    if second in state.input:
        down = state.input[second]
        experts.down_input_hook = lambda h: down(h)  # a plain function: the quantizer stays under experts.quant
    if packed:
        return state  # the decode applies the weight transforms; there are no parameters to swap
    _swap_during_forward(experts, lambda: {
        name: q.fake_quant(getattr(experts, name), expert_dim=True) for name, q in state.weight.items()
        if q.mode == "quant"
    })
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
