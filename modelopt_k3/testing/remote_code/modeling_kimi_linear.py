# Tiny-checkpoint stand-in for the language-model file of Kimi-K3's remote code, written for modelopt_k3.
#
# What is the same as the real file is the contract, not the text: class and function names, constructor
# signatures, attribute names, the module tree with its parameter names/shapes/dtypes (A_log declared
# [num_heads] while checkpoints store [head_dim]), the forward math of kimi_k3_reference.md section 3, the
# fla-core kernels imported at module load, and the transformers-4-era calls of the hub's file (they fail
# on transformers 5.x; modelopt_k3.models.kimi_k3.shims adapts them, and the tiny generator's
# "transformers5" variant rewrites the same spots). The code itself is ours.
# This file is copied into generated checkpoints: it must not import modelopt_k3.
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
from transformers.cache_utils import Cache  # noqa: F401  (imported by the real file too)
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
from transformers.utils import can_return_tuple, logging
from transformers.utils.generic import OutputRecorder, check_model_inputs

from .configuration_kimi_k3 import KimiLinearConfig

logger = logging.get_logger(__name__)

FLASH = "flash_attention_2"
MLA_NORM_EPS = 1e-6  # the q_a / kv_a norms ignore rms_norm_eps


def _bias_free(n_in: int, n_out: int) -> nn.Linear:
    """Every projection of the model is a bias-free Linear [n_out, n_in]."""
    return nn.Linear(n_in, n_out, bias=False)


def _split_heads(t: torch.Tensor, width: int) -> torch.Tensor:
    return t.unflatten(-1, (-1, width))


# ----------------------------------------------------------------------------------------------
# Activation, RMSNorm, gated feed-forwards
# ----------------------------------------------------------------------------------------------


class SituAndMul(nn.Module):
    """y = beta*tanh(g/beta)*sigmoid(g) * clamp(u), x = [g | u]; clamp(u) = lbeta*tanh(u/lbeta), or u without
    lbeta. Evaluated in fp32, returned in the input dtype."""

    def __init__(self, beta: float = 1.0, linear_beta: float | None = None) -> None:
        super().__init__()
        self.beta = beta
        self.linear_beta = linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_half, up_half = x.float().chunk(2, dim=-1)
        soft_gate = torch.sigmoid(gate_half) * (self.beta * torch.tanh(gate_half / self.beta))
        if self.linear_beta is not None:
            up_half = torch.tanh(up_half / self.linear_beta) * self.linear_beta
        return (soft_gate * up_half).type_as(x)


# The hub file registers the class itself: ACT2FN["situ"] is then a default SituAndMul (beta 1, no clamp).
# The feed-forwards below build theirs from the config instead.
ACT2FN["situ"] = SituAndMul


def _activation_for(config: KimiLinearConfig) -> nn.Module:
    if config.hidden_act != "situ":
        return ACT2FN[config.hidden_act]
    beta = config.activation_situ_beta if config.activation_situ_beta else 1.0
    return SituAndMul(beta=beta, linear_beta=config.activation_situ_linear_beta)


def _gated(act: nn.Module, is_situ: bool, gate_out: torch.Tensor, up_out: torch.Tensor) -> torch.Tensor:
    # SituAndMul takes both halves at once; any other activation only sees the gate.
    return act(torch.cat((gate_out, up_out), dim=-1)) if is_situ else act(gate_out) * up_out


class KimiRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        wide = hidden_states.float()
        inv_rms = wide.square().mean(dim=-1, keepdim=True).add(self.variance_epsilon).rsqrt()
        # The weight multiplies after the cast back: an fp32 weight promotes a bf16 activation to fp32.
        return self.weight * (wide * inv_rms).type_as(hidden_states)


ALL_LAYERNORM_LAYERS.append(KimiRMSNorm)


