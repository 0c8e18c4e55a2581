"""Layerwise streaming calibration (issue 28): the export equals the resident run's, byte for byte, for each
model, in one process and under expert parallelism; the capture/replay and the resume state in isolation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _exports import read_export

from modelopt_k3.layerwise.replay import Captured, load_captured, output_meta, placeholder, save_captured
from modelopt_k3.layerwise.state import RankDir, ResumeError

PTQ = ["--qformat", "nvfp4", "--calib_size", "4", "--batch_size", "2", "--calib_seq", "24", "--no_progress"]


def assert_same_export(a: Path, b: Path) -> None:
    """Tensor for tensor, byte for byte (input scales included), and the same configs."""
    ta, tb = read_export(a), read_export(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))[:10]
    differ = [k for k in ta if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
              or not torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8))]
    assert differ == [], differ[:10]
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name


def ptq(*argv) -> int:
    from modelopt_k3.cli import hf_ptq

    return hf_ptq.run(hf_ptq.build_parser().parse_args([*PTQ, *map(str, argv)]))


# --------------------------------------------------------------------------- replay pieces


def test_captured_arguments_round_trip_through_safetensors(tmp_path: Path):
    h, mask = torch.randn(2, 3, 4), torch.ones(2, 1, 3, 3, dtype=torch.bool)
    item = Captured.of((h,), {"attention_mask": mask, "past_key_values": None, "use_cache": False, "n": 3,
                              "position_embeddings": (h[..., :2], h[..., 2:])})
    save_captured(tmp_path / "c.safetensors", [item, item])
    back = load_captured(tmp_path / "c.safetensors")
    assert len(back) == 2
    args, kwargs = back[1].call_args(torch.device("cpu"))
    assert torch.equal(args[0], h) and torch.equal(kwargs["attention_mask"], mask)
    assert kwargs["past_key_values"] is None and kwargs["use_cache"] is False and kwargs["n"] == 3
    assert torch.equal(kwargs["position_embeddings"][1], h[..., 2:])
    with pytest.raises(TypeError, match="cannot keep"):
        Captured.of((h,), {"cache": object()})


def test_a_skipped_layer_hands_on_its_outputs_structure_without_memory():
    out = (torch.randn(2, 3, 4), torch.randn(6, 2, 4, dtype=torch.bfloat16))
    ph = placeholder(output_meta(out), torch.device("cpu"))
    assert isinstance(ph, tuple) and [x.shape for x in ph] == [x.shape for x in out]
    assert [x.dtype for x in ph] == [x.dtype for x in out] and all(x.stride() == (0,) * x.dim() for x in ph)


# --------------------------------------------------------------------------- resume state


def test_rank_state_commits_resumes_and_refuses_another_run(tmp_path: Path):
    from modelopt_k3.layerwise.state import LayerRecord

    fp = {"recipe": "a", "calibration tokens": "t"}
    d = RankDir(tmp_path, 0, fp)
    assert d.load() == 0
    item = Captured.of((torch.ones(2),), {})
    (d.path / "layer00000-r00000-00000.safetensors").write_bytes(b"x")
    d.commit(LayerRecord(0, {"k": "layer00000-r00000-00000.safetensors"}, 8, {}), {"q": torch.ones(1)}, [item])
    (d.path / "layer00001-r00000-00000.safetensors").write_bytes(b"half")  # an interrupted layer's debris
    again = RankDir(tmp_path, 0, fp)
    assert again.load() == 1
    again.roll_back(1)
    assert not (d.path / "layer00001-r00000-00000.safetensors").exists()
    assert (d.path / "layer00000-r00000-00000.safetensors").exists()
    assert torch.equal(again.inputs(1)[0].tensors[0], torch.ones(2))
    again.roll_back(0)  # a peer rank had not committed layer 0: back to the start
    assert again.state.layers == [] and not (d.path / "layer00000-r00000-00000.safetensors").exists()
    with pytest.raises(ResumeError, match="another calibration tokens, recipe"):
        RankDir(tmp_path, 0, {"recipe": "b", "calibration tokens": "u"}).load()


def test_rank_state_refuses_what_changed_after_its_commit(tmp_path: Path):
    """Issue 42: a truncated ``state.json``, a committed file edited, a captured input truncated: each one line
    naming the file (a ``ResumeError``), never a bare ``JSONDecodeError`` or a replay of wrong inputs."""
    from modelopt_k3.layerwise.state import LayerRecord

    fp = {"recipe": "a"}
    d = RankDir(tmp_path, 0, fp)
    (d.path / "layer00000-r00000-00000.safetensors").write_bytes(b"x" * 64)
    d.commit(LayerRecord(0, {"k": "layer00000-r00000-00000.safetensors"}, 64, {}), {"q": torch.ones(1)},
             [Captured.of((torch.ones(2),), {})])
    assert set(d.state.layers[0].files) == {"layer00000-r00000-00000.safetensors", "quant-00000.safetensors",
                                            "inputs-00001.safetensors"}
    inputs = d.path / "inputs-00001.safetensors"
    good = inputs.read_bytes()
    inputs.write_bytes(good[: len(good) - 3])
    again = RankDir(tmp_path, 0, fp)
    assert again.load() == 1
    with pytest.raises(ResumeError, match="inputs-00001.safetensors changed since it was committed"):
        again.inputs(1)
    inputs.write_bytes(good)
    (d.path / "quant-00000.safetensors").write_bytes(b"edited")
    with pytest.raises(ResumeError, match="quant-00000.safetensors changed since it was committed"):
        RankDir(tmp_path, 0, fp).load()
    state = d.path / "state.json"
    state.write_text(state.read_text()[:40])
    with pytest.raises(ResumeError, match="state.json is not the JSON this package writes"):
        RankDir(tmp_path, 0, fp).load()


def test_a_second_run_on_a_checkpoint_dir_is_refused_while_the_first_holds_it(tmp_path: Path):
    """Two runs on one checkpoint directory gave ``[Errno 17] File exists`` (no lock): now the second is refused
    naming the live holder; another rank's lock is its own, and the lock goes with the run."""
    from modelopt_k3.files.locks import LockHeld
    from modelopt_k3.layerwise.state import held

    with held(tmp_path, 0):
        with pytest.raises(LockHeld, match=r"\.rank00000\.lock is held by another run"), held(tmp_path, 0):
            pass
        with held(tmp_path, 1):
            pass
    with held(tmp_path, 0):
        pass


