"""The GPU-only pieces each driver replaces to run an engine's loader on CPU, one line of why each.

Pure data (no imports): the drivers apply these stubs inside the engine venv, the report lists them.
A stub may only stand in for a fact about the GPU or for a kernel whose CPU equivalent is plain
tensor arithmetic; nothing here changes how the engine maps, fuses, checks or converts tensors.
"""

STUBS: dict[str, list[tuple[str, str]]] = {
    "vllm": [
        ("platform = CudaPlatform subclass reporting SM100 (B200), one device, device 'cpu'",
         "the loader and kernel selection read the GPU's compute capability; SM100 is what NVFP4 serving targets"),
        ("vllm._C* compiled extensions -> empty modules when libcuda.so.1 (the GPU driver) is absent",
         "they link the driver and only register CUDA kernels; a load step that called one would raise, visibly"),
        ("tensors placed on 'cuda' (factory device=, .cuda(), .to('cuda')) -> CPU (a TorchFunctionMode)",
         "attention backends and the model allocate workspaces on the GPU at import/construction; the bytes are the same"),
        ("torch.accelerator.current_device_index() -> 0",
         "the TRT-LLM NVFP4 MoE experts object records its device index at construction"),
        ("torch.cuda.Stream / torch.cuda.Event -> inert objects",
         "the K3 model allocates auxiliary CUDA streams and events at construction; loading never uses them"),
        ("flashinfer block_scale_interleave -> the same 128x4 layout in torch (_common.interleave_block_scales)",
         "post-processing swizzles NVFP4 block scales with a CUDA kernel; the layout is plain index arithmetic"),
        ("MULTIMODAL_REGISTRY.get_processing_info raises ValueError (vLLM's own 'text-only inputs' answer)",
         "the tiny checkpoint ships no image-processor config; the vision tower is still built and loaded"),
        ("distributed: gloo, world size 1",
         "vLLM's parallel groups must exist to build layers; NCCL needs a GPU, gloo on one rank has the same shapes"),
    ],
    "sglang": [
        ("platform facts: is_cuda/is_blackwell/SM100 true, device capability (10, 0), device 'cpu'",
         "SGLang picks K3's fused paths and the ModelOpt FP4 methods from these facts; SM100 is the NVFP4 target"),
        ("DeepSeek-V3 / GLM-5 driver: torch.cuda.get_device_capability() -> (10, 0)",
         "the same fact where a server-argument hook asks torch directly (GLM-5's sparse-attention defaults)"),
        ("tensors placed on 'cuda' (factory device=, .cuda(), .to('cuda')) -> CPU (a TorchFunctionMode)",
         "the model and its layers allocate buffers on the GPU at construction; the bytes are the same"),
        ("torch.cuda.Stream / torch.cuda.Event / torch.cuda.current_stream -> inert objects",
         "the K3 model allocates alternate CUDA streams at construction; loading never uses them"),
        ("flashinfer block_scale_interleave -> the same 128x4 layout in torch (_common.interleave_block_scales)",
         "post-processing swizzles NVFP4 block scales with a CUDA kernel; the layout is plain index arithmetic"),
        ("distributed: gloo, world size 1",
         "SGLang's parallel groups must exist to build layers; NCCL needs a GPU, gloo on one rank has the same shapes"),
        ("Qwen3-MoE driver: layers/rotary_embedding/base.py module-level _is_cuda -> True",
         "it is torch.cuda.is_available() at import; on CUDA RotaryEmbedding takes its rope kernel from sglang.kernels, "
         "on CPU it imports vLLM's (absent from an SGLang venv); only the rope kernel and the cos/sin cache dtype depend on it"),
        ("GPT-OSS and DeepSeek-V3 drivers: the Qwen3-MoE driver's rope stub (above)",
         "the same RotaryEmbedding module; GPT-OSS's and DeepSeek-V3's ropes hold no checkpoint tensor"),
        ("DeepSeek-V3 driver: models/deepseek_v2.py get_rope_wrapper called with device 'cuda' where the runtime device "
         "'cpu' is passed",
         "DeepseekV2AttentionMLA passes the runtime device; 'cpu' selects SGLang's CPU-backend rope factory "
         "(get_rope_cpu, which asserts a rope_scaling the tiny config lacks), 'cuda' the get_rope a GPU serve builds; "
         "a rope holds no checkpoint tensor (its cos/sin cache is a non-persistent buffer)"),
    ],
    # tools/conformance/trtllm.py: not a GPU stand-in but the names TensorRT-LLM's replayed resolution functions
    # use that are not themselves replayed from the tree (the TensorRT-LLM package is never imported).
    "trtllm": [
        ("QuantAlgo -> a str Enum of TensorRT-LLM's algo names (value = name)",
         "tensorrt_llm/quantization/mode.py was not read at the pinned snapshot; its QuantAlgo is a StrEnum whose "
         "values are its names, so QuantAlgo('X') of a name outside the list raises ValueError as the real one does"),
        ("QuantConfig -> an attribute holder with TensorRT-LLM's field defaults (group_size 128, the rest None/False) "
         "+ TensorRT-LLM's own is_module_excluded_from_quantization",
         "the real class is a pydantic StrictBaseModel (llmapi); the replayed code only sets and reads these fields, "
         "and the exclusion matching, which decides, is the pinned method itself"),
        ("ModelConfig -> a namespace with quant_config and quant_config_dict",
         "the replayed resolvers read only those two attributes, which ModelConfig.from_pretrained fills from "
         "load_modelopt_quant_config's (quant_config, layer_quant_config)"),
        ("transformers.utils.hub.cached_file -> the file in the local checkpoint directory, else OSError",
         "what it does for a local directory; _build_modelopt_quant_config only asks it for quant_cfg.json"),
        ("tensorrt_llm.logger.logger -> records the lines", "logging only; the report shows the non-debug lines"),
        ("moe_backend -> 'TRTLLM'",
         "ModelConfig.resolve_moe_backend returns TRTLLM for the Kimi-K3 architectures (AUTO, the default)"),
    ],
}
