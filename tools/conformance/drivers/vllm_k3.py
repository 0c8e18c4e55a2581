"""vLLM's own Kimi-K3 loading of one export, on CPU; runs inside a vLLM venv (``run.py`` starts it).

vLLM builds ``KimiK3ForConditionalGeneration`` from the export's config through its own ``ModelConfig``
/ ``VllmConfig`` (which parse ``quantization_config`` and pick the ModelOpt method per layer), and its
``DefaultModelLoader`` reads the safetensors, runs the model's ``load_weights`` and then
``process_weights_after_loading``. This driver subclasses that loader only to look between the steps
(``_common``: sentinels, landing search, post-load scales). The stubs are ``stub_list.STUBS["vllm"]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import _common as C
import torch

FUSED = {  # vLLM's K3 fused modules -> the checkpoint modules in their shards (model.py stacked_params_mapping)
    "in_proj_qkvgfab": ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


# What vLLM 0.33's post-processed scales hold. Linear (modelopt.py KNvfp4Static/KNvfp4Dynamic.process,
# maybe_fuse_global_scales): weight_global_scale = max weight_scale_2, input_global_scale = max input_scale,
# its inverse, alpha = their product. Routed experts on FLASHINFER_TRTLLM (fused_moe/experts/
# trtllm_nvfp4_moe.py process_weights_after_loading): w13/w2_weight_scale_2 are multiplied in place by
# the (max) input scale, i.e. they hold g1/g2 alphas; g1_scale_c is 1/w2 input scale for SiTU.
VLLM_RULES = {
    "weight_global_scale": ("lin", C.W), "input_global_scale": ("lin", C.A),
    "input_global_scale_inv": ("lin", C.INV_A), "alpha": ("lin", C.WA),
    "w13_weight_scale_2": ("w13", C.WA), "w2_weight_scale_2": ("w2", C.WA),
    "w13_input_scale": ("w13", C.A), "w2_input_scale": ("w2", C.A), "g1_scale_c": ("w2", C.INV_A),
}


class _Inert:
    """Stands in for a CUDA stream or event: constructible, every method a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def apply_stubs() -> None:
    torch.cuda.Stream = _Inert
    torch.cuda.Event = _Inert
    torch.accelerator.current_device_index = lambda: 0
    C.CudaToCpu().__enter__()  # for the whole driver process
    C.patch_flashinfer_interleave()
    missing = C.without_gpu_driver("vllm")
    import vllm.platforms as platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class CpuHostedSm100(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(major=10, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA B200"

        @classmethod
        def device_count(cls) -> int:
            return 1

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 180 << 30

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 148  # B200's SM count

        def current_device(self):
            return torch.device("cpu")

    platforms.current_platform = CpuHostedSm100()
    from vllm.multimodal import MULTIMODAL_REGISTRY

    def no_processor(*args, **kwargs):  # ModelConfig reads a ValueError here as "text-only inputs"
        raise ValueError("no multimodal processor: the tiny checkpoint has no image-processor config")

    MULTIMODAL_REGISTRY.get_processing_info = no_processor
    return missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pieces_of(ours: dict[str, torch.Tensor]):
    """The export modules behind each vLLM K3 module (``_common.pieces_by_name``); LatentMoERunner's
    ``RoutedExperts`` is its ``experts`` module."""
    by_name = C.pieces_by_name(ours, FUSED, {"w1": "w1", "w3": "w3", "w2": "w2"})
    return lambda engine_module: by_name(engine_module.removesuffix(".routed_experts"))


def run(export: Path, options: dict, pieces_of=pieces_of, owned_of=None, rules=VLLM_RULES, serve_config=None,
        post_checks=None, by_design=None) -> dict:
    """One export's load (``pieces_of``: the export modules behind each engine module, for the scales;
    ``owned_of(model, export)``: a model's engine-owned parameters besides the non-persistent buffers;
    ``rules``: what each post-load scale attribute holds, ``VLLM_RULES`` or a model's own;
    ``serve_config(export, model_config)``: ``VllmConfig`` keyword arguments a serve of this export gets (recorded
    as ``serve_config``); ``post_checks(model, ours)``: further post-load comparisons, ``_common.merge_post``'d;
    ``by_design(model, ours)``: export tensors the model's class skips or transforms on purpose, right after
    ``load_weights``: ``_common.summarize``)."""
    result: dict = {"engine": "vllm", "export": str(export), "stubs": "stub_list.STUBS['vllm']"}
    stage = "import"
    try:
        import vllm
        from vllm.config import (
            DeviceConfig,
            LoadConfig,
            ModelConfig,
            ParallelConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        result["version"] = vllm.__version__
        result["stub_checks"] = {"interleave == vLLM's torch swizzle_blockscale": C.check_interleave_against(
            swizzle_blockscale)}
        ours = C.export_tensors(export)
        probe: dict = {}

        class Instrumented(DefaultModelLoader):
            def create_model(self, *args, **kwargs):
                probe["stage"] = "build"
                model = super().create_model(*args, **kwargs)
                probe["stage"] = "load_weights"
                return model

            def load_weights(self, model, model_config):
                probe["masks"], probe["landed"] = C.load_with_sentinel(
                    model, lambda: DefaultModelLoader.load_weights(self, model, model_config), ours)
                probe["owned"] = {**C.non_persistent(model), **(owned_of(model, export) if owned_of else {})}
                probe["by_design"] = by_design(model, ours) if by_design else {}
                probe["stage"] = "post_process"

        stage = "config"
        model_config = ModelConfig(model=str(export), tokenizer=str(export), trust_remote_code=True, dtype="bfloat16",
                                   **{"max_model_len": 4096, "enforce_eager": True, **options.get("model_config", {})})
        extra = serve_config(export, model_config) if serve_config else {}
        if extra:
            result["serve_config"] = {k: repr(v) for k, v in extra.items()}
        vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="safetensors"),
                                 device_config=DeviceConfig(device="cpu"), parallel_config=ParallelConfig(), **extra)
        result["quant_method"] = type(vllm_config.quant_config).__name__ if vllm_config.quant_config else None
        with set_current_vllm_config(vllm_config):
            stage = "distributed"
            from vllm.distributed.parallel_state import model_parallel_is_initialized

            if not model_parallel_is_initialized():  # one driver process loads several exports
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
                initialize_model_parallel(1, 1)
            loader = Instrumented(vllm_config.load_config)
            probe["stage"] = "build"
            try:
                model = loader.load_model(vllm_config=vllm_config, model_config=model_config)
            except BaseException:
                stage = probe["stage"]
                raise
            stage = "report"
        global LAST_MODEL
        LAST_MODEL = model  # for interactive inspection of one run
        result["load"] = C.summarize(ours, probe["landed"], probe["masks"], probe["owned"].get,
                                       probe.get("by_design"))
        scales = C.post_load_scales(model, rules)
        result["post_load"] = C.compare_scales(scales, ours, pieces_of(ours), rules)
        if post_checks:
            C.merge_post(result["post_load"], post_checks(model, ours))
        result["outcome"] = "ran"
    except BaseException as exc:  # noqa: BLE001 - every failure is the observation
        if isinstance(exc, KeyboardInterrupt):
            raise
        result["outcome"] = "raised"
        result["error"] = C.error_record(stage, exc)
        if "masks" in locals().get("probe", {}):
            result["load"] = C.summarize(ours, probe["landed"], probe["masks"], probe["owned"].get,
                                       probe.get("by_design"))
    return result


def main(pieces_of=pieces_of, owned_of=None, rules=VLLM_RULES, serve_config=None, post_checks=None,
         defaults: dict | None = None, by_design=None) -> int:
    """``--exports A B ...``: each export's result goes to ``--out_dir``/<index>.json as soon as it is
    known (one process loads them in turn: importing the engine is most of the time)."""
    p = argparse.ArgumentParser()
    p.add_argument("--exports", type=Path, nargs="+", required=True)
    p.add_argument("--out_dir", type=Path, required=True)
    p.add_argument("--options", default="{}")
    args = p.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    stubbed = apply_stubs()
    for i, export in enumerate(args.exports):
        options = {**(defaults or {}), **json.loads(args.options)}
        result = run(export, options, pieces_of, owned_of, rules, serve_config, post_checks, by_design)
        result["extensions_without_driver"] = stubbed
        (args.out_dir / f"{i}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
