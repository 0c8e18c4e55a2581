# Stand-in for the Kimi-K3 checkpoint's own language-model code (tiny test checkpoints).
# Same class names, module tree, parameter names/shapes and forward math as the real remote code
# (see docs/kimi_k3_reference.md); written for this project, simplified where it does not matter
# (no flash-attention, no output recording, a minimal cache).
# This file ships inside generated checkpoints: it must not import modelopt_k3.
# On CPU the KDA layers run a plain torch reference; with CUDA they call fla-core's kernels,
# imported lazily so that CPU-only installs (no triton) never import fla.
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from .configuration_kimi_k3 import KimiLinearConfig

# ----------------------------------------------------------------------------------------------
# Small building blocks
# ----------------------------------------------------------------------------------------------


class SituAndMul(nn.Module):
    """x = [g | u] -> beta*tanh(g/beta)*sigmoid(g) * (beta_lin*tanh(u/beta_lin) | u), in fp32."""

    def __init__(self, beta: float | None = 1.0, linear_beta: float | None = None) -> None:
        super().__init__()
        self.beta = float(beta) if beta else 1.0
        self.linear_beta = float(linear_beta) if linear_beta else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = x.float().chunk(2, dim=-1)
        act = self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g)
        if self.linear_beta is not None:
            u = self.linear_beta * torch.tanh(u / self.linear_beta)
        return (act * u).to(x.dtype)


class KimiRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        # Multiply after casting back: an fp32 weight promotes a bf16 input to fp32 (as upstream).
        return self.weight * x.to(input_dtype)


class KimiGatedRMSNorm(nn.Module):
    """Weights-compatible CPU stand-in for fla's FusedRMSNormGated(dk, eps, activation="sigmoid")."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.activation = "sigmoid"
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from fla.modules.norm.fused_norm_gate import rms_norm_gated

            return rms_norm_gated(x, gate, self.weight, None, activation="sigmoid", eps=self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * torch.sigmoid(gate.float())).to(x.dtype)


def _output_with_cache(cls: type, cache: Any, **fields: Any) -> Any:
    """transformers 5.24 renamed the outputs' `past_key_values` field to `cache`; support both."""
    name = "cache" if "cache" in getattr(cls, "__dataclass_fields__", {}) else "past_key_values"
    return cls(**fields, **{name: cache})


def _cache_of(output: Any) -> Any:
    return getattr(output, "cache", None) if hasattr(output, "cache") else output.past_key_values


# As upstream: "situ" is registered globally, but ACT2FN["situ"] is SituAndMul() with beta=1 and no
# linear clamp, so the modules below never use it.
if "situ" not in ACT2FN:
    ACT2FN["situ"] = SituAndMul


def _make_act(config: KimiLinearConfig) -> nn.Module:
    if config.hidden_act == "situ":
        # Never ACT2FN["situ"]: it would ignore the configured betas.
        return SituAndMul(config.activation_situ_beta, config.activation_situ_linear_beta)
    return ACT2FN[config.hidden_act]


