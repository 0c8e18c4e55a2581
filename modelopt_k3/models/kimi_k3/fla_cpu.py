"""CPU implementations of the fla-core names Kimi-K3's remote code imports, for machines without Triton.

The real ``modeling_kimi_linear.py`` imports, at module load, ``ShortConvolution`` and ``FusedRMSNormGated``
(``fla.modules``), ``chunk_kda`` / ``fused_recurrent_kda`` (``fla.ops.kda``), ``prepare_cu_seqlens_from_mask`` /
``prepare_lens_from_mask`` (``fla.ops.utils.index``) and ``tensor_cache`` (``fla.utils``). All of them live in
modules that import triton, so without Triton the checkpoint's code does not import at all
(kimi_k3_reference.md section 7). ``install_fla_cpu()`` puts modules carrying our implementations under those
import paths in ``sys.modules``; it does so only when Triton is absent (a GPU machine keeps fla's kernels).

The KDA recurrence itself is fla's own pure-torch reference, ``naive_recurrent_kda`` from
``fla/ops/kda/naive.py``, loaded by file path (the file needs only torch and einops). The rest is the
kernels' documented math, written here: the gates of ``fla/ops/kda/gate.py`` (that file imports triton),
the L2 norm fused into the kernels, the depthwise causal convolution with its ``[N, D, W]`` state, and the
sigmoid-gated RMSNorm (fla has no CPU reference for either). Argument checks mirror fla 0.6's, so a call that
fails on a GPU fails here too; options no Kimi code uses (context parallel, graph mode, intermediate states)
raise ``NotImplementedError`` instead of being ignored.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# fla's l2norm_fwd default eps (used by use_qk_l2norm_in_kernel).
L2NORM_EPS = 1e-6
# Set to 1 to install the CPU implementations even where triton imports (e.g. CPU runs on a GPU machine).
FORCE_ENV = "MODELOPT_K3_FLA_CPU"
_INSTALLED_FLAG = "__modelopt_k3_fla_cpu__"


class FlaUnavailableError(ImportError):
    """fla-core is not installed, so there is no reference to build the CPU path on."""


@cache
def fla_reference(relative_path: str) -> types.ModuleType:
    """A pure-torch file of the installed fla-core (e.g. ``ops/kda/naive.py``), loaded by path.

    ``importlib.machinery.PathFinder`` looks on ``sys.path`` only, so this finds the real package even
    after our modules have been installed under ``fla.*`` in ``sys.modules``.
    """
    spec = importlib.machinery.PathFinder.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise FlaUnavailableError("fla-core is not installed; Kimi-K3's remote code needs it (pip install fla-core)")
    path = Path(next(iter(spec.submodule_search_locations))) / relative_path
    module_spec = importlib.util.spec_from_file_location(f"modelopt_k3._fla_reference.{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise FlaUnavailableError(f"fla-core has no {relative_path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------
# fla.modules
# ----------------------------------------------------------------------------------------------


class ShortConvolution(nn.Conv1d):
    """Depthwise causal ``Conv1d`` (weight ``[D, 1, W]``) with SiLU, as ``fla.modules.ShortConvolution``.

    ``forward(x [B, T, D], cache [N, D, W] | None, output_final_state, cu_seqlens)`` returns
    ``(y [B, T, D], final_state [N, D, W] | None)``: y_t = act(bias + sum_j w[:, 0, j] * x_{t-W+1+j}) with the
    cache (else zeros) before the first token, computed in fp32 and stored in x's dtype; the final state
    holds the last W inputs of each sequence (cache included), in x's dtype. Unlike fla's decode kernel,
    the cache is never updated in place (the remote code stores the returned state).
    """

    def __init__(
        self,
        hidden_size: int,
        kernel_size: int,
        bias: bool = False,
        activation: str | None = "silu",
        backend: str | None = "triton",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        # Depthwise (one filter per channel); the causal left context is handled in causal_conv1d.
        depthwise = dict(groups=hidden_size, bias=bias, device=device, dtype=dtype)
        super().__init__(hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, **depthwise)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"Activation `{activation}` not supported yet.")
        self.hidden_size = hidden_size
        self.activation = activation
        self.backend = "torch"

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        chunk_indices: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mask is not None:
            if cu_seqlens is not None:
                raise ValueError("`mask` and `cu_seqlens` cannot be provided at the same time")
            x = x * mask.unsqueeze(-1)
        ys, states = [], []
        for n, rows in enumerate(_sequences(x, cu_seqlens)):
            init = cache if cache is None or cu_seqlens is None else cache[n : n + 1]
            y, state = causal_conv1d(rows, self.weight, self.bias, init, self.activation)
            ys.append(y)
            states.append(state)
        y = torch.cat(ys, dim=0 if cu_seqlens is None else 1).view_as(x)
        if residual is not None:
            y = y + residual
        return y, (torch.cat(states) if output_final_state else None)

    @property
    def state_size(self) -> int:
        return self.hidden_size * self.kernel_size[0]


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of equal-length sequences: x [B, T, D], weight [D, 1, W], state [B, D, W] -> (y, state)."""
    width = weight.shape[-1]
    xt = x.float().transpose(1, 2)  # [B, D, T]
    if initial_state is None:
        prefix = xt.new_zeros(xt.shape[0], xt.shape[1], width)
    else:
        prefix = initial_state.float()
    padded = torch.cat([prefix, xt], dim=-1)
    # The state's first column falls out of the window of the first token (window = W inputs).
    y = F.conv1d(padded[..., 1:], weight.float(), None if bias is None else bias.float(), groups=xt.shape[1])
    if activation is not None:
        y = F.silu(y)
    return y.transpose(1, 2).to(x.dtype), padded[..., -width:].to(x.dtype).contiguous()


