"""Packed-resident experts: keep this rank's experts as their MXFP4 source bytes, decode them just in time.

With ``experts="bf16"`` a fused experts module holds ``gate_up_proj``/``down_proj`` decoded, i.e. 16 bits
a weight. With ``experts="packed"`` (an MXFP4-sourced checkpoint) it holds the source's bytes instead,
4.25 bits a weight, and decodes them into a reusable workspace inside the experts forward: one layer
at a time, or a chunk of experts at a time when the memory planner says so. Decoding is exact
(``numerics.mxfp4_decode``), so logits, calibration amax and the export equal the ``bf16`` residency
bit for bit (a whole layer decoded: always; in chunks: under eager, and in bf16 for grouped_mm/batched_mm --
their fp32 GEMMs over a chunk's experts have other shapes, which a BLAS may sum in another order, ~1e-6).

Declared layout, per fused parameter ``p`` (the spec's ``ExpertsSpec.sharded_params``), following the fields
of torchao's ``MXTensor`` (pytorch/ao torchao/prototype/mx_formats/mx_tensor.py:
``tensor_data_names = ["qdata", "scale"]``, block size, original dtype):

* ``<p>_qdata``: uint8 buffer ``[E_local, out, in/2]``, E2M1 codes, element ``2i`` in the low nibble;
* ``<p>_scale``: uint8 buffer ``[E_local, out, in/32]``, E8M0 exponents, one per 32 elements of a row;
* ``<p>``: a meta tensor ``[E_local, out, in]`` in the decoded dtype. It only describes the decoded
  shape (``is_experts_module``, recipe matching and shape checks read it); the values exist only in the
  workspace while the experts run, or through ``expert_weight_rows``.

Rows follow the fused parameter (``gate_up_proj``: the gate projection's rows, then the up
projection's), so decoding experts ``[a, b)`` gives ``gate_up_proj[a:b]`` of the ``bf16`` residency.

Running: any implementation of transformers' experts interface (``eager``, ``batched_mm``,
``grouped_mm``) is called on a view of the module whose ``gate_up_proj``/``down_proj`` are the
decoded workspace (and whose ``num_experts`` is the chunk's), with owner-local expert ids. With the
whole layer decoded the implementation runs unchanged; with chunks, each chunk's (token, slot) pairs
are run with routing weight 1.0 and combined at the end by the module's ``combine`` (``FusedExperts``,
``experts/base.py``), the one its eager forward uses. A dispatching implementation (``torch_a2a``,
``experts/dispatch.py``) runs first and decodes only on the owner, around its local implementation
(``local_experts_forward``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..dist.placement import ResidencyError
from ..numerics.constants import MXFP4_BLOCK
from ..numerics.e2m1 import E2M1_VALUES
from ..numerics.mxfp4 import e8m0_to_float, mxfp4_decode
from ..spec import ModelSpec
from .base import combine_fp32

# Experts decoded at a time outside the forward (amax, export rows): bounds those temporaries.
EXPERTS_PER_PASS = 16
# Set on an experts implementation that exchanges tokens and calls ``local_experts_forward`` itself.
DISPATCHES_ATTR = "dispatches_to_owners"


@dataclass(frozen=True)
class PackedLayout:
    """The declared packed layout of one fused parameter (see the module docstring)."""

    param: str
    num_experts: int
    out_features: int
    in_features: int
    dtype: torch.dtype  # the decoded dtype (the model's)
    block_size: int = MXFP4_BLOCK

    @property
    def qdata_name(self) -> str:
        return f"{self.param}_qdata"

    @property
    def scale_name(self) -> str:
        return f"{self.param}_scale"

    @property
    def expert_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def decoded_bytes(self, experts: int = 1) -> int:
        return experts * self.out_features * self.in_features * torch.empty((), dtype=self.dtype).element_size()


class DecodeWorkspace:
    """Reusable decode buffers, one per fused parameter shape, shared by every packed experts module of a
    model: layers run one at a time, so one layer's (or chunk's) worth is all that ever exists."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._busy: set[tuple] = set()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def release(self) -> None:
        """Drop the buffers (they are allocated again on the next decode)."""
        if self._busy:
            raise RuntimeError("cannot release the decode workspace while experts are running")
        self._buffers.clear()

    @contextmanager
    def rows(self, layout: PackedLayout, n: int, device: torch.device) -> Iterator[torch.Tensor]:
        """``[n, out, in]`` of the shared buffer for ``layout``'s expert shape, held for the block."""
        key = (layout.param, layout.expert_shape, layout.dtype, device)
        if key in self._busy:
            raise RuntimeError(f"decode workspace for {layout.param} is already in use (nested experts forward)")
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < n:
            self._buffers.pop(key, None)  # free the smaller one first
            buf = self._buffers[key] = torch.empty((n, *layout.expert_shape), dtype=layout.dtype, device=device)
        self._busy.add(key)
        try:
            yield buf[:n]
        finally:
            self._busy.discard(key)


