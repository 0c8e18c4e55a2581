"""Weight algorithms on the tiny Qwen3-MoE: ``nvfp4_mse`` errs no more than max on every NVFP4 weight (each
block's scale is its sweep optimum), and the export writes exactly the searched block scales."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.numerics import nvfp4_fake_quant
from modelopt_k3.quant.calibrators.weights import weight_sites
from modelopt_k3.testing.qwen3_moe import calibration_token_ids

pytestmark = pytest.mark.slow


def _quantized(ckpt, recipe):
    import modelopt_k3

    model = modelopt_k3.load_pretrained(ckpt, progress=False)

    def loop(m):
        with torch.no_grad():
            m(input_ids=calibration_token_ids())

    return modelopt_k3.quantize(model, recipe, loop, verbose=False)


def test_nvfp4_mse_weight_error_at_most_max_for_every_nvfp4_module(qwen3_moe_ckpt):
    model = _quantized(qwen3_moe_ckpt, "presets/nvfp4_default_mse")
    sites = list(weight_sites(model))
    assert len(sites) == 19 and set(model.modelopt_k3_quant.calibration.values()) == {"mse(fp8_scale_sweep=True)"}
    improved = 0
    for site in sites:
        q = site.quantizer
        w = getattr(site.module, site.param).detach().float()
        gs = q.scale().view(-1, 1, 1) if site.experts else q.scale()
        err_mse = ((nvfp4_fake_quant(w, gs, block_scale=q.block_scale) - w) ** 2).double()
        err_max = ((nvfp4_fake_quant(w, gs) - w) ** 2).double()
        per_block_mse = err_mse.reshape(*w.shape[:-1], -1, 16).sum(-1)
        per_block_max = err_max.reshape(*w.shape[:-1], -1, 16).sum(-1)
        assert bool((per_block_mse <= per_block_max * (1 + 1e-6)).all()), site.name
        assert per_block_mse.sum() <= per_block_max.sum(), site.name
        improved += bool(per_block_mse.sum() < per_block_max.sum())
    assert improved == len(sites)


def test_export_writes_the_searched_block_scales(qwen3_moe_ckpt, tmp_path):
    from safetensors import safe_open

    import modelopt_k3

    model = _quantized(qwen3_moe_ckpt, "presets/nvfp4_default_four_over_six")
    out = modelopt_k3.export_checkpoint(model, tmp_path / "e", progress=False)
    modules = dict(model.named_modules())
    name = "model.layers.0.self_attn.q_proj"
    q = modules[name].weight_quantizer
    tensors = {}
    for f in out.glob("*.safetensors"):
        with safe_open(f, framework="pt") as s:
            tensors.update({k: s.get_tensor(k) for k in s.keys() if k.startswith(name + ".")})  # noqa: SIM118
    assert torch.equal(tensors[f"{name}.weight_scale"].view(torch.uint8), q.block_scale.view(torch.uint8))
    assert float(tensors[f"{name}.weight_scale_2"]) == float(q.amax) / (6 * 256)


def _pre_inputs(model, modules: dict, keep) -> dict[str, list]:
    """``keep(args)`` of every call of each module's forward (pre-hooks registered last: after its input
    quantizer), in one forward on the calibration tokens with activations fake-quantized and weights not."""
    from modelopt_k3.quant.modules import set_mode

    seen: dict[str, list] = {n: [] for n in modules}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen[n].append(keep(args))) for n, m in modules.items()]
    set_mode(model, "off", role="weight")
    try:
        with torch.no_grad():
            model(input_ids=calibration_token_ids())
    finally:
        set_mode(model, "quant")
        for h in hooks:
            h.remove()
    return seen


def _layer_inputs(model, linears: dict) -> dict:
    """Each Linear's input after its input quantizer, activations fake-quantized and weights not (what
    GPTQ's Hessian was taken from), on ``ids``."""
    seen = _pre_inputs(model, linears, lambda args: args[0].detach())
    return {n: torch.cat([t.reshape(-1, t.shape[-1]) for t in v]).float() for n, v in seen.items()}


