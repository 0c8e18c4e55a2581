# Stand-in for the Kimi-K3 checkpoint's own language-model code (tiny test checkpoints).
# Written for this project from kimi_k3_reference.md and the public behaviour of the real remote code:
# same class names, constructor signatures, attribute names, module tree, parameter names and shapes,
# forward math, and the same outside dependencies -- fla-core's kernels imported at module load (no
# triton, no import), and the transformers API calls the hub's files make. This default ("hub") file
# calls the transformers-4-era APIs the hub ships with (they break on transformers 5.x); the tiny
# generator's `remote_code="transformers5"` variant rewrites those lines the way llm-compressor's
# vendored copy does. The vision tower exists with the real key names and a non-persistent buffer, but
# only text-only forwards are implemented.
# This file ships inside generated checkpoints: it must not import modelopt_k3.
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from fla.modules import FusedRMSNormGated, ShortConvolution
from fla.ops.kda import chunk_kda, fused_recurrent_kda
from fla.ops.utils.index import prepare_cu_seqlens_from_mask, prepare_lens_from_mask
from fla.utils import tensor_cache
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
from transformers.utils import can_return_tuple, logging
from transformers.utils.generic import OutputRecorder, check_model_inputs

from .configuration_kimi_k3 import KimiLinearConfig

logger = logging.get_logger(__name__)

# ----------------------------------------------------------------------------------------------
# Activations, norms, MLPs
# ----------------------------------------------------------------------------------------------


class SituAndMul(nn.Module):
    """x = [g | u] -> beta*tanh(g/beta)*sigmoid(g) * (beta_lin*tanh(u/beta_lin) | u), in fp32."""

    def __init__(self, beta: float = 1.0, linear_beta: float | None = None) -> None:
        super().__init__()
        self.beta = beta
        self.linear_beta = linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        gate, up = x[..., :half].float(), x[..., half:].float()
        act = self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate)
        if self.linear_beta is not None:
            up = self.linear_beta * torch.tanh(up / self.linear_beta)
        return (act * up).to(x.dtype)


# As upstream: registered globally, but ACT2FN["situ"] is SituAndMul() with beta=1 and no linear clamp,
# so the modules below build their own from the config.
ACT2FN["situ"] = SituAndMul


def _situ_params(config: KimiLinearConfig) -> tuple[float, float | None]:
    return config.activation_situ_beta or 1.0, config.activation_situ_linear_beta


def _make_act(config: KimiLinearConfig) -> nn.Module:
    if config.hidden_act == "situ":
        beta, linear_beta = _situ_params(config)
        return SituAndMul(beta=beta, linear_beta=linear_beta)
    return ACT2FN[config.hidden_act]


class KimiRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        # Multiply after casting back: an fp32 weight promotes a bf16 input to fp32 (as upstream).
        return self.weight * x.to(dtype)


ALL_LAYERNORM_LAYERS.append(KimiRMSNorm)


