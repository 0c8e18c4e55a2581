"""Calibration algorithms (issue 29) against max, one process on CPU, on the tiny Qwen3-MoE outlier stand-in.

Checkpoint: ``make_tiny_qwen3_moe(..., outliers=True)`` (3 layers, 8 experts, hidden 64: a few 20-100x input
channels and Student-t weights, ``testing/qwen3_moe.py``). Each side is ``modelopt_k3.quantize`` of a freshly
loaded model (the load untimed) with ``presets/nvfp4_default_<algorithm>`` against ``nvfp4_default`` (max),
calibrated on the same ``calibration_token_ids`` and timed interleaved in the same run (common.py's rule).

Figures, all report-only (a tiny random model shows the algorithms' mechanics, not their quality or their
cost at full size, where the forwards dominate less and the searches scale with the weights):

- calibration wall time, algorithm / max (the algorithm runs max first, so >= 1);
- summed squared weight error over every NVFP4 weight (dense Linears and routed experts), algorithm / max;
- squared output error of each dense NVFP4 Linear on HELD-OUT tokens (never calibrated on; each Linear's
  own input from the weights-unquantized forward), algorithm / max, the mean over Linears (ours = the worst
  Linear's ratio, reference = the best's);
- per decoder layer, the output error on the held-out tokens (the layer run with quantized weights against
  the same layer with unquantized weights, same inputs), algorithm / max: in the markdown table.

Correctness checks (fail the run): mse's weight error <= max's on every NVFP4 weight; gptq's held-out
decoder-layer output error < max's on every layer (issue 29's acceptance; its per-Linear figures on the
weights-unquantized inputs may exceed 1: the asymmetric target compensates the quantized inputs' error,
which those inputs do not have).
"""

from __future__ import annotations

import statistics

from .common import Figure, summary, time_interleaved

AREA = "calibrators"
ALGORITHMS = {
    "max": "nvfp4_default",
    "mse": "presets/nvfp4_default_mse",
    "four_over_six": "presets/nvfp4_default_four_over_six",
    "local_hessian": "presets/nvfp4_default_local_hessian",
    "gptq": "presets/nvfp4_default_gptq",
}
QUICK_ALGORITHMS = ("max", "mse", "gptq")  # --quick: the two checked algorithms, one repeat, no warm-up
CALIB = {"num": 16, "seq": 32}  # 512 tokens: with 128, GPTQ's Hessians over-fit (layer 0's q/v tie max held out)
HELD_OUT = {"num": 8, "seq": 32, "seed": 4321}  # calibration_token_ids' default seed is 1234


def _nvfp4_linears(model) -> dict:
    import torch

    from modelopt_k3.quant.schemes import NVFP4_TENSOR

    return {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear
            and getattr(m, "weight_quantizer", None) is not None and m.weight_quantizer.fmt is NVFP4_TENSOR}


def _weight_errors(model) -> dict[str, float]:
    """Per NVFP4 weight site, ``||fake_quant(w) - w||²`` of what the export holds."""
    from modelopt_k3.numerics import nvfp4_fake_quant
    from modelopt_k3.quant.calibrators.weights import weight_sites

    out = {}
    for site in weight_sites(model):
        q = site.quantizer
        w = getattr(site.module, site.param).detach().float()
        if getattr(q, "updated_weight", None) is not None:
            dq = q.updated_weight.float()
        else:
            gs = q.scale().view(-1, 1, 1) if site.experts else q.scale()
            dq = nvfp4_fake_quant(w, gs, block_scale=q.block_scale)
        out[f"{site.name}.{site.param}"] = float(((dq - w) ** 2).double().sum())
    return out


def _held_out_capture(model, ids) -> tuple[dict, list]:
    """Weights unquantized, activations fake-quantized: each dense NVFP4 Linear's input and each decoder
    layer's call (args, kwargs) on ``ids``."""
    import torch

    from modelopt_k3.quant.modules import set_mode

    linears = _nvfp4_linears(model)
    seen: dict[str, list] = {}
    calls: list = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, []).append(args[0].detach()))
             for n, m in linears.items()]
    hooks += [layer.register_forward_pre_hook(lambda mod, args, kwargs: calls.append((args, dict(kwargs))),
                                              with_kwargs=True) for layer in model.model.layers]
    set_mode(model, "off", role="weight")
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        set_mode(model, "quant")
        for h in hooks:
            h.remove()
    return {n: torch.cat([t.reshape(-1, t.shape[-1]) for t in v]).float() for n, v in seen.items()}, calls


def _output_errors(model, inputs: dict) -> dict[str, float]:
    out = {}
    for name, m in _nvfp4_linears(model).items():
        w = m.weight.detach().float()
        dw = w - m.weight_quantizer.fake_quant(m.weight).float()
        out[name] = float(((inputs[name] @ dw.T) ** 2).double().sum())
    return out


def _layer_errors(model, calls: list) -> list[float]:
    import torch

    from modelopt_k3.quant.modules import set_mode

    def forward(layer, args, kwargs):
        y = layer(*args, **kwargs)
        return (y[0] if isinstance(y, tuple) else y).float()

    errors = []
    with torch.no_grad():
        for layer, (args, kwargs) in zip(model.model.layers, calls):
            set_mode(model, "off", role="weight")
            try:
                ref = forward(layer, args, kwargs)
            finally:
                set_mode(model, "quant")
            errors.append(float(((forward(layer, args, kwargs) - ref) ** 2).double().sum()))
    return errors