def _expert_inputs(model, experts: dict):
    """(module name, module, expert, param, its inputs) for every routed expert a calibration token reached, in one
    forward with weights unquantized and activations fake-quantized: gate/up reads the routed tokens as the
    experts module receives them (after its input quantizer), down the input-quantized activation of gate/up's
    output. Written here from the module's own routing arguments, independently of the calibrators' hooks."""
    routed = _pre_inputs(model, experts, lambda args: (args[0], args[1]))
    for name, m in experts.items():
        hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h, _ in routed[name]])
        ids = torch.cat([i.reshape(-1, i.shape[-1]) for _, i in routed[name]])
        down_q = m.quant.input["down_proj"]
        for e in range(m.num_experts):
            x = hidden[(ids == e).any(-1)].float()
            if not len(x):
                continue
            with torch.no_grad():
                down_in = down_q.fake_quant(m.activation(x.to(m.gate_up_proj.dtype) @ m.gate_up_proj[e].T)).float()
            yield name, m, e, "gate_up_proj", x
            yield name, m, e, "down_proj", down_in


def test_local_hessian_searches_each_routed_expert_under_its_own_tokens_hessian(qwen3_moe_ckpt):
    """Routed experts (BF16) under local_hessian: every block scale of every expert a token reached is the
    brute-force E4M3 sweep's optimum under that expert's block Hessian ``E[x_b x_bᵀ]`` of its own routed
    inputs (computed here directly in float64); the report records local_hessian for them."""
    from modelopt_k3.numerics.nvfp4_search import nvfp4_sweep_block_scales as sweep

    model = _quantized(qwen3_moe_ckpt, "presets/nvfp4_default_local_hessian")
    experts = {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}
    checked, differs = 0, 0
    for name, m, e, param, x in _expert_inputs(model, experts):
        assert model.modelopt_k3_quant.weight_algorithms[f"{name}.{param}"] == "local_hessian"
        q = m.quant.weight[param]
        w = getattr(m, param)[e].detach()
        xb = x.double().reshape(x.shape[0], -1, 16)
        h = (torch.einsum("tnb,tnd->nbd", xb, xb) / x.shape[0]).float()
        want = sweep(w, q.scale()[e], hessian=h)
        assert torch.equal(q.block_scale[e].view(torch.uint8), want.view(torch.uint8)), (name, e, param)
        differs += not torch.equal(want.view(torch.uint8), sweep(w, q.scale()[e]).view(torch.uint8))
        checked += 1
    assert checked >= 24 and differs >= checked // 2  # the weighting changes most experts' choices


def test_gptq_output_error_below_max_for_every_dense_layer(qwen3_moe_ckpt):
    """ModelOpt's semantics (``true_sequential: false``): one Hessian forward, every weight unquantized; each
    Linear's GPTQ weight errs less than max's on those inputs."""
    from modelopt_k3.quant.schemes import NVFP4_TENSOR
    from modelopt_k3.recipe import load_recipe

    recipe = load_recipe("presets/nvfp4_default_gptq",
                         overrides={"algorithm": {"method": "gptq", "perc_damp": 0.01, "block_size": 128}})
    model = _quantized(qwen3_moe_ckpt, recipe)
    linears = {n: m for n, m in model.named_modules()
               if type(m) is torch.nn.Linear and getattr(m, "weight_quantizer", None) is not None
               and m.weight_quantizer.fmt is NVFP4_TENSOR}
    assert len(linears) == 15
    inputs = _layer_inputs(model, linears)
    for name, m in linears.items():
        q = m.weight_quantizer
        assert q.updated_weight is not None and model.modelopt_k3_quant.calibration[name].startswith("gptq")
        w = m.weight.detach().float()
        w_gptq = q.fake_quant(m.weight).float()  # what the export holds
        w_max = nvfp4_fake_quant(w, q.scale())
        x = inputs[name]
        err_gptq, err_max = ((x @ (w - w_gptq).T) ** 2).sum(), ((x @ (w - w_max).T) ** 2).sum()
        assert err_gptq < err_max, (name, float(err_gptq), float(err_max))