class KimiBlockSparseMLP(nn.Module):
    """One routed expert: w1 (gate) and w3 (up) are [I, D], w2 (down) is [D, I]."""

    def __init__(
        self, config: KimiLinearConfig, hidden_size: int | None = None, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.hidden_dim = hidden_size or config.hidden_size
        self.ffn_dim = intermediate_size or config.intermediate_size
        self.w1 = _bias_free(self.hidden_dim, self.ffn_dim)
        self.w2 = _bias_free(self.ffn_dim, self.hidden_dim)
        self.w3 = _bias_free(self.hidden_dim, self.ffn_dim)
        self.act_fn = _activation_for(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        inner = _gated(self.act_fn, self.config.hidden_act == "situ", self.w1(hidden_states), self.w3(hidden_states))
        return self.w2(inner)


class KimiMLP(nn.Module):
    """Dense gated feed-forward: layer 0's ``mlp`` and every MoE layer's ``shared_experts``."""

    def __init__(
        self, config: KimiLinearConfig, hidden_size: int | None = None, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size or config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = _bias_free(self.hidden_size, self.intermediate_size)
        self.up_proj = _bias_free(self.hidden_size, self.intermediate_size)
        self.down_proj = _bias_free(self.intermediate_size, self.hidden_size)
        self.act_fn = _activation_for(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_gated(self.act_fn, self.config.hidden_act == "situ", self.gate_proj(x), self.up_proj(x)))


# ----------------------------------------------------------------------------------------------
# Cache: a plain object, not a transformers Cache (as in the real file)
# ----------------------------------------------------------------------------------------------


class KimiDynamicCache:
    """MLA layers keep key/value tensors [B, H, T, d]; KDA layers keep conv tails and the recurrent state."""

    is_compileable = False

    def __init__(self, config: KimiLinearConfig) -> None:
        self.config = config
        depth = config.num_hidden_layers
        self.layer_types = [("linear_attention" if config.is_kda_layer(i) else "full_attention") for i in range(depth)]
        self.transformer_layers = [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]
        kda = [i for i, kind in enumerate(self.layer_types) if kind == "linear_attention"]
        self.last_linear_layer = kda[-1] if kda else -1
        self.key_cache: list[Any] = [None for _ in range(depth)]
        self.value_cache: list[Any] = [None for _ in range(depth)]
        self.conv_states: list[Any] = [None for _ in range(depth)]
        self.recurrent_states: list[Any] = [None for _ in range(depth)]

    def __len__(self) -> int:
        return len(self.layer_types)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values along the time axis; return everything cached for the layer."""
        for store, new in ((self.key_cache, key_states), (self.value_cache, value_states)):
            old = store[layer_idx]
            store[layer_idx] = new if old is None else torch.cat((old, new), dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        # KDA layers hold no per-token tensors: count on the first MLA layer instead.
        mla = layer_idx if layer_idx in self.transformer_layers else self.transformer_layers[0]
        keys = self.key_cache[mla] if mla < len(self.key_cache) else None
        return 0 if keys is None else int(keys.shape[2])

    def get_mask_sizes(self, cache_position: torch.Tensor, layer_idx: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask; transformers 4 hands over the cache_position tensor."""
        new_tokens = len(cache_position)
        return self.get_seq_length(layer_idx) + new_tokens, 0

    @property
    def has_previous_state(self) -> bool:
        if self.last_linear_layer < 0:
            return False
        return self.conv_states[self.last_linear_layer] is not None


# ----------------------------------------------------------------------------------------------
# MLA: multi-head latent attention, no rotary embedding at all
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
    """softmax(q k^T * scaling + mask) v for [B, H, T, d] inputs; returns ([B, T, H, dv], probabilities)."""
    repeat = module.num_key_value_groups
    key, value = (t if repeat == 1 else t.repeat_interleave(repeat, dim=1) for t in (key, value))
    logits = torch.einsum("bhqd,bhkd->bhqk", query, key) * scaling
    if attention_mask is not None:
        logits = logits + attention_mask[..., : key.size(2)]
    weights = logits.float().softmax(dim=-1).to(query.dtype)
    if module.training and dropout > 0:
        weights = F.dropout(weights, p=dropout)
    return torch.einsum("bhqk,bhkd->bqhd", weights, value).contiguous(), weights


class KimiMLAAttention(nn.Module):
    """Latent (low-rank) queries and keys/values; the rope slice of K is one vector shared by all heads,
    used as is (mla_use_nope). Optional sigmoid output gate ``g_proj``."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        assert config.mla_use_nope, "Kimi MLA layers apply no rotary embedding: mla_use_nope must be True"
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.attention_dropout = getattr(config, "attention_dropout", 0.0)
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.use_nope = config.mla_use_nope
        self.scaling = 1.0 / math.sqrt(self.q_head_dim)
        self.is_causal = True
        self.rotary_emb = None

        width, heads = self.hidden_size, self.num_heads
        if self.q_lora_rank is None:
            self.q_proj = _bias_free(width, heads * self.q_head_dim)
        else:
            self.q_a_proj = _bias_free(width, self.q_lora_rank)
            self.q_a_layernorm = KimiRMSNorm(self.q_lora_rank, eps=MLA_NORM_EPS)
            self.q_b_proj = _bias_free(self.q_lora_rank, heads * self.q_head_dim)
        self.kv_a_proj_with_mqa = _bias_free(width, self.kv_lora_rank + self.qk_rope_head_dim)
        self.kv_a_layernorm = KimiRMSNorm(self.kv_lora_rank, eps=MLA_NORM_EPS)
        self.kv_b_proj = _bias_free(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = _bias_free(heads * self.v_head_dim, width)
        self.use_output_gate = bool(getattr(config, "mla_use_output_gate", False))
        if self.use_output_gate:
            self.g_proj = _bias_free(width, heads * self.v_head_dim)

    def _queries(self, h: torch.Tensor) -> torch.Tensor:
        flat = self.q_proj(h) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        return _split_heads(flat, self.q_head_dim).transpose(1, 2)  # [B, H, T, dq]

    def _keys_values(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        compressed = self.kv_a_proj_with_mqa(h)
        latent, shared_rope = compressed[..., : self.kv_lora_rank], compressed[..., self.kv_lora_rank :]
        per_head = _split_heads(self.kv_b_proj(self.kv_a_layernorm(latent)), self.qk_nope_head_dim + self.v_head_dim)
        per_head = per_head.transpose(1, 2)  # [B, H, T, nope + v]
        k_nope, values = per_head[..., : self.qk_nope_head_dim], per_head[..., self.qk_nope_head_dim :]
        rope = shared_rope.unsqueeze(1).expand(-1, k_nope.size(1), -1, -1)
        return torch.cat((k_nope, rope), dim=-1), values

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        queries = self._queries(hidden_states)
        keys, values = self._keys_values(hidden_states)
        if past_key_values is not None:
            keys, values = past_key_values.update(keys, values, self.layer_idx)

        impl = self.config._attn_implementation
        # Flash kernels want equal q/k and v head widths: pad V with zeros and cut the output back.
        pad_v = self.q_head_dim - self.v_head_dim if impl == FLASH else 0
        if pad_v > 0:
            values = F.pad(values, (0, pad_v))
        attend: Callable = eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
        context, _ = attend(
            self,
            queries,
            keys,
            values,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        if pad_v > 0:
            context = context[..., : self.v_head_dim]
        context = context.flatten(2)  # [B, T, H * v]
        if self.use_output_gate:
            context = context * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(context)


# ----------------------------------------------------------------------------------------------
# KDA: Kimi delta attention on fla-core's kernels
# ----------------------------------------------------------------------------------------------


@tensor_cache
def get_unpad_data(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Flat positions of the kept tokens of a [B, T] 0/1 mask, its cu_seqlens, and the longest length."""
    kept = attention_mask.reshape(-1).nonzero().squeeze(-1)
    longest = int(prepare_lens_from_mask(attention_mask).max())
    return kept, prepare_cu_seqlens_from_mask(attention_mask), longest


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch_size: int, seq_len: int) -> torch.Tensor:
    """Inverse of the unpadding: rows back at ``indices`` of a zero [B * T, ...] tensor, as [B, T, ...]."""
    full = torch.zeros((batch_size * seq_len, *hidden_states.shape[1:]), dtype=hidden_states.dtype, device=hidden_states.device)
    full.index_copy_(0, indices, hidden_states)
    return full.unflatten(0, (batch_size, seq_len))


class KimiDeltaAttention(nn.Module):
    """Short causal convolutions on q/k/v, a per-channel decay gate (A_log, dt_bias, low-rank f_a/f_b),
    a sigmoid beta, the delta-rule recurrence, and a sigmoid-gated RMSNorm on the output."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        spec = config.linear_attn_config
        self.config = config
        self.layer_idx = layer_idx
        self.mode = "chunk"
        self.hidden_size = config.hidden_size
        self.conv_size = spec["short_conv_kernel_size"]
        self.head_dim = spec["head_dim"]
        self.num_heads = spec["num_heads"]
        self.head_k_dim = spec["head_dim"]
        self.num_k_heads = spec["num_heads"]
        self.use_full_rank_gate = spec.get("use_full_rank_gate", False)
        self.gate_lower_bound = spec.get("gate_lower_bound")
        width, inner, rank = self.hidden_size, self.num_heads * self.head_dim, self.head_dim

        self.q_proj = _bias_free(width, inner)
        self.k_proj = _bias_free(width, inner)
        self.v_proj = _bias_free(width, inner)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            ShortConvolution(hidden_size=inner, kernel_size=self.conv_size, activation="silu") for _ in range(3)
        )
        # [num_heads] as declared by the real code (its checkpoint stores [head_dim], zero past num_heads).
        a_init = torch.empty(self.num_heads, dtype=torch.float32).uniform_(1.0, 16.0)
        self.A_log = nn.Parameter(a_init.log())
        self.f_a_proj = _bias_free(width, rank)
        self.f_b_proj = _bias_free(rank, inner)
        self.dt_bias = nn.Parameter(torch.empty(inner, dtype=torch.float32))
        self.b_proj = _bias_free(width, self.num_heads)
        if self.use_full_rank_gate:
            self.g_proj = _bias_free(width, inner)
        else:
            self.g_a_proj = _bias_free(width, rank)
            self.g_b_proj = _bias_free(rank, inner)
        self.o_norm = FusedRMSNormGated(self.head_dim, eps=config.rms_norm_eps, activation="sigmoid")
        self.o_proj = _bias_free(inner, width)

    def _output_gate(self, h: torch.Tensor) -> torch.Tensor:
        return self.g_proj(h) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(h))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache_params: KimiDynamicCache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """attention_mask: None or a 2-D [B, T] padding mask (1 keeps a token)."""
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError("KDA takes a 2-D [batch, seq_len] 0/1 padding mask")
        batch, steps = hidden_states.shape[0], hidden_states.shape[1]
        caching = cache_params is not None
        decode = caching and steps == 1

        # With padding, every kept token goes into one packed row and cu_seqlens marks the sequences.
        cu_seqlens, kept = kwargs.get("cu_seqlens"), None
        if attention_mask is not None:
            kept, cu_seqlens, _ = get_unpad_data(attention_mask[:, -steps:])
            hidden_states = hidden_states.flatten(0, 1).index_select(0, kept).unsqueeze(0)

        conv_in, state_in = (None, None, None), None
        if caching:
            conv_in = cache_params.conv_states[self.layer_idx] or conv_in
            state_in = cache_params.recurrent_states[self.layer_idx]

        streams, conv_out = [], []
        for proj, conv, tail in zip(
            (self.q_proj, self.k_proj, self.v_proj), (self.q_conv1d, self.k_conv1d, self.v_conv1d), conv_in
        ):
            mixed, new_tail = conv(x=proj(hidden_states), cache=tail, output_final_state=caching, cu_seqlens=cu_seqlens)
            streams.append(rearrange(mixed, "... (h d) -> ... h d", d=self.head_dim))
            conv_out.append(new_tail)
        q, k, v = streams
        raw_decay = rearrange(self.f_b_proj(self.f_a_proj(hidden_states)), "... (h d) -> ... h d", d=self.head_dim)
        raw_beta = self.b_proj(hidden_states).float()

        common = dict(
            initial_state=state_in,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=self.gate_lower_bound,
            transpose_state_layout=True,
            cu_seqlens=cu_seqlens,
        )
        if decode:
            o, state_out = fused_recurrent_kda(
                q, k, v, raw_decay, raw_beta, A_log=self.A_log, dt_bias=self.dt_bias, **common
            )
        else:
            o, state_out = chunk_kda(
                q, k, v, raw_decay, raw_beta, A_log=self.A_log, dt_bias=self.dt_bias,
                safe_gate=self.gate_lower_bound is not None, **common,
            )  # fmt: skip
        if caching:
            cache_params.conv_states[self.layer_idx] = tuple(conv_out)
            cache_params.recurrent_states[self.layer_idx] = state_out

        gate = rearrange(self._output_gate(hidden_states), "... (h d) -> ... h d", d=self.head_dim)
        out = self.o_proj(self.o_norm(o, gate).flatten(-2))
        return out if kept is None else pad_input(out[0], kept, batch, steps)


# ----------------------------------------------------------------------------------------------
# Mixture of experts
# ----------------------------------------------------------------------------------------------


class KimiMoEGate(nn.Module):
    """Router. Returns (topk_idx [N, k] int64, topk_weight [N, k] fp32) for a [B, T, D] input, no logits."""

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
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Grouped selection: keep the topk_group groups with the best top-2 sums, the rest at -inf."""
        grouped = choice.unflatten(-1, (self.num_expert_group, -1))  # [N, G, E/G]
        strength = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        winners = strength.topk(self.topk_group, dim=-1).indices
        dropped = torch.ones_like(strength, dtype=torch.bool).scatter(1, winners, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).flatten(1)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert not self.training, "KimiMoEGate is inference-only"
        b, t, d = hidden_states.shape  # the real router needs 3-D input as well
        logits = hidden_states.reshape(b * t, d).float() @ self.weight.float().t()
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise NotImplementedError(f"router activation {self.moe_router_activation_func!r}")
        scores = logits.sigmoid() if self.moe_router_activation_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias.unsqueeze(0)  # the bias picks experts, never weighs them
        if self.num_expert_group > max(1, self.topk_group):
            choice = self._mask_groups(choice)
        picked = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = torch.gather(scores, 1, picked)
        if self.moe_renormalize and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return picked, self.routed_scaling_factor * weights


class KimiSparseMoeBlock(nn.Module):
    """Route on h; the routed experts work in the latent width (down-projection, experts, norm,
    up-projection); the shared experts see h itself."""

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
        # Expert parallelism of the real code: this rank owns experts [ep_rank * experts_per_rank, ...).
        self.ep_size, self.ep_rank = 1, 0
        self.experts_per_rank = config.num_experts
        self.experts = nn.ModuleList(
            [
                KimiBlockSparseMLP(config, hidden_size=self.moe_hidden_size, intermediate_size=config.moe_intermediate_size)
                for _ in range(config.num_experts)
            ]
        )
        self.gate = KimiMoEGate(config)
        if config.num_shared_experts is not None:
            shared_width = config.num_shared_experts * config.moe_intermediate_size
            self.shared_experts = KimiMLP(config=config, intermediate_size=shared_width)
        if self.use_latent_moe:
            self.routed_expert_down_proj = _bias_free(config.hidden_size, self.moe_hidden_size)
            self.routed_expert_up_proj = _bias_free(self.moe_hidden_size, config.hidden_size)
            if self.latent_moe_use_norm:
                self.routed_expert_norm = KimiRMSNorm(self.moe_hidden_size, eps=config.rms_norm_eps)

    def _to_latent(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed_expert_down_proj(x) if self.use_latent_moe else x

    def _from_latent(self, y: torch.Tensor) -> torch.Tensor:
        if not self.use_latent_moe:
            return y
        if self.latent_moe_use_norm:
            y = self.routed_expert_norm(y)
        return self.routed_expert_up_proj(y)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_idx, topk_weight = self.gate(hidden_states)
        tokens = self._to_latent(hidden_states.flatten(0, -2))
        dispatch = self.moe_train if self.training else self.moe_infer
        routed = self._from_latent(dispatch(tokens, topk_idx, topk_weight)).view_as(hidden_states)
        if self.config.num_shared_experts is None:
            return routed
        return routed + self.shared_experts(hidden_states)

    def moe_train(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """Differentiable dispatch: one masked pass per expert, accumulated in x's dtype."""
        acc = x.new_zeros(x.shape)
        for e, expert in enumerate(self.experts):
            token, slot = (topk_ids == e).nonzero(as_tuple=True)
            if token.numel():
                contrib = expert(x[token]) * topk_weight[token, slot].unsqueeze(-1)
                acc = acc.index_add(0, token, contrib.to(acc.dtype))
        return acc

    @torch.no_grad()
    def moe_infer(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """x [N, D] (latent width), topk_ids [N, k], topk_weight [N, k] fp32 -> [N, D] in x's dtype.

        Token copies are grouped by expert, each expert runs once on its contiguous group, and the results
        are weighted and summed per token in fp32 (the weights' dtype)."""
        n, k = topk_ids.shape
        flat = topk_ids.flatten()
        order = flat.argsort()
        sizes = torch.bincount(flat, minlength=len(self.experts)).cpu().tolist()  # host sync, as upstream
        offset = self.ep_rank * self.experts_per_rank
        groups = x.index_select(0, order // k).split(sizes)
        ran = [self.experts[e + offset](group) for e, group in enumerate(groups) if group.shape[0] > 0]
        by_expert = torch.cat(ran) if ran else x.new_empty((0, x.shape[-1]))
        by_slot = torch.empty_like(by_expert).index_copy_(0, order, by_expert)
        weighted = by_slot.view(n, k, -1).to(topk_weight.dtype) * topk_weight.unsqueeze(-1)
        return weighted.sum(dim=1).to(by_slot.dtype)


# ----------------------------------------------------------------------------------------------
# Attention residuals (AttnRes) and the decoder layer
# ----------------------------------------------------------------------------------------------


def _apply_attn_res(prefix_sum: torch.Tensor, block_residual: torch.Tensor, proj: nn.Linear, norm: KimiRMSNorm) -> torch.Tensor:
    """Softmax over depth of the candidates V = [R_1 .. R_n, p]: prefix_sum p [N, D], block_residual [N, n, D].

    Candidate i scores sum_d rmsnorm(V_i)_d * norm.weight_d * proj.weight_d; ``proj`` is only a weight
    vector here (its forward is never called). Computed in fp32, returned in the candidates' dtype.
    """
    candidates = torch.cat((block_residual, prefix_sum.unsqueeze(1)), dim=1)
    wide = candidates.float()
    inv_rms = wide.square().mean(dim=-1, keepdim=True).add(norm.variance_epsilon).rsqrt()
    query = norm.weight.float() * proj.weight.float().flatten()
    mix = ((wide * inv_rms) * query).sum(dim=-1).softmax(dim=-1)  # [N, n + 1]
    return torch.bmm(mix.unsqueeze(1), wide)[:, 0].to(candidates.dtype)


class KimiDecoderLayer(nn.Module):
    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        # linear_attn_config lists are 1-indexed; a layer missing from kda_layers is MLA.
        self.is_linear_attn = config.is_kda_layer(layer_idx)
        if not self.is_linear_attn and not config.is_mla:
            raise NotImplementedError(f"layer {layer_idx} is neither a KDA nor an MLA layer")
        attention_cls = KimiDeltaAttention if self.is_linear_attn else KimiMLAAttention
        self.self_attn = attention_cls(config=config, layer_idx=layer_idx)
        freq = getattr(config, "moe_layer_freq", 1)
        sparse = config.num_experts is not None and layer_idx >= config.first_k_dense_replace and layer_idx % freq == 0
        if sparse:
            self.block_sparse_moe = KimiSparseMoeBlock(config)
        else:
            self.mlp = KimiMLP(config)
        width, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = KimiRMSNorm(width, eps=eps)
        self.post_attention_layernorm = KimiRMSNorm(width, eps=eps)
        self.use_attn_residuals = getattr(config, "attn_res_block_size", None) is not None
        if self.use_attn_residuals:
            self.attn_res_block_size = config.attn_res_block_size
            self.self_attention_res_norm = KimiRMSNorm(width, eps=eps)
            self.mlp_res_norm = KimiRMSNorm(width, eps=eps)
            self.self_attention_res_proj = _bias_free(width, 1)
            self.mlp_res_proj = _bias_free(width, 1)

    def _mix(self, partial: torch.Tensor, residuals: torch.Tensor, proj: nn.Linear, norm: KimiRMSNorm) -> torch.Tensor:
        shape = partial.shape
        return _apply_attn_res(partial.flatten(0, 1), residuals, proj, norm).view(shape)

    def _attend(self, x: torch.Tensor, mask: Any, position_ids: Any, cache: Any, **kwargs: Any) -> torch.Tensor:
        x = self.input_layernorm(x)
        if self.is_linear_attn:
            return self.self_attn(hidden_states=x, attention_mask=mask, cache_params=cache, **kwargs)
        return self.self_attn(hidden_states=x, attention_mask=mask, position_ids=position_ids, past_key_values=cache, **kwargs)

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.post_attention_layernorm(x)
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

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
        """Plain pre-norm residual layer -> h. With AttnRes, ``hidden_states`` is the running sum of the
        current block and ``block_residual`` [B*T, n, D] the finished blocks -> (running sum, block_residual)."""
        kwargs.update(output_attentions=output_attentions, use_cache=use_cache)
        if not self.use_attn_residuals:
            h = hidden_states + self._attend(hidden_states, attention_mask, position_ids, past_key_values, **kwargs)
            return h + self._feed_forward(h)

        running = hidden_states
        opens_block = self.layer_idx % self.attn_res_block_size == 0
        attn_in = running
        if block_residual.size(1):
            attn_in = self._mix(running, block_residual, self.self_attention_res_proj, self.self_attention_res_norm)
        if opens_block:  # the finished block joins the residual stack after it fed this layer's input
            block_residual = torch.cat((block_residual, running.flatten(0, 1).unsqueeze(1)), dim=1)
        attn_out = self._attend(attn_in, attention_mask, position_ids, past_key_values, **kwargs)
        running = attn_out if opens_block else running + attn_out
        ffn_in = self._mix(running, block_residual, self.mlp_res_proj, self.mlp_res_norm)
        return running + self._feed_forward(ffn_in), block_residual


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

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """N(0, initializer_range) for Linear and Embedding weights; zero biases and the padding row."""
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return
        nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        bias = getattr(module, "bias", None)
        if bias is not None:
            nn.init.zeros_(bias)
        pad = getattr(module, "padding_idx", None)
        if pad is not None:
            module.weight[pad].fill_(0.0)


def _kda_padding_mask(attention_mask: torch.Tensor | None, cache_position: torch.Tensor) -> torch.Tensor | None:
    """KDA layers take the 2-D mask only on a first (prefill) pass that really pads something."""
    if attention_mask is None or cache_position[0] > 0 or bool(attention_mask.all()):
        return None
    return attention_mask


class KimiLinearModel(KimiPreTrainedModel):
    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList([KimiDecoderLayer(config, idx) for idx in range(config.num_hidden_layers)])
        self.norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.use_attn_residuals = getattr(config, "attn_res_block_size", None) is not None
        if self.use_attn_residuals:
            self.output_attn_res_norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.output_attn_res_proj = _bias_free(config.hidden_size, 1)
        # Hub behaviour: flash attention is imposed, whatever the caller asked for.
        requested = getattr(config, "_attn_implementation", None)
        if requested is not None:
            if requested != FLASH:
                logger.warning_once(f"KimiLinearModel: attention implementation {requested!r} replaced by {FLASH}")
            config._attn_implementation = "flash_attention_2"
        self.gradient_checkpointing = False
        self.post_init()

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
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("KimiLinearModel needs input_ids or inputs_embeds")
            inputs_embeds = self.embed_tokens(input_ids)
        if past_key_values is None and (self.config.use_cache if use_cache is None else use_cache):
            past_key_values = KimiDynamicCache(config=self.config)
        if cache_position is None:
            seen = 0 if past_key_values is None else past_key_values.get_seq_length()
            cache_position = seen + torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position[None]

        causal_mask = create_causal_mask(
            config=self.config,
            input_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache_position=cache_position,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        kda_mask = _kda_padding_mask(attention_mask, cache_position)

        if past_key_values is not None:  # the real model accepts its own cache class only
            assert isinstance(past_key_values, KimiDynamicCache), type(past_key_values).__name__
        h = inputs_embeds
        stack = h.new_zeros((h.shape[0] * h.shape[1], 0, h.shape[2])) if self.use_attn_residuals else None
        for layer in self.layers:
            step_kwargs = dict(
                attention_mask=kda_mask if layer.is_linear_attn else causal_mask,
                past_key_values=past_key_values,
                cache_position=cache_position,
                **kwargs,
            )
            if stack is None:
                h = layer(h, **step_kwargs)
            else:
                h, stack = layer(h, block_residual=stack, **step_kwargs)
        if stack is not None:
            h = _apply_attn_res(h.flatten(0, 1), stack, self.output_attn_res_proj, self.output_attn_res_norm).view_as(h)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), past_key_values=past_key_values)


class KimiLinearForCausalLM(KimiPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__(config)
        self.vocab_size = config.vocab_size
        self.model = KimiLinearModel(config)
        self.lm_head = _bias_free(config.hidden_size, config.vocab_size)
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
        cfg = self.config
        base = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=cfg.output_attentions if output_attentions is None else output_attentions,
            output_hidden_states=cfg.output_hidden_states if output_hidden_states is None else output_hidden_states,
            return_dict=cfg.use_return_dict if return_dict is None else return_dict,
            cache_position=cache_position,
        )
        last = base.last_hidden_state
        logits = self.lm_head(last[:, -1:] if generation_mode else last)
        loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=base.past_key_values,
            hidden_states=base.hidden_states,
            attentions=base.attentions,
        )
