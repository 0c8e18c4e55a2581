"""SGLang's own Kimi-K3 loading of one export, on CPU; runs inside an SGLang venv (``run.py`` starts it).

SGLang builds ``KimiK3ForConditionalGeneration`` from the export's config through its own
``ServerArgs`` / ``ModelConfig`` (which pick the quantization config from ``quantization_config`` or
``hf_quant_config.json``), and its ``DefaultModelLoader`` reads the safetensors, runs the model's
``load_weights`` and then every layer's ``process_weights_after_loading``. This driver subclasses that
loader only to look between the steps (``_common``). The stubs are ``stub_list.STUBS["sglang"]``.
Option ``moe_runner_backend`` (default ``flashinfer_trtllm``: what K3's ``situ`` activation needs on
NVFP4 experts) is passed as ``--moe-runner-backend``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import _common as C
import torch

FUSED = {  # SGLang's K3 fused modules -> the checkpoint modules in their shards (kimi_k3.py load_weights)
    "fused_qkvg_proj": ("q_proj", "k_proj", "v_proj", "g_proj"),
    "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
PLATFORM = {"is_cuda": True, "is_blackwell": True, "is_sm100": True, "is_sm100_or_sm110": True,
            "has_flashinfer": True, "device_sm": 100, "device_capability": (10, 0)}


# What SGLang 0.5.23's kernels read after post-processing. Linear (modelopt_quant.py ModelOptFp4LinearMethod):
# weight_scale_2 = max over shards, input_scale = max, alpha, input_scale_inv. Routed experts on
# flashinfer_trtllm (ModelOptNvFp4FusedMoEMethod.apply builds FlashInferTrtllmFp4MoeQuantInfo from
# g1_alphas, g2_alphas, w13_input_scale_quant): g1_alphas is w1's alpha and serves both GEMM1 halves;
# g1_alphas_up (w3's) is not passed to that kernel, so it is not a scale the engine computes with.
SGLANG_RULES = {
    "weight_scale_2": ("lin", C.W), "input_scale": ("lin", C.A), "alpha": ("lin", C.WA),
    "input_scale_inv": ("lin", C.INV_A),
    "g1_alphas": ("w13", C.WA), "g2_alphas": ("w2", C.WA),
    "w13_input_scale_quant": ("w13", C.INV_A), "w2_input_scale_quant": ("w2", C.INV_A),
}


class _Inert:
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def apply_stubs():
    torch.cuda.Stream = _Inert
    torch.cuda.Event = _Inert
    torch.cuda.current_stream = lambda *a, **k: _Inert()
    C.CudaToCpu().__enter__()  # for the whole driver process
    C.patch_flashinfer_interleave()
    from sglang.srt.runtime_context import override_platform

    return override_platform(**PLATFORM).install()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_defaults(model, export: Path) -> dict[str, str]:
    """Without a KV-cache quantization in the export, the attention layers' k_scale/v_scale keep
    SGLang's default 1.0 and are not read (no FP8 KV cache): not a checkpoint tensor."""
    hf = export / "hf_quant_config.json"
    kv = json.loads(hf.read_text())["quantization"].get("kv_cache_quant_algo") if hf.exists() else None
    if kv:
        return {}
    return {n: "a KV-cache scale kept at its default (the export declares no KV-cache quantization)"
            for n, _ in model.named_parameters() if n.endswith((".k_scale", ".v_scale"))}


def pieces_of(ours: dict[str, torch.Tensor]):
    """SGLang module name -> the export modules behind it (``block_sparse_moe`` is ``mlp`` at runtime)."""
    modules = {k.rpartition(".")[0] for k in ours}

    def hf(name: str) -> list[str]:
        return [name, name.replace(".mlp.", ".block_sparse_moe."), "language_model." + name,
                ("language_model." + name).replace(".mlp.", ".block_sparse_moe.")]

    def pieces(engine_module: str):
        for cand in hf(engine_module):
            if cand in modules:
                return {"lin": [[cand]]}
        parent, _, last = engine_module.rpartition(".")
        if last in FUSED:
            for p_cand in hf(parent + "."):
                p_cand = p_cand[:-1]
                row = [f"{p_cand}.{p}" for p in FUSED[last] if f"{p_cand}.{p}" in modules]
                if row:
                    return {"lin": [[m] for m in row]}
            return None
        if last == "experts":
            for cand in hf(engine_module):
                n = 0
                while f"{cand}.{n}.w1" in modules:
                    n += 1
                if n:
                    return {p: [[f"{cand}.{e}.{p}"] for e in range(n)] for p in ("w1", "w3", "w2")}
        return None

    return pieces


