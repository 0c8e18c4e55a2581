"""Tests for the tiny Kimi-K3 stand-in checkpoint generator, its remote code and the reference loader."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from modelopt_k3.models.kimi_k3.fla_cpu import fla_reference
from modelopt_k3.models.kimi_k3.shims import apply_import_shims
from modelopt_k3.testing import TINY_DEFAULTS, make_tiny_kimi_k3
from modelopt_k3.testing.reference import load_reference_model, read_checkpoint, reference_logits
from modelopt_k3.testing.tiny import REMOTE_CODE_DIR, raised_gate_up_expert

apply_import_shims(REMOTE_CODE_DIR)  # the stand-in imports fla-core's kernels, as the real code does
from modelopt_k3.testing.remote_code import modeling_kimi_linear as mkl  # noqa: E402

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
F32_SUFFIXES = (".A_log", ".dt_bias", ".e_score_correction_bias", "_conv1d.weight", ".o_norm.weight")
TEXT_PREFIX = "language_model.model.layers."


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """The tiny model gains nothing from intra-op threads, and on a shared machine they oversubscribe."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_kimi_k3(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def ref_model(ckpt: Path) -> torch.nn.Module:
    return load_reference_model(ckpt)


@pytest.fixture(scope="module")
def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(ckpt)


class _Timer:
    """min(wall, process CPU) seconds: the test machine is shared, so wall time alone is inflated by
    other processes, and CPU time alone by intra-op threads; the smaller one bounds our own cost."""

    def __enter__(self) -> _Timer:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = min(time.perf_counter() - self._wall, time.process_time() - self._cpu)


def _shard_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.suffix in (".safetensors", ".json")}


# ----------------------------------------------------------------------------------------------
# Generator: files, determinism, config
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_deterministic_in_seed(ckpt: Path, tmp_path: Path) -> None:
    same = _shard_bytes(make_tiny_kimi_k3(tmp_path / "same", seed=0))
    assert same == _shard_bytes(ckpt)
    other = _shard_bytes(make_tiny_kimi_k3(tmp_path / "other", seed=1))
    shards = [n for n in same if n.endswith(".safetensors")]
    assert len(shards) >= 2
    assert all(same[n] != other[n] for n in shards)


def test_refuses_non_empty_dir(ckpt: Path) -> None:
    with pytest.raises(FileExistsError):
        make_tiny_kimi_k3(ckpt)
    with pytest.raises(ValueError, match="unknown"):
        make_tiny_kimi_k3(ckpt.parent / "x", num_expertz=4)


