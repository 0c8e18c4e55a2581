"""The stand-in remote code fails where the real Kimi-K3 code fails, and our shims fix exactly that.

Each break of the hub's files on transformers 5.x (kimi_k3_reference.md sections 6 and 9) is shown on a
fresh copy of the stand-in's "hub" variant without the shim, then with it; the "transformers5" variant
(llm-compressor's compatibility edits) needs none of them, which is what "detected, not assumed" means.
"""

from __future__ import annotations

import ast
import copy
import inspect
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from modelopt_k3.models.kimi_k3 import shims
from modelopt_k3.models.kimi_k3.fla_cpu import install_fla_cpu, triton_available
from modelopt_k3.testing.tiny import REMOTE_CODE_FILES, remote_code_source

pytestmark = pytest.mark.slow  # fresh copies of the remote code, imported one by one

HUB_CLASS_SHIMS = [
    "KimiK3ForConditionalGeneration.tie_weights",
    "KimiDynamicCache.get_query_offset/get_mask_sizes",
    "KimiLinearForCausalLM._tied_weights_keys",
    "KimiLinearModel.__init__(flash_attention_2)",
    "create_causal_mask(cache_position, input_embeds)",
]


def _remote_dir(tmp_path: Path, tiny_ckpt: Path, variant: str = "hub") -> Path:
    """config.json + the remote code in `variant`, with a unique marker: a dynamic module no test loaded yet."""
    marker = uuid.uuid4().hex[:12]
    path = tmp_path / f"rc_{variant}_{marker}"
    path.mkdir()
    (path / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    for fname in REMOTE_CODE_FILES:
        (path / fname).write_text(remote_code_source(fname, variant) + f"\n# fresh module {marker}\n")
    return path


def _remote_class(path: Path) -> tuple[object, type]:
    shims.apply_import_shims(path)
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=True)
    return config, get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], str(path))


def _module_of(cls: type, name: str):
    return sys.modules[cls.__module__.rpartition(".")[0] + "." + name]


def _build(config, cls: type) -> torch.nn.Module:
    """A real (CPU) model with every parameter set to small deterministic values."""
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model.eval()


IDS = torch.arange(3, 15).view(1, 12)


@pytest.fixture
def hub(tmp_path: Path, tiny_ckpt: Path):
    return _remote_class(_remote_dir(tmp_path, tiny_ckpt))


# ----------------------------------------------------------------------------------------------
# Import-time breaks
# ----------------------------------------------------------------------------------------------


@contextmanager
def _clean_modules(prefixes: tuple[str, ...]) -> Iterator[None]:
    """Hide the loaded modules under ``prefixes`` for the block; restore exactly what was there."""
    saved = {n: m for n, m in sys.modules.items() if n.startswith(prefixes)}
    for name in saved:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.startswith(prefixes)]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.mark.skipif(triton_available(), reason="with triton, fla's own kernels import")
def test_stand_in_needs_fla_kernels_like_the_real_code(tmp_path: Path, tiny_ckpt: Path) -> None:
    path = _remote_dir(tmp_path, tiny_ckpt)
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=True)
    with _clean_modules(("fla",)), pytest.raises(ImportError, match="triton"):
        get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], str(path))
    imports = shims.imported_names([(path / "modeling_kimi_linear.py").read_text()])
    assert {("fla.modules", "ShortConvolution"), ("fla.modules", "FusedRMSNormGated"), ("fla.ops.kda", "chunk_kda"),
            ("fla.ops.kda", "fused_recurrent_kda"), ("fla.ops.utils.index", "prepare_cu_seqlens_from_mask"),
            ("fla.ops.utils.index", "prepare_lens_from_mask"), ("fla.utils", "tensor_cache")} <= imports  # fmt: skip


def test_output_recorder_import_location(tmp_path: Path, tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """5.12 moved OutputRecorder out of utils.generic, where the hub's file imports it from."""
    import transformers.utils.generic as generic

    install_fla_cpu()  # past the fla imports, which come first in the file
    monkeypatch.delattr(generic, "OutputRecorder", raising=False)
    path = _remote_dir(tmp_path, tiny_ckpt)
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=True)
    with pytest.raises(ImportError, match="OutputRecorder"):
        get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], str(path))
    assert "transformers.utils.generic.OutputRecorder" in shims.apply_import_shims(path)
    get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], str(path))


# ----------------------------------------------------------------------------------------------
# Class-level breaks, one at a time
# ----------------------------------------------------------------------------------------------