def experts_forward(model) -> dict:
    """The first routed-experts layer's forward on 4 CPU tokens (router output given): what it raises.

    The quantization method assembles its kernel arguments before any kernel runs, so a missing
    post-processed attribute shows here; a CUDA kernel call is where the CPU run ends (not observable).
    """
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    name, layer = next(((n, m) for n, m in model.named_modules() if isinstance(m, FusedMoE)), (None, None))
    if layer is None:
        return {"outcome": "no routed-experts layer"}
    hidden = layer.w2_weight.shape[1] if layer.w2_weight.dtype != torch.uint8 else layer.w2_weight.shape[1]
    x = torch.randn(4, getattr(layer, "hidden_size", hidden), dtype=torch.bfloat16)
    k = getattr(layer, "top_k", 2) or 2
    ids = torch.stack([torch.arange(k, dtype=torch.int32)] * 4)
    topk = StandardTopKOutput(torch.full((4, k), 1.0 / k), ids, torch.zeros(4, layer.num_experts))
    try:
        layer.forward(x, topk)
    except BaseException as exc:  # noqa: BLE001 - the observation
        # A missing layer attribute or key is the layer's own state (what a GPU run would hit too);
        # anything else is where the CPU run meets a kernel (absent entry point, CUDA error).
        # A NotImplementedError the engine raises itself (not a missing CPU kernel: "... from the 'CPU' backend")
        # is its own answer too: e.g. a quantization method refusing the MoE runner backend it was given.
        observable = isinstance(exc, (AttributeError, KeyError)) or (
            isinstance(exc, NotImplementedError) and "from the 'CPU' backend" not in str(exc))
        return {"layer": name, "outcome": "raised" if observable else "reached a GPU kernel (not observable on CPU)",
                "error": C.error_record("first_forward", exc)}
    return {"layer": name, "outcome": "ran on CPU"}


def _resolved_backend() -> str | None:
    """The MoE runner backend the engine settled on (after its model overrides of ``auto``)."""
    try:
        from sglang.srt.layers.moe import get_moe_runner_backend

        return str(get_moe_runner_backend())
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        return f"unknown ({type(exc).__name__}: {exc})"[:200]


