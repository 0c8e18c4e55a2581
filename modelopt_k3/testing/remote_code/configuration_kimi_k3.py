# Stand-in for the Kimi-K3 checkpoint's own configuration code (tiny test checkpoints).
# Same class names, model types and fields as the real remote code; written for this project.
# This file ships inside generated checkpoints: it must not import modelopt_k3.
from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig


class KimiLinearConfig(PretrainedConfig):
    """Text (language model) config, model_type ``kimi_linear``."""

    model_type = "kimi_linear"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 4096,
        num_hidden_layers: int = 32,
        intermediate_size: int = 11008,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        activation_situ_beta: float | None = None,
        activation_situ_linear_beta: float | None = None,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = 0,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        tie_word_embeddings: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        max_position_embeddings: int = 4096,
        q_lora_rank: int | None = None,
        kv_lora_rank: int | None = None,
        qk_nope_head_dim: int | None = None,
        qk_rope_head_dim: int | None = None,
        v_head_dim: int | None = None,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = False,
        linear_attn_config: dict | None = None,
        num_experts: int | None = None,
        num_experts_per_token: int | None = None,
        moe_intermediate_size: int | None = None,
        num_shared_experts: int | None = None,
        first_k_dense_replace: int = 0,
        moe_layer_freq: int = 1,
        moe_router_activation_func: str = "sigmoid",
        moe_renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        num_expert_group: int = 1,
        topk_group: int = 1,
        use_grouped_topk: bool = True,
        topk_method: str = "noaux_tc",
        routed_expert_hidden_size: int | None = None,
        latent_moe_use_norm: bool = False,
        attn_res_block_size: int | None = None,
        num_nextn_predict_layers: int = 0,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        if rope_scaling is not None:  # unused (no RoPE); transformers 5 warns on a None rope_scaling attribute
            self.rope_scaling = rope_scaling
        self.max_position_embeddings = max_position_embeddings
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.linear_attn_config = linear_attn_config
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.moe_intermediate_size = moe_intermediate_size
        self.num_shared_experts = num_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.moe_router_activation_func = moe_router_activation_func
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.use_grouped_topk = use_grouped_topk
        self.topk_method = topk_method
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.attn_res_block_size = attn_res_block_size
        self.num_nextn_predict_layers = num_nextn_predict_layers
        # Set explicitly: transformers 5 keeps these as plain attributes of the config.
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings

        if self.is_mla and not self.mla_use_nope:
            raise ValueError("this stand-in (like Kimi-K3) only supports mla_use_nope=True (no RoPE)")
        if moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError(f"moe_router_activation_func must be sigmoid or softmax, got {moe_router_activation_func}")
        if linear_attn_config is not None:
            for key in ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"):
                if linear_attn_config.get(key) is None:
                    raise ValueError(f"linear_attn_config needs {key!r}")
        super().__init__(**kwargs)

    @property
    def is_mla(self) -> bool:
        return any(
            x is not None
            for x in (self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def is_linear_attn(self) -> bool:
        return self.linear_attn_config is not None

    def is_kda_layer(self, layer_idx: int) -> bool:
        # kda_layers is 1-indexed; any layer not listed is MLA.
        return self.is_linear_attn and (layer_idx + 1) in self.linear_attn_config["kda_layers"]


class KimiK3VisionConfig(PretrainedConfig):
    """MoonViT tower + patch-merger projector settings (``vision_config``)."""

    model_type = "kimi_k3_vision"

    def __init__(
        self,
        patch_size: int = 14,
        init_pos_emb_height: int = 64,
        init_pos_emb_width: int = 64,
        init_pos_emb_time: int = 4,
        vt_num_attention_heads: int = 12,
        vt_num_hidden_layers: int = 27,
        vt_hidden_size: int = 1024,
        vt_intermediate_size: int = 4096,
        qkv_hidden_size: int = 1536,
        norm_type: str = "rmsnorm",
        merge_kernel_size: tuple[int, int] | list[int] = (2, 2),
        mm_projector_type: str = "patchmergerv2",
        mm_hidden_size: int | None = None,
        text_hidden_size: int = 7168,
        projector_ln_eps: float = 1e-5,
        vt_norm_eps: float = 1e-6,
        **kwargs: Any,
    ) -> None:
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.vt_num_attention_heads = vt_num_attention_heads
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.qkv_hidden_size = qkv_hidden_size
        self.norm_type = norm_type
        self.merge_kernel_size = list(merge_kernel_size)
        self.mm_projector_type = mm_projector_type
        self.mm_hidden_size = vt_hidden_size if mm_hidden_size is None else mm_hidden_size
        self.text_hidden_size = text_hidden_size
        self.projector_ln_eps = projector_ln_eps
        self.vt_norm_eps = vt_norm_eps
        super().__init__(**kwargs)


class KimiK3Config(PretrainedConfig):
    """Top-level multimodal config, model_type ``kimi_k3``."""

    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiLinearConfig, "vision_config": KimiK3VisionConfig}

    def __init__(
        self,
        text_config: dict | KimiLinearConfig | None = None,
        vision_config: dict | KimiK3VisionConfig | None = None,
        ignore_index: int = -100,
        media_placeholder_token_id: int = 163605,
        pad_token_id: int = 0,
        **kwargs: Any,
    ) -> None:
        if text_config is None:
            text_config = KimiLinearConfig()
        elif isinstance(text_config, dict):
            text_config = KimiLinearConfig(**text_config)
        if vision_config is None:
            vision_config = KimiK3VisionConfig()
        elif isinstance(vision_config, dict):
            vision_config = KimiK3VisionConfig(**vision_config)
        self.text_config = text_config
        self.vision_config = vision_config
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        self.pad_token_id = pad_token_id
        # The checkpoint stores quantization_config inside text_config, but from_pretrained
        # (and every quantization tool) looks for it at the top level.
        text_qcfg = getattr(text_config, "quantization_config", None)
        if text_qcfg is not None and "quantization_config" not in kwargs:
            kwargs["quantization_config"] = copy.deepcopy(text_qcfg)
        super().__init__(**kwargs)