def _sequences(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[torch.Tensor]:
    """The batch as one piece, or (``cu_seqlens``, B == 1) each packed sequence as its own [1, T_n, ...]."""
    if cu_seqlens is None:
        return [x]
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens packs every sequence into one row: batch size must be 1, got {x.shape[0]}")
    bounds = cu_seqlens.tolist()
    return [x[:, bos:eos] for bos, eos in zip(bounds[:-1], bounds[1:])]


class FusedRMSNormGated(nn.Module):
    """``fla.modules.FusedRMSNormGated``: y = x * rsqrt(mean(x^2) + eps) * weight * act(g), in fp32, cast to x's dtype.

    ``act`` is sigmoid (what Kimi uses) or swish/silu (g * sigmoid(g)).
    """

    def __init__(
        self,
        hidden_size: int,
        elementwise_affine: bool = True,
        eps: float = 1e-5,
        activation: str = "swish",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"Unsupported activation: {activation}")
        self.hidden_size = hidden_size
        self.elementwise_affine = elementwise_affine
        self.eps = eps
        self.activation = activation
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.register_parameter("bias", None)

    def forward(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        residual: torch.Tensor | None = None,
        prenorm: bool = False,
        residual_in_fp32: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        if residual is not None:
            xf = xf + residual.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        gf = g.float()
        y = y * torch.sigmoid(gf) if self.activation == "sigmoid" else y * gf * torch.sigmoid(gf)
        y = y.to(x.dtype)
        if not prenorm:
            return y
        return y, xf if residual_in_fp32 else xf.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# fla.ops.kda
# ----------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32, stored in x's dtype (fla's l2norm_fwd)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda_gate(
    g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None
) -> torch.Tensor:
    """Log-decay [..., H, K] from the raw gate g [..., H, K], fp32 (fla/ops/kda/gate.py's naive gates).

    z = g + dt_bias.view(H, K); lower_bound set: lb * sigmoid(exp(A_log[h]) * z) (A_log None: lb * sigmoid(z));
    else -exp(A_log[h]) * softplus(z). Like the kernels, only the first H entries of A_log are read.
    """
    heads, head_dim = g.shape[-2:]
    z = g.float()
    if dt_bias is not None:
        z = z + dt_bias.float().view(heads, head_dim)
    a = None if A_log is None else A_log.float().reshape(-1)[:heads].exp().view(heads, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(z if a is None else a * z)
    if a is None:
        raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
    return -a * F.softplus(z)


def _check_varlen(q: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> None:
    # The same two refusals as fla's varlen kernels (messages ours): one packed row, one state per sequence.
    if cu_seqlens is None:
        return
    sequences = len(cu_seqlens) - 1
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens packs every sequence into one row: batch size must be 1, got {q.shape[0]}")
    if initial_state is not None and initial_state.shape[0] != sequences:
        raise ValueError(f"cu_seqlens holds {sequences} sequences but initial_state has {initial_state.shape[0]}")


def _unsupported(options: dict[str, Any]) -> None:
    used = [name for name, value in options.items() if value]
    if used:
        raise NotImplementedError(f"the CPU KDA path does not implement {used}")


def _kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    lower_bound: float | None,
    state_v_first: bool,
    cu_seqlens: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What chunk_kda and fused_recurrent_kda compute: fused pre-processing, then fla's naive recurrence."""
    _check_varlen(q, initial_state, cu_seqlens)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2 if allow_neg_eigval else 1)
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    naive = fla_reference("ops/kda/naive.py").naive_recurrent_kda
    outputs, states = [], []
    pieces = zip(*(_sequences(t, cu_seqlens) for t in (q, k, v, g, beta)))
    for n, (q_n, k_n, v_n, g_n, beta_n) in enumerate(pieces):
        init = initial_state if initial_state is None or cu_seqlens is None else initial_state[n : n + 1]
        o_n, s_n = naive(q_n, k_n, v_n, g_n, beta_n, scale=scale, initial_state=init, output_final_state=True)
        outputs.append(o_n)
        states.append(s_n)
    o = torch.cat(outputs, dim=1 if cu_seqlens is not None else 0)
    if not output_final_state:
        return o, None
    state = torch.cat(states)
    return o, (state.transpose(-1, -2).contiguous() if state_v_first else state)


def _state_layout(state_v_first: bool, kwargs: dict[str, Any]) -> bool:
    """fla 0.6 renamed ``transpose_state_layout`` (still accepted, deprecated) to ``state_v_first``."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        return bool(kwargs.pop("transpose_state_layout"))
    return state_v_first


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fla.ops.kda.chunk_kda`` on CPU: (o [B, T, HV, V] in v's dtype, final state fp32 or None).

    The chunked kernel and the per-token recurrence compute the same thing; this runs the recurrence.
    """
    state_v_first = _state_layout(state_v_first, kwargs)
    _unsupported({"return_intermediate_states": return_intermediate_states, "cp_context": cp_context, "use_graph": use_graph})
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise AssertionError("initial_state must be in float32.")
    if kwargs.get("chunk_size", 64) not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {kwargs['chunk_size']}.")
    A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    return _kda(
        q, k, v, g, beta,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
    )  # fmt: skip


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fla.ops.kda.fused_recurrent_kda`` on CPU (the decode path: cache present and T == 1)."""
    state_v_first = _state_layout(state_v_first, kwargs)
    _unsupported({k_: kwargs.get(k_) for k_ in ("ssm_state_indices", "num_accepted_tokens")})
    return _kda(
        q, k, v, g, beta,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        A_log=A_log if use_gate_in_kernel else None, dt_bias=dt_bias if use_gate_in_kernel else None,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# fla.ops.utils.index, fla.utils
# ----------------------------------------------------------------------------------------------


def prepare_lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return torch.diff(cu_seqlens)


def prepare_lens_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Tokens kept per row of a [B, T] 0/1 mask, int32."""
    return mask.sum(dim=-1, dtype=torch.int32)


def prepare_cu_seqlens_from_lens(lens: torch.Tensor, dtype: torch.dtype | None = torch.int32) -> torch.Tensor:
    return F.pad(lens.cumsum(dim=0, dtype=dtype), (1, 0))


def prepare_cu_seqlens_from_mask(mask: torch.Tensor, dtype: torch.dtype | None = torch.int32) -> torch.Tensor:
    """[0, len_0, len_0 + len_1, ...] for a [B, T] 0/1 mask."""
    return prepare_cu_seqlens_from_lens(prepare_lens_from_mask(mask), dtype)


def tensor_cache(fn):
    """fla's ``tensor_cache`` memoises the last call by tensor identity (a speed-up only); run every call."""
    return fn


# ----------------------------------------------------------------------------------------------
# Installation
# ----------------------------------------------------------------------------------------------

# Import path -> the names the remote code takes from it. Parent packages get empty modules so that
# importing them never runs fla's own (triton-importing) package __init__ files.
PROVIDED: dict[str, tuple[str, ...]] = {
    "fla.modules": ("ShortConvolution", "FusedRMSNormGated"),
    "fla.ops.kda": ("chunk_kda", "fused_recurrent_kda"),
    "fla.ops.utils.index": (
        "prepare_lens",
        "prepare_lens_from_mask",
        "prepare_cu_seqlens_from_lens",
        "prepare_cu_seqlens_from_mask",
    ),
    "fla.utils": ("tensor_cache",),
}
_PACKAGES = ("fla", "fla.ops", "fla.ops.utils")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def fla_cpu_installed() -> bool:
    return getattr(sys.modules.get("fla.ops.kda"), _INSTALLED_FLAG, False)


def install_fla_cpu(*, force: bool | None = None) -> bool:
    """Install the CPU implementations under fla's import paths when Triton is absent. True when installed.

    With Triton importable nothing is replaced (fla's kernels run on the GPU), unless ``force`` (or
    ``MODELOPT_K3_FLA_CPU=1``) asks for the CPU path anyway. The real top-level ``fla`` package stays when
    it imports without Triton (fla-core 0.6's does); the references are located before anything is installed.
    """
    if force is None:
        force = os.environ.get(FORCE_ENV) == "1"
    if fla_cpu_installed():
        return True
    if triton_available() and not force:
        return False
    fla_reference("ops/kda/naive.py")  # fail here, naming fla-core, rather than at the first forward
    this = sys.modules[__name__]
    for name in _PACKAGES:
        if name == "fla" and _real_fla_importable():
            continue
        sys.modules[name] = _module(name, package=True)
    for name, attrs in PROVIDED.items():
        module = _module(name, package=False)
        for attr in attrs:
            setattr(module, attr, getattr(this, attr))
        sys.modules[name] = module
    return True


def _real_fla_importable() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return not getattr(sys.modules["fla"], _INSTALLED_FLAG, False)


def _module(name: str, *, package: bool) -> types.ModuleType:
    module = types.ModuleType(name, f"modelopt_k3 CPU implementations for {name} (no Triton on this machine)")
    module.__file__ = __file__
    setattr(module, _INSTALLED_FLAG, True)
    if package:
        module.__path__ = []  # a package, so that submodule imports resolve through sys.modules
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module