class PackedExpertsMixin:
    """Mixed in front of a fused experts class by ``to_packed`` (the instance's class is swapped)."""

    packed_layouts: dict[str, PackedLayout]
    decode_chunk: int
    workspace: DecodeWorkspace
    # fused param -> fn(decoded rows [n, out, in], local expert slice) -> the rows the forward uses
    # (the quantizers' fake quant hooks in here: quant/modules.py)
    weight_transforms: dict[str, Callable[[torch.Tensor, slice], torch.Tensor]]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        name = self.config._experts_implementation
        fn = experts_functions().get(name) if name != "eager" else None
        if fn is not None and getattr(fn, DISPATCHES_ATTR, False):
            return fn(self, hidden_states, top_k_index, top_k_weights)
        return local_experts_forward(self, name)(self, hidden_states, top_k_index, top_k_weights)


def is_packed(module: nn.Module) -> bool:
    return isinstance(module, PackedExpertsMixin)


_PACKED_CLASSES: dict[type, type] = {}


def _packed_class(cls: type) -> type:
    if cls not in _PACKED_CLASSES:
        _PACKED_CLASSES[cls] = type(f"Packed{cls.__name__}", (PackedExpertsMixin, cls), {"__module__": cls.__module__})
    return _PACKED_CLASSES[cls]


