# Stand-in for the Kimi-K3 checkpoint's own multimodal wrapper (tiny test checkpoints).
# Same class names and parameter names as the real remote code (docs/kimi_k3_reference.md §5);
# written for this project. The vision tower exists with the real key names but only text-only
# forwards are supported (the tower is never executed).
# This file ships inside generated checkpoints: it must not import modelopt_k3.
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llava.modeling_llava import LlavaCausalLMOutputWithPast

from .configuration_kimi_k3 import KimiK3Config, KimiK3VisionConfig
from .modeling_kimi_linear import KimiLinearForCausalLM, _cache_of, _output_with_cache


class VisionTowerConfig(PretrainedConfig):
    model_type = "moonvit3d"

    def __init__(self, vision_config: KimiK3VisionConfig | None = None, **kwargs: Any) -> None:
        vc = vision_config if vision_config is not None else KimiK3VisionConfig()
        self.patch_size = vc.patch_size
        self.init_pos_emb_height = vc.init_pos_emb_height
        self.init_pos_emb_width = vc.init_pos_emb_width
        self.init_pos_emb_time = vc.init_pos_emb_time
        self.num_attention_heads = vc.vt_num_attention_heads
        self.num_hidden_layers = vc.vt_num_hidden_layers
        self.hidden_size = vc.vt_hidden_size
        self.intermediate_size = vc.vt_intermediate_size
        self.qkv_hidden_size = vc.qkv_hidden_size
        self.norm_type = vc.norm_type
        self.norm_eps = getattr(vc, "vt_norm_eps", 1e-6)
        self.merge_kernel_size = list(vc.merge_kernel_size)
        super().__init__(**kwargs)


class ProjectorConfig:
    def __init__(self, vision_config: KimiK3VisionConfig) -> None:
        self.mm_projector_type = vision_config.mm_projector_type
        self.mm_hidden_size = vision_config.mm_hidden_size
        self.text_hidden_size = vision_config.text_hidden_size
        self.projector_ln_eps = vision_config.projector_ln_eps
        self.merge_kernel_size = list(vision_config.merge_kernel_size)


def _vt_norm(config: VisionTowerConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)


class MoonViT3dPosEmb(nn.Module):
    """Learnable 2-D position table `weight` [H, W, D] (interpolated to the patch grid upstream)."""

    def __init__(self, height: int, width: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))


class MoonViT3dPatchEmbed(nn.Module):
    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(3, config.hidden_size, kernel_size=p, stride=p, bias=False)
        self.pos_emb = MoonViT3dPosEmb(config.init_pos_emb_height, config.init_pos_emb_width, config.hidden_size)


class MoonViTMLP(nn.Module):
    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc1 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)


class MoonViTEncoderLayer(nn.Module):
    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.norm0 = _vt_norm(config)
        self.norm1 = _vt_norm(config)
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(config.qkv_hidden_size, config.hidden_size, bias=False)
        self.mlp = MoonViTMLP(config)


class MoonViT3dEncoder(nn.Module):
    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MoonViTEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layernorm = _vt_norm(config)


class MoonViT3dPretrainedModel(PreTrainedModel):
    config_class = VisionTowerConfig
    base_model_prefix = "vision_tower"
    _no_split_modules = ["MoonViTEncoderLayer"]
    _supports_flash_attn = False

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__(config)
        self.merge_kernel_size = tuple(config.merge_kernel_size)
        self.patch_embed = MoonViT3dPatchEmbed(config)
        self.encoder = MoonViT3dEncoder(config)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, MoonViT3dPosEmb):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the tiny Kimi-K3 stand-in supports text-only forwards")


class PatchMergerMLPV2(nn.Module):
    """Merged 2x2 patches (4m) -> Linear(4m, 4m) -> exact GELU -> Linear(4m, text_hidden) -> RMSNorm."""

    def __init__(self, config: ProjectorConfig) -> None:
        super().__init__()
        kh, kw = config.merge_kernel_size
        self.hidden_size = config.mm_hidden_size * kh * kw
        self.proj = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size, bias=False),
            nn.GELU(),
            nn.Linear(self.hidden_size, config.text_hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(config.text_hidden_size, eps=config.projector_ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x.reshape(*x.shape[:-2], -1)))


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiDecoderLayer", "MoonViTEncoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = False
    _supports_sdpa = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config.text_config, "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel):
    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(config)
        self.vision_tower = MoonViT3dPretrainedModel(VisionTowerConfig(config.vision_config))
        projector_config = ProjectorConfig(config.vision_config)
        if projector_config.mm_projector_type != "patchmergerv2":
            raise ValueError(f"unsupported mm_projector_type {projector_config.mm_projector_type!r}")
        self.mm_projector = PatchMergerMLPV2(projector_config)
        self.language_model = KimiLinearForCausalLM(config.text_config)
        self.post_init()
        # As upstream: the tower and projector follow the language model's dtype.
        lm_dtype = self.language_model.dtype
        self.vision_tower.to(dtype=lm_dtype)
        self.mm_projector.to(dtype=lm_dtype)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_output_embeddings(value)

    def get_decoder(self) -> nn.Module:
        return self.language_model.get_decoder()

    def set_decoder(self, decoder: nn.Module) -> None:
        self.language_model.set_decoder(decoder)

    def tie_weights(self, **kwargs: Any) -> None:
        return self.language_model.tie_weights(**kwargs)

    def _supports_default_dynamic_cache(self) -> bool:
        return False

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
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if pixel_values is not None:
            raise NotImplementedError("the tiny Kimi-K3 stand-in supports text-only forwards")
        assert self.vision_tower is not None  # upstream asserts the tower exists but never runs it here
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
            return_dict=True,
        )
        logits = outputs.logits
        loss = None
        if labels is not None:
            # Shifted cross-entropy over positions the attention mask keeps.
            shift_logits = logits[:, :-1].float()
            shift_labels = labels[:, 1:]
            if attention_mask is not None:
                keep = attention_mask[:, 1:].to(shift_labels.device) != 0
                shift_logits, shift_labels = shift_logits[keep], shift_labels[keep]
            loss = F.cross_entropy(
                shift_logits.reshape(-1, shift_logits.shape[-1]),
                shift_labels.reshape(-1),
                ignore_index=self.config.ignore_index,
            )
        if not return_dict:
            return tuple(x for x in (loss, logits, _cache_of(outputs)) if x is not None)
        return _output_with_cache(LlavaCausalLMOutputWithPast, _cache_of(outputs), loss=loss, logits=logits)
