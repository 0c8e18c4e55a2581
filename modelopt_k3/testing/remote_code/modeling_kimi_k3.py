# Stand-in for the Kimi-K3 checkpoint's own multimodal wrapper (tiny test checkpoints).
# Same class names, parameter names, buffers and transformers API calls as the real remote code
# (kimi_k3_reference.md section 5); written for this project. The vision tower exists with the real key
# names and the real non-persistent buffer (`pos_emb.time_weight`, a sin-cos table built in __init__,
# never in a checkpoint), but only text-only forwards are implemented.
# This file ships inside generated checkpoints: it must not import modelopt_k3.
from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch
from torch import nn
from transformers.activations import PytorchGELUTanh
from transformers.configuration_utils import PretrainedConfig
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llava.modeling_llava import LlavaCausalLMOutputWithPast

from .configuration_kimi_k3 import KimiK3Config
from .modeling_kimi_linear import KimiLinearForCausalLM


def sincos_table(dim: int, length: int) -> torch.Tensor:
    """[length, dim]: sin(p * w) | cos(p * w) with w_i = 10000^(-2i/dim), fp32 (MoonViT's temporal table)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float32) / (dim / 2.0))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), omega)
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class Learnable2DInterpPosEmbDivided_fixed(nn.Module):
    """Learnable 2-D table `weight` [H, W, D] plus a fixed temporal table `time_weight` [T, 1, D]."""

    def __init__(self, height: int, width: int, num_frames: int, dim: int, interpolation_mode: str = "bicubic") -> None:
        super().__init__()
        self.height, self.width, self.num_frames, self.dim = height, width, num_frames, dim
        self.interpolation_mode = interpolation_mode
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        self.register_buffer("time_weight", sincos_table(dim, num_frames).unsqueeze(1), persistent=False)
        nn.init.normal_(self.weight)


class MoonVision3dPatchEmbed(nn.Module):
    def __init__(
        self,
        out_dim: int,
        in_dim: int = 3,
        patch_size: int = 14,
        pos_emb_height: int = 14,
        pos_emb_width: int = 14,
        pos_emb_time: int = 4,
        pos_emb_type: str = "divided_fixed",
        patch_embed_proj_bias: bool = True,
        pos_emb_interpolation_mode: str = "bicubic",
    ) -> None:
        super().__init__()
        if pos_emb_type != "divided_fixed":
            raise NotImplementedError(f"Not support pos_emb_type: {pos_emb_type}")
        self.proj = nn.Conv2d(in_dim, out_dim, kernel_size=patch_size, stride=patch_size, bias=patch_embed_proj_bias)
        self.pos_emb = Learnable2DInterpPosEmbDivided_fixed(
            pos_emb_height, pos_emb_width, pos_emb_time, out_dim, interpolation_mode=pos_emb_interpolation_mode
        )


class MLP2(nn.Module):
    def __init__(self, dims: list[int], activation: nn.Module, bias: bool = True) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dims[0], dims[1], bias=bias)
        self.fc1 = nn.Linear(dims[1], dims[2], bias=bias)
        self.activation = activation


class MoonViTEncoderLayer(nn.Module):
    def __init__(
        self,
        num_heads: int,
        hidden_dim: int,
        mlp_dim: int,
        qkv_hidden_size: int | None = None,
        norm_type: str = "layernorm",
        *,
        attn_implementation: str = "flash_attention_2",
        activation: nn.Module | None = None,
        attn_bias: bool = False,
        linear_bias: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv_hidden_size = hidden_dim if qkv_hidden_size is None else qkv_hidden_size
        self.attn_implementation = attn_implementation
        norm = nn.RMSNorm if norm_type == "rmsnorm" else nn.LayerNorm
        self.norm0, self.norm1 = norm(hidden_dim), norm(hidden_dim)
        self.mlp = MLP2([hidden_dim, mlp_dim, hidden_dim], activation, bias=linear_bias)
        self.wqkv = nn.Linear(hidden_dim, self.qkv_hidden_size * 3, bias=attn_bias)
        self.wo = nn.Linear(self.qkv_hidden_size, hidden_dim, bias=attn_bias)


class MoonViT3dEncoder(nn.Module):
    def __init__(self, hidden_dim: int, num_layers: int, block_cfg: dict) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoonViTEncoderLayer(**block_cfg) for _ in range(num_layers))
        norm = nn.RMSNorm if block_cfg.get("norm_type") == "rmsnorm" else nn.LayerNorm
        self.final_layernorm = norm(hidden_dim)


class MoonViT3dPretrainedModel(PreTrainedModel):
    config_class = None
    model_type = "moonvit3d"
    _no_split_modules = ["MoonViTEncoderLayer"]
    _supports_flash_attn_2 = True
    _supports_sdpa = True

    def __init__(self, config: PretrainedConfig, *inputs: Any, **kwargs: Any) -> None:
        super().__init__(config, *inputs, **kwargs)
        config = deepcopy(config)
        self.merge_kernel_size = config.merge_kernel_size
        self.patch_size = config.patch_size
        self.merge_type = config.merge_type
        self.patch_embed = MoonVision3dPatchEmbed(
            out_dim=config.hidden_size,
            patch_size=config.patch_size,
            pos_emb_height=config.init_pos_emb_height,
            pos_emb_width=config.init_pos_emb_width,
            pos_emb_time=config.init_pos_emb_time,
            pos_emb_type=config.pos_emb_type,
            patch_embed_proj_bias=getattr(config, "patch_embed_proj_bias", True),
            pos_emb_interpolation_mode=getattr(config, "pos_emb_interpolation_mode", "bicubic"),
        )
        self.encoder = MoonViT3dEncoder(
            hidden_dim=config.hidden_size,
            num_layers=config.num_hidden_layers,
            block_cfg={
                "num_heads": config.num_attention_heads,
                "hidden_dim": config.hidden_size,
                "qkv_hidden_size": getattr(config, "qkv_hidden_size", None),
                "mlp_dim": config.intermediate_size,
                "norm_type": getattr(config, "norm_type", "layernorm"),
                "activation": PytorchGELUTanh(),
                "attn_bias": getattr(config, "attn_bias", True),
                "linear_bias": getattr(config, "linear_bias", True),
                "attn_implementation": config._attn_implementation,
            },
        )

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the tiny Kimi-K3 stand-in supports text-only forwards")


class PatchMergerMLPV2(nn.Module):
    """Merged 2x2 patches (4m) -> Linear(4m, 4m) -> exact GELU -> Linear(4m, text_hidden) -> RMSNorm."""

    def __init__(self, config: ProjectorConfig) -> None:
        super().__init__()
        self.hidden_size = config.mm_hidden_size * (config.merge_kernel_size[0] * config.merge_kernel_size[1])
        self.proj = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size, bias=False),
            nn.GELU(),
            nn.Linear(self.hidden_size, config.hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(config.hidden_size, eps=config.projector_ln_eps)


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = "model"
    _no_split_modules = [
        "MoonViT3dPretrainedModel",
        "MoonViTEncoderLayer",
        "KimiDecoderLayer",
        "PatchMergerMLP",
        "PatchMergerMLPV2",
    ]
    _skip_keys_device_placement = "past_key_values"
    _supports_flash_attn_2 = True
    _supports_sdpa = False

    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config, "initializer_range", None) or self.config.text_config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)


class VisionTowerConfig(PretrainedConfig):
    model_type = "moonvit3d"

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.patch_size = config.patch_size
        self.init_pos_emb_height = config.init_pos_emb_height
        self.init_pos_emb_width = config.init_pos_emb_width
        self.init_pos_emb_time = config.init_pos_emb_time
        self.pos_emb_type = config.pos_emb_type
        self.num_attention_heads = config.vt_num_attention_heads
        self.num_hidden_layers = config.vt_num_hidden_layers
        self.hidden_size = config.vt_hidden_size
        self.intermediate_size = config.vt_intermediate_size
        self.merge_kernel_size = config.merge_kernel_size
        self.merge_type = config.merge_type
        self._attn_implementation = config._attn_implementation
        self.qkv_hidden_size = getattr(config, "qkv_hidden_size", None)
        self.norm_type = getattr(config, "norm_type", "layernorm")
        self.attn_bias = getattr(config, "attn_bias", True)
        self.patch_embed_proj_bias = getattr(config, "patch_embed_proj_bias", True)
        self.mlp_type = getattr(config, "mlp_type", "mlp2")
        self.linear_bias = getattr(config, "linear_bias", True)
        self.pos_emb_interpolation_mode = getattr(config, "pos_emb_interpolation_mode", "bilinear")


class ProjectorConfig:
    def __init__(self, config: Any) -> None:
        self.mm_projector_type = config.mm_projector_type
        self.mm_hidden_size = config.mm_hidden_size
        self.hidden_size = config.text_hidden_size
        self.merge_kernel_size = config.merge_kernel_size
        self.projector_hidden_act = config.projector_hidden_act
        self.projector_ln_eps = config.projector_ln_eps


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel):
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(config)
        self.vision_tower = MoonViT3dPretrainedModel(VisionTowerConfig(config.vision_config))
        projector_config = ProjectorConfig(config.vision_config)
        if projector_config.mm_projector_type != "patchmergerv2":
            raise ValueError(f"Unsupported mm_projector_type: {projector_config.mm_projector_type}")
        self.mm_projector = PatchMergerMLPV2(projector_config)
        self.language_model = KimiLinearForCausalLM(config.text_config)
        self.post_init()
        # As upstream: the tower and projector follow the language model's dtype (buffers included).
        if hasattr(self.language_model, "dtype"):
            self.vision_tower = self.vision_tower.to(dtype=self.language_model.dtype)
            self.mm_projector = self.mm_projector.to(dtype=self.language_model.dtype)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.language_model.set_output_embeddings(new_embeddings)

    def set_decoder(self, decoder: nn.Module) -> None:
        self.language_model.set_decoder(decoder)

    def get_decoder(self) -> nn.Module:
        return self.language_model.get_decoder()

    def tie_weights(self):
        return self.language_model.tie_weights()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        grid_thws: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> LlavaCausalLMOutputWithPast | tuple:
        assert self.vision_tower is not None, "vision_tower is not loaded"
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = self.config.use_return_dict if return_dict is None else return_dict
        if pixel_values is not None and len(pixel_values) > 0:
            raise NotImplementedError("the tiny Kimi-K3 stand-in supports text-only forwards")
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        outputs = self.language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=return_dict,
        )
        logits = outputs[0]
        loss = None
        if labels is not None:
            # Shifted cross-entropy over the positions the attention mask keeps.
            shift_logits, shift_labels = logits[..., :-1, :], labels[..., 1:]
            if attention_mask is not None:
                keep = attention_mask[..., 1:] != 0
                shift_logits, shift_labels = shift_logits[keep], shift_labels[keep]
            loss = nn.CrossEntropyLoss()(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1))
        if not return_dict:
            output = (logits,) + tuple(outputs[1:])
            return (loss,) + output if loss is not None else output
        return LlavaCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
