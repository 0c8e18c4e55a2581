# Tiny-checkpoint stand-in for the multimodal wrapper file of Kimi-K3's remote code, written for modelopt_k3.
#
# Same contract as the real file (kimi_k3_reference.md section 5): class names, the vision tower's and
# projector's key names and shapes, the non-persistent `pos_emb.time_weight` buffer (a sin-cos table made
# in __init__, never in a checkpoint), the tower and projector following the language model's dtype, the
# delegation to the language model, and the hub's 4.x-style `tie_weights(self)`. Only text-only forwards
# run: the tower is built but never executed, like in a text-only run of the real model.
# This file is copied into generated checkpoints: it must not import modelopt_k3.
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.activations import PytorchGELUTanh
from transformers.configuration_utils import PretrainedConfig
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llava.modeling_llava import LlavaCausalLMOutputWithPast

from .configuration_kimi_k3 import KimiK3Config
from .modeling_kimi_linear import KimiLinearForCausalLM

TEXT_ONLY = "the tiny Kimi-K3 stand-in runs text-only forwards (no vision tower forward)"


def sincos_table(dim: int, length: int) -> torch.Tensor:
    """fp32 [length, dim]: position p gets sin(p * f_i) for the first half, cos(p * f_i) for the second,
    with f_i = 10000^(-i / (dim/2)), i < dim/2."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float32) / half)
    phase = torch.arange(length, dtype=torch.float32).unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((torch.sin(phase), torch.cos(phase)), dim=-1)


def _norm_cls(norm_type: str | None) -> type[nn.Module]:
    return nn.RMSNorm if norm_type == "rmsnorm" else nn.LayerNorm


class Learnable2DInterpPosEmbDivided_fixed(nn.Module):
    """Learned spatial table ``weight`` [height, width, dim]; fixed temporal table ``time_weight``
    [num_frames, 1, dim] kept as a non-persistent buffer."""

    def __init__(self, height: int, width: int, num_frames: int, dim: int, interpolation_mode: str = "bicubic") -> None:
        super().__init__()
        self.height = height
        self.width = width
        self.num_frames = num_frames
        self.dim = dim
        self.interpolation_mode = interpolation_mode
        self.weight = nn.Parameter(torch.randn(height, width, dim))
        self.register_buffer("time_weight", sincos_table(dim, num_frames)[:, None, :], persistent=False)


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
            raise NotImplementedError(f"pos_emb_type {pos_emb_type!r}: the stand-in has only 'divided_fixed'")
        # Non-overlapping patches: kernel = stride = patch_size.
        self.proj = nn.Conv2d(in_dim, out_dim, patch_size, stride=patch_size, bias=patch_embed_proj_bias)
        self.pos_emb = Learnable2DInterpPosEmbDivided_fixed(
            pos_emb_height, pos_emb_width, pos_emb_time, out_dim, interpolation_mode=pos_emb_interpolation_mode
        )


class MLP2(nn.Module):
    """fc0 [dims[1], dims[0]] -> activation -> fc1 [dims[2], dims[1]]."""

    def __init__(self, dims: list[int], activation: nn.Module, bias: bool = True) -> None:
        super().__init__()
        d_in, d_mid, d_out = dims
        self.fc0 = nn.Linear(d_in, d_mid, bias=bias)
        self.fc1 = nn.Linear(d_mid, d_out, bias=bias)
        self.activation = activation


class MoonViTEncoderLayer(nn.Module):
    """Pre-norm ViT block: norm0 -> fused wqkv [3*qkv, hidden] -> wo [hidden, qkv]; norm1 -> MLP2."""

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
        self.attn_implementation = attn_implementation
        self.qkv_hidden_size = qkv_hidden_size or hidden_dim
        norm = _norm_cls(norm_type)
        self.norm0 = norm(hidden_dim)
        self.norm1 = norm(hidden_dim)
        self.mlp = MLP2([hidden_dim, mlp_dim, hidden_dim], activation, bias=linear_bias)
        self.wqkv = nn.Linear(hidden_dim, 3 * self.qkv_hidden_size, bias=attn_bias)
        self.wo = nn.Linear(self.qkv_hidden_size, hidden_dim, bias=attn_bias)


class MoonViT3dEncoder(nn.Module):
    def __init__(self, hidden_dim: int, num_layers: int, block_cfg: dict) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MoonViTEncoderLayer(**block_cfg) for _ in range(num_layers)])
        self.final_layernorm = _norm_cls(block_cfg.get("norm_type"))(hidden_dim)


class MoonViT3dPretrainedModel(PreTrainedModel):
    config_class = None
    model_type = "moonvit3d"
    _no_split_modules = ["MoonViTEncoderLayer"]
    _supports_flash_attn_2 = True
    _supports_sdpa = True

    def __init__(self, config: PretrainedConfig, *inputs: Any, **kwargs: Any) -> None:
        super().__init__(config, *inputs, **kwargs)
        opt = lambda name, default: getattr(config, name, default)  # noqa: E731  (older configs lack fields)
        self.patch_size = config.patch_size
        self.merge_kernel_size = config.merge_kernel_size
        self.merge_type = config.merge_type
        self.patch_embed = MoonVision3dPatchEmbed(
            config.hidden_size,
            patch_size=config.patch_size,
            pos_emb_height=config.init_pos_emb_height,
            pos_emb_width=config.init_pos_emb_width,
            pos_emb_time=config.init_pos_emb_time,
            pos_emb_type=config.pos_emb_type,
            patch_embed_proj_bias=opt("patch_embed_proj_bias", True),
            pos_emb_interpolation_mode=opt("pos_emb_interpolation_mode", "bicubic"),
        )
        layer_kwargs = dict(
            num_heads=config.num_attention_heads,
            hidden_dim=config.hidden_size,
            mlp_dim=config.intermediate_size,
            qkv_hidden_size=opt("qkv_hidden_size", None),
            norm_type=opt("norm_type", "layernorm"),
            attn_implementation=config._attn_implementation,
            activation=PytorchGELUTanh(),
            attn_bias=opt("attn_bias", True),
            linear_bias=opt("linear_bias", True),
        )
        self.encoder = MoonViT3dEncoder(config.hidden_size, config.num_hidden_layers, layer_kwargs)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(TEXT_ONLY)


class PatchMergerMLPV2(nn.Module):
    """Each 2x2 group of patches (4m wide) -> Linear(4m, 4m) -> exact GELU -> Linear(4m, text) -> RMSNorm."""

    def __init__(self, config: ProjectorConfig) -> None:
        super().__init__()
        kh, kw = config.merge_kernel_size
        self.hidden_size = kh * kw * config.mm_hidden_size
        layers = [
            nn.Linear(self.hidden_size, self.hidden_size, bias=False),
            nn.GELU(),
            nn.Linear(self.hidden_size, config.hidden_size, bias=False),
        ]
        self.proj = nn.Sequential(*layers)
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

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """N(0, initializer_range) weights for Linear, Conv2d and Embedding; zero biases."""
        if not isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)):
            return
        std = getattr(self.config, "initializer_range", None) or self.config.text_config.initializer_range
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


class VisionTowerConfig(PretrainedConfig):
    """The tower's view of ``vision_config``: the ``vt_*`` fields under plain names."""

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
        optional = {
            "qkv_hidden_size": None,
            "norm_type": "layernorm",
            "attn_bias": True,
            "patch_embed_proj_bias": True,
            "mlp_type": "mlp2",
            "linear_bias": True,
            "pos_emb_interpolation_mode": "bilinear",
        }
        for name, default in optional.items():
            setattr(self, name, getattr(config, name, default))