def run(export: Path, options: dict, pieces_of=pieces_of, owned_of=kv_defaults, post_checks=None,
        by_design=None) -> dict:
    """One export's load (``pieces_of``: the export modules behind each engine module, for the scales;
    ``owned_of(model, export)``: engine-owned parameters besides the non-persistent buffers (``kv_defaults`` or a
    model's own); ``post_checks(model, ours)``: further post-load comparisons, ``_common.merge_post``'d;
    ``by_design(model, ours)``: export tensors the model's class skips or transforms on purpose, right after
    ``load_weights``: ``_common.summarize``)."""
    backend = options.get("moe_runner_backend", "flashinfer_trtllm")
    result: dict = {"engine": "sglang", "export": str(export), "moe_runner_backend": backend}
    stage = "import"
    global LAST_PROBE
    probe: dict = {}
    LAST_PROBE = probe  # for interactive inspection of one run
    ours: dict = {}
    try:
        import sglang
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from sglang.srt.layers.dp_attention import init_dp_gathered_buffer, initialize_dp_attention
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.utils import swizzle_blockscale
        from sglang.srt.model_loader.loader import DefaultModelLoader
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs

        result["version"] = sglang.__version__
        result["stub_checks"] = {"interleave == SGLang's torch swizzle_blockscale": C.check_interleave_against(
            swizzle_blockscale)}
        ours = C.export_tensors(export)

        class Instrumented(DefaultModelLoader):
            @staticmethod
            def load_weights_and_postprocess(model, weights, target_device):
                probe["model"] = model
                weights = list(weights)  # the loader's own iterator over the export, read once
                probe["stage"] = "load_weights"
                probe["masks"], probe["landed"] = C.load_with_sentinel(
                    model, lambda: DefaultModelLoader.load_weights_only(model, iter(weights), target_device), ours)
                probe["owned"] = {**C.non_persistent(model), **owned_of(model, export)}
                probe["by_design"] = by_design(model, ours) if by_design else {}
                probe["stage"] = "post_process"
                DefaultModelLoader.postprocess_weights(model, target_device)
                probe["stage"] = "report"

        stage = "config"
        server_args = ServerArgs(model_path=str(export), trust_remote_code=True, tp_size=1, device="cpu",
                                 moe_runner_backend=backend, dtype="bfloat16", **options.get("server_args", {}))
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        initialize_moe_config()
        model_config = ModelConfig.from_server_args(server_args)
        stage = "distributed"
        from sglang.srt.distributed.parallel_state import model_parallel_is_initialized

        if not model_parallel_is_initialized():  # one driver process loads several exports
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            initialize_model_parallel()
        initialize_dp_attention(server_args)
        init_dp_gathered_buffer(model_config)
        probe["stage"] = "build"
        loader = Instrumented(LoadConfig(load_format="safetensors"))
        try:
            model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
        except BaseException:
            stage = probe["stage"]
            raise
        stage = "report"
        result["moe_runner_backend_resolved"] = _resolved_backend()
        result["quant_method"] = type(model.quant_config).__name__ if getattr(model, "quant_config", None) else None
        result["load"] = C.summarize(ours, probe["landed"], probe["masks"], probe["owned"].get,
                                       probe.get("by_design"))
        scales = C.post_load_scales(model, SGLANG_RULES)
        result["post_load"] = C.compare_scales(scales, ours, pieces_of(ours), SGLANG_RULES)
        if post_checks:
            C.merge_post(result["post_load"], post_checks(model, ours))
        result["outcome"] = "ran"
        result["first_forward"] = experts_forward(model)
    except BaseException as exc:  # noqa: BLE001 - every failure is the observation
        if isinstance(exc, KeyboardInterrupt):
            raise
        result["outcome"] = "raised"
        result["error"] = C.error_record(stage, exc)
        if stage in ("build", "load_weights", "post_process"):
            result["moe_runner_backend_resolved"] = _resolved_backend()
        if "masks" in probe:
            result["load"] = C.summarize(ours, probe["landed"], probe["masks"], probe["owned"].get,
                                       probe.get("by_design"))
    return result


def main(defaults: dict | None = None, pieces_of=pieces_of, stubs=apply_stubs, owned_of=kv_defaults,
         post_checks=None, by_design=None) -> int:
    """``--exports A B ...``: each export's result goes to ``--out_dir``/<index>.json as soon as it is
    known (one process loads them in turn: importing the engine is most of the time). ``defaults``: options
    a model's driver sets unless ``--options`` gives them (``sglang_qwen3.py``); ``stubs``: ``apply_stubs`` or
    a model's own additions to it."""
    p = argparse.ArgumentParser()
    p.add_argument("--exports", type=Path, nargs="+", required=True)
    p.add_argument("--out_dir", type=Path, required=True)
    p.add_argument("--options", default="{}")
    args = p.parse_args()
    stubs()
    options = {**(defaults or {}), **json.loads(args.options)}
    for i, export in enumerate(args.exports):
        result = run(export, options, pieces_of, owned_of, post_checks, by_design)
        # The same export under the other runner backends: what their first forward does (the routed
        # experts' kernel arguments are assembled from post-processed layer state).
        result["other_backends"] = {}
        for backend in options.get("other_backends", ("auto",)) if result.get("outcome") == "ran" else ():
            other = run(export, {**options, "moe_runner_backend": backend}, pieces_of, owned_of, post_checks,
                        by_design)
            result["other_backends"][backend] = {"outcome": other.get("outcome"),
                                                 "error": other.get("error"),
                                                 "first_forward": other.get("first_forward")}
        (args.out_dir / f"{i}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