def test_config_fields(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3"
    assert cfg["auto_map"] == {
        "AutoConfig": "configuration_kimi_k3.KimiK3Config",
        "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
    }
    assert cfg["dtype"] == "bfloat16"
    text = cfg["text_config"]
    assert text["model_type"] == "kimi_linear"
    for key in (
        "hidden_size",
        "num_experts",
        "routed_expert_hidden_size",
        "attn_res_block_size",
        "vocab_size",
    ):
        assert text[key] == TINY_DEFAULTS[key]
    assert text["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert text["linear_attn_config"]["full_attn_layers"] == [4]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        assert 0 <= text[key] < text["vocab_size"]
    assert 0 <= cfg["media_placeholder_token_id"] < text["vocab_size"]

    q = text["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == "mxfp4-pack-quantized"
    assert q["quantization_status"] == "compressed"
    group = q["config_groups"]["group_0"]
    assert group["format"] == "mxfp4-pack-quantized" and group["targets"] == ["Linear"]
    assert group["input_activations"] is None
    assert group["weights"] == {
        "num_bits": 4,
        "type": "float",
        "strategy": "group",
        "group_size": 32,
        "symmetric": True,
        "dynamic": False,
        "scale_dtype": "torch.uint8",
    }
    ignore = q["ignore"]
    assert "language_model.lm_head" in ignore
    assert any("vision_tower" in n for n in ignore) and any("mm_projector" in n for n in ignore)
    assert any(".self_attn." in n for n in ignore) and any("shared_experts" in n for n in ignore)
    assert any(n.endswith("block_sparse_moe.gate") for n in ignore)
    assert not any("routed_expert" in n or n.endswith("res_proj") or ".experts." in n for n in ignore)


def test_autoconfig_remote_code(ckpt: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt, trust_remote_code=True)
    assert type(cfg).__name__ == "KimiK3Config"
    assert type(cfg.text_config).__name__ == "KimiLinearConfig"
    assert type(cfg.vision_config).__name__ == "KimiK3VisionConfig"
    assert cfg.quantization_config == cfg.text_config.quantization_config
    assert cfg.quantization_config["format"] == "mxfp4-pack-quantized"


def test_tokenizer_offline_roundtrip(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True)
    text = "Hello, Kimi! ünïcødé ✓ 1+1=2\n\ttabs"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    cfg = json.loads((ckpt / "config.json").read_text())["text_config"]
    assert len(tok) <= cfg["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        cfg["bos_token_id"],
        cfg["eos_token_id"],
        cfg["pad_token_id"],
    )


# ----------------------------------------------------------------------------------------------
# Tensors on disk
# ----------------------------------------------------------------------------------------------


def test_index_covers_shards(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert {p.name for p in shards} == set(index["weight_map"].values())
    seen: dict[str, str] = {}
    total = 0
    for shard in shards:
        assert shard.name.endswith(f"-of-{len(shards):05d}.safetensors")
        with safe_open(str(shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                assert key not in seen
                seen[key] = shard.name
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total


def test_routed_experts_are_mxfp4_packed(tensors: dict[str, torch.Tensor]) -> None:
    s = TINY_DEFAULTS
    dl, inter = s["routed_expert_hidden_size"], s["moe_intermediate_size"]
    shapes = {"w1": (inter, dl), "w3": (inter, dl), "w2": (dl, inter)}
    experts = [k for k in tensors if ".block_sparse_moe.experts." in k]
    moe_layers = range(s["first_k_dense_replace"], s["num_hidden_layers"])
    assert len(experts) == 2 * 3 * s["num_experts"] * len(moe_layers)
    nibbles = set()
    for key in experts:
        proj = key.split(".")[-2]
        out_f, in_f = shapes[proj]
        t = tensors[key]
        assert t.dtype == torch.uint8
        if key.endswith(".weight_packed"):
            assert t.shape == (out_f, in_f // 2)
            nibbles |= set((t & 0xF).unique().tolist()) | set((t >> 4).unique().tolist())
        else:
            assert key.endswith(".weight_scale") and t.shape == (out_f, in_f // 32)
            assert int(t.min()) >= 115 and int(t.max()) <= 127
    assert nibbles == set(range(16))
    assert not any(".experts." in k and k.endswith(".weight") for k in tensors)


def test_every_moe_layer_has_gate_up_pairs_whose_largest_exponents_differ(tensors) -> None:
    """Data that can tell an expert's shared w1/w3 global scale (the max over both) from w1's or w3's own:
    per MoE layer, one expert whose largest E8M0 exponent is w3's and one whose is w1's, the rest equal."""
    s = TINY_DEFAULTS
    for layer in range(s["first_k_dense_replace"], s["num_hidden_layers"]):
        top = {
            (e, p): int(tensors[f"{TEXT_PREFIX}{layer}.block_sparse_moe.experts.{e}.{p}.weight_scale"].max())
            for e in range(s["num_experts"]) for p in ("w1", "w3")
        }
        w3_larger = [e for e in range(s["num_experts"]) if top[e, "w3"] > top[e, "w1"]]
        w1_larger = [e for e in range(s["num_experts"]) if top[e, "w1"] > top[e, "w3"]]
        assert len(w3_larger) == 1 and len(w1_larger) == 1, (layer, top)
        assert raised_gate_up_expert(layer, s["num_experts"]) == {"w3": w3_larger[0], "w1": w1_larger[0]}


def test_dtypes_f32_where_the_real_checkpoint_has_them(tensors: dict[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if ".experts." in key:
            continue
        expected = torch.float32 if key.endswith(F32_SUFFIXES) else torch.bfloat16
        assert t.dtype == expected, key
    dk, hk = TINY_DEFAULTS["linear_head_dim"], TINY_DEFAULTS["linear_num_heads"]
    a_log = tensors[f"{TEXT_PREFIX}0.self_attn.A_log"]
    assert a_log.shape == (dk,) and (a_log[hk:] == 0).all() and (a_log[:hk] != 0).all()
    assert tensors[f"{TEXT_PREFIX}0.self_attn.dt_bias"].abs().sum() > 0
    assert tensors[f"{TEXT_PREFIX}1.block_sparse_moe.gate.e_score_correction_bias"].abs().sum() > 0
    assert tensors[f"{TEXT_PREFIX}0.self_attn.q_conv1d.weight"].shape == (hk * dk, 1, 4)


def test_reference_decode_matches_format_rule(ckpt: Path, ref_model: torch.nn.Module, tensors) -> None:
    key = f"{TEXT_PREFIX}1.block_sparse_moe.experts.3.w2"
    packed, scale = tensors[f"{key}.weight_packed"], tensors[f"{key}.weight_scale"]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    expected = E2M1[codes] * torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)
    got = ref_model.get_parameter(f"{key}.weight")
    assert torch.equal(got, expected)


# ----------------------------------------------------------------------------------------------
# Model structure and forward
# ----------------------------------------------------------------------------------------------


def test_state_dict_keys_match_checkpoint(ref_model: torch.nn.Module, tensors) -> None:
    ckpt_keys = {k.replace(".weight_packed", ".weight") for k in tensors if not k.endswith(".weight_scale")}
    assert set(ref_model.state_dict()) == ckpt_keys


def test_layer_types(ref_model: torch.nn.Module) -> None:
    layers = ref_model.language_model.model.layers
    kinds = [
        (type(layer.self_attn).__name__, "moe" if hasattr(layer, "block_sparse_moe") else "dense")
        for layer in layers
    ]
    assert kinds == [
        ("KimiDeltaAttention", "dense"),
        ("KimiDeltaAttention", "moe"),
        ("KimiDeltaAttention", "moe"),
        ("KimiMLAAttention", "moe"),
    ]
    block = layers[1].block_sparse_moe
    assert isinstance(block.experts, torch.nn.ModuleList) and len(block.experts) == 8
    assert (block.ep_size, block.ep_rank, block.experts_per_rank) == (1, 0, 8)
    assert block.use_latent_moe and block.latent_moe_use_norm and block.moe_hidden_size == 64
    assert type(block.experts[0]).__name__ == "KimiBlockSparseMLP"
    assert type(block.gate).__name__ == "KimiMoEGate"
    size = TINY_DEFAULTS["attn_res_block_size"]
    assert sum(i % size == 0 for i in range(len(layers))) >= 2  # at least two AttnRes blocks
    assert ref_model.language_model.model.output_attn_res_proj.weight.shape == (1, 128)


def test_vision_side_keys_and_dtype(ref_model: torch.nn.Module) -> None:
    assert ref_model.vision_tower.patch_embed.pos_emb.weight.shape == (64, 64, 32)
    assert ref_model.vision_tower.encoder.blocks[0].wqkv.weight.shape == (96, 32)
    assert ref_model.mm_projector.proj[0].weight.shape == (128, 128)
    assert ref_model.mm_projector.proj[2].weight.shape == (128, 128)
    lm_dtype = ref_model.language_model.dtype
    for name, p in ref_model.named_parameters():
        if name.startswith(("vision_tower.", "mm_projector.")):
            assert p.dtype == lm_dtype, name
    assert not any(n.endswith(".bias") for n, _ in ref_model.named_parameters())


def test_reference_forward(ref_model: torch.nn.Module) -> None:
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    reference_logits(ref_model, ids[:, :8])  # warm-up
    timings = []
    for _ in range(3):
        with _Timer() as timer:
            logits = reference_logits(ref_model, ids)
        timings.append(timer.elapsed)
    elapsed = min(timings)
    assert logits.shape == (1, 64, 512) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std() < 100
    assert elapsed < 1.0, f"64-token forward took {elapsed:.2f}s"


def test_padding_and_cache(ref_model: torch.nn.Module) -> None:
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    full = reference_logits(ref_model, ids)
    # Left padding: the valid positions must see exactly the unpadded sequence.
    padded = torch.cat([torch.full((1, 3), 258), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], dim=1)
    got = reference_logits(ref_model, padded, attention_mask=mask)[:, 3:]
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    # Cached prefill + one decode step equals the full forward.
    with torch.no_grad():
        out = ref_model(input_ids=ids[:, :-1], use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values  # renamed in transformers 5.2x
        step = ref_model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], rtol=1e-4, atol=1e-4)


def test_stand_in_has_the_real_signatures_and_attributes(ref_model: torch.nn.Module) -> None:
    """The constructor signatures, attribute names and config shape the adapter must tolerate (reference section 9)."""
    sig = inspect.signature(mkl.KimiBlockSparseMLP)
    assert list(sig.parameters) == ["config", "hidden_size", "intermediate_size"]
    assert sig.parameters["hidden_size"].default is None and sig.parameters["intermediate_size"].default is None
    gate = ref_model.language_model.model.layers[1].block_sparse_moe.gate
    assert gate.num_expert_group == TINY_DEFAULTS["num_expert_group"] and not hasattr(gate, "n_group")
    assert list(inspect.signature(mkl.KimiDecoderLayer.forward).parameters) == [
        "self", "hidden_states", "attention_mask", "position_ids", "past_key_values", "output_attentions",
        "use_cache", "block_residual", "kwargs",
    ]  # fmt: skip
    config_cls = type(ref_model.config)
    assert "sub_configs" not in vars(config_cls) and not config_cls.sub_configs
    kda = ref_model.language_model.model.layers[0].self_attn
    assert kda.A_log.shape == (TINY_DEFAULTS["linear_num_heads"],)  # declared [num_heads], stored [head_dim]


def test_router_asserts_eval_and_block_dispatch_follows_training_mode(ref_model: torch.nn.Module) -> None:
    block = ref_model.language_model.model.layers[2].block_sparse_moe
    h = torch.randn(1, 6, 128, generator=torch.Generator().manual_seed(0))
    calls: list[str] = []
    with torch.no_grad():
        eval_out = block(h)
    try:
        block.train()
        with pytest.raises(AssertionError):
            block(h)  # the router asserts eval mode
        block.gate.eval()
        for name in ("moe_infer", "moe_train"):
            original = getattr(block, name)
            setattr(block, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
        with torch.no_grad():
            train_out = block(h)
        block.eval()
        with torch.no_grad():
            block(h)
    finally:
        block.eval()
        for name in ("moe_infer", "moe_train"):
            vars(block).pop(name, None)
    assert calls == ["moe_train", "moe_infer"]
    torch.testing.assert_close(train_out, eval_out, rtol=1e-5, atol=1e-5)


def test_vision_tower_has_a_non_persistent_sincos_buffer(ref_model: torch.nn.Module, tensors) -> None:
    pos = ref_model.vision_tower.patch_embed.pos_emb
    assert "time_weight" in pos._non_persistent_buffers_set
    frames, dim = 4, TINY_DEFAULTS["vt_hidden_size"]
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    angles = torch.outer(torch.arange(frames, dtype=torch.float64), omega)
    expected = torch.cat([angles.sin(), angles.cos()], dim=1).unsqueeze(1)
    torch.testing.assert_close(pos.time_weight.double(), expected, rtol=1e-6, atol=1e-6)
    assert not any("time_weight" in k for k in tensors)


def test_meta_instantiation_of_every_pretrained_class(ckpt: Path) -> None:
    from modelopt_k3.testing.reference import load_reference_class

    config, cls = load_reference_class(ckpt)
    with torch.device("meta"):
        model = cls(config)
        lm_cls = type(model.language_model)
        lm = lm_cls(config.text_config)
    assert all(p.is_meta for p in model.parameters())
    assert lm.lm_head.weight.shape == (512, 128)
    assert type(model).__name__ == "KimiK3ForConditionalGeneration"
    assert "KimiDecoderLayer" in model._no_split_modules


@pytest.mark.slow
def test_many_experts(tmp_path: Path) -> None:
    with _Timer() as timer:
        path = make_tiny_kimi_k3(tmp_path / "e128", num_experts=128)
    assert timer.elapsed < 5.0, f"generating 128 experts took {timer.elapsed:.2f}s"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert f"{TEXT_PREFIX}3.block_sparse_moe.experts.127.w2.weight_packed" in index["weight_map"]
    model = load_reference_model(make_tiny_kimi_k3(tmp_path / "e64", num_experts=64))
    logits = reference_logits(model, torch.arange(16).view(1, 16))
    assert logits.shape == (1, 16, 512) and torch.isfinite(logits).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes",
    [
        {"attn_res_block_size": None, "q_lora_rank": None},
        {"use_full_rank_gate": False, "hidden_act": "silu", "num_hidden_layers": 6},
        {
            "num_expert_group": 4,
            "topk_group": 2,
            "routed_expert_hidden_size": None,
            "routed_scaling_factor": 2.5,
        },
    ],
    ids=["no-attnres", "lowrank-gate-silu-6layers", "grouped-topk-no-latent"],
)
def test_config_variants(tmp_path: Path, sizes: dict) -> None:
    model = load_reference_model(make_tiny_kimi_k3(tmp_path / "v", **sizes))
    ids = torch.arange(3, 23).view(1, 20)
    full = reference_logits(model, ids)
    assert torch.isfinite(full).all()
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :4] = 0
    padded = torch.cat([torch.full((1, 4), 258), ids[:, :16]], dim=1)
    both = reference_logits(model, torch.cat([ids, padded]), attention_mask=mask)
    torch.testing.assert_close(both[0], full[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[1, 4:], full[0, :16], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Remote-code math against fla's CPU references and simple re-derivations
# ----------------------------------------------------------------------------------------------


def test_apply_attn_res_matches_fla_naive() -> None:
    naive = fla_reference("ops/attnres/naive.py")
    g = torch.Generator().manual_seed(0)
    N, n, D = 5, 3, 16
    residuals, partial = torch.randn(N, n, D, generator=g), torch.randn(N, D, generator=g)
    proj, norm = torch.nn.Linear(D, 1, bias=False), mkl.KimiRMSNorm(D, eps=1e-5)
    with torch.no_grad():
        proj.weight.normal_(generator=g)
        norm.weight.uniform_(0.5, 1.5, generator=g)
    ours = mkl._apply_attn_res(partial, residuals, proj, norm)
    ref = naive.naive_attnres(
        query=proj.weight,
        residuals=[residuals[:, i] for i in range(n)] + [partial],
        rms_weight=norm.weight,
        rms_eps=norm.variance_epsilon,
    )
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_moe_infer_matches_dense_loop(ref_model: torch.nn.Module) -> None:
    block = ref_model.language_model.model.layers[2].block_sparse_moe
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 20, 128, generator=g)
    idx, w = block.gate(h)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (20, 2)
    torch.testing.assert_close(w.sum(-1), torch.ones(20))  # renormalised, scaling factor 1
    x = torch.randn(20, 64, generator=g)
    with torch.no_grad():
        expected = torch.zeros(20, 64)
        for t in range(20):
            for j in range(2):
                expected[t] += w[t, j] * block.experts[int(idx[t, j])](x[t : t + 1])[0]
        got = block.moe_infer(x, idx, w)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_situ_and_mul() -> None:
    act = mkl.SituAndMul(4.0, 25.0)
    x = torch.randn(3, 8)
    gate, up = x.chunk(2, -1)
    expected = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * 25.0 * torch.tanh(up / 25.0)
    torch.testing.assert_close(act(x), expected)