def test_tie_weights_break_and_shim(hub) -> None:
    config, cls = hub
    with pytest.raises(TypeError, match="recompute_mapping"), torch.device("meta"):
        cls(copy.deepcopy(config))
    assert shims.shim_tie_weights(sys.modules[cls.__module__], None) == ["KimiK3ForConditionalGeneration.tie_weights"]
    with torch.device("meta"):
        cls(copy.deepcopy(config))


def test_create_causal_mask_break_and_shim(hub) -> None:
    config, cls = hub
    shims.shim_tie_weights(sys.modules[cls.__module__], None)
    linear = _module_of(cls, "modeling_kimi_linear")
    model = _build(config, cls)
    with pytest.raises(TypeError, match="input_embeds"):
        model(input_ids=IDS, use_cache=False)
    applied = shims.shim_mask_functions(linear, ast.parse(inspect.getsource(linear)))
    assert applied == ["create_causal_mask(cache_position, input_embeds)"]
    # Next break: the hub's KimiLinearModel forced flash_attention_2 at construction.
    assert model.config.text_config._attn_implementation == "flash_attention_2"
    # Without flash-attn: ImportError (transformers < 5.25), or the Hub-kernel fallback refused offline (>= 5.25).
    with pytest.raises((ImportError, ValueError), match="flash_attn|flash-attn|[Kk]ernel"):
        model(input_ids=IDS, use_cache=False)


def test_forced_flash_attention_and_cache_protocol_breaks_and_shims(hub) -> None:
    config, cls = hub
    k3 = sys.modules[cls.__module__]
    linear = _module_of(cls, "modeling_kimi_linear")
    tree = ast.parse(inspect.getsource(linear))
    shims.shim_tie_weights(k3, None)
    shims.shim_mask_functions(linear, tree)
    assert shims.shim_forced_flash_attention(linear, tree) == ["KimiLinearModel.__init__(flash_attention_2)"]
    model = _build(config, cls)
    assert model.config.text_config._attn_implementation == "eager"
    plain = model(input_ids=IDS, use_cache=False).logits
    # use_cache=True (the config default): 5.9's masking asks the 4.x cache for get_query_offset.
    with pytest.raises(AttributeError, match="get_query_offset"):
        model(input_ids=IDS, use_cache=True)
    assert shims.shim_cache_protocol(linear, tree) == ["KimiDynamicCache.get_query_offset/get_mask_sizes"]
    out = model(input_ids=IDS[:, :-1], use_cache=True)
    torch.testing.assert_close(out.logits, plain[:, :-1], rtol=1e-5, atol=1e-5)
    step = model(input_ids=IDS[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], plain[:, -1], rtol=1e-4, atol=1e-4)


def test_tied_weights_keys_list_break_and_shim(hub) -> None:
    config, cls = hub
    shims.shim_tie_weights(sys.modules[cls.__module__], None)
    with torch.device("meta"):
        model = cls(config)
    lm = model.language_model
    lm.config.tie_word_embeddings = True
    with pytest.raises(AttributeError, match="keys"):
        lm.get_expanded_tied_weights_keys()
    linear = _module_of(cls, "modeling_kimi_linear")
    assert shims.shim_tied_weights_keys(linear, None) == ["KimiLinearForCausalLM._tied_weights_keys"]
    assert lm.get_expanded_tied_weights_keys() == {"lm_head.weight": "model.embed_tokens.weight"}


# ----------------------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------------------


def test_shims_are_detected_not_assumed(tmp_path: Path, tiny_ckpt: Path) -> None:
    """The hub variant gets exactly its five shims, the transformers5 variant none; both compute the same."""
    hub_config, hub_cls = _remote_class(_remote_dir(tmp_path, tiny_ckpt, "hub"))
    assert sorted(shims.apply_class_shims(hub_cls)) == sorted(HUB_CLASS_SHIMS)
    assert shims.apply_class_shims(hub_cls) == []  # idempotent
    t5_config, t5_cls = _remote_class(_remote_dir(tmp_path, tiny_ckpt, "transformers5"))
    assert shims.apply_class_shims(t5_cls) == []
    hub_model, t5_model = _build(hub_config, hub_cls), _build(t5_config, t5_cls)
    with torch.no_grad():
        plain = t5_model(input_ids=IDS, use_cache=False).logits
        torch.testing.assert_close(t5_model(input_ids=IDS, use_cache=True).logits, plain, rtol=1e-5, atol=1e-5)
        assert torch.equal(hub_model(input_ids=IDS, use_cache=False).logits, plain)


def test_generator_refuses_unknown_variant(tmp_path: Path) -> None:
    from modelopt_k3.testing import make_tiny_kimi_k3

    with pytest.raises(ValueError, match="remote_code"):
        make_tiny_kimi_k3(tmp_path / "x", remote_code="vendored")