class KimiBlockSparseMLP(nn.Module):
    """One routed expert: w1 (gate) [I, D], w3 (up) [I, D], w2 (down) [D, I]."""

    def __init__(
        self, config: KimiLinearConfig, hidden_size: int | None = None, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.ffn_dim = config.intermediate_size if intermediate_size is None else intermediate_size
        self.hidden_dim = config.hidden_size if hidden_size is None else hidden_size
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.act_fn = _make_act(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.config.hidden_act == "situ":
            h = self.act_fn(torch.cat([self.w1(hidden_states), self.w3(hidden_states)], dim=-1))
        else:
            h = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(h)


class KimiMLP(nn.Module):
    """Dense gated MLP (layer-0 `mlp` and the `shared_experts`)."""

    def __init__(
        self, config: KimiLinearConfig, hidden_size: int | None = None, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = _make_act(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.hidden_act == "situ":
            return self.down_proj(self.act_fn(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------------------------
# Cache (not a transformers Cache, as upstream)
# ----------------------------------------------------------------------------------------------


class KimiDynamicCache:
    """Per-layer MLA key/value cache and KDA conv/recurrent states."""

    is_compileable = False

    def __init__(self, config: KimiLinearConfig) -> None:
        self.config = config
        n = config.num_hidden_layers
        self.layer_types = ["linear_attention" if config.is_kda_layer(i) else "full_attention" for i in range(n)]
        self.transformer_layers = [i for i in range(n) if self.layer_types[i] == "full_attention"]
        linear = [i for i in range(n) if self.layer_types[i] == "linear_attention"]
        self.last_linear_layer = linear[-1] if linear else -1
        self.conv_states: list[Any] = [None] * n
        self.recurrent_states: list[Any] = [None] * n
        self.key_cache: list[Any] = [None] * n
        self.value_cache: list[Any] = [None] * n

    def __len__(self) -> int:
        return len(self.layer_types)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.key_cache[layer_idx] is None:
            self.key_cache[layer_idx], self.value_cache[layer_idx] = key_states, value_states
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        # KDA layers keep no per-token state: fall back to the first MLA layer, as upstream.
        if layer_idx not in self.transformer_layers:
            layer_idx = self.transformer_layers[0]
        if len(self.key_cache) <= layer_idx or self.key_cache[layer_idx] is None:
            return 0
        return self.key_cache[layer_idx].shape[-2]

    def get_mask_sizes(self, cache_position: torch.Tensor, layer_idx: int) -> tuple[int, int]:
        """(kv_length, kv_offset) for the mask; the 4.x protocol passes the cache_position tensor."""
        query_length = cache_position.shape[0]
        return query_length + self.get_seq_length(layer_idx), 0

    @property
    def has_previous_state(self) -> bool:
        return self.last_linear_layer != -1 and self.conv_states[self.last_linear_layer] is not None


# ----------------------------------------------------------------------------------------------
# Multi-head latent attention (no RoPE)
# ----------------------------------------------------------------------------------------------


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with an additive mask; scores in the query dtype, softmax in fp32."""
    groups = module.num_key_value_groups
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


class KimiMLAAttention(nn.Module):
    """Multi-head latent attention without RoPE (mla_use_nope=True), optional sigmoid output gate."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.attention_dropout = getattr(config, "attention_dropout", 0.0)
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.use_nope = config.mla_use_nope
        self.scaling = self.q_head_dim**-0.5
        if not self.use_nope:
            raise ValueError("Kimi MLA needs mla_use_nope=True (no RoPE)")

        if self.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(self.hidden_size, self.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiRMSNorm(self.q_lora_rank)  # eps 1e-6, not rms_norm_eps
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = KimiRMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=False)
        self.is_causal = True
        self.use_output_gate = getattr(config, "mla_use_output_gate", False)
        if self.use_output_gate:
            self.g_proj = nn.Linear(self.hidden_size, self.num_heads * self.v_head_dim, bias=False)
        self.rotary_emb = None  # no RoPE anywhere in Kimi-K3

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        bsz, seq = hidden_states.shape[:-1]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, seq, -1, self.q_head_dim).transpose(1, 2)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(bsz, seq, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, value_states = kv.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        # The rope part of K is one vector shared by every head; no rotation is applied.
        k_rot = k_rot.view(bsz, 1, seq, self.qk_rope_head_dim).expand(*k_nope.shape[:-1], -1)
        query_states = q
        key_states = torch.cat([k_nope, k_rot], dim=-1)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        flash = self.config._attn_implementation == "flash_attention_2"
        if flash and self.q_head_dim != self.v_head_dim:
            value_states = F.pad(value_states, [0, self.q_head_dim - self.v_head_dim])
        attention: Callable = eager_attention_forward
        if self.config._attn_implementation != "eager":
            attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, _ = attention(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        if flash and self.q_head_dim != self.v_head_dim:
            out = out[:, :, :, : self.v_head_dim]
        out = out.reshape(bsz, seq, -1).contiguous()
        if self.use_output_gate:
            out = out * self.g_proj(hidden_states).sigmoid()
        return self.o_proj(out)


# ----------------------------------------------------------------------------------------------
# Kimi delta attention (fla-core kernels)
# ----------------------------------------------------------------------------------------------


@tensor_cache
def get_unpad_data(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(indices of kept tokens, cu_seqlens, longest sequence) for a [B, T] 0/1 mask."""
    lens = prepare_lens_from_mask(attention_mask)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    return indices, prepare_cu_seqlens_from_mask(attention_mask), int(lens.max().item())


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch_size: int, seq_len: int) -> torch.Tensor:
    out = hidden_states.new_zeros(batch_size * seq_len, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch_size, seq_len, *hidden_states.shape[1:])


class KimiDeltaAttention(nn.Module):
    """Gated delta rule with per-channel decay and short convolutions (fla's chunk/fused_recurrent KDA)."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.mode = "chunk"
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        lac = config.linear_attn_config
        self.conv_size = lac["short_conv_kernel_size"]
        self.head_dim = lac["head_dim"]
        self.num_heads = lac["num_heads"]
        self.head_k_dim = self.head_dim
        self.num_k_heads = self.num_heads
        projection_k_size = self.head_k_dim * self.num_k_heads
        projection_size = self.head_dim * self.num_heads

        self.q_proj = nn.Linear(self.hidden_size, projection_k_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, projection_k_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, projection_size, bias=False)
        self.q_conv1d = ShortConvolution(hidden_size=projection_k_size, kernel_size=self.conv_size, activation="silu")
        self.k_conv1d = ShortConvolution(hidden_size=projection_k_size, kernel_size=self.conv_size, activation="silu")
        self.v_conv1d = ShortConvolution(hidden_size=projection_size, kernel_size=self.conv_size, activation="silu")
        # Declared [num_heads]; the real checkpoint stores F32 [head_dim] with zeros past num_heads.
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_heads, dtype=torch.float32).uniform_(1, 16)))
        self.f_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, projection_size, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(projection_size, dtype=torch.float32))
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self.use_full_rank_gate = lac.get("use_full_rank_gate", False)
        self.gate_lower_bound = lac.get("gate_lower_bound", None)
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(self.hidden_size, projection_size, bias=False)
        else:
            self.g_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, projection_size, bias=False)
        self.o_norm = FusedRMSNormGated(self.head_dim, eps=config.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(projection_size, self.hidden_size, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache_params: KimiDynamicCache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """attention_mask: 2-D padding mask [B, T] (1 = keep) or None."""
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a 0-1 matrix of shape [batch_size, seq_len]")
        use_cache = cache_params is not None
        bsz, q_len, _ = hidden_states.shape
        mode = "fused_recurrent" if use_cache and q_len == 1 else self.mode

        cu_seqlens = kwargs.get("cu_seqlens")
        indices = None
        if attention_mask is not None:  # unpad: one packed row, sequences delimited by cu_seqlens
            indices, cu_seqlens, _ = get_unpad_data(attention_mask[:, -q_len:])
            hidden_states = rearrange(hidden_states, "b s ... -> (b s) ...")[indices].unsqueeze(0)

        conv_q = conv_k = conv_v = recurrent_state = None
        if cache_params is not None:
            if cache_params.conv_states[self.layer_idx] is not None:
                conv_q, conv_k, conv_v = cache_params.conv_states[self.layer_idx]
            recurrent_state = cache_params.recurrent_states[self.layer_idx]

        q, conv_q = self.q_conv1d(x=self.q_proj(hidden_states), cache=conv_q, output_final_state=use_cache, cu_seqlens=cu_seqlens)
        k, conv_k = self.k_conv1d(x=self.k_proj(hidden_states), cache=conv_k, output_final_state=use_cache, cu_seqlens=cu_seqlens)
        v, conv_v = self.v_conv1d(x=self.v_proj(hidden_states), cache=conv_v, output_final_state=use_cache, cu_seqlens=cu_seqlens)
        g = rearrange(self.f_b_proj(self.f_a_proj(hidden_states)), "... (h d) -> ... h d", d=self.head_dim)
        beta = self.b_proj(hidden_states).float()
        q, k = (rearrange(t, "... (h d) -> ... h d", d=self.head_k_dim) for t in (q, k))
        v = rearrange(v, "... (h d) -> ... h d", d=self.head_dim)

        kernel_kwargs: dict[str, Any] = dict(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            initial_state=recurrent_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=self.gate_lower_bound,
            transpose_state_layout=True,
            cu_seqlens=cu_seqlens,
        )
        if mode == "chunk":
            o, recurrent_state = chunk_kda(safe_gate=self.gate_lower_bound is not None, **kernel_kwargs)
        else:
            o, recurrent_state = fused_recurrent_kda(**kernel_kwargs)
        if cache_params is not None:
            cache_params.recurrent_states[self.layer_idx] = recurrent_state
            cache_params.conv_states[self.layer_idx] = (conv_q, conv_k, conv_v)

        gate = self.g_proj(hidden_states) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(hidden_states))
        o = self.o_norm(o, rearrange(gate, "... (h d) -> ... h d", d=self.head_dim))
        o = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        if attention_mask is not None:
            o = pad_input(o.squeeze(0), indices, bsz, q_len)
        return o


# ----------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------


class KimiMoEGate(nn.Module):
    """Router: sigmoid (or softmax) scores; bias-corrected top-k selection; returns (idx, fp32 weights)."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_token
        self.num_experts = config.num_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.moe_router_activation_func = config.moe_router_activation_func
        self.num_expert_group = getattr(config, "num_expert_group", 1)
        self.topk_group = getattr(config, "topk_group", 1)
        self.moe_renormalize = config.moe_renormalize
        self.gating_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.gating_dim))
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert not self.training  # inference only, as upstream
        bsz, seq_len, dim = hidden_states.shape  # 3-D input only
        n = bsz * seq_len
        logits = F.linear(hidden_states.view(-1, dim).float(), self.weight.float())
        if self.moe_router_activation_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=1)
        # The correction bias only decides which experts are picked, not their weights.
        choice = scores + self.e_score_correction_bias.unsqueeze(0)
        if self.num_expert_group > 1 and self.num_expert_group > self.topk_group:
            groups = self.num_expert_group
            group_scores = choice.view(n, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            keep = group_mask.unsqueeze(-1).expand(n, groups, self.num_experts // groups).reshape(n, -1)
            choice = choice.masked_fill(~keep.bool(), float("-inf"))
        topk_idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weight = scores.gather(1, topk_idx)
        if self.top_k > 1 and self.moe_renormalize:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * self.routed_scaling_factor


class KimiSparseMoeBlock(nn.Module):
    """Latent MoE: route on h, project to latent, routed experts, norm, project back, + shared experts(h)."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_dim = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.moe_renormalize = config.moe_renormalize
        self.use_latent_moe = getattr(config, "routed_expert_hidden_size", None) is not None
        self.moe_hidden_size = config.routed_expert_hidden_size if self.use_latent_moe else config.hidden_size
        self.latent_moe_use_norm = getattr(config, "latent_moe_use_norm", False)
        self.ep_size = 1
        self.experts_per_rank = config.num_experts
        self.ep_rank = 0
        self.experts = nn.ModuleList(
            KimiBlockSparseMLP(config, hidden_size=self.moe_hidden_size, intermediate_size=config.moe_intermediate_size)
            for _ in range(config.num_experts)
        )
        self.gate = KimiMoEGate(config)
        if config.num_shared_experts is not None:
            self.shared_experts = KimiMLP(
                config=config, intermediate_size=config.moe_intermediate_size * config.num_shared_experts
            )
        if self.use_latent_moe:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, self.moe_hidden_size, bias=False)
            self.routed_expert_up_proj = nn.Linear(self.moe_hidden_size, config.hidden_size, bias=False)
            if self.latent_moe_use_norm:
                self.routed_expert_norm = KimiRMSNorm(self.moe_hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        x = hidden_states.view(-1, hidden_states.shape[-1])
        if self.use_latent_moe:
            x = self.routed_expert_down_proj(x)
        if not self.training:
            y = self.moe_infer(x, topk_idx, topk_weight)
        else:
            y = self.moe_train(x, topk_idx, topk_weight)
        if self.use_latent_moe:
            if self.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        y = y.view(*orig_shape)
        if self.config.num_shared_experts is not None:
            y = y + self.shared_experts(identity)  # the shared experts see the un-projected h
        return y

    def moe_train(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """Per-expert masked dispatch with gradients; accumulates in x's dtype."""
        y = torch.zeros_like(x)
        with torch.no_grad():
            routed = F.one_hot(topk_ids, self.num_experts).permute(2, 1, 0)  # [E, k, N]
        for expert_idx, expert in enumerate(self.experts):
            slot, token = torch.where(routed[expert_idx])
            out = expert(x[token]) * topk_weight[token, slot, None]
            y.index_add_(0, token, out.to(y.dtype))
        return y

    @torch.no_grad()
    def moe_infer(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """x [N, D], topk_ids [N, k], topk_weight [N, k] fp32 -> [N, D] in x's dtype."""
        counts = topk_ids.new_zeros(topk_ids.shape[0], len(self.experts)).scatter_(1, topk_ids, 1).sum(dim=0)
        order = topk_ids.view(-1).argsort()
        sorted_tokens = x[order // topk_ids.shape[1]]
        outputs, start = [], 0
        for i, count in enumerate(counts.cpu().tolist()):  # host sync, as upstream
            if count == 0:
                continue
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            outputs.append(expert(sorted_tokens[start : start + count]))
            start += count
        outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0)
        unsorted = torch.empty_like(outs)
        unsorted[order] = outs
        # Combine in fp32 (the routing weights' dtype), then cast back.
        combined = unsorted.view(*topk_ids.shape, -1).to(topk_weight.dtype) * topk_weight.unsqueeze(-1)
        return combined.sum(dim=1).to(unsorted.dtype)


# ----------------------------------------------------------------------------------------------
# Attention residuals and decoder layer
# ----------------------------------------------------------------------------------------------


def _apply_attn_res(prefix_sum: torch.Tensor, block_residual: torch.Tensor, proj: nn.Linear, norm: KimiRMSNorm) -> torch.Tensor:
    """Softmax-over-depth mix of [R_1..R_n, p]. prefix_sum [N, D]; block_residual [N, n, D] -> [N, D].

    Scores: s_i = sum_d rmsnorm(V_i)_d * norm.weight_d * proj.weight_d (proj's forward is never called).
    """
    v = torch.cat([block_residual, prefix_sum.unsqueeze(1)], dim=1)
    vf = v.float()
    normed = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    scores = (normed * (norm.weight.float() * proj.weight.squeeze(0).float())).sum(-1)
    return torch.matmul(scores.softmax(-1).unsqueeze(1), vf).squeeze(1).to(v.dtype)


class KimiDecoderLayer(nn.Module):
    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.config = config
        self.layer_idx = layer_idx
        if config.is_kda_layer(layer_idx):
            self.is_linear_attn = True
            self.self_attn = KimiDeltaAttention(config=config, layer_idx=layer_idx)
        elif config.is_mla:
            self.is_linear_attn = False
            self.self_attn = KimiMLAAttention(config=config, layer_idx=layer_idx)
        else:
            raise NotImplementedError("every Kimi layer is KDA or MLA")
        moe_layer = layer_idx >= config.first_k_dense_replace and layer_idx % getattr(config, "moe_layer_freq", 1) == 0
        if config.num_experts is not None and moe_layer:
            self.block_sparse_moe = KimiSparseMoeBlock(config)
        else:
            self.mlp = KimiMLP(config)
        self.input_layernorm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.use_attn_residuals = getattr(config, "attn_res_block_size", None) is not None
        if self.use_attn_residuals:
            self.attn_res_block_size = config.attn_res_block_size
            self.self_attention_res_norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp_res_norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
            self.mlp_res_proj = nn.Linear(config.hidden_size, 1, bias=False)

    def _attention(self, hidden_states, attention_mask, position_ids, past_key_values, output_attentions, use_cache, **kwargs):
        if self.is_linear_attn:
            return self.self_attn(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                cache_params=past_key_values,
                output_attentions=output_attentions,
                use_cache=use_cache,
                **kwargs,
            )
        return self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            output_attentions=output_attentions,
            use_cache=use_cache,
            **kwargs,
        )

    def _ffn(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(hidden_states)
        return self.mlp(hidden_states)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        output_attentions: bool | None = False,
        use_cache: bool | None = False,
        block_residual: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With AttnRes: hidden_states is the running block sum, returns (it, block_residual). Without: h."""
        if self.use_attn_residuals:
            return self._forward_attn_residual(
                hidden_states, attention_mask, position_ids, past_key_values, output_attentions, use_cache,
                block_residual, **kwargs,
            )  # fmt: skip
        residual = hidden_states
        hidden_states = self._attention(
            self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_values, output_attentions,
            use_cache, **kwargs,
        )  # fmt: skip
        hidden_states = residual + hidden_states
        return hidden_states + self._ffn(self.post_attention_layernorm(hidden_states))

    def _forward_attn_residual(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        past_key_values: Any,
        output_attentions: bool | None,
        use_cache: bool | None,
        block_residual: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, seq, dim = hidden_states.shape
        prefix_sum = hidden_states
        is_block_start = self.layer_idx % self.attn_res_block_size == 0
        if block_residual.shape[1] > 0:
            hidden_states = _apply_attn_res(
                prefix_sum.view(-1, dim), block_residual, self.self_attention_res_proj, self.self_attention_res_norm
            ).view(bsz, seq, dim)
        if is_block_start:
            block_residual = torch.cat([block_residual, prefix_sum.view(-1, dim).unsqueeze(1)], dim=1)
        hidden_states = self._attention(
            self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_values, output_attentions,
            use_cache, **kwargs,
        )  # fmt: skip
        prefix_sum = hidden_states if is_block_start else prefix_sum + hidden_states
        hidden_states = _apply_attn_res(
            prefix_sum.view(-1, dim), block_residual, self.mlp_res_proj, self.mlp_res_norm
        ).view(bsz, seq, dim)
        prefix_sum = prefix_sum + self._ffn(self.post_attention_layernorm(hidden_states))
        return prefix_sum, block_residual


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


class KimiPreTrainedModel(PreTrainedModel):
    config_class = KimiLinearConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiDecoderLayer"]
    _skip_keys_device_placement = "past_key_values"
    _supports_flash_attn_2 = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(KimiBlockSparseMLP, index=1),
        "hidden_states": KimiDecoderLayer,
        "attentions": KimiMLAAttention,
    }
    _is_stateful = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()


class KimiLinearModel(KimiPreTrainedModel):
    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.use_attn_residuals = getattr(config, "attn_res_block_size", None) is not None
        if self.use_attn_residuals:
            self.output_attn_res_norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        # As the hub's file: whatever was asked for, use flash_attention_2.
        if getattr(config, "_attn_implementation", None) is not None:
            if config._attn_implementation != "flash_attention_2":
                logger.warning_once(f"Ignoring the provided attention implementation {config._attn_implementation}")
                config._attn_implementation = "flash_attention_2"
        self.gradient_checkpointing = False
        self.post_init()

    def _update_linear_attn_mask(self, attention_mask: torch.Tensor | None, cache_position: torch.Tensor) -> torch.Tensor | None:
        """KDA layers need the 2-D mask only for a prefill with padding."""
        if cache_position[0] > 0 or (attention_mask is not None and torch.all(attention_mask == 1)):
            return None
        return attention_mask

    @check_model_inputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        cache_position: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if (input_ids is None) and (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = KimiDynamicCache(config=self.config)
        if cache_position is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(past, past + inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            input_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache_position=cache_position,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        linear_attn_mask = self._update_linear_attn_mask(attention_mask, cache_position)

        hidden_states = inputs_embeds
        block_residual = None
        if self.use_attn_residuals:
            block_residual = hidden_states.new_zeros(hidden_states.shape[0] * hidden_states.shape[1], 0, hidden_states.shape[2])
        for layer in self.layers:
            layer_mask = linear_attn_mask if layer.is_linear_attn else causal_mask
            if self.use_attn_residuals:
                hidden_states, block_residual = layer(
                    hidden_states,
                    attention_mask=layer_mask,
                    past_key_values=past_key_values,
                    cache_position=cache_position,
                    block_residual=block_residual,
                    **kwargs,
                )
            else:
                hidden_states = layer(
                    hidden_states,
                    attention_mask=layer_mask,
                    past_key_values=past_key_values,
                    cache_position=cache_position,
                    **kwargs,
                )
        if self.use_attn_residuals:
            bsz, seq, dim = hidden_states.shape
            hidden_states = _apply_attn_res(
                hidden_states.view(-1, dim), block_residual, self.output_attn_res_proj, self.output_attn_res_norm
            ).view(bsz, seq, dim)
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


class KimiLinearForCausalLM(KimiPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__(config)
        self.model = KimiLinearModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def get_decoder(self) -> nn.Module:
        return self.model

    def set_decoder(self, decoder: nn.Module) -> None:
        self.model = decoder

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        generation_mode: bool | None = None,
        return_dict: bool | None = None,
        cache_position: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = self.config.use_return_dict if return_dict is None else return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=return_dict,
            cache_position=cache_position,
        )
        hidden = outputs[0]
        if generation_mode:
            hidden = hidden[:, -1:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