# --------------------------------------------------------------------------- end to end, one process

MODELS = {
    "kimi_k3": lambda p: __import__("modelopt_k3.testing", fromlist=["x"]).make_tiny_kimi_k3(p),
    "qwen3_moe": lambda p: __import__("modelopt_k3.testing.qwen3_moe", fromlist=["x"]).make_tiny_qwen3_moe(p),
    "gpt_oss": lambda p: __import__("modelopt_k3.testing.tiny_gpt_oss", fromlist=["x"]).make_tiny_gpt_oss(p),
    # block-FP8 (kept MLA projections are decoded at load: the export writes them BF16) with an MTP layer (carried)
    "deepseek_v3": lambda p: __import__("modelopt_k3.testing.deepseek_v3", fromlist=["x"]).make_tiny_deepseek_v3(
        p, num_nextn_predict_layers=1),
}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lw")
    return {name: make(root / name) for name, make in MODELS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_layerwise_export_equals_the_resident_export(stand_ins, model, tmp_path: Path):
    ckpt = stand_ins[model]
    extra = ["--kv_cache_qformat", "fp8"] if model == "kimi_k3" else []
    assert ptq("--pyt_ckpt_path", ckpt, "--trust_remote_code", "--export_path", tmp_path / "resident",
               "--report", "none", *extra) == ptq("--pyt_ckpt_path", ckpt, "--trust_remote_code", "--layerwise",
                                                  "--export_path", tmp_path / "layerwise", *extra)
    assert_same_export(tmp_path / "resident", tmp_path / "layerwise")
    assert not [p for p in tmp_path.iterdir() if ".layerwise-" in p.name], "the temporary layer directory stayed"


@pytest.mark.slow
def test_layerwise_packed_experts_and_a_weight_algorithm_equal_resident(stand_ins, tmp_path: Path):
    """Packed-resident experts (decoded per layer in the forward), MSE weight scales and act-headroom input scales
    (each layer's histograms from the unquantized inputs, as resident), layer by layer."""
    ckpt = stand_ins["kimi_k3"]
    for name, flags in (("packed", ["--experts", "packed"]), ("mse", ["--qformat", "nvfp4_mse"]),
                        ("act_headroom", ["--qformat", "nvfp4_act_headroom"])):
        ptq("--pyt_ckpt_path", ckpt, "--trust_remote_code", "--export_path", tmp_path / f"{name}-r", "--report",
            "none", *flags)
        ptq("--pyt_ckpt_path", ckpt, "--trust_remote_code", "--export_path", tmp_path / f"{name}-l", "--layerwise",
            *flags)
        assert_same_export(tmp_path / f"{name}-r", tmp_path / f"{name}-l")


def test_layerwise_refusals_name_the_flag(stand_ins, tmp_path: Path):
    from modelopt_k3.run.preflight import PreflightError

    ckpt = stand_ins["kimi_k3"]
    base = ["--pyt_ckpt_path", ckpt, "--trust_remote_code", "--export_path", tmp_path / "out"]
    with pytest.raises(PreflightError, match="needs --layerwise"):
        ptq(*base, "--layerwise_checkpoint_dir", tmp_path / "ck")
    with pytest.raises(PreflightError, match="overlaps the export path"):
        ptq(*base, "--layerwise", "--layerwise_checkpoint_dir", tmp_path / "out" / "ck")
    with pytest.raises(ValueError, match="inside the source|source checkpoint"):
        ptq(*base, "--layerwise", "--layerwise_checkpoint_dir", ckpt / "ck")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gptq_layerwise_feeds_each_layer_the_quantized_outputs_before_it(stand_ins, tmp_path: Path):
    """GPTQ defaults to quantized propagation (ModelOpt's get_qdq_activations_from_prev_layer): layer 0 sees
    the embeddings either way, so its tensors equal the resident GPTQ run's; later layers' GPTQ weights come
    from the quantized model's activations, so some differ."""
    ckpt = stand_ins["kimi_k3"]
    for name, flags in (("resident", ["--report", "none"]), ("layerwise", ["--layerwise"])):
        ptq("--pyt_ckpt_path", ckpt, "--trust_remote_code", "--qformat", "nvfp4_gptq", "--export_path",
            tmp_path / name, *flags)
    a, b = read_export(tmp_path / "resident"), read_export(tmp_path / "layerwise")
    assert set(a) == set(b)
    layer0 = [k for k in a if ".layers.0." in k]
    assert layer0 and all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in layer0)
    differ = {k for k in a if not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))}
    assert any(k.endswith(".weight") and ".experts." not in k for k in differ), sorted(differ)[:5]  # a GPTQ weight