def run(ctx):
    import torch

    import modelopt_k3
    from modelopt_k3.testing.qwen3_moe import calibration_token_ids, make_tiny_qwen3_moe

    ckpt = make_tiny_qwen3_moe(ctx.workdir / "qwen3_moe_outliers", seed=0, outliers=True, overwrite=True)
    algorithms = {n: ALGORITHMS[n] for n in (QUICK_ALGORITHMS if ctx.quick else ALGORITHMS)}
    calib = calibration_token_ids(**CALIB)
    held_out = calibration_token_ids(**HELD_OUT)

    def loop(m):
        with torch.no_grad():
            m(input_ids=calib)

    loaded: dict = {}
    done: dict = {}

    def load(name):
        return lambda: loaded.__setitem__(name, modelopt_k3.load_pretrained(ckpt, progress=False))

    def calibrate(name):
        def fn():
            done[name] = modelopt_k3.quantize(loaded.pop(name), algorithms[name], loop, verbose=False)
        return fn

    repeats = 1 if ctx.quick else ctx.repeats
    times = time_interleaved({n: calibrate(n) for n in algorithms}, repeats, warmup=0 if ctx.quick else 1,
                             before={n: load(n) for n in algorithms})
    inputs, calls = _held_out_capture(done["max"], held_out)
    weight = {n: _weight_errors(m) for n, m in done.items()}
    output = {n: _output_errors(m, inputs) for n, m in done.items()}
    layers = {n: _layer_errors(m, calls) for n, m in done.items()}
    ctx.log("calibrators: " + ", ".join(f"{n} {statistics.median(t):.2f}s" for n, t in times.items()))

    checks = {
        ("mse", "weight"): {"mse weight error <= max on every NVFP4 weight":
                            all(weight["mse"][k] <= weight["max"][k] * (1 + 1e-9) for k in weight["max"])},
        ("gptq", "output"): {"gptq held-out decoder-layer output error < max on every layer":
                             all(a < b for a, b in zip(layers["gptq"], layers["max"]))},
    }
    tmax = statistics.median(times["max"])
    figures = []
    for n in algorithms:
        if n == "max":
            continue
        paired = [a / b for a, b in zip(times[n], times["max"])]
        figures.append(Figure(
            f"calibrators/time_{n}", AREA, f"calibration time, {n} / max (tiny Qwen3-MoE outliers)",
            {"label": ALGORITHMS[n], **summary(times[n])}, {"label": "nvfp4_default (max)", **summary(times["max"])},
            statistics.median(times[n]) / tmax, ratio_range=(min(paired), max(paired)), target=None,
            target_text="report only (x max's time)", higher_is_better=False))
        per_linear = [output[n][k] / output["max"][k] for k in output["max"]]
        for kind, ours, ref, ratio, what, sides in (
                ("weight", sum(weight[n].values()), sum(weight["max"].values()), None,
                 "summed weight error (all NVFP4 weights)",
                 (f"{ALGORITHMS[n]}: summed weight error", "nvfp4_default (max): summed weight error")),
                ("output", max(per_linear), min(per_linear), statistics.mean(per_linear),
                 "held-out output error (dense Linears), mean of per-Linear ratios",
                 (f"worst per-Linear held-out output error, {n} / max",
                  f"best per-Linear held-out output error, {n} / max"))):
            figures.append(Figure(
                f"calibrators/{kind}_error_{n}", AREA, f"{what}, {n} / max",
                {"label": sides[0], "value": ours, "unit": "" if ratio is None else "worst ratio"},
                {"label": sides[1], "value": ref, "unit": "" if ratio is None else "best ratio"},
                ours / ref if ratio is None else ratio, target=None,
                target_text="report only (< 1: less error than max)", higher_is_better=False, unit="",
                checks=checks.get((n, kind), {})))
    rows = [f"| {n} | {statistics.median(times[n]) / tmax:.2f} | {sum(weight[n].values()) / sum(weight['max'].values()):.3f} "
            f"| {statistics.mean(output[n][k] / output['max'][k] for k in output['max']):.3f} "
            f"[{min(output[n][k] / output['max'][k] for k in output['max']):.3f}–"
            f"{max(output[n][k] / output['max'][k] for k in output['max']):.3f}] | "
            + " / ".join(f"{a / b:.3f}" for a, b in zip(layers[n], layers["max"])) + " |" for n in algorithms]
    calib_text = CALIB
    markdown = "\n".join([
        f"### Calibrators against max (tiny Qwen3-MoE, outliers=True; calibration {calib_text['num']} x "
        f"{calib_text['seq']} tokens, held out {HELD_OUT['num']} x {HELD_OUT['seq']}; medians of {repeats})",
        "",
        "| algorithm | time / max | summed weight error / max | held-out output error / max per dense Linear, "
        "mean [min–max] | "
        "held-out decoder-layer output error / max (layers 0 / 1 / 2) |",
        "|---|---|---|---|---|",
        *rows,
    ])
    return figures, {"checkpoint": str(ckpt), "calibration": calib_text, "held_out": HELD_OUT,
                     "times_s": times, "weight_error": weight, "output_error": output,
                     "layer_output_error": layers, "markdown": markdown}