def to_packed(module: nn.Module, spec: ModelSpec, workspace: DecodeWorkspace) -> None:
    """Turn a fused experts module (built on meta, not yet materialised) into its packed form.

    Its fused parameters become the ``_qdata``/``_scale`` buffers (still on meta: ``to_empty``
    allocates them, a quarter of the decoded bytes) and a meta shape descriptor.
    """
    if is_packed(module):
        return
    layouts = {}
    for param, dim in spec.experts.sharded_params.items():
        weight = module._parameters.get(param)
        if weight is None or weight.dim() != 3 or dim != 0:
            raise ResidencyError(
                f"packed experts need fused [experts, out, in] parameters indexed on dim 0; "
                f"{type(module).__name__}.{param} is {None if weight is None else list(weight.shape)} (dim {dim})"
            )
        num, out_f, in_f = weight.shape
        if in_f % MXFP4_BLOCK:
            raise ResidencyError(f"{param}: in_features {in_f} is not a multiple of the MXFP4 block {MXFP4_BLOCK}")
        layout = PackedLayout(param, num, out_f, in_f, weight.dtype)
        del module._parameters[param]
        module.register_buffer(layout.qdata_name, torch.empty(num, out_f, in_f // 2, dtype=torch.uint8, device=weight.device))
        module.register_buffer(layout.scale_name, torch.empty(num, out_f, in_f // MXFP4_BLOCK, dtype=torch.uint8, device=weight.device))
        setattr(module, param, torch.empty(weight.shape, dtype=weight.dtype, device="meta"))  # shape only
        layouts[param] = layout
    module.__class__ = _packed_class(type(module))
    module.packed_layouts = layouts
    module.decode_chunk = module.num_experts
    module.workspace = workspace
    module.weight_transforms = {}


def release_decode_workspaces(modules) -> None:
    """Free the decode workspaces of these experts modules (the next forward allocates them again)."""
    for workspace in {id(m.workspace): m.workspace for m in modules if is_packed(m)}.values():
        workspace.release()


def experts_device(module: nn.Module, spec: ModelSpec | None = None) -> torch.device:
    """Where a fused experts module's weights live (packed: its codes; else the spec's first fused param)."""
    if is_packed(module):
        return getattr(module, next(iter(module.packed_layouts.values())).qdata_name).device
    if spec is None:
        raise ValueError("experts_device needs the spec for a module that is not packed")
    return getattr(module, next(iter(spec.experts.sharded_params))).device


# ------------------------------------------------------------------------------ running


def _eager_forward(cls: type) -> Callable:
    """The class's own (eager) forward, below the experts-interface dispatch."""
    for klass in cls.__mro__:
        fn = klass.__dict__.get("forward")
        if fn is not None and hasattr(fn, "__wrapped__"):
            return fn.__wrapped__
    raise TypeError(f"{cls.__name__} has no experts-interface forward (@use_experts_implementation)")


def implementation(module: nn.Module, name: str) -> Callable:
    """The experts implementation ``name`` as ``fn(module, hidden, ids, weights)`` (eager: the class's own)."""
    return _eager_forward(type(module)) if name == "eager" else experts_functions()[name]


def experts_functions():
    """transformers' experts-interface registry, imported on first use: the interface imports torch's compiler
    stack (~1 s), which the command lines that never run a model (plan, check, convert) must not pay."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS


def local_experts_forward(module: nn.Module, name: str) -> Callable:
    """``fn(module, hidden, local ids, weights)`` running implementation ``name`` on this rank's experts;
    for a packed module it decodes them first (whole layer or chunks)."""
    fn = implementation(module, name)
    if not is_packed(module):
        return fn
    return lambda self, hidden, ids, weights: _run_decoded(self, fn, hidden, ids, weights)


class _DecodedView:
    """The module as an implementation sees it while decoded: weights from the workspace, ``num_experts``
    the chunk's; every other attribute (``_apply_gate``, flags, dims) is the module's."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor], num_experts: int) -> None:
        self.__dict__.update(weights, _module=module, num_experts=num_experts)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_module"], name)


@contextmanager
def _decoded(module: nn.Module, start: int, stop: int) -> Iterator[_DecodedView]:
    with _decoded_weights(module, slice(start, stop)) as weights:
        yield _DecodedView(module, weights, stop - start)


@contextmanager
def _decoded_weights(module: nn.Module, part: slice) -> Iterator[dict[str, torch.Tensor]]:
    """Decode local experts ``part`` of every fused parameter into the shared workspace (transforms applied)."""
    n = part.stop - part.start
    with ExitStack() as held:
        weights = {}
        for param, layout in module.packed_layouts.items():
            qdata, scale = getattr(module, layout.qdata_name), getattr(module, layout.scale_name)
            buf = held.enter_context(module.workspace.rows(layout, n, qdata.device))
            mxfp4_decode(qdata[part], scale[part], layout.dtype, out=buf)
            transform = module.weight_transforms.get(param)
            weights[param] = transform(buf, part) if transform is not None else buf
        yield weights


def _run_decoded(module, fn: Callable, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    n = module.num_experts
    chunk = max(1, min(module.decode_chunk or n, n))
    if chunk >= n:
        with _decoded(module, 0, n) as view:
            return fn(view, hidden_states, top_k_index, top_k_weights)
    num_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    # Every implementation computes in the weights' dtype; casting first keeps each pair's output exact.
    x = hidden_states.to(module.packed_layouts[next(iter(module.packed_layouts))].dtype)
    per_slot = x.new_empty(flat.numel(), module.hidden_dim)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        pairs = ((flat >= start) & (flat < stop)).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        ones = torch.ones(pairs.numel(), 1, dtype=torch.float32, device=x.device)
        with _decoded(module, start, stop) as view:
            per_slot[pairs] = fn(view, x[pairs // top_k], (flat[pairs] - start).unsqueeze(1), ones)
    # The combine the module's eager forward (and torch_a2a) closes a layer with (FusedExperts.combine).
    combine = getattr(module, "combine", None) or combine_fp32
    return combine(per_slot.view(num_tokens, top_k, -1), top_k_index, top_k_weights, hidden_states.dtype)


# ------------------------------------------------------------------------------ reading the packed bytes


def expert_weight_rows(module: nn.Module, param: str, part: slice) -> torch.Tensor:
    """``[n, out, in]`` weights of this rank's local experts ``part`` of fused ``param``: a view of the
    parameter (bf16 residency; FSDP2: this rank's rows) or a fresh decode (packed)."""
    from ..dist.fsdp import local_tensor

    if not is_packed(module):
        return local_tensor(getattr(module, param)).detach()[part]
    layout = module.packed_layouts[param]
    return mxfp4_decode(getattr(module, layout.qdata_name)[part], getattr(module, layout.scale_name)[part], layout.dtype)


def projection_fields(module: nn.Module, spec: ModelSpec, proj: str, part: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """The resident (codes, scales) of checkpoint projection ``proj`` (e.g. ``w1``) for local experts ``part``:
    the same bytes the checkpoint stores for ``<module>.<e>.<proj>.weight_packed/weight_scale``."""
    (p,) = [p for p in spec.experts.projections if p.name == proj]
    layout = module.packed_layouts[p.fused_param]
    rows = layout.out_features // p.n_chunks
    r = slice(p.chunk * rows, (p.chunk + 1) * rows)
    return getattr(module, layout.qdata_name)[part, r], getattr(module, layout.scale_name)[part, r]


_MAX_CODE: dict[torch.device, torch.Tensor] = {}


def _max_code_table(device: torch.device) -> torch.Tensor:
    """uint8 [256]: the larger E2M1 magnitude index (0..7, increasing in |value|) of a byte's two codes."""
    if device not in _MAX_CODE:
        byte = torch.arange(256)
        _MAX_CODE[device] = torch.maximum(byte & 7, (byte >> 4) & 7).to(torch.uint8).to(device)
    return _MAX_CODE[device]


@torch.no_grad()
def packed_weight_amax(module: nn.Module, param: str) -> torch.Tensor:
    """fp32 ``[E_local]``: ``max |w|`` per expert of fused ``param``, from the packed blocks alone.

    Per block of 32: the largest E2M1 magnitude times ``2**(scale - 127)`` (FORMATS.md MXFP4), the
    same fp32 product ``mxfp4_decode`` rounds to the weight dtype, where it is exact; so this equals
    ``|decoded|.amax`` bit for bit (NaN for an E8M0 NaN scale, inf past the dtype's range), without
    decoding the layer: temporaries are a byte per code byte for ``EXPERTS_PER_PASS`` experts.
    """
    layout = module.packed_layouts[param]
    qdata, scale = getattr(module, layout.qdata_name), getattr(module, layout.scale_name)
    values = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=qdata.device)
    table = _max_code_table(qdata.device)
    out = torch.empty(layout.num_experts, dtype=torch.float32, device=qdata.device)
    for start in range(0, layout.num_experts, EXPERTS_PER_PASS):
        part = slice(start, min(start + EXPERTS_PER_PASS, layout.num_experts))
        codes = qdata[part]
        n = codes.shape[0]
        mag = table.index_select(0, codes.reshape(-1).int()).view(n, layout.out_features, -1, layout.block_size // 2)
        block = values.index_select(0, mag.amax(dim=-1).reshape(-1).int()).view(scale[part].shape)
        out[part] = (block * e8m0_to_float(scale[part])).view(n, -1).amax(dim=-1)
    return out


def packed_param_bytes(module: nn.Module) -> int:
    """Resident bytes of a packed module's codes and scales."""
    return sum(getattr(module, name).nbytes for lay in module.packed_layouts.values() for name in (lay.qdata_name, lay.scale_name))