@pytest.mark.slow
def test_gptq_layerwise_with_quantized_propagation_differs_from_unquantized(stand_ins, tmp_path: Path):
    """``get_qdq_activations_from_prev_layer`` decides what layer 1 on sees: GPTQ's default (true) feeds it layer
    0's quantized outputs, ``false`` the unquantized ones; layer 0 sees the embeddings either way. So the two
    runs agree on layer 0's tensors and differ in a later dense GPTQ weight (a run that captured the
    unquantized outputs with quantized propagation asked for would give the ``false`` export)."""
    from modelopt_k3.recipe import load_recipe

    text = Path(load_recipe("presets/nvfp4_gptq").path).read_text()
    assert text.count("enable: false") == 1
    unquantized = tmp_path / "gptq_unquantized_inputs.yaml"
    unquantized.write_text(text.replace("enable: false", "enable: true\n    get_qdq_activations_from_prev_layer: false"))
    ckpt = stand_ins["kimi_k3"]
    for name, recipe in (("qdq", ["--qformat", "nvfp4_gptq"]), ("plain", ["--recipe", unquantized])):
        ptq("--pyt_ckpt_path", ckpt, "--trust_remote_code", *recipe, "--layerwise", "--export_path", tmp_path / name)
    a, b = read_export(tmp_path / "qdq"), read_export(tmp_path / "plain")
    assert set(a) == set(b)
    same = {k for k in a if torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))}
    layer0 = [k for k in a if ".layers.0." in k]
    assert layer0 and set(layer0) <= same
    assert any(k.endswith(".weight") and ".experts." not in k and ".layers.0." not in k for k in set(a) - same)


class _Toy(torch.nn.Module):
    """Embedding, three layers, a head: the decoder loop a layerwise replay patches."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)

    def forward(self, input_ids, use_cache=False):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def test_replay_runs_the_current_layer_on_its_inputs_and_captures_what_it_hands_on():
    """Layer by layer, each layer's captured arguments are the real outputs of the one before (a layer that
    returned its placeholder while being replayed would hand on zeros)."""
    from modelopt_k3.layerwise.replay import LayerReplay

    model, ids = _Toy(), torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = [model.embed(ids)]
        for layer in model.layers:
            want.append(torch.tanh(layer(want[-1])))
    replay = LayerReplay(model, ["layers.0", "layers.1", "layers.2"], torch.device("cpu"))
    try:
        replay.current, replay.capture = -1, True
        inputs = replay.step(ids, None)
        for i in range(3):
            assert torch.equal(inputs.tensors[0], want[i]), i
            replay.current = i
            inputs = replay.step(ids, inputs)
        assert inputs is None  # the last layer: nothing after it to capture
    finally:
        replay.restore()
