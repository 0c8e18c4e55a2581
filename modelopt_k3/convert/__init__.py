"""Calibration-free streaming conversion: an MXFP4 Kimi-K3-class checkpoint -> a ModelOpt checkpoint.

``convert_checkpoint(src, dst, recipe)`` never builds the model. It reads the source index and the
safetensors headers, decides every tensor by its checkpoint name through the recipe, and then
streams one source shard at a time into one output shard of the same file name:

- what each module becomes is the decision table's (``quant/decisions.py``), the same table the
  model path's ``quantize`` builds from the same checkpoint: formats, and the shared-input groups
  whose NVFP4 global scales are shared (found by a probe forward of the checkpoint's own classes on
  a tiny configuration: ``trust_remote_code=True``, needed only when a recipe gives dense Linears
  NVFP4). Without ``--recipe`` the CLI converts with ``models/moonshotai/Kimi-K3/nvfp4_experts``;
- routed experts (``<experts>.{e}.w{1,2,3}.weight_packed/weight_scale`` pairs, one module each)
  with an NVFP4 format: the lossless MXFP4 -> NVFP4 cast (``numerics.mxfp4_to_nvfp4``); blocks that
  cannot carry over are requantized and counted; ``input_scale`` is the recipe's constant
  ``input_amax / (6 * 448)``;
- dense Linears with a calibration-free format (weight-only, or a constant ``input_amax``, the max
  over a shared-input group); ``fp8_pb`` is 128x128 block FP8, weight only. A dimension that is not
  a multiple of 128 (KDA ``b_proj`` ``[num_heads, D]``) gets a partial edge block with its own
  amax-derived scale (``numerics.fp8``); ``weight_scale`` is ``[ceil(out/128), 1, ceil(in/128), 1]``;
- block-FP8 Linears and INT4 pack-quantized routed experts (the DeepSeek-V3 family) are decoded first,
  through the spec's own converters as the model path loads them (``checkpoint.source_decode.SourceDecode``); a kept one is
  written decoded, as the model path writes it;
- every other tensor is copied byte for byte (same name, dtype and bytes).

The tensors and configs equal, byte for byte, what the model path (``load_pretrained`` ->
``quantize`` -> ``export_checkpoint``) exports for the same recipe: it casts MXFP4-sourced experts the
same way (``quant/mxfp4_source.py``) and both write through ``export/modelopt_format.py``.

Decisions:

- **w1/w3 pairs across shards.** An expert's ``w1`` and ``w3`` share ``weight_scale_2``. The shared
  power-of-two scale depends only on both E8M0 ``weight_scale`` tensors (1/16 of the packed size),
  so the shard that holds ``w1`` reads ``w3.weight_scale`` wherever it is stored (and vice versa).
  Both sides compute the same value independently: shards stay whole, mirror the source one to one,
  and no rank waits for another.
- **Module tensors split across shards.** A module's output tensors go to the shard holding its
  main tensor (``weight_packed`` or ``weight``); its other source tensors are read from wherever
  they are.
- **Which 2-D weights are Linears** is decided from the checkpoint alone (the model is not built,
  ``quant/decisions.py``): a module whose tensors are a 2-D float ``weight`` and optionally
  ``bias``, and whose name is not an embedding's. Modules with other tensors (the router's
  ``e_score_correction_bias``) are not Linears. The model path builds the same table and checks it
  against the model's own ``type(module) is nn.Linear`` set (refusing on a difference).
- **Output layout.** The header is written first (output shapes are known from the source headers),
  tensors follow sorted by element size then production order (so every tensor is aligned), each
  written in place as it is produced: memory holds a few modules (one per worker thread), not a
  shard. Copied tensors go through one 64 MiB buffer, hashed on the way (the digest needs their
  bytes, and this spares reading the output back).
- **Overlap.** Worker threads convert one shard's tensors; a finisher thread fsyncs, renames and
  records shard k while shard k + 1 is converted. Output bytes do not depend on the threads.
- **Reads** use ``pread`` rather than ``safe_open``: an mmap keeps every page it touched resident
  for the life of the handle, which would put a whole source shard into the process RSS.

Resume protocol (``dst`` is written in place so that a run can resume):

1. ``.modelopt_k3_convert/job.json`` identifies the job (a digest of the recipe and the source
   headers); a directory holding another job, or foreign files, is refused without ``overwrite``.
2. Each shard is written to ``.<name>.partial``, fsynced and renamed to ``<name>``; then its record
   ``.modelopt_k3_convert/shards/<name>.json`` (sizes, the output's digest, its tensors and
   counters) is written (temporary file + rename). The digest (``export.writer.ShardDigest``) is sha256 over
   the sha256 of the header and of each tensor's bytes in file order, computed while writing. A rerun
   skips a shard whose record matches the job and whose file still has the recorded size and digest,
   and redoes every other shard.
3. The finalize step (rank 0 after a barrier when a process group is initialised; otherwise
   whichever rank finds every record in place when it finishes, or ``finalize_conversion``)
   checks every record, writes the index, ``config.json``, ``hf_quant_config.json``, the remote
   code and tokenizer files, and last the marker ``.modelopt_k3_complete``. A complete directory is
   refused without ``overwrite``.
"""

from .api import convert_checkpoint, finalize_conversion
from .plan import _build_plan as _build_plan  # private, used by tests/ and benchmarks/
from .report import ConvertReport, ConvertStats
from .shard import _ShardConverter as _ShardConverter  # private, patched by tests/convert/test_api.py
from .state import COMPLETE_MARKER, STATE_DIR, ConvertError

__all__ = [
    "COMPLETE_MARKER",
    "STATE_DIR",
    "ConvertError",
    "ConvertReport",
    "ConvertStats",
    "convert_checkpoint",
    "finalize_conversion",
]