class KimiBlockSparseMLP(nn.Module):
    """One routed expert: w1 (gate) [I, Dl], w3 (up) [I, Dl], w2 (down) [Dl, I]."""

    def __init__(self, config: KimiLinearConfig, hidden_dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.ffn_dim = ffn_dim
        self.w1 = nn.Linear(hidden_dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(hidden_dim, ffn_dim, bias=False)
        self.is_situ = config.hidden_act == "situ"
        self.act_fn = _make_act(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_situ:
            return self.w2(self.act_fn(torch.cat([self.w1(x), self.w3(x)], dim=-1)))
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class KimiMLP(nn.Module):
    """Dense gated MLP (layer-0 `mlp` and the `shared_experts`)."""

    def __init__(
        self, config: KimiLinearConfig, hidden_size: int | None = None, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.is_situ = config.hidden_act == "situ"
        self.act_fn = _make_act(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_situ:
            return self.down_proj(self.act_fn(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------------------------
# Cache (minimal; use_cache=False avoids it entirely)
# ----------------------------------------------------------------------------------------------


class KimiDynamicCache:
    """Per-layer MLA key/value cache and KDA conv/recurrent states. Not a transformers Cache."""

    is_compileable = False

    def __init__(self, config: KimiLinearConfig) -> None:
        n = config.num_hidden_layers
        self.layer_types = ["linear_attention" if config.is_kda_layer(i) else "full_attention" for i in range(n)]
        self.transformer_layers = [i for i, t in enumerate(self.layer_types) if t == "full_attention"]
        self.conv_states: list[Any] = [None] * n
        self.recurrent_states: list[Any] = [None] * n
        self.key_cache: list[Any] = [None] * n
        self.value_cache: list[Any] = [None] * n
        self._seen_tokens = 0

    def __len__(self) -> int:
        return len(self.layer_types)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.key_cache[layer_idx] is None:
            self.key_cache[layer_idx] = key_states
            self.value_cache[layer_idx] = value_states
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        # Falls back to the first MLA layer (KDA layers keep no per-token state), as upstream.
        if layer_idx is None or self.layer_types[layer_idx] != "full_attention":
            if not self.transformer_layers:
                return self._seen_tokens
            layer_idx = self.transformer_layers[0]
        if self.key_cache[layer_idx] is None:
            return 0
        return self.key_cache[layer_idx].shape[-2]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        q_len = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return q_len + self.get_seq_length(layer_idx), 0

    @property
    def has_previous_state(self) -> bool:
        return any(s is not None for s in self.conv_states)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


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
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.scaling = self.q_head_dim**-0.5
        self.use_output_gate = config.mla_use_output_gate
        self.rotary_emb = None  # no RoPE anywhere in Kimi-K3
        self.is_causal = True

        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.q_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(self.hidden_size, self.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiRMSNorm(self.q_lora_rank, eps=1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = KimiRMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=False)
        if self.use_output_gate:
            self.g_proj = nn.Linear(self.hidden_size, self.num_heads * self.v_head_dim, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KimiDynamicCache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """attention_mask: additive float mask [B, 1, T, S] (the model builds it), or None for causal."""
        bsz, q_len, _ = hidden_states.shape
        h, nope, rope, vd = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim

        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, q_len, h, self.q_head_dim).transpose(1, 2)

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        c, k_rot = compressed_kv.split([self.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(bsz, q_len, h, nope + vd).transpose(1, 2)
        k_nope, value_states = kv.split([nope, vd], dim=-1)
        # The rope part of K is one vector shared by every head; no rotation is applied.
        k_rot = k_rot.view(bsz, 1, q_len, rope).expand(bsz, h, q_len, rope)
        key_states = torch.cat([k_nope, k_rot], dim=-1)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        kv_len = key_states.shape[-2]
        scores = torch.matmul(q.float(), key_states.float().transpose(-1, -2)) * self.scaling
        if attention_mask is None:
            past = kv_len - q_len
            causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril(diagonal=past)
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask[..., :kv_len].float()
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value_states.dtype)
        out = torch.matmul(probs, value_states)  # [B, H, T, v]
        out = out.transpose(1, 2).reshape(bsz, q_len, h * vd)
        if self.use_output_gate:
            out = out * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(out)


def _causal_depthwise_conv_silu(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """y[t, c] = silu(sum_j w[c, 0, j] * x[t-W+1+j, c]), zero (or `state`) left-padding, in fp32.

    x: [B, T, C]; weight: [C, 1, W]; state: [B, C, W] (last W inputs, fla's layout) or None.
    Returns y in x's dtype and the new state.
    """
    width = weight.shape[-1]
    xt = x.float().transpose(1, 2)  # [B, C, T]
    if state is None:
        prefix = xt.new_zeros(xt.shape[0], xt.shape[1], width - 1)
    else:
        prefix = state[..., 1:].float()
    xp = torch.cat([prefix, xt], dim=-1)
    y = F.conv1d(xp, weight.float(), groups=xt.shape[1])  # [B, C, T]
    new_state = xp[..., -width:].to(x.dtype)
    return F.silu(y).transpose(1, 2).to(x.dtype), new_state


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Log-decay a [.., H, K] from the raw gate g [.., H, K]; only A_log[:H] is used."""
    num_heads, head_dim = g.shape[-2], g.shape[-1]
    z = g.float() + dt_bias.float().view(num_heads, head_dim)
    a_scale = A_log[:num_heads].float().exp().view(num_heads, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a_scale * z)
    return -a_scale * F.softplus(z)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token delta rule with per-channel decay, fp32.

    q, k: [B, T, H, K] (already L2-normalised); v: [B, T, H, V]; a: [B, T, H, K] log-decay;
    b: [B, T, H] (after sigmoid). S: [B, H, K, V].
      S <- diag(exp(a_t)) S;  S <- S + b_t k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t
    """
    bsz, seq, heads, kd = q.shape
    vd = v.shape[-1]
    q, k, v, a, b = (t.float() for t in (q, k, v, a, b))
    S = q.new_zeros(bsz, heads, kd, vd) if initial_state is None else initial_state.float().clone()
    out = q.new_empty(bsz, seq, heads, vd)
    for t in range(seq):
        k_t = k[:, t]
        S = S * a[:, t].exp().unsqueeze(-1)
        delta = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + torch.einsum("bhk,bhv->bhkv", b[:, t].unsqueeze(-1) * k_t, delta)
        out[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return out, S


class KimiDeltaAttention(nn.Module):
    """Kimi delta attention (KDA): gated delta rule with per-channel decay and short convolutions."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        lac = config.linear_attn_config
        self.num_heads = lac["num_heads"]
        self.head_dim = lac["head_dim"]
        self.conv_size = lac["short_conv_kernel_size"]
        self.lower_bound = lac.get("gate_lower_bound")
        self.use_full_rank_gate = lac.get("use_full_rank_gate", False)
        projection_size = self.num_heads * self.head_dim
        if self.num_heads > self.head_dim:
            raise ValueError("A_log is stored with head_dim entries (as the real checkpoint); need num_heads <= head_dim")

        self.q_proj = nn.Linear(self.hidden_size, projection_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, projection_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, projection_size, bias=False)
        # Depthwise causal convolutions, weight [P, 1, W] (fla ShortConvolution layout), SiLU.
        self.q_conv1d = nn.Conv1d(projection_size, projection_size, self.conv_size, groups=projection_size, bias=False)
        self.k_conv1d = nn.Conv1d(projection_size, projection_size, self.conv_size, groups=projection_size, bias=False)
        self.v_conv1d = nn.Conv1d(projection_size, projection_size, self.conv_size, groups=projection_size, bias=False)
        # The real checkpoint stores A_log as F32 [head_dim]; only the first num_heads entries are read.
        self.A_log = nn.Parameter(torch.zeros(self.head_dim, dtype=torch.float32))
        self.f_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, projection_size, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(projection_size, dtype=torch.float32))
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(self.hidden_size, projection_size, bias=False)
        else:
            self.g_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, projection_size, bias=False)
        self.o_norm = KimiGatedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(projection_size, self.hidden_size, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache_params: KimiDynamicCache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """attention_mask: 2-D padding mask [B, T] (1 = keep) or None."""
        bsz, seq, _ = hidden_states.shape

        # Padding: drop padded tokens, run each sequence on its own, scatter back (zeros at pads).
        # (Upstream unpads to cu_seqlens; the result is the same. The cache is not updated here.)
        if attention_mask is not None and not bool(attention_mask.all()):
            keep = attention_mask.bool()
            out = hidden_states.new_zeros(bsz, seq, self.hidden_size)
            for i in range(bsz):
                if keep[i].any():
                    out[i, keep[i]] = self._forward_dense(hidden_states[i : i + 1, keep[i]], None)[0]
            return out
        return self._forward_dense(hidden_states, cache_params)

    def _forward_dense(self, hidden_states: torch.Tensor, cache: KimiDynamicCache | None) -> torch.Tensor:
        bsz, seq, _ = hidden_states.shape
        heads, dk = self.num_heads, self.head_dim
        conv_state = recurrent_state = None
        if cache is not None and cache.conv_states[self.layer_idx] is not None:
            conv_state = cache.conv_states[self.layer_idx]
            recurrent_state = cache.recurrent_states[self.layer_idx]

        qkv = []
        new_conv = []
        for idx, (proj, conv) in enumerate(
            ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d))
        ):
            y, st = self._short_conv(proj(hidden_states), conv.weight, None if conv_state is None else conv_state[idx])
            qkv.append(y.view(bsz, seq, heads, dk))
            new_conv.append(st)
        q, k, v = qkv
        g = self.f_b_proj(self.f_a_proj(hidden_states)).view(bsz, seq, heads, dk)
        beta = self.b_proj(hidden_states).float()

        if hidden_states.is_cuda:
            o, final_state = self._kda_cuda(q, k, v, g, beta, recurrent_state, use_recurrent=cache is not None and seq == 1)
        else:
            a = kda_gate(g, self.A_log, self.dt_bias, self.lower_bound)
            # The cache stores the state as [V, K] (fla's transpose_state_layout); the math uses [K, V].
            init = None if recurrent_state is None else recurrent_state.transpose(-1, -2)
            o, final_state = kda_recurrence(l2norm(q), l2norm(k), v, a, torch.sigmoid(beta), dk**-0.5, init)
            o = o.to(q.dtype)
            final_state = final_state.transpose(-1, -2).contiguous()

        if cache is not None:
            cache.conv_states[self.layer_idx] = new_conv
            cache.recurrent_states[self.layer_idx] = final_state

        if self.use_full_rank_gate:
            gate = self.g_proj(hidden_states)
        else:
            gate = self.g_b_proj(self.g_a_proj(hidden_states))
        o = self.o_norm(o, gate.view(bsz, seq, heads, dk))
        return self.o_proj(o.reshape(bsz, seq, heads * dk))

    @staticmethod
    def _short_conv(
        x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda and state is None:
            from fla.modules.causal_conv1d.ops import causal_conv1d

            width = weight.shape[-1]
            y, _ = causal_conv1d(x=x, weight=weight.squeeze(1), bias=None, activation="silu")
            xt = x.transpose(1, 2)
            st = F.pad(xt, (max(width - xt.shape[-1], 0), 0))[..., -width:]
            return y, st.contiguous()
        return _causal_depthwise_conv_silu(x, weight, state)

    def _kda_cuda(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
        use_recurrent: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        kw: dict[str, Any] = dict(
            g=g,
            beta=beta,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            initial_state=None if state is None else state.float(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=self.lower_bound,
        )
        # The cache keeps the state as [V, K]; fla 0.6 renamed `transpose_state_layout` to `state_v_first`.
        layout_kw = "state_v_first" if "state_v_first" in inspect.signature(chunk_kda).parameters else None
        kw[layout_kw or "transpose_state_layout"] = True
        if use_recurrent:
            return fused_recurrent_kda(q, k, v, **kw)
        return chunk_kda(q, k, v, safe_gate=self.lower_bound is not None, **kw)


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
        self.moe_renormalize = config.moe_renormalize
        self.n_group = config.num_expert_group
        self.topk_group = config.topk_group
        self.gating_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.gating_dim))
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, seq_len, dim = hidden_states.shape  # 3-D input only, as upstream
        h = hidden_states.view(-1, dim)
        logits = F.linear(h.float(), self.weight.float())
        if self.moe_router_activation_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        # The correction bias only affects which experts are picked, not their weights.
        choice = scores + self.e_score_correction_bias.float().unsqueeze(0)
        if self.n_group > 1 and self.n_group > self.topk_group:
            n = choice.shape[0]
            group_scores = choice.view(n, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(n, self.n_group, self.num_experts // self.n_group).reshape(n, -1)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        topk_idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weight = scores.gather(1, topk_idx)
        if self.top_k > 1 and self.moe_renormalize:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx, topk_weight


class KimiSparseMoeBlock(nn.Module):
    """Latent MoE: route on h, project to latent, routed experts, norm, project back, + shared experts(h)."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_dim = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.moe_renormalize = config.moe_renormalize
        self.use_latent_moe = config.routed_expert_hidden_size is not None
        self.latent_moe_use_norm = bool(config.latent_moe_use_norm) and self.use_latent_moe
        self.moe_hidden_size = config.routed_expert_hidden_size if self.use_latent_moe else config.hidden_size
        self.ep_size = 1
        self.ep_rank = 0
        self.experts_per_rank = config.num_experts

        self.experts = nn.ModuleList(
            [
                KimiBlockSparseMLP(config, self.moe_hidden_size, config.moe_intermediate_size)
                for _ in range(self.num_experts)
            ]
        )
        self.gate = KimiMoEGate(config)
        if self.use_latent_moe:
            self.routed_expert_down_proj = nn.Linear(self.hidden_dim, self.moe_hidden_size, bias=False)
            self.routed_expert_up_proj = nn.Linear(self.moe_hidden_size, self.hidden_dim, bias=False)
            if self.latent_moe_use_norm:
                self.routed_expert_norm = KimiRMSNorm(self.moe_hidden_size, eps=config.rms_norm_eps)
        if config.num_shared_experts is not None:
            self.shared_experts = KimiMLP(
                config, intermediate_size=config.moe_intermediate_size * config.num_shared_experts
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        x = hidden_states.view(-1, hidden_states.shape[-1])
        if self.use_latent_moe:
            x = self.routed_expert_down_proj(x)
        y = self.moe_infer(x, topk_idx, topk_weight)
        if self.latent_moe_use_norm:
            y = self.routed_expert_norm(y)
        if self.use_latent_moe:
            y = self.routed_expert_up_proj(y)
        y = y.view(*orig_shape)
        if getattr(self, "shared_experts", None) is not None:
            y = y + self.shared_experts(identity)  # shared experts see the un-projected h
        return y

    @torch.no_grad()
    def moe_infer(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """x [N, Dl], topk_ids [N, k], topk_weight [N, k] fp32 -> [N, Dl] in x's dtype."""
        num_tokens, k = topk_ids.shape
        counts = torch.zeros(num_tokens, self.experts_per_rank * self.ep_size, dtype=torch.long, device=x.device)
        counts.scatter_(1, topk_ids, 1)
        tokens_per_expert = counts.sum(dim=0).cpu().tolist()  # host sync, as upstream
        order = topk_ids.view(-1).argsort()
        sorted_tokens = x[order // k]

        outputs = []
        start = 0
        for i, n in enumerate(tokens_per_expert):
            if n == 0:
                continue
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            outputs.append(expert(sorted_tokens[start : start + n]))
            start += n
        outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0, x.shape[-1])

        unsorted = torch.empty_like(outs)
        unsorted[order] = outs
        # Combine in fp32 (the routing weights' dtype), then cast back.
        combined = unsorted.view(num_tokens, k, -1).to(topk_weight.dtype) * topk_weight.unsqueeze(-1)
        return combined.sum(dim=1).to(unsorted.dtype)


# ----------------------------------------------------------------------------------------------
# Attention residuals and decoder layer
# ----------------------------------------------------------------------------------------------


def _apply_attn_res(
    partial: torch.Tensor, residuals: torch.Tensor, proj: nn.Linear, norm: KimiRMSNorm
) -> torch.Tensor:
    """Softmax-over-depth mix of [R_1..R_n, p]. partial [N, D]; residuals [N, n, D] -> [N, D].

    Scores: s_i = sum_d rmsnorm(V_i)_d * norm.weight_d * proj.weight_d (proj's forward is never called).
    """
    values = torch.cat([residuals, partial.unsqueeze(1)], dim=1)
    v = values.float()
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    query = norm.weight.float() * proj.weight.float().view(-1)
    scores = (normed * query).sum(-1)  # [N, n+1]
    probs = scores.softmax(dim=-1)
    return (probs.unsqueeze(-1) * v).sum(dim=1).to(values.dtype)


def _attn_res_pre_update(
    partial: torch.Tensor, residuals: torch.Tensor, proj: nn.Linear, norm: KimiRMSNorm, is_block_start: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of an AttnRes layer: attention input x, and R with P appended at a block start."""
    if residuals.shape[1] > 0:
        x = _apply_attn_res(partial, residuals, proj, norm)
    else:
        x = partial
    if is_block_start:
        residuals = torch.cat([residuals, partial.unsqueeze(1)], dim=1)
    return x, residuals


class KimiDecoderLayer(nn.Module):
    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.is_linear_attn = config.is_kda_layer(layer_idx)
        if self.is_linear_attn:
            self.self_attn = KimiDeltaAttention(config, layer_idx)
        else:
            self.self_attn = KimiMLAAttention(config, layer_idx)
        if config.is_moe and layer_idx >= config.first_k_dense_replace and layer_idx % config.moe_layer_freq == 0:
            self.block_sparse_moe = KimiSparseMoeBlock(config)
        else:
            self.mlp = KimiMLP(config)
        self.input_layernorm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn_res_block_size = config.attn_res_block_size
        if self.attn_res_block_size is not None:
            self.self_attention_res_norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
            self.mlp_res_norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(config.hidden_size, 1, bias=False)

    def _attn(self, x: torch.Tensor, mla_mask: Any, kda_mask: Any, cache: Any) -> torch.Tensor:
        if self.is_linear_attn:
            return self.self_attn(x, attention_mask=kda_mask, cache_params=cache)
        return self.self_attn(x, attention_mask=mla_mask, past_key_values=cache)

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(x)
        return self.mlp(x)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residuals: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        linear_attention_mask: torch.Tensor | None = None,
        past_key_values: KimiDynamicCache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With AttnRes: hidden_states is the partial sum P, returns (P, R). Without: returns h."""
        if self.attn_res_block_size is None:
            h = hidden_states
            h = h + self._attn(self.input_layernorm(h), attention_mask, linear_attention_mask, past_key_values)
            return h + self._ffn(self.post_attention_layernorm(h))

        bsz, seq, dim = hidden_states.shape
        is_start = self.layer_idx % self.attn_res_block_size == 0
        partial = hidden_states.reshape(-1, dim)
        x, residuals = _attn_res_pre_update(
            partial, residuals, self.self_attention_res_proj, self.self_attention_res_norm, is_start
        )
        a = self._attn(
            self.input_layernorm(x.view(bsz, seq, dim)), attention_mask, linear_attention_mask, past_key_values
        ).reshape(-1, dim)
        partial = a if is_start else partial + a
        x2 = _apply_attn_res(partial, residuals, self.mlp_res_proj, self.mlp_res_norm)
        m = self._ffn(self.post_attention_layernorm(x2.view(bsz, seq, dim))).reshape(-1, dim)
        partial = partial + m
        return partial.view(bsz, seq, dim), residuals


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


class KimiPreTrainedModel(PreTrainedModel):
    config_class = KimiLinearConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = False
    _supports_sdpa = False
    _can_record_outputs: dict[str, Any] = {}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Only used when building on a real device; tests overwrite every weight from the checkpoint.
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, KimiMoEGate):
            nn.init.normal_(module.weight, std=std)
            nn.init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KimiDeltaAttention):
            module.A_log.zero_()
            module.A_log[: module.num_heads] = torch.log(
                torch.linspace(1.0, 16.0, module.num_heads, device=module.A_log.device)
            )
            nn.init.zeros_(module.dt_bias)
        elif isinstance(module, (KimiRMSNorm, KimiGatedRMSNorm)):
            nn.init.ones_(module.weight)


def _build_masks(
    attention_mask: torch.Tensor | None, bsz: int, q_len: int, past: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Additive [B, 1, T, past+T] causal+padding mask for MLA, and the 2-D mask for KDA (None if unneeded)."""
    has_padding = attention_mask is not None and not bool(attention_mask.all())
    if not has_padding:
        return None, None  # MLA builds its own causal mask
    kv_len = past + q_len
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=past)
    keep = causal[None, None] & attention_mask[:, None, None, -kv_len:].bool()
    mla_mask = torch.zeros(bsz, 1, q_len, kv_len, dtype=torch.float32, device=device)
    # finfo.min rather than -inf: fully masked rows (padding queries) stay finite.
    mla_mask = mla_mask.masked_fill(~keep, torch.finfo(torch.float32).min)
    kda_mask = attention_mask[:, -q_len:] if past == 0 else None
    return mla_mask, kda_mask


class KimiLinearModel(KimiPreTrainedModel):
    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([KimiDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,  # unused: no RoPE
        past_key_values: KimiDynamicCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache_position: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = KimiDynamicCache(self.config)
        if not use_cache:
            past_key_values = None

        bsz, seq, dim = inputs_embeds.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        mla_mask, kda_mask = _build_masks(attention_mask, bsz, seq, past, inputs_embeds.device)

        hidden = inputs_embeds
        residuals = hidden.new_zeros(bsz * seq, 0, dim) if self.config.attn_res_block_size is not None else None
        for layer in self.layers:
            out = layer(
                hidden,
                residuals=residuals,
                attention_mask=mla_mask,
                linear_attention_mask=kda_mask,
                past_key_values=past_key_values,
            )
            if residuals is None:
                hidden = out
            else:
                hidden, residuals = out
        if residuals is not None:
            hidden = _apply_attn_res(
                hidden.reshape(-1, dim), residuals, self.output_attn_res_proj, self.output_attn_res_norm
            ).view(bsz, seq, dim)
        hidden = self.norm(hidden)
        if past_key_values is not None:
            past_key_values._seen_tokens += seq
        return _output_with_cache(BaseModelOutputWithPast, past_key_values, last_hidden_state=hidden)


class KimiLinearForCausalLM(KimiPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

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

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KimiDynamicCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache_position: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            cache_position=cache_position,
            use_cache=use_cache,
        )
        hidden = outputs.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if not return_dict:
            return tuple(x for x in (loss, logits, _cache_of(outputs)) if x is not None)
        return _output_with_cache(CausalLMOutputWithPast, _cache_of(outputs), loss=loss, logits=logits)
