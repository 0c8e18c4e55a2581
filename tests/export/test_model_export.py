"""quantize -> export_checkpoint -> read back, on the tiny Kimi-K3, checked against docs/FORMATS.md.

The exported checkpoints are read by a small INDEPENDENT reader written out below (safetensors plus the
FORMATS.md rules in plain torch; nothing from ``modelopt_k3.numerics`` or ``modelopt_k3.quant``). Its
dequantized weights are loaded into the checkpoint's own, unpatched model class (built from the export
directory's copied remote code), whose logits must reproduce the fake-quantized model's.

Activations: the reader fake-quantizes a quantized Linear's input from the exported ``input_scale``
(NVFP4: dynamic per-16 E4M3 block scales under the static input_scale, i.e. FORMATS.md's weight rule
applied to the activation; FP8: per tensor), with pre-hooks on the reference model's Linears, routed
experts' w1/w3/w2 included. Compared at fp32 tolerance (1e-4 of max |logit|): ``w4a16_nvfp4`` (no
activation quantization) and the Kimi-K3 mirror recipe (expert W4A4 with input_scale 1.0). Calibrated
W4A4 on every Linear (``ALL_LINEARS_W4A4``: the old ``presets/nvfp4``, attention included) is compared too,
with a looser bound: should the fused and the
per-expert arithmetic ever differ in the last fp32 bit, an activation on an E2M1 rounding threshold
could round the other way (one step in one element). Measured on torch 2.13 CPU: 0 for all three
(bit-identical logits). KV-cache fake quant is not reproduced: the compared runs have none.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import unpatch_remote_code
from safetensors import safe_open

import modelopt_k3
from modelopt_k3 import export_checkpoint, load_pretrained, quantize
from modelopt_k3.recipe import RecipeError, recipe_from_dict
from modelopt_k3.testing import generator_fingerprint
from modelopt_k3.testing.reference import build_reference_model, fill_reference_model

pytestmark = [pytest.mark.usefixtures("restore_remote_code"), pytest.mark.slow]  # quantize + export + independent read-back of whole models

ROOT = Path(__file__).resolve().parents[2]
MIRROR = "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention"
MIRROR_YAML = ROOT / "recipes" / f"{MIRROR}.yaml"
INDEX = "model.safetensors.index.json"
EXPERT_RE = re.compile(r"^(?P<layer>.+\.block_sparse_moe\.experts)\.(?P<e>\d+)\.(?P<proj>w[123])$")
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")
# Tensors that stay in the source dtype, byte-equal to the source checkpoint, in every recipe here.
PASSTHROUGH = {
    "res_proj": re.compile(r"_res_proj\.weight$"),
    "routed_expert": re.compile(r"\.routed_expert_(up|down)_proj\.weight$"),
    "router": re.compile(r"\.block_sparse_moe\.gate\.weight$"),
    "router_bias": re.compile(r"\.block_sparse_moe\.gate\.e_score_correction_bias$"),
    "mm_projector": re.compile(r"^mm_projector\."),
    "vision_tower": re.compile(r"^vision_tower\."),
    "lm_head": re.compile(r"lm_head\.weight$"),
}
# Held-out text (not in the built-in calibration set).
HELD_OUT = [
    "The lighthouse keeper counted the ships each evening and wrote their names in a blue ledger.",
    "When the bakery closed for the winter, the whole street smelled of snow instead of bread.",
    "A hash table trades memory for speed: each key is mapped to a bucket by a cheap function.",
    "Die Katze schlief auf dem warmen Fensterbrett, waehrend draussen der Regen fiel.",
]
SEQ = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# =====================================================================================================
# The independent reader: FORMATS.md written out in plain torch
# =====================================================================================================

E4M3 = torch.float8_e4m3fn
E4M3_MAX, FP4_MAX = 448.0, 6.0
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)
E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_TIES_UP = (0.75, 1.75, 3.5)


def read_dir(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / INDEX).read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index.values())):
        with safe_open(str(path / fname), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert index[key] == fname, f"{key} is in {fname}, index says {index[key]}"
                out[key] = f.get_tensor(key)
    assert set(out) == set(index), "index and shard contents differ"
    return out


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> codes [..., 2m]: element 2i is the LOW nibble."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """FORMATS.md threshold rule: #thresholds strictly below |x|, +1 at exactly .75/1.75/3.5; sign bit 3."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8)
    for t in E2M1_THRESHOLDS:
        code += (mag >= t) if t in E2M1_TIES_UP else (mag > t)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """w = E2M1(code) * (float(weight_scale) * weight_scale_2), blocks of 16 along in; fp32 [out, in]."""
    vals = E2M1_VALUES[unpack_nibbles(packed).long()]
    out, n = vals.shape
    eff = scale.float() * scale_2.float()
    return (vals.view(out, n // 16, 16) * eff.unsqueeze(-1)).view(out, n)


def nvfp4_block_scale(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """block_amax / (6 * global), all-zero block -> 1.0, clamp [2**-9, 448], cast to e4m3."""
    bs = block_amax / (FP4_MAX * global_scale)
    bs = torch.where(block_amax == 0, torch.ones_like(bs), bs).clamp(2.0**-9, E4M3_MAX)
    return bs.to(E4M3)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None):
    """(packed u8, e4m3 scale, fp32 weight_scale_2) of a 2-D weight per FORMATS.md."""
    w = w.float()
    out, n = w.shape
    if global_scale is None:
        global_scale = w.abs().amax() / (FP4_MAX * E4M3_MAX)
    blocks = w.view(out, n // 16, 16)
    bs = nvfp4_block_scale(blocks.abs().amax(-1), global_scale)
    codes = e2m1_round(blocks / (bs.float() * global_scale).unsqueeze(-1)).view(out, n)
    return pack_nibbles(codes), bs, global_scale


def fake_quant_nvfp4_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 activation: dynamic per-16 block scales (as for weights) under the static input_scale."""
    shape, dtype = x.shape, x.dtype
    blocks = x.float().reshape(-1, shape[-1] // 16, 16)
    bs = nvfp4_block_scale(blocks.abs().amax(-1), input_scale)
    eff = (bs.float() * input_scale).unsqueeze(-1)
    return (E2M1_VALUES[e2m1_round(blocks / eff).long()] * eff).reshape(shape).to(dtype)


def fake_quant_fp8_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    q = (x.float() / input_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return (q.float() * input_scale).to(x.dtype)


def block_broadcast(scale: torch.Tensor, shape: tuple[int, int], block: int = 128) -> torch.Tensor:
    """scale[i // 128, j // 128] at every [i, j] of ``shape``; edge blocks may be partial."""
    out, n = shape
    return scale.float().repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :n]


def decode_fp8_block(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return w.float() * block_broadcast(scale, tuple(w.shape))


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w[r, c] = E2M1(nibble) * 2 ** (weight_scale[r, c // 32] - 127)."""
    vals = E2M1_VALUES[unpack_nibbles(packed).long()]
    out, n = vals.shape
    pow2 = torch.exp2(scale.float() - 127)
    return (vals.view(out, n // 32, 32) * pow2.unsqueeze(-1)).view(out, n)


@dataclass
class ReadBack:
    """What the reader made of an exported directory."""

    path: Path
    tensors: dict[str, torch.Tensor]
    hf_quant: dict
    config: dict
    algos: dict[str, str]  # module -> quant_algo
    state_dict: dict[str, torch.Tensor]  # parameter name -> value (quantized weights dequantized, fp32)
    input_scales: dict[str, tuple[str, torch.Tensor]]  # module -> (algo, input_scale)


def check_and_decode(prefix: str, algo: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Check the FORMATS.md table of one quantized Linear and return its fp32 weight."""
    w, s = t[f"{prefix}.weight"], t[f"{prefix}.weight_scale"]
    has_input = f"{prefix}.input_scale" in t
    if algo in ("NVFP4", "W4A16_NVFP4"):
        s2 = t[f"{prefix}.weight_scale_2"]
        assert w.dtype == torch.uint8 and w.dim() == 2, (prefix, w.dtype)
        out, half = w.shape
        assert (2 * half) % 16 == 0, prefix
        assert s.dtype == E4M3 and tuple(s.shape) == (out, 2 * half // 16), (prefix, s.dtype, s.shape)
        assert s2.dtype == torch.float32 and s2.shape == (), (prefix, s2.dtype, s2.shape)
        assert has_input == (algo == "NVFP4"), prefix
        return decode_nvfp4(w, s, s2)
    assert f"{prefix}.weight_scale_2" not in t, prefix
    if algo == "FP8":
        assert w.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (), (prefix, w.dtype, s.shape)
        assert has_input, prefix
        return w.float() * s
    if algo == "FP8_PB_WO":
        out, n = w.shape
        assert w.dtype == E4M3 and s.dtype == torch.float32, prefix
        # ModelOpt 0.47's (and vLLM's ModelOptFp8PbWoLinearMethod's) shape: [out_blk, 1, in_blk, 1].
        assert tuple(s.shape) == (math.ceil(out / 128), 1, math.ceil(n / 128), 1), (prefix, tuple(s.shape))
        assert not has_input, prefix
        return decode_fp8_block(w, s[:, 0, :, 0])
    raise AssertionError(f"{prefix}: unknown quant_algo {algo}")


def read_export(path: Path) -> ReadBack:
    tensors = read_dir(path)
    hf_quant = json.loads((path / "hf_quant_config.json").read_text())
    config = json.loads((path / "config.json").read_text())
    q = hf_quant["quantization"]
    quantized = {k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")}
    if q["quant_algo"] == "MIXED_PRECISION":
        # Each quantized module by its own entry, a routed expert by its bank's (how the engines look it up).
        layers = q["quantized_layers"]
        entries = {m: layers.get(m) or layers.get(re.sub(r"\.\d+\.w[123]$", "", m)) for m in quantized}
        assert all(entries.values()), sorted(m for m, e in entries.items() if not e)[:10]
        algos = {m: e["quant_algo"] for m, e in entries.items()}
    else:
        algos = dict.fromkeys(quantized, q["quant_algo"])
    assert set(algos) == quantized, sorted(set(algos) ^ quantized)[:10]
    assert not quantized & set(q.get("exclude_modules", []))
    state: dict[str, torch.Tensor] = {}
    input_scales: dict[str, tuple[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.endswith(SCALE_SUFFIXES):
            if key.endswith((".k_scale", ".v_scale")):
                assert value.dtype == torch.float32 and value.shape == (), key
            continue
        prefix = key.rpartition(".")[0]
        if key.endswith(".weight") and prefix in algos:
            state[key] = check_and_decode(prefix, algos[prefix], tensors)
        else:
            state[key] = value
    for prefix, algo in algos.items():
        if f"{prefix}.input_scale" in tensors:
            s = tensors[f"{prefix}.input_scale"]
            assert s.dtype == torch.float32 and s.shape == () and s.item() > 0, prefix
            input_scales[prefix] = (algo, s)
    return ReadBack(path, tensors, hf_quant, config, algos, state, input_scales)


def reference_from_export(rb: ReadBack, *, quantize_inputs: bool = True) -> torch.nn.Module:
    """The export's own (unpatched) model class, filled with the reader's state dict; optionally
    with pre-hooks fake-quantizing every quantized Linear's input the way the export says."""
    unpatch_remote_code()
    model = fill_reference_model(build_reference_model(rb.path), rb.state_dict)
    assert any(isinstance(m, torch.nn.ModuleList) and n.endswith(".experts") for n, m in model.named_modules())
    if quantize_inputs:
        modules = dict(model.named_modules())
        for name, (algo, scale) in rb.input_scales.items():
            fq = fake_quant_nvfp4_activation if algo == "NVFP4" else fake_quant_fp8_activation
            modules[name].register_forward_pre_hook(lambda mod, args, fq=fq, s=scale: (fq(args[0], s), *args[1:]))
    return model.eval()


# =====================================================================================================
# Helpers and fixtures
# =====================================================================================================


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def next_token_kl(base_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p_base || p_quant) of the next-token distributions."""
    p = torch.log_softmax(base_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


def load_f32(ckpt: Path) -> torch.nn.Module:
    return load_pretrained(ckpt, trust_remote_code=True, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_ckpt, trust_remote_code=True)


@pytest.fixture(scope="module")
def held_out_ids(tokenizer) -> torch.Tensor:
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"][:SEQ] for t in HELD_OUT]
    assert all(len(r) == SEQ for r in rows)
    return torch.tensor(rows)


@pytest.fixture(scope="module")
def calib_loop(tokenizer):
    from modelopt_k3.data import load_texts, make_forward_loop, pack_sequences

    seqs = pack_sequences(tokenizer, load_texts("builtin"), num_sequences=8, seq_len=SEQ)
    assert not any(t[:40] in " ".join(load_texts("builtin")) for t in HELD_OUT), "held-out text is in the calibration set"
    return make_forward_loop(list(seqs.split(4)), device=torch.device("cpu"), progress=False)


@pytest.fixture(scope="module")
def base_logits(tiny_reference: torch.nn.Module, held_out_ids: torch.Tensor) -> torch.Tensor:
    """The unquantized model (BF16 checkpoint values in fp32)."""
    return logits_of(tiny_reference, held_out_ids)


@pytest.fixture(scope="module")
def source(tiny_ckpt: Path) -> dict[str, torch.Tensor]:
    return read_dir(tiny_ckpt)


@dataclass
class Run:
    model: torch.nn.Module
    logits: torch.Tensor  # fake-quantized model on held_out_ids
    rb: ReadBack


def _api_run(tiny_ckpt, tmp_path_factory, held_out_ids, recipe, name, forward_loop=None) -> Run:
    model = quantize(load_f32(tiny_ckpt), recipe, forward_loop, verbose=False)
    logits = logits_of(model, held_out_ids)
    out = export_checkpoint(model, tmp_path_factory.mktemp(name) / f"export_{name}", progress=False)
    return Run(model, logits, read_export(out))


@pytest.fixture(scope="module")
def w4a16(tiny_ckpt, tiny_reference, tmp_path_factory, held_out_ids) -> Run:
    return _api_run(tiny_ckpt, tmp_path_factory, held_out_ids, "presets/w4a16_nvfp4", "w4a16")


@pytest.fixture(scope="module")
def mirror(tiny_ckpt, tiny_reference, tmp_path_factory, held_out_ids) -> Run:
    return _api_run(tiny_ckpt, tmp_path_factory, held_out_ids, MIRROR, "mirror")


# NVFP4 W4A4 on every Linear but units/default_disabled, attention included (presets/nvfp4 keeps attention
# BF16 for the serving engines; the reader must still reproduce quantized attention).
ALL_LINEARS_W4A4 = {"quant_cfg": [{"pattern": "*", "weights": "nvfp4", "inputs": "nvfp4"},
                                  {"import": "units/default_disabled"}]}


@pytest.fixture(scope="module")
def w4a4(tiny_ckpt, tiny_reference, tmp_path_factory, held_out_ids, calib_loop) -> Run:
    recipe = recipe_from_dict(ALL_LINEARS_W4A4, name="all_linears_w4a4")
    return _api_run(tiny_ckpt, tmp_path_factory, held_out_ids, recipe, "w4a4", calib_loop)


# =====================================================================================================
# Export read back: logits, quality
# =====================================================================================================


@pytest.mark.parametrize("run_name", ["w4a16", "mirror"])
def test_reader_reproduces_fake_quant_logits(run_name, request, held_out_ids, base_logits) -> None:
    run: Run = request.getfixturevalue(run_name)
    if run_name == "mirror":  # the only activation quantization is the experts' constant 1.0
        assert run.rb.input_scales and all(
            EXPERT_RE.match(m) and s.item() == 1.0 for m, (_, s) in run.rb.input_scales.items()
        )
    else:
        assert not run.rb.input_scales
    ref = reference_from_export(run.rb)
    logits = logits_of(ref, held_out_ids)
    err = rel_err(logits, run.logits)
    print(f"{run_name}: reader vs fake-quant relative logits error {err:.3g}")
    assert err < 1e-4, err
    # ... and quantization did change something (the comparison is not vacuous).
    assert rel_err(run.logits, base_logits) > 1e-3


def test_reader_w4a4_all_linears(w4a4: Run, held_out_ids) -> None:
    """Calibrated W4A4 on every Linear: input scales reproduced by pre-hooks on the reference Linears.

    Measured: 0 (bit-identical; the eager fused experts and the per-expert reference run the same fp32
    ops). The bound allows for a platform where they differ in the last bit and an activation on an
    E2M1 rounding threshold rounds the other way (one quantization step in one element).
    """
    assert len(w4a4.rb.input_scales) > 40
    logits = logits_of(reference_from_export(w4a4.rb), held_out_ids)
    err = rel_err(logits, w4a4.logits)
    print(f"w4a4: reader vs fake-quant relative logits error {err:.3g}")
    assert err < 2e-3, err


def test_nvfp4_quality_kl(w4a16: Run, w4a4: Run, mirror: Run, base_logits, held_out_ids) -> None:
    """KL(BF16 || quantized) of next-token distributions on 4 x 64 held-out tokens, reported and bounded.

    Measured (torch 2.13 CPU, tiny seed-0 checkpoint): w4a16 fake-quant 0.2425, w4a16 exported 0.2425
    (identical logits), nvfp4 W4A4 fake-quant 0.3253, Kimi-K3 mirror fake-quant 0.0845. Bounds are 3x
    those, rounded up. The values are large because the random tiny KDA model is very sensitive, not
    because NVFP4 is off: per-Linear relative weight error is 9.5% (as expected for E2M1 with per-16
    E4M3 scales); Gaussian noise of the same RMS on q/k/v alone gives KL 0.170 vs NVFP4 q/k/v 0.179;
    the lossless NVFP4 experts alone give KL 0; the BF16 model vs fp32 gives 0.006.
    """
    exported = logits_of(reference_from_export(w4a16.rb), held_out_ids)
    kl = {
        "w4a16 fake-quant": next_token_kl(base_logits, w4a16.logits),
        "w4a16 exported": next_token_kl(base_logits, exported),
        "nvfp4 w4a4 fake-quant": next_token_kl(base_logits, w4a4.logits),
        "mirror fake-quant": next_token_kl(base_logits, mirror.logits),
    }
    for name, value in kl.items():
        print(f"KL(bf16 || {name}) = {value:.4f}")
    bounds = {"w4a16 fake-quant": 0.75, "w4a16 exported": 0.75, "nvfp4 w4a4 fake-quant": 1.0,
              "mirror fake-quant": 0.26}
    for name, value in kl.items():
        assert 0 < value < bounds[name], (name, value)
    assert abs(kl["w4a16 exported"] - kl["w4a16 fake-quant"]) <= 1e-4 * kl["w4a16 fake-quant"]


# =====================================================================================================
# Tensors: FORMATS.md tables, sharing rules, lossless experts, pass-through bytes
# =====================================================================================================


def expert_layers(rb: ReadBack) -> dict[str, dict[int, dict[str, str]]]:
    """experts module -> expert -> proj -> module name, for the quantized experts of an export."""
    out: dict[str, dict[int, dict[str, str]]] = {}
    for module in rb.algos:
        m = EXPERT_RE.match(module)
        if m:
            out.setdefault(m["layer"], {}).setdefault(int(m["e"]), {})[m["proj"]] = module
    return out


def check_expert_sharing(rb: ReadBack, num_experts: int, *, input_quant: bool) -> None:
    t = rb.tensors
    layers = expert_layers(rb)
    assert len(layers) == 3, sorted(layers)
    for layer, experts in layers.items():
        assert sorted(experts) == list(range(num_experts)), layer
        assert all(sorted(p) == ["w1", "w2", "w3"] for p in experts.values()), layer
        for e, p in experts.items():
            s1, s3 = t[f"{p['w1']}.weight_scale_2"], t[f"{p['w3']}.weight_scale_2"]
            assert bytes_of(s1).tolist() == bytes_of(s3).tolist(), f"{layer}.{e}: w1/w3 weight_scale_2 differ"
            m, exp = math.frexp(s1.item())
            assert m == 0.5, f"{layer}.{e}: weight_scale_2 {s1.item()} of a lossless MXFP4 cast is not 2**k"
        for projs in (("w1", "w3"), ("w2",)):
            keys = [f"{p[proj]}.input_scale" for p in experts.values() for proj in projs]
            if not input_quant:
                assert not any(k in t for k in keys), layer
                continue
            values = {bytes(bytes_of(t[k]).tolist()) for k in keys}
            assert len(values) == 1, f"{layer}: experts do not share one input_scale for {projs}"


def test_expert_scales_shared(w4a4: Run, mirror: Run, w4a16: Run, tiny_ckpt) -> None:
    num_experts = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]["num_experts"]
    check_expert_sharing(w4a4.rb, num_experts, input_quant=True)
    check_expert_sharing(mirror.rb, num_experts, input_quant=True)
    check_expert_sharing(w4a16.rb, num_experts, input_quant=False)
    # Calibrated W4A4: gate/up and down inputs are different tensors, so their scales differ.
    for layer, experts in expert_layers(w4a4.rb).items():
        s13, s2 = (w4a4.rb.tensors[f"{experts[0][p]}.input_scale"].item() for p in ("w1", "w2"))
        assert s13 != s2 and s13 > 0 and s2 > 0, layer
    for name, (_, s) in mirror.rb.input_scales.items():
        assert s.item() == 1.0, name


def check_passthrough(rb: ReadBack, source: dict[str, torch.Tensor], extra_keys: set[str] = frozenset()) -> None:
    """Every source tensor not replaced by a quantized one is in the export: same name, dtype, bytes."""
    t = rb.tensors
    expected: set[str] = set(extra_keys)
    seen = dict.fromkeys(PASSTHROUGH, 0)
    for key, value in source.items():
        module = key.rpartition(".")[0]
        m = EXPERT_RE.match(module)
        if m:  # routed experts: written per expert, quantized or BF16
            assert module in rb.algos or f"{module}.weight" in t, module
            continue
        if module in rb.algos and key.endswith(".weight"):
            continue
        expected.add(key)
        assert key in t, f"{key} missing from the export"
        assert t[key].dtype == value.dtype and t[key].shape == value.shape, (key, t[key].dtype, value.dtype)
        assert torch.equal(bytes_of(t[key]), bytes_of(value)), f"{key} is not byte-equal to the source"
        for cat, pattern in PASSTHROUGH.items():
            if pattern.search(key):
                seen[cat] += 1
                assert module not in rb.algos, f"{module} must stay unquantized"
    assert all(seen.values()), seen
    assert source[next(k for k in source if PASSTHROUGH["router_bias"].search(k))].dtype == torch.float32
    # Nothing else: quantized modules' tensors, routed experts, KV scales.
    others = {k for k in t if k not in expected}
    for key in others:
        module = key.rpartition(".")[0]
        assert module in rb.algos or EXPERT_RE.match(module) or key.endswith((".k_scale", ".v_scale")), key


@pytest.mark.parametrize("run_name", ["w4a16", "mirror", "w4a4"])
def test_passthrough_tensors_byte_equal(run_name, request, source) -> None:
    check_passthrough(request.getfixturevalue(run_name).rb, source)


def test_nvfp4_experts_are_lossless_cast_of_mxfp4_source(w4a16: Run, source, tiny_reference) -> None:
    ref_params = dict(tiny_reference.named_parameters())
    n = 0
    for module, algo in w4a16.rb.algos.items():
        if not EXPERT_RE.match(module):
            continue
        assert algo == "W4A16_NVFP4"
        packed, mx_scale = source[f"{module}.weight_packed"], source[f"{module}.weight_scale"]
        # E2M1 codes carried over byte for byte.
        assert torch.equal(w4a16.rb.tensors[f"{module}.weight"], packed), module
        decoded = w4a16.rb.state_dict[f"{module}.weight"]
        assert torch.equal(decoded, decode_mxfp4(packed, mx_scale)), module
        # ... which is also what compressed-tensors' decoder gives (the reference model's experts).
        assert torch.equal(decoded, ref_params[f"{module}.weight"]), module
        n += 1
    assert n == 3 * 8 * 3


@pytest.fixture(scope="module")
def reference_groups(tiny_reference, held_out_ids) -> list[tuple[str, ...]]:
    """Linears of the reference model that receive the identical input tensor (forward pre-hooks, as
    ModelOpt's collect_shared_input_modules does), routed experts aside: written here, independently."""
    readers: dict[int, tuple[torch.Tensor, list[str]]] = {}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, n=n: readers.setdefault(id(args[0]), (args[0], []))[1].append(n))
        for n, m in tiny_reference.named_modules()
        if type(m) is torch.nn.Linear and not EXPERT_RE.match(n)
    ]
    try:
        logits_of(tiny_reference, held_out_ids[:1, :8])
    finally:
        for h in handles:
            h.remove()
    return sorted({tuple(sorted(set(names))) for _, names in readers.values() if len(set(names)) > 1})


def test_reference_groups_are_the_fused_projections(reference_groups) -> None:
    """What serving engines fuse: KDA q/k/v/f_a/b/g, MLA q_a + kv_a + g, dense and shared-expert gate/up
    (not routed_expert_down_proj: it reads a view of the shared experts' input)."""
    kinds = {tuple(n.rpartition(".")[2] for n in g) for g in reference_groups}
    assert kinds == {("b_proj", "f_a_proj", "g_proj", "k_proj", "q_proj", "v_proj"),
                     ("g_proj", "kv_a_proj_with_mqa", "q_a_proj"), ("gate_proj", "up_proj")}
    assert len(reference_groups) == 3 + 1 + 1 + 3  # 3 KDA layers, 1 MLA, 1 dense MLP, 3 shared experts


def group_of(module: str, groups: list[tuple[str, ...]], quantized) -> tuple[str, ...]:
    """The quantized members of ``module``'s shared-input group (only quantized members count)."""
    members = next((g for g in groups if module in g), (module,))
    return tuple(m for m in members if m in quantized)


def test_shared_input_groups_share_scales(w4a4: Run, w4a16: Run, cli_nvfp4: ReadBack, reference_groups, source) -> None:
    """Every shared-input group has one weight_scale_2 (the max of its weights' amax / 2688) and one
    input_scale, read straight from the exports."""
    # presets/nvfp4 (the CLI run) keeps attention BF16 for the serving engines: its 4 attention groups
    # (3 KDA, 1 MLA) have no quantized member.
    for rb, expected in ((w4a4.rb, 8), (w4a16.rb, 8), (cli_nvfp4, 4)):
        t, checked = rb.tensors, 0
        for group in reference_groups:
            if not any(m in rb.algos for m in group):
                continue
            members = group_of(group[0], reference_groups, rb.algos)
            assert len(members) == len(group), (group, members)
            for key in ("weight_scale_2", "input_scale"):
                values = {bytes(bytes_of(t[f"{m}.{key}"]).tolist()) for m in members if f"{m}.{key}" in t}
                assert len(values) <= 1, f"{members} export {len(values)} different {key}"
            amax = max(source[f"{m}.weight"].float().abs().amax() for m in members)
            assert t[f"{members[0]}.weight_scale_2"].item() == (amax / 2688.0).item(), members
            checked += 1
        assert checked == expected and len(reference_groups) == 8


def test_dense_nvfp4_bit_exact(w4a16: Run, source, reference_groups) -> None:
    """Dense Linears: FORMATS.md's NVFP4 rules applied to the source BF16 weight, under the global scale
    of the Linear's shared-input group (its max amax / 2688; block scales recomputed against it)."""
    t = w4a16.rb.tensors
    dense = [m for m in w4a16.rb.algos if not EXPERT_RE.match(m)]
    assert any(".shared_experts." in m for m in dense) and any(m.endswith("self_attn.b_proj") for m in dense)
    grouped = 0
    for module in dense:
        members = group_of(module, reference_groups, w4a16.rb.algos)
        gs = max(source[f"{m}.weight"].float().abs().amax() for m in members) / (FP4_MAX * E4M3_MAX)
        grouped += len(members) > 1
        packed, scale, _ = quantize_nvfp4(source[f"{module}.weight"], gs)
        assert t[f"{module}.weight_scale_2"].item() == gs.item(), module
        assert torch.equal(bytes_of(t[f"{module}.weight_scale"]), bytes_of(scale)), module
        assert torch.equal(t[f"{module}.weight"], packed), module
    assert grouped == 3 * 6 + 3 + 2 + 3 * 2


def _sha(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(bytes_of(t).numpy().tobytes()).hexdigest()[:16]


GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "modelopt_0_47_golden.json").read_text())


def test_dense_nvfp4_equals_modelopt_0_47(w4a16: Run) -> None:
    """The NVFP4 tensors of every BF16-sourced Linear equal, bit for bit, what nvidia-modelopt 0.47.0's own
    export writes for the same weights (its group-unified global scales included; tests/data says how the
    golden file was made)."""
    golden = GOLDEN["w4a16_nvfp4"]
    t = w4a16.rb.tensors
    assert set(golden) == {m for m in w4a16.rb.algos if not EXPERT_RE.match(m)}
    for module, want in golden.items():
        got = {"weight": _sha(t[f"{module}.weight"]), "weight_scale": _sha(t[f"{module}.weight_scale"]),
               "weight_scale_shape": list(t[f"{module}.weight_scale"].shape),
               "weight_scale_2": t[f"{module}.weight_scale_2"].item().hex()}
        assert got == want, module


def test_fp8_pb_bit_exact_with_partial_blocks(mirror: Run, source) -> None:
    t = mirror.rb.tensors
    fp8 = [m for m, a in mirror.rb.algos.items() if a == "FP8_PB_WO"]
    assert all(".self_attn." in m for m in fp8)
    assert len([m for m in fp8 if m.endswith(".b_proj")]) == 3
    for module in fp8:
        w = source[f"{module}.weight"].float()
        out, n = w.shape
        nr, nc = math.ceil(out / 128), math.ceil(n / 128)
        padded = torch.nn.functional.pad(w, (0, nc * 128 - n, 0, nr * 128 - out))
        amax = padded.view(nr, 128, nc, 128).abs().amax(dim=(1, 3))
        scale = amax / 448.0
        assert torch.equal(t[f"{module}.weight_scale"], scale[:, None, :, None]), module
        q = (w / block_broadcast(scale, (out, n))).clamp(-448, 448).to(E4M3)
        assert torch.equal(bytes_of(t[f"{module}.weight"]), bytes_of(q)), module
        rel = (mirror.rb.state_dict[f"{module}.weight"] - w).abs().max() / w.abs().max()
        assert rel <= 2.0**-4, (module, rel)  # E4M3: 3 mantissa bits
    b_proj = next(m for m in fp8 if m.endswith(".b_proj"))
    assert t[f"{b_proj}.weight"].shape[0] < 128 and t[f"{b_proj}.weight_scale"].shape == (1, 1, 1, 1)


# =====================================================================================================
# hf_ptq CLI (issue 3 acceptance), configs, KV cache
# =====================================================================================================

CLI_COMMON = ["--calib_size", "8", "--calib_seq", "64", "--batch_size", "4", "--no_progress"]


def run_cli(argv: list[str]) -> None:
    from modelopt_k3.cli import hf_ptq

    assert hf_ptq.main([*argv, *CLI_COMMON]) == 0


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


def _cli_on_tiny(tiny_ckpt: Path, out: Path, *args: str) -> ReadBack:
    run_cli(["--pyt_ckpt_path", str(tiny_ckpt), "--trust_remote_code", "--export_path", str(out), *args])
    return read_export(out)


@pytest.fixture(scope="module")
def cli_nvfp4(tiny_ckpt, cli_dir) -> ReadBack:
    return _cli_on_tiny(tiny_ckpt, cli_dir / "nvfp4_kv", "--qformat", "nvfp4", "--kv_cache_qformat", "fp8")


@pytest.fixture(scope="module")
def cli_mirror(tiny_ckpt, cli_dir) -> ReadBack:
    return _cli_on_tiny(tiny_ckpt, cli_dir / "mirror", "--recipe", str(MIRROR_YAML))


@pytest.fixture(scope="module")
def cli_fp8(tiny_ckpt, cli_dir) -> ReadBack:
    return _cli_on_tiny(tiny_ckpt, cli_dir / "fp8", "--qformat", "fp8")


def text_config(tiny_ckpt: Path) -> dict:
    return json.loads((tiny_ckpt / "config.json").read_text())["text_config"]


def reference_unquantized(rb: ReadBack) -> set[str]:
    """Modules ModelOpt gives a quantizer (Linear, Embedding, Conv, MoE router) that the export left
    unquantized, read off the reference model's own module types."""
    model = reference_from_export(rb, quantize_inputs=False)
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    # isinstance: the KDA short convolutions are fla's ShortConvolution, an nn.Conv1d subclass.
    found = {n for n, m in model.named_modules() if isinstance(m, kinds)}
    routers = {f"{n}.gate" for n, m in model.named_modules() if hasattr(m, "experts") and hasattr(m, "gate")}
    return (found | routers) - set(rb.algos)


def check_exclusions(patterns: list[str], unquantized: set[str], quantized: set[str]) -> None:
    """ModelOpt's exclude_modules: wildcards covering every unquantized module and no quantized one."""
    import fnmatch

    for p in patterns:
        assert not [q for q in quantized if fnmatch.fnmatchcase(q, p)], f"{p} matches quantized modules"
    assert all(any(fnmatch.fnmatchcase(u, p) for p in patterns) for u in unquantized)
    assert "vision_tower*" in patterns and len(patterns) < len(unquantized)  # summarized, as ModelOpt does


MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # engines' fallback parsers check the name


def check_configs(rb: ReadBack, tiny_ckpt: Path, *, quant_algo: str, kv: bool, recipe: str) -> None:
    """hf_quant_config.json and config.json's quantization_config: ModelOpt 0.47's fields, FORMATS.md's values."""
    hf = rb.hf_quant
    assert hf["producer"] == MODELOPT_PRODUCER
    assert hf["modelopt_k3"] == {"name": "modelopt_k3", "version": modelopt_k3.__version__, "recipe": recipe}
    q = hf["quantization"]
    assert q["quant_algo"] == quant_algo
    assert q["kv_cache_quant_algo"] == ("FP8" if kv else None)
    if quant_algo == "MIXED_PRECISION":
        # As ModelOpt's Kimi-K3 converter writes it (tests/export/test_kimi_k3_manifest.py: entries per bank and
        # runtime spelling); read_export resolved every quantized module through it.
        assert list(q) == ["quant_algo", "kv_cache_quant_algo", "group_size", "quantized_layers", "exclude_modules"]
        assert q["group_size"] == 16
        for module, entry in q["quantized_layers"].items():
            if entry["quant_algo"] == "NVFP4":
                assert entry == {"quant_algo": "NVFP4", "group_size": 16}, module
            else:
                assert entry == {"quant_algo": "FP8_PB_WO"}, module
    else:
        assert set(rb.algos.values()) == {quant_algo}
        fields = ["quant_algo", "kv_cache_quant_algo"] + (["group_size"] if "NVFP4" in quant_algo else [])
        assert list(q) == [*fields, "exclude_modules"]
        if "NVFP4" in quant_algo:
            assert q["group_size"] == 16
        check_exclusions(q["exclude_modules"], reference_unquantized(rb), set(rb.algos))

    cfg = rb.config
    src = json.loads((tiny_ckpt / "config.json").read_text())
    assert "quantization_config" in src["text_config"]  # the source scheme that must go
    assert "quantization_config" not in cfg["text_config"]
    text = json.dumps(cfg)
    assert "compressed-tensors" not in text and "mxfp4" not in text

    def without_qc(c: dict) -> dict:
        c = {k: v for k, v in c.items() if k != "quantization_config"}
        c["text_config"] = {k: v for k, v in c["text_config"].items() if k != "quantization_config"}
        return c

    assert without_qc(cfg) == without_qc(src)
    qc = cfg["quantization_config"]
    mixed = quant_algo == "MIXED_PRECISION"
    assert qc["quant_method"] == ("modelopt_mixed" if mixed else "modelopt") and qc["quant_algo"] == quant_algo
    assert qc["producer"] == MODELOPT_PRODUCER and qc["ignore"] == q.get("exclude_modules", [])
    if kv:
        assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    else:
        assert "kv_cache_scheme" not in qc
    groups = list(qc["config_groups"].values())
    nvfp4_w = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    if quant_algo == "NVFP4":
        assert groups == [{"input_activations": nvfp4_w, "weights": nvfp4_w, "targets": ["Linear"]}]
    elif quant_algo == "W4A16_NVFP4":
        assert groups == [{"weights": nvfp4_w, "targets": ["Linear"]}]
    elif mixed:
        assert qc["quantized_layers"] == q["quantized_layers"]
        assert sorted(t for g in groups for t in g["targets"]) == sorted(q["quantized_layers"])
        assert {"input_activations": nvfp4_w, "weights": nvfp4_w} in [{k: v for k, v in g.items() if k != "targets"}
                                                                        for g in groups]
        assert any(g.get("quant_algo") == "FP8_PB_WO" for g in groups)
    else:  # FP8
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        assert groups == [{"input_activations": fp8, "weights": fp8, "targets": ["Linear"]}]

    # The export loads with trust_remote_code; remote code, tokenizer and side files copied unchanged.
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(str(rb.path), trust_remote_code=True)
    loaded_qc = loaded.quantization_config
    loaded_qc = loaded_qc if isinstance(loaded_qc, dict) else loaded_qc.to_dict()
    assert loaded_qc["quant_method"] == qc["quant_method"]
    side = {p.name for p in tiny_ckpt.iterdir() if p.suffix != ".safetensors" and p.name not in (INDEX, "config.json")}
    assert {"configuration_kimi_k3.py", "modeling_kimi_k3.py", "tokenizer.json"} <= side
    for name in side:
        assert (rb.path / name).read_bytes() == (tiny_ckpt / name).read_bytes(), name
    shards = {p.name for p in rb.path.iterdir() if p.suffix == ".safetensors"}
    assert shards == set(json.loads((rb.path / INDEX).read_text())["weight_map"].values())
    assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", s) for s in shards)
    # quant_report/: hf_ptq's quantization report (modelopt_k3/report/), written into the export by default.
    written = {p.name for p in rb.path.iterdir()} - {"quant_report"}
    assert written == side | shards | {INDEX, "config.json", "hf_quant_config.json"}


def check_kv_scales(rb: ReadBack, tiny_ckpt: Path, present: bool) -> None:
    text = text_config(tiny_ckpt)
    mla = {i - 1 for i in text["linear_attn_config"]["full_attn_layers"]}
    assert mla and len(mla) < text["num_hidden_layers"]
    for i in range(text["num_hidden_layers"]):
        # ModelOpt's names, the ones vLLM's maybe_remap_kv_scale_name moves onto its attention layer.
        k, v = (f"language_model.model.layers.{i}.self_attn.{s}" for s in ("k_proj.k_scale", "v_proj.v_scale"))
        if present and i in mla:
            kt, vt = rb.tensors[k], rb.tensors[v]
            assert kt.dtype == vt.dtype == torch.float32 and kt.shape == vt.shape == ()
            assert torch.equal(kt, vt) and 0 < kt.item() < math.inf, (k, kt, vt)
        else:
            assert k not in rb.tensors and v not in rb.tensors, i
    n_kv = sum(key.endswith((".k_scale", ".v_scale")) for key in rb.tensors)
    assert n_kv == (2 * len(mla) if present else 0)


def test_cli_nvfp4_checkpoint_matches_formats(cli_nvfp4: ReadBack, tiny_ckpt, source) -> None:
    rb = cli_nvfp4
    check_configs(rb, tiny_ckpt, quant_algo="NVFP4", kv=True, recipe="presets/nvfp4")
    check_kv_scales(rb, tiny_ckpt, present=True)
    check_expert_sharing(rb, text_config(tiny_ckpt)["num_experts"], input_quant=True)
    check_passthrough(rb, source)
    # Shared experts keep their own names; every quantized Linear of NVFP4 W4A4 has an input_scale.
    assert any(m.endswith("shared_experts.gate_proj") for m in rb.algos)
    assert set(rb.input_scales) == set(rb.algos)


def test_cli_embedded_default_checkpoint(cli_nvfp4: ReadBack, cli_dir: Path, tiny_ckpt) -> None:
    """No --pyt_ckpt_path: the tiny Kimi-K3 is built into $MODELOPT_K3_CACHE and used; same result."""
    cache, out = cli_dir / "cache", cli_dir / "default"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MODELOPT_K3_CACHE", str(cache))
        run_cli(["--qformat", "nvfp4", "--kv_cache_qformat", "fp8", "--export_path", str(out)])
    assert (cache / f"tiny_kimi_k3-{generator_fingerprint()}" / INDEX).is_file()
    rb = read_export(out)
    check_configs(rb, cache / f"tiny_kimi_k3-{generator_fingerprint()}", quant_algo="NVFP4", kv=True, recipe="presets/nvfp4")
    assert set(rb.tensors) == set(cli_nvfp4.tensors)
    for key, value in rb.tensors.items():
        assert value.dtype == cli_nvfp4.tensors[key].dtype, key
        assert torch.equal(bytes_of(value), bytes_of(cli_nvfp4.tensors[key])), key
    assert rb.hf_quant == cli_nvfp4.hf_quant and rb.config == cli_nvfp4.config


def test_cli_mirror_recipe_is_mixed_precision(cli_mirror: ReadBack, mirror: Run, tiny_ckpt, source) -> None:
    rb = cli_mirror
    check_configs(rb, tiny_ckpt, quant_algo="MIXED_PRECISION", kv=False, recipe=MIRROR)
    check_kv_scales(rb, tiny_ckpt, present=False)
    check_passthrough(rb, source)
    algos = rb.algos
    assert {a for m, a in algos.items() if EXPERT_RE.match(m)} == {"NVFP4"}
    assert sum(1 for m in algos if EXPERT_RE.match(m)) == 3 * 8 * 3
    assert {a for m, a in algos.items() if not EXPERT_RE.match(m)} == {"FP8_PB_WO"}
    assert {m.rpartition(".")[0].rpartition(".")[2] for m in algos if not EXPERT_RE.match(m)} == {"self_attn"}
    assert all(s.item() == 1.0 for _, s in rb.input_scales.values())
    # The CLI loads BF16, the API fixture fp32: the export does not depend on the load dtype.
    assert set(rb.tensors) == set(mirror.rb.tensors)
    for key, value in rb.tensors.items():
        assert torch.equal(bytes_of(value), bytes_of(mirror.rb.tensors[key])), key


def test_cli_fp8_per_tensor(cli_fp8: ReadBack, tiny_ckpt, source, reference_groups) -> None:
    """Per-tensor FP8, bit exact: each weight under the scale of its shared-input group (the max amax / 448 of the
    group's quantized members, as NVFP4 groups share theirs: the engines fuse the group into one parameter; issue
    41), each routed expert's w1/w3 under their shared scale."""
    rb = cli_fp8
    check_configs(rb, tiny_ckpt, quant_algo="FP8", kv=False, recipe="presets/fp8")
    check_passthrough(rb, source)
    t = rb.tensors
    grouped = 0
    for module in rb.algos:
        m = EXPERT_RE.match(module)
        if m:  # source: the MXFP4-decoded expert; w1 and w3 of an expert share one scale
            pair = ("w1", "w3") if m["proj"] != "w2" else ("w2",)
            ws = [decode_mxfp4(source[f"{m['layer']}.{m['e']}.{p}.weight_packed"],
                               source[f"{m['layer']}.{m['e']}.{p}.weight_scale"]) for p in pair]
            amax = max(w.abs().amax() for w in ws)
            w = ws[pair.index(m["proj"])]
        else:
            w = source[f"{module}.weight"].float()
            members = group_of(module, reference_groups, rb.algos)
            grouped += len(members) > 1
            amax = max(source[f"{g}.weight"].float().abs().amax() for g in members)
        scale = amax / 448.0
        assert t[f"{module}.weight_scale"].item() == scale.item(), module
        q = (w / scale).clamp(-448, 448).to(E4M3)
        assert torch.equal(bytes_of(t[f"{module}.weight"]), bytes_of(q)), module
    for layer, experts in expert_layers(rb).items():  # one input_scale per layer and projection
        for projs in (("w1", "w3"), ("w2",)):
            assert len({t[f"{e[p]}.input_scale"].item() for e in experts.values() for p in projs}) == 1, layer
    assert grouped > 0  # presets/fp8 quantizes grouped Linears (an FP8 group may lose BF16-kept members)


def test_cli_calibrate_all_experts(cli_nvfp4: ReadBack, tiny_ckpt, cli_dir) -> None:
    rb = _cli_on_tiny(tiny_ckpt, cli_dir / "all_experts", "--qformat", "nvfp4", "--calibrate_all_experts")
    check_configs(rb, tiny_ckpt, quant_algo="NVFP4", kv=False, recipe="presets/nvfp4")
    routed, everyone = expert_layers(cli_nvfp4), expert_layers(rb)
    assert set(routed) == set(everyone)
    greater = 0
    for layer in routed:
        for proj in ("w1", "w3", "w2"):
            a = cli_nvfp4.tensors[f"{routed[layer][0][proj]}.input_scale"].item()
            b = rb.tensors[f"{everyone[layer][0][proj]}.input_scale"].item()
            print(f"{layer} {proj}: input_scale routed-only {a:.6g}, all experts {b:.6g}")
            assert b >= a, (layer, proj, a, b)
            greater += b > a
    assert greater > 0, "every expert seeing every token should raise some down_proj input amax"
    # Weights and dense tensors do not depend on the mode: only expert input scales may differ.
    for key, value in rb.tensors.items():
        if not (key.endswith(".input_scale") and EXPERT_RE.match(key.rpartition(".")[0])):
            assert torch.equal(bytes_of(value), bytes_of(cli_nvfp4.tensors[key])), key


def test_kv_cache_scales_are_mla_latent_amax(tiny_ckpt, tiny_reference, tmp_path, calib_loop, tokenizer) -> None:
    """k_scale = v_scale = amax(kv_a_layernorm(c) and k_rot) / 448 over the calibration data."""
    from modelopt_k3.recipe import load_recipe

    recipe = load_recipe(MIRROR, overrides={"kv_cache": "fp8"})
    model = quantize(load_f32(tiny_ckpt), recipe, calib_loop, verbose=False)
    rb = read_export(export_checkpoint(model, tmp_path / "kv", progress=False))
    check_kv_scales(rb, tiny_ckpt, present=True)
    assert rb.hf_quant["quantization"]["kv_cache_quant_algo"] == "FP8"
    # Independent amax: hooks on the reference (unquantized, fp32) model over the same batches.
    amax: dict[str, torch.Tensor] = {}
    handles = []
    for name, mod in tiny_reference.named_modules():
        if hasattr(mod, "kv_a_proj_with_mqa"):
            rank = mod.kv_lora_rank

            def record(key, value):
                amax[key] = torch.maximum(amax.get(key, torch.zeros(())), value.detach().abs().amax().float())

            handles.append(mod.kv_a_layernorm.register_forward_hook(
                lambda m, a, out, n=name: record(n, out)))
            handles.append(mod.kv_a_proj_with_mqa.register_forward_hook(
                lambda m, a, out, n=name, r=rank: record(n, out[..., r:])))
    try:
        with torch.no_grad():
            calib_loop(tiny_reference)
    finally:
        for h in handles:
            h.remove()
    assert amax
    for name, value in amax.items():
        got = rb.tensors[f"{name}.k_proj.k_scale"]
        assert got.item() == pytest.approx((value / 448.0).item(), rel=1e-6), name


# =====================================================================================================
# export_checkpoint: atomic directory, overwrite
# =====================================================================================================


def test_export_refuses_nonempty_dir_and_overwrite_replaces(w4a16: Run, tmp_path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"overwrite=True") as info:
        export_checkpoint(w4a16.model, out, progress=False)
    assert str(out) in str(info.value)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "temporary directory left behind"

    export_checkpoint(w4a16.model, out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists()
    again = read_dir(out)
    assert set(again) == set(w4a16.rb.tensors)
    assert all(torch.equal(bytes_of(v), bytes_of(w4a16.rb.tensors[k])) for k, v in again.items())
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]

    empty = tmp_path / "empty"  # an existing empty directory is not refused
    empty.mkdir()
    export_checkpoint(w4a16.model, empty, progress=False, max_shard_bytes=1 << 16)
    assert (empty / INDEX).is_file() and len(list(empty.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("existing", [False, True], ids=["new", "over-existing"])
@pytest.mark.parametrize("stage", ["shard", "configs"])
def test_export_failure_leaves_no_directory(w4a16: Run, tmp_path, monkeypatch, stage, existing) -> None:
    from modelopt_k3.export import model_export, writer

    out = tmp_path / "ckpt"
    if existing:
        out.mkdir()
        (out / "old.txt").write_text("old checkpoint")
    calls = {"flush": 0}
    if stage == "shard":  # fail writing the third shard: two are already on disk
        real_flush = writer.ShardWriter._flush

        def flaky_flush(self):
            if self._buffer:
                calls["flush"] += 1
                if calls["flush"] == 3:
                    raise RuntimeError("injected shard failure")
            real_flush(self)

        monkeypatch.setattr(writer.ShardWriter, "_flush", flaky_flush)
    else:  # fail after every shard and the index are written

        def failing_configs(*args, **kwargs):
            raise RuntimeError("injected config failure")

        monkeypatch.setattr(model_export, "write_configs", failing_configs)
    with pytest.raises(RuntimeError, match="injected"):
        export_checkpoint(w4a16.model, out, overwrite=existing, progress=False, max_shard_bytes=1 << 16)
    if stage == "shard":
        assert calls["flush"] == 3
    if existing:
        assert [p.name for p in out.iterdir()] == ["old.txt"]
        assert (out / "old.txt").read_text() == "old checkpoint"
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    else:
        assert not out.exists()
        assert list(tmp_path.iterdir()) == [], "temporary directory left behind"


# =====================================================================================================
# quantize(): summary, refusals
# =====================================================================================================


def test_quantize_summary_refusals_and_twice(tiny_ckpt, tiny_reference, capsys) -> None:
    model = load_f32(tiny_ckpt)
    experts = "*.block_sparse_moe.experts*"
    mixed_experts = recipe_from_dict({"quant_cfg": [
        {"pattern": experts, "weights": "nvfp4", "inputs": None},
        {"pattern": "*.layers.2.block_sparse_moe.experts.3.*", "weights": "fp8", "inputs": "fp8"},
    ]}, name="mixed_experts")
    with pytest.raises(RecipeError, match=r"layers\.2\.block_sparse_moe\.experts.*different formats"):
        quantize(model, mixed_experts, verbose=False)
    split_w1_w3 = recipe_from_dict({"quant_cfg": [
        {"pattern": experts, "weights": "nvfp4", "inputs": None},
        {"pattern": "*.experts.*.w3", "enable": False},
    ]}, name="split_w1_w3")
    with pytest.raises(RecipeError, match=r"w1.*w3|share"):
        quantize(model, split_w1_w3, verbose=False)
    # The refusals changed nothing: the model quantizes normally afterwards.
    assert getattr(model, "modelopt_k3_quant", None) is None
    assert not any(hasattr(m, "quant") or hasattr(m, "weight_quantizer") for m in model.modules())
    quantize(model, MIRROR, verbose=True)
    summary = capsys.readouterr().out
    print(summary)
    for text in ("NVFP4 (experts, per layer+proj)", "FP8_PB_WO", "BF16 (left unquantized)", "attention-residual projection",
                 "latent-expert projection", "lm_head", "vision tower", "vision projector", "no recipe entry matches"):
        assert text in summary, text
    counts = dict(re.findall(r"^\s+(NVFP4 \(experts, per layer\+proj\)|FP8_PB_WO)\s+(\d+) modules$", summary, re.M))
    assert counts == {"NVFP4 (experts, per layer+proj)": "9", "FP8_PB_WO": str(3 * 8 + 6)}, counts
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model, "presets/nvfp4", verbose=False)
