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
}