class ProjectorConfig:
    def __init__(self, config: Any) -> None:
        self.mm_projector_type = config.mm_projector_type
        self.mm_hidden_size = config.mm_hidden_size
        self.hidden_size = config.text_hidden_size
        self.merge_kernel_size = config.merge_kernel_size
        self.projector_hidden_act = config.projector_hidden_act
        self.projector_ln_eps = config.projector_ln_eps


def _shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Next-token loss over the positions whose target the attention mask keeps."""
    pred, target = logits[:, :-1], labels[:, 1:]
    if attention_mask is not None:
        keep = attention_mask[:, 1:].ne(0)
        pred, target = pred[keep], target[keep]
    return nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1))


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel):
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(config)
        self.vision_tower = MoonViT3dPretrainedModel(VisionTowerConfig(config.vision_config))
        projector = ProjectorConfig(config.vision_config)
        if projector.mm_projector_type != "patchmergerv2":
            raise ValueError(f"mm_projector_type {projector.mm_projector_type!r} is not supported")
        self.mm_projector = PatchMergerMLPV2(projector)
        self.language_model = KimiLinearForCausalLM(config.text_config)
        self.post_init()
        # The tower and the projector (buffers included) take the language model's dtype.
        lm_dtype = getattr(self.language_model, "dtype", None)
        if lm_dtype is not None:
            self.vision_tower.to(dtype=lm_dtype)
            self.mm_projector.to(dtype=lm_dtype)

    # Embeddings and decoder belong to the language model.
    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.language_model.set_output_embeddings(new_embeddings)

    def get_decoder(self) -> nn.Module:
        return self.language_model.get_decoder()

    def set_decoder(self, decoder: nn.Module) -> None:
        self.language_model.set_decoder(decoder)

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
        if self.vision_tower is None:
            raise AssertionError("vision_tower is not loaded")
        if pixel_values is not None and len(pixel_values) > 0:
            raise NotImplementedError(TEXT_ONLY)
        cfg = self.config
        as_dict = cfg.use_return_dict if return_dict is None else return_dict
        embeds = self.get_input_embeddings()(input_ids) if inputs_embeds is None else inputs_embeds
        lm_out = self.language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=embeds,
            use_cache=use_cache,
            output_attentions=cfg.output_attentions if output_attentions is None else output_attentions,
            output_hidden_states=cfg.output_hidden_states if output_hidden_states is None else output_hidden_states,
            return_dict=as_dict,
        )
        logits = lm_out.logits if as_dict else lm_out[0]
        loss = None if labels is None else _shifted_cross_entropy(logits, labels, attention_mask)
        if as_dict:
            return LlavaCausalLMOutputWithPast(
                loss=loss,
                logits=logits,
                past_key_values=lm_out.past_key_values,
                hidden_states=lm_out.hidden_states,
                attentions=lm_out.attentions,
            )
        rest = (logits, *lm_out[1:])
        return rest if loss is None else (loss, *rest)