def test_local_hessian_weights_by_the_input_as_it_arrives(qwen3_moe_ckpt, monkeypatch):
    """ModelOpt's local Hessian hooks a Linear's input before the Linear's own input quantizer (upstream
    activations fake-quantized, this one not): the calibrator must ask for that input, in 16-blocks."""
    from modelopt_k3.quant.calibrators import local_hessian

    asked, real = [], local_hessian.input_moments

    def input_moments(*args, **kwargs):
        asked.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(local_hessian, "input_moments", input_moments)
    model = _quantized(qwen3_moe_ckpt, "presets/nvfp4_default_local_hessian")
    assert [(a["blocks"], a["raw_input"]) for a in asked] == [(True, True)]
    assert len(asked[0]["experts"]) == 2  # both experts modules' owners take their experts' block Hessians
    assert any(v.startswith("local_hessian") for v in model.modelopt_k3_quant.calibration.values())


def test_gptq_lowers_every_routed_experts_output_error_on_its_own_tokens(qwen3_moe_ckpt):
    """Routed experts (BF16) get GPTQ from their owner's Hessian of the tokens routed to them: for every expert
    and both projections, ``||(W - Ŵ) X||²`` on its calibration inputs (ModelOpt's one-pass semantics: weights
    unquantized, activations fake-quantized; gate/up reads the routed tokens, down the input-quantized gate of
    gate/up's output) is below max's."""
    from modelopt_k3.recipe import load_recipe

    recipe = load_recipe("presets/nvfp4_default_gptq",
                         overrides={"algorithm": {"method": "gptq", "perc_damp": 0.01, "block_size": 128}})
    model = _quantized(qwen3_moe_ckpt, recipe)
    experts = {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}
    assert len(experts) == 2
    checked = 0
    for name, m, e, param, x_in in _expert_inputs(model, experts):
        assert model.modelopt_k3_quant.weight_algorithms[f"{name}.{param}"] == "gptq"
        q = m.quant.weight[param]
        w = getattr(m, param)[e].detach().float()
        w_gptq = q.fake_quant(getattr(m, param).detach(), expert_dim=True)[e].float()  # what the export holds
        w_max = nvfp4_fake_quant(w, q.scale()[e])
        err_gptq, err_max = ((x_in @ (w - w_gptq).T) ** 2).sum(), ((x_in @ (w - w_max).T) ** 2).sum()
        assert err_gptq < err_max, (name, e, param, float(err_gptq), float(err_max))
        checked += 1
    assert checked >= 24  # most of the 2 x 8 experts got tokens


def test_gptq_asymmetric_refuses_a_layer_that_changes_its_arguments_in_place(qwen3_moe_ckpt):
    """The resident reference rerun calls a decoder layer twice on the same arguments: a layer writing into one
    of them would feed the real call what the rerun wrote, so it is refused, naming the way out."""
    import modelopt_k3

    model = modelopt_k3.load_pretrained(qwen3_moe_ckpt, progress=False)
    layer = model.model.layers[1]
    forward = layer.forward

    def writes_its_input(hidden_states, *args, **kwargs):
        hidden_states.mul_(1.0)
        return forward(hidden_states, *args, **kwargs)

    layer.forward = writes_its_input

    def loop(m):
        with torch.no_grad():
            m(input_ids=calibration_token_ids())

    with pytest.raises(RuntimeError, match="changed one of its arguments in place.*asymmetric: false"):
        modelopt_k3.quantize(model, "presets/nvfp4_default_gptq", loop, verbose=False)


def test_gptq_forwards_modelopt_one_pass_and_ours_one_per_stage(qwen3_moe_ckpt):
    """ModelOpt's gptq (``true_sequential: false``): max's forward, then ONE Hessian forward for every weight.
    The preset's ``true_sequential``: one forward per stage of a layer (q/k/v; o; gate/up and the experts'
    gate/up; down and the experts' down: 4 on Qwen3-MoE), the asymmetric reference reruns inside them."""
    import modelopt_k3
    from modelopt_k3.recipe import load_recipe

    one_pass = load_recipe("presets/nvfp4_default_gptq",
                           overrides={"algorithm": {"method": "gptq", "perc_damp": 0.01, "block_size": 128}})
    for recipe, forwards in ((one_pass, 1 + 1), ("presets/nvfp4_default_gptq", 1 + 4)):
        calls = []

        def loop(m, calls=calls):
            calls.append(1)
            with torch.no_grad():
                m(input_ids=calibration_token_ids())

        modelopt_k3.quantize(modelopt_k3.load_pretrained(qwen3_moe_ckpt, progress=False), recipe, loop, verbose=False)
        assert len(calls) == forwards, (recipe, len(calls))
