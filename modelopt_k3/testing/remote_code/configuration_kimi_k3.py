# Tiny-checkpoint stand-in for the configuration file of Kimi-K3's remote code, written for modelopt_k3.
# Same class names, model types, fields and defaults as the real file, including what the real one lacks:
# KimiK3Config declares no `sub_configs` and does not default its sub-configs.
# This file is copied into generated checkpoints: it must not import modelopt_k3.
from __future__ import annotations

from typing import Any

from transformers.configuration_utils import PretrainedConfig


class KimiLinearConfig(PretrainedConfig):
    """Text (language model) config, model_type ``kimi_linear``."""

    model_type = "kimi_linear"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        model_type: str = "kimi_linear",
        vocab_size: int = 163840,
        hidden_size: int = 4096,
        head_dim: int | None = None,
        intermediate_size: int = 11008,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        hidden_act: str = "silu",
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = 0,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        tie_word_embeddings: bool = False,
        moe_intermediate_size: int | None = None,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        num_experts: int | None = None,
        num_experts_per_token: int | None = None,
        num_shared_experts: int = 0,
        routed_scaling_factor: float = 1.0,
        first_k_dense_replace: int = 0,
        moe_layer_freq: int = 1,
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        q_lora_rank: int | None = None,
        kv_lora_rank: int | None = None,
        qk_nope_head_dim: int | None = None,
        qk_rope_head_dim: int | None = None,
        v_head_dim: int | None = None,
        mla_use_nope: bool | None = False,
        mla_use_output_gate: bool | None = False,
        num_nextn_predict_layers: int = 0,
        linear_attn_config: dict | None = None,
        attn_res_block_size: int | None = None,
        latent_moe_use_norm: bool = False,
        activation_situ_beta: float | None = None,
        activation_situ_linear_beta: float | None = None,
        max_position_embeddings: int = 4096,
        routed_expert_hidden_size: int | None = None,
        topk_method: str = "noaux_tc",
        **kwargs: Any,
    ) -> None:
        self.model_type = model_type
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.moe_renormalize = moe_renormalize
        self.num_shared_experts = num_shared_experts
        self.routed_scaling_factor = routed_scaling_factor
        assert moe_router_activation_func in ("softmax", "sigmoid"), moe_router_activation_func  # as the real file
        self.moe_router_activation_func = moe_router_activation_func
        self.moe_intermediate_size = moe_intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.attn_res_block_size = attn_res_block_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.max_position_embeddings = max_position_embeddings
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.topk_method = topk_method
        # Asserted like the real file: a missing key is a KeyError, a null list an AssertionError.
        for required in ("kda_layers", "full_attn_layers") if linear_attn_config is not None else ():
            assert linear_attn_config[required] is not None, f"linear_attn_config[{required!r}] is null"
        self.linear_attn_config = linear_attn_config
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def is_mla(self) -> bool:
        dims = (self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        return any(d is not None for d in dims) or self.mla_use_nope is True

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def is_linear_attn(self) -> bool:
        lac = self.linear_attn_config
        return lac is not None and not (isinstance(lac, dict) and lac.get("kda_layers") == [])

    def is_kda_layer(self, layer_idx: int) -> bool:
        # kda_layers is 1-indexed; every layer not listed is MLA.
        return self.linear_attn_config is not None and (layer_idx + 1) in self.linear_attn_config["kda_layers"]


class KimiK3VisionConfig(PretrainedConfig):
    """MoonViT tower + patch-merger projector settings (``vision_config``)."""

    def __init__(
        self,
        patch_size: int = 14,
        init_pos_emb_height: int = 64,
        init_pos_emb_width: int = 64,
        init_pos_emb_time: int = 4,
        pos_emb_type: str = "divided_fixed",
        vt_num_attention_heads: int = 12,
        vt_num_hidden_layers: int = 27,
        vt_hidden_size: int = 1024,
        vt_intermediate_size: int = 4096,
        merge_kernel_size: tuple[int, int] | list[int] = (2, 2),
        merge_type: str = "sd2_tpool",
        _attn_implementation: str = "flash_attention_2",
        mm_projector_type: str = "patchmergerv2",
        mm_hidden_size: int | None = None,
        projector_hidden_act: str = "gelu",
        projector_ln_eps: float = 1e-5,
        qkv_hidden_size: int = 1536,
        norm_type: str = "rmsnorm",
        attn_bias: bool = False,
        patch_embed_proj_bias: bool = False,
        mlp_type: str = "mlp2",
        linear_bias: bool = False,
        activation_func: str = "gelu_pytorch_tanh",
        pos_emb_interpolation_mode: str = "bilinear",
        ignore_index: int = -100,
        media_placeholder_token_id: int = 163605,
        pad_token_id: int = 0,
        text_hidden_size: int = 7168,
        **kwargs: Any,
    ) -> None:
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.pos_emb_type = pos_emb_type
        self.vt_num_attention_heads = vt_num_attention_heads
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.merge_kernel_size = merge_kernel_size
        self.merge_type = merge_type
        # Set before PretrainedConfig.__init__, which resets it on transformers 5 (as the real file does).
        self._attn_implementation = _attn_implementation
        self.mm_projector_type = mm_projector_type
        self.mm_hidden_size = vt_hidden_size if mm_hidden_size is None else mm_hidden_size
        self.projector_hidden_act = projector_hidden_act
        self.projector_ln_eps = projector_ln_eps
        self.text_hidden_size = text_hidden_size
        self.qkv_hidden_size = qkv_hidden_size
        self.norm_type = norm_type
        self.attn_bias = attn_bias
        self.patch_embed_proj_bias = patch_embed_proj_bias
        self.mlp_type = mlp_type
        self.linear_bias = linear_bias
        self.activation_func = activation_func
        self.pos_emb_interpolation_mode = pos_emb_interpolation_mode
        super().__init__(**kwargs)


class KimiK3Config(PretrainedConfig):
    """Top-level multimodal config, model_type ``kimi_k3``. Like the real one: no ``sub_configs``."""

    model_type = "kimi_k3"

    def __init__(
        self,
        text_config: dict | KimiLinearConfig | None = None,
        vision_config: dict | KimiK3VisionConfig | None = None,
        ignore_index: int = -100,
        media_placeholder_token_id: int = 163605,
        pad_token_id: int = 0,
        **kwargs: Any,
    ) -> None:
        # Sub-configs arrive as plain dicts from config.json (there are no sub_configs to do it).
        self.text_config = KimiLinearConfig(**text_config) if isinstance(text_config, dict) else text_config
        self.vision_config = KimiK3VisionConfig(**vision_config) if isinstance(vision_config, dict) else vision_config
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        # The checkpoint keeps quantization_config inside text_config; from_pretrained (and every
        # quantization tool) reads it at the top level, so it is lifted there.
        lifted = getattr(self.text_config, "quantization_config", None)
        if lifted is not None:
            self.quantization_config = lifted
        super().__init__(pad_token_id=pad_token_id, **kwargs)
