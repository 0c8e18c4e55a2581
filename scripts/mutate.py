"""Mutation testing: put one small bug into the package at a time and see whether its tests notice.

Two kinds of mutant over the areas of ``AREAS`` (numerics, formats, placement, export, convert, check, and
those added since: report ... planner, runplan, layerwise, calibrators):

* **curated** (``CURATED``): plausible single bugs written by hand (a wrong operand, a regex that stops
  matching, a staging file skipped), the six of issue 23 among them;
* **operator**: generated from each module's syntax tree (``operator_mutants``): a comparison flipped
  (``<`` / ``<=``, ``==`` / ``!=``, ``in`` / ``not in``), an arithmetic or bitwise operator swapped, ``and`` /
  ``or`` swapped, a ``not`` dropped, an integer constant off by one, ``max``/``min`` (``amax``/``amin``)
  swapped. Code that only builds error messages (``raise`` arguments, f-strings, logging calls) and type
  annotations are left alone. ``--sample N`` draws N per area with ``--seed``, deterministically.

Each mutant runs only the tests its module maps to (``AREAS``: a few files, ``-x``, a per-mutant
timeout), in a private copy of the tree (the worktree is never edited), so a run fits on 2 shared cores.
A mutant is *killed* when those tests fail or time out, *survived* when they pass. ``EQUIVALENT`` lists
surviving mutants that change no observable behaviour, each with the reason; the recorded kill rate is
killed / (mutants - equivalent). ``--record`` rewrites the generated part of docs/MUTATION.md::

    python scripts/mutate.py --list --sample 10             # what would run
    python scripts/mutate.py --only issue23:shard-scale     # one mutant (see red)
    python scripts/mutate.py --curated --sample 10 --record docs/MUTATION.md

Exit code 0 when every non-equivalent mutant was killed.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COPIED = ("modelopt_k3", "tests", "recipes", "pyproject.toml")  # what the tests need (recipes: data files)
PYTEST = ["-x", "-q", "-p", "no:cacheprovider", "--no-header", "-W", "ignore"]


@dataclass(frozen=True)
class Area:
    """Modules (globs relative to the repo) and the tests that cover them (pytest args, marker filter)."""

    modules: tuple[str, ...]
    tests: tuple[str, ...]
    markers: str = "not multiprocess"


# Each area's tests are the ones written against its modules; slower whole-model tests only where they are
# the only check (the engine check's numerics, the converter's equality with the model path).
AREAS: dict[str, Area] = {
    "numerics": Area(
        ("modelopt_k3/numerics/*.py",),
        ("tests/numerics/test_numerics.py", "tests/numerics/test_finite.py", "tests/test_formats.py")),
    "formats": Area(
        ("modelopt_k3/quant/schemes.py", "modelopt_k3/export/layouts.py"),
        ("tests/test_formats.py", "tests/export/test_modelopt_format.py", "tests/quant/test_decisions.py")),
    "placement": Area(
        ("modelopt_k3/dist/placement.py",),
        ("tests/dist/test_placement.py",)),
    "export": Area(
        ("modelopt_k3/export/modelopt_format.py", "modelopt_k3/export/writer.py", "modelopt_k3/export/staging.py"),
        ("tests/export/test_modelopt_format.py", "tests/export/test_writer.py", "tests/quant/test_decisions.py",
         "tests/test_formats.py")),
    "convert": Area(
        ("modelopt_k3/convert/shard.py", "modelopt_k3/convert/jobs.py", "modelopt_k3/convert/plan.py"),
        ("tests/convert/test_api.py", "tests/faults/test_faults_kill_convert.py"),
        ),
    "check": Area(
        ("modelopt_k3/check/engines/base.py", "modelopt_k3/check/engines/vllm.py",
         "modelopt_k3/check/engines/sglang.py"),
        ("tests/check/test_fused_rules.py", "tests/check/test_engines.py")),
    # Areas added in issue 33 (code of the turn before): the report's numbers, the coverage guard, owner
    # records and heartbeats, the converter's resume state, each model's layout / placement / checkpoint
    # view, the engine manifests, the spec registry and the memory planner.
    "report": Area(
        ("modelopt_k3/numerics/stats.py", "modelopt_k3/report/build.py", "modelopt_k3/quant/evaluate.py"),
        ("tests/report/test_stats.py", "tests/report/test_report.py")),
    "coverage": Area(
        ("modelopt_k3/quant/coverage.py",),
        ("tests/quant/test_coverage.py", "tests/report/test_report.py")),
    "ownership": Area(
        ("modelopt_k3/files/locks.py",),
        ("tests/files/test_locks.py", "tests/faults/test_faults_locks.py",
         *(f"tests/faults/test_faults_destination.py::{t}" for t in (
             "test_preflight_refuses_while_another_live_run_exports_to_the_path",
             "test_converter_recovers_locks_of_dead_owners_saying_so",
             "test_converter_refuses_a_destination_held_by_a_live_run_on_another_host")))),
    "convert_resume": Area(
        ("modelopt_k3/convert/state.py",),
        ("tests/faults/test_faults_source.py::test_a_source_changed_before_the_resume_is_refused_never_mixed",
         "tests/faults/test_faults_source.py::test_the_shard_record_holds_the_digest_of_every_tensor_its_quantized_jobs_read",
         "tests/faults/test_faults_destination_owned.py", "tests/convert/test_api.py")),
    "kimi_k3": Area(
        ("modelopt_k3/models/kimi_k3/source_layout.py", "modelopt_k3/models/kimi_k3/experts.py"),
        ("tests/models/kimi_k3/test_source_layout.py", "tests/models/test_conversion_layout.py",
         "tests/dist/test_placement.py", "tests/test_source_check.py", "tests/memory/test_planner.py")),
    "qwen3_moe": Area(
        ("modelopt_k3/models/qwen3_moe/source_layout.py", "modelopt_k3/models/common/experts.py",
         "modelopt_k3/models/common/layout.py"),
        ("tests/models/qwen3_moe/test_qwen3_moe.py", "tests/models/test_conversion_layout.py",
         "tests/models/common/test_transformers_moe.py")),
    "gpt_oss": Area(
        ("modelopt_k3/models/gpt_oss/source_layout.py", "modelopt_k3/models/gpt_oss/model.py",
         "modelopt_k3/models/gpt_oss/config_layout.py", "modelopt_k3/models/gpt_oss/experts.py"),
        ("tests/models/gpt_oss/test_source_layout.py", "tests/models/test_conversion_layout.py",
         "tests/models/gpt_oss/test_pipeline.py")),
    "manifests": Area(
        ("modelopt_k3/models/kimi_k3/manifest.py", "modelopt_k3/models/qwen3_moe/serving.py",
         "modelopt_k3/models/gpt_oss/serving.py", "modelopt_k3/models/deepseek_v3/serving.py"),
        ("tests/export/test_kimi_k3_manifest.py", "tests/models/qwen3_moe/test_trtllm.py",
         "tests/models/qwen3_moe/test_sglang.py", "tests/models/gpt_oss", "tests/models/deepseek_v3/test_serving.py",
         "tests/models/deepseek_v3/test_deepseek_v3_mtp.py", "tests/check/test_conformance_matrix.py")),
    "registry": Area(
        ("modelopt_k3/spec/registry.py",),
        ("tests/spec/test_contract.py", "tests/spec/test_registry.py")),
    "planner": Area(
        ("modelopt_k3/memory/planner.py",),
        ("tests/memory/test_planner.py", "tests/memory/test_algorithm_state.py")),
    # Issue 33, second part: the run's settings and preflight, layerwise calibration and its resume, the
    # calibrators with their numerics (gptq.py and nvfp4_search.py are theirs, not the numerics area's: a
    # module named exactly wins over a glob). A few to forty seconds a mutant; no multiprocess test.
    "runplan": Area(
        ("modelopt_k3/run/plan.py", "modelopt_k3/run/planning.py", "modelopt_k3/run/preflight.py",
         "modelopt_k3/memory/preflight.py"),
        ("tests/cli/test_config.py", "tests/run/test_preflight_checks.py", "tests/dist/test_plan_decisions.py",
         "tests/faults/test_faults_config.py", "tests/faults/test_faults_bounds.py",
         "tests/faults/test_faults_destination.py", "tests/test_run_once.py",
         "tests/layerwise/test_layerwise.py::test_layerwise_refusals_name_the_flag")),
    "layerwise": Area(
        ("modelopt_k3/layerwise/state.py", "modelopt_k3/layerwise/replay.py", "modelopt_k3/layerwise/__init__.py",
         "modelopt_k3/load/layerwise.py"),
        ("tests/layerwise/test_layerwise.py", "tests/layerwise/test_layerwise_state.py",
         "tests/layerwise/test_layerwise_resume.py::test_a_resume_of_another_run_is_refused_naming_what_changed",
         "tests/layerwise/test_layerwise_resume.py::test_a_resume_never_trusts_what_it_has_not_checked",
         "tests/layerwise/test_layerwise_resume.py::test_killed_layerwise_run_resumes_and_exports_the_same[qwen3_moe-1]")),
    "calibrators": Area(
        ("modelopt_k3/quant/calibrators/*.py", "modelopt_k3/numerics/nvfp4_search.py", "modelopt_k3/numerics/gptq.py",
         "modelopt_k3/recipe/algorithm.py"),
        ("tests/quant/test_calibrators.py", "tests/quant/test_act_headroom.py", "tests/recipe/test_recipe.py",
         "tests/models/qwen3_moe/test_calibrators_qwen3.py", "tests/report/test_weight_algorithm.py",
         "tests/layerwise/test_layerwise.py::test_gptq_layerwise_feeds_each_layer_the_quantized_outputs_before_it")),
    # Issue 32 (the code of the turn before): DeepSeek-V3's source layout and block-FP8 passthrough.
    "deepseek_v3": Area(
        ("modelopt_k3/quant/block_fp8_source.py", "modelopt_k3/models/deepseek_v3/source_layout.py",
         "modelopt_k3/models/common/kv_cache.py"),
        ("tests/models/deepseek_v3/test_deepseek_v3_fp8_passthrough.py", "tests/models/deepseek_v3/test_deepseek_v3.py",
         "tests/models/deepseek_v3/test_deepseek_v3_mtp.py")),
}
FAST = "not slow and not multiprocess"  # the fast set's marker filter (``--fast``)
# Modules whose tests are not their area's: these run instead (the staging sweep is tested with the faults).
MODULE_TESTS: dict[str, tuple[str, ...]] = {
    "modelopt_k3/export/staging.py": (
        "tests/faults/test_faults_destination.py::test_sweep_removes_only_what_dead_runs_left",
        "tests/faults/test_faults_destination.py::test_sweep_puts_back_an_old_export_a_dead_run_moved_aside",
        "tests/export/test_writer.py"),
}
# Modules outside the areas that a curated mutant touches, and their tests.
EXTRA_TESTS: dict[str, Area] = {
    "modelopt_k3/quant/mxfp4_source.py": Area(("modelopt_k3/quant/mxfp4_source.py",),
                                              ("tests/convert/test_api.py",)),
    "modelopt_k3/models/kimi_k3/serving.py": Area(("modelopt_k3/models/kimi_k3/serving.py",),
                                                  ("tests/check/test_fused_rules.py", "tests/check/test_engines.py")),
}


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str  # relative to the repo
    old: str  # exact text replaced (once)
    new: str
    note: str = ""
    start: int = -1  # character offset of ``old`` (-1: its only occurrence)
    area: str = ""  # a curated mutant's area when its module is in none (its tests are that area's)

    def apply(self, text: str) -> str:
        at = self.start
        if at < 0:
            if text.count(self.old) != 1:
                raise ValueError(f"{self.id}: {self.old!r} is not in {self.path} exactly once")
            at = text.index(self.old)
        elif text[at : at + len(self.old)] != self.old:
            raise ValueError(f"{self.id}: {self.path} changed at offset {at}")
        return text[:at] + self.new + text[at + len(self.old) :]


CURATED: tuple[Mutant, ...] = (
    Mutant("issue23:shard-scale", "modelopt_k3/convert/shard.py",
           "shared_global_scale_for(*(self._read(m.sources[1]) for m in members))",
           "shared_global_scale_for(self._read(job.sources[1]))",
           "converter: an expert's weight_scale_2 from its own scales, not the max over w1 and w3"),
    Mutant("issue23:source-w1-only", "modelopt_k3/quant/mxfp4_source.py",
           "for p in self._projections(fused_param))))",
           "for p in self._projections(fused_param)[:1])))",
           "model path: the fused w1/w3 global scale from w1 alone"),
    Mutant("issue23:exclude-dot", "modelopt_k3/export/modelopt_format.py",
           'choice = head + ".*"', 'choice = head + "*"',
           "exclude_modules: `a.b*` where `a.b.*` is needed (covers a quantized `a.b0`)"),
    Mutant("issue23:fused-input-scale", "modelopt_k3/check/engines/base.py",
           "        if any(s != top for s in inputs):\n            out.append(Deviation(",
           "        if False:\n            out.append(Deviation(",
           "engine check: different input_scales inside one fused group not flagged"),
    Mutant("issue23:vllm-kda-keep", "modelopt_k3/models/kimi_k3/serving.py",
           r'(r"\.self_attn\.in_proj_qkvgfab$",', r'(r"\.self_attn\.in_proj_qkvgfa$",',
           "vLLM's BF16 keep-list no longer matches in_proj_qkvgfab"),
    Mutant("issue23:no-staging", "modelopt_k3/convert/shard.py",
           "PlannedShard(staging_path(dst / file), plan.outputs(file))", "PlannedShard(dst / file, plan.outputs(file))",
           "converter writes straight to the final shard name (the rename a no-op)"),
    # issue 33: the survivors it names, then plausible bugs in each area added the turn before.
    Mutant("issue33:kl-reversed", "modelopt_k3/numerics/stats.py",
           "kl = (ref.exp() * (ref - quant)).sum(-1)", "kl = (quant.exp() * (quant - ref)).sum(-1)",
           "report: KL(quantized || original) instead of KL(original || quantized)"),
    Mutant("issue33:kl-args-swapped", "modelopt_k3/quant/evaluate.py",
           "self.final += kl_and_top1(reference, quantized)", "self.final += kl_and_top1(quantized, reference)",
           "held-out pass: the quantized logits passed as the reference"),
    Mutant("issue33:rel-rms-no-sqrt", "modelopt_k3/numerics/stats.py",
           "return math.sqrt(sse / ssq)", "return sse / ssq", "report: relative RMS error without the square root"),
    Mutant("issue33:underflow-zero-blocks", "modelopt_k3/numerics/stats.py",
           "underflow = ((blocks > 0) & (raw < FP8_E4M3_MIN_SUBNORMAL))", "underflow = (raw < FP8_E4M3_MIN_SUBNORMAL)",
           "report: all-zero blocks counted as underflowing"),
    Mutant("issue33:min-tokens-ignored", "modelopt_k3/quant/coverage.py",
           "[e for e, n in enumerate(self.handled) if n < min_tokens]", "[e for e, n in enumerate(self.handled) if n == 0]",
           "coverage guard: only experts with zero tokens starved (--min_expert_tokens ignored)"),
    Mutant("issue33:cli-min-tokens", "modelopt_k3/cli/hf_ptq.py",
           "min_tokens=config.min_expert_tokens,", "min_tokens=1,",
           "hf_ptq: the guard runs with the default threshold, not --min_expert_tokens", area="coverage"),
    Mutant("issue33:refuse-ignores-dependence", "modelopt_k3/quant/coverage.py",
           'if policy == "refuse" and depends:', 'if policy == "refuse":',
           "coverage guard: refuses experts whose scales need no calibration"),
    Mutant("issue33:count-outside-calib", "modelopt_k3/quant/coverage.py",
           'if not any(q.mode == "calib" for q in state.input.values()):', "if False:",
           "coverage: held-out and other forwards counted as calibration tokens"),
    Mutant("issue33:record-copied-only", "modelopt_k3/convert/shard.py",
           "{**converter.log.hashes, **shard.copied}", "dict(shard.copied)",
           "shard record: sha256 of copied tensors only, not of what the quantized jobs read", area="convert_resume"),
    Mutant("issue33:finalize-trusts-stat", "modelopt_k3/convert/state.py",
           "if verify_hash or stat_identity(plan.src / f) != ident}", "if verify_hash}",
           "resume: a source file whose size/times/inode changed is not re-hashed at finalize"),
    Mutant("issue33:record-any-fingerprint", "modelopt_k3/convert/state.py",
           'or rec.get("fingerprint") != fingerprint:', ":",
           "resume: a shard record of another job (recipe, source headers) is trusted"),
    Mutant("issue33:stale-never", "modelopt_k3/files/locks.py", "if age > stale:", "if age > 10 * stale:",
           "ownership: another host's owner is live ten times longer than the stale limit"),
    Mutant("issue33:kimi-moe-layers", "modelopt_k3/models/kimi_k3/source_layout.py",
           "if i >= first_k and i % freq == 0]", "if i > first_k and i % freq == 0]",
           "Kimi-K3 layout: the first MoE layer (== first_k_dense_replace) left out"),
    Mutant("issue33:kimi-w2-shape", "modelopt_k3/models/kimi_k3/source_layout.py",
           '"w2": (hidden, inter)', '"w2": (inter, hidden)', "Kimi-K3 layout: w2 stored [inter, hidden]"),
    # (the per-model ``place`` moved into experts/base.py: one implementation, tested through each model)
    Mutant("issue33:kimi-place-first", "modelopt_k3/experts/base.py",
           "nn.Parameter(param.data[local.start : local.stop].clone()",
           "nn.Parameter(param.data[: len(local)].clone()",
           "Kimi-K3 placement: every rank keeps the first experts, not its own", area="kimi_k3"),
    # (Qwen3-MoE's layer rule is transformers' own now: its layout is read off the model built on meta)
    Mutant("issue39:meta-layout-gate-rows", "modelopt_k3/models/common/layout.py",
           "(proj, (rows // len(projs), cols))", "(proj, (rows, cols))",
           "meta layout: a per-expert gate/up weight as wide as the fused gate_up_proj, not half"),
    Mutant("issue33:qwen3-place-first", "modelopt_k3/experts/base.py",
           "nn.Parameter(param.data[local.start : local.stop].clone()",
           "nn.Parameter(param.data[: len(local)].clone()",
           "Qwen3-MoE placement: every rank keeps the first experts, not its own", area="qwen3_moe"),
    Mutant("issue33:gptoss-view-offset", "modelopt_k3/models/gpt_oss/model.py",
           "info.offset + e * per)", "info.offset + e * per // 2)",
           "GPT-OSS view: per-expert byte ranges overlap (half stride)"),
    Mutant("issue33:gptoss-interleave", "modelopt_k3/models/gpt_oss/source_layout.py",
           "index[dim] = slice(1, None, 2)", "index[dim] = slice(0, None, 2)",
           "GPT-OSS layout: up taken from the gate's (even) positions"),
    Mutant("issue33:kimi-manifest-alias", "modelopt_k3/models/kimi_k3/manifest.py",
           'out += [f"model.{rest}", rest]', 'out += [f"model.{rest}"]',
           "Kimi-K3 manifest: the bare name (no model. prefix) is not an alias"),
    # (issue 27 removed register_spec's overwrite and the lookup of submodules by name: their mutants went.)
    Mutant("issue33:registry-duplicate", "modelopt_k3/spec/registry.py",
           "if spec.model_type in _REGISTRY:", "if False:",
           "registry: a second spec for a model_type silently replaces the first"),
    Mutant("issue33:registry-private", "modelopt_k3/spec/registry.py",
           'and not d.name.startswith("_")', "",
           "registry: a private package under models/ (_name) registered as a model type"),
    Mutant("issue33:planner-chunk-smallest", "modelopt_k3/memory/planner.py",
           "for c in range(e_local - 1, 0, -1):", "for c in range(1, e_local):",
           "planner: the smallest decode chunk that fits, not the largest"),
    Mutant("issue33:planner-fsdp-floor", "modelopt_k3/memory/planner.py",
           "return -(-n // world)", "return n // world",
           "planner: FSDP2 rank 0's rows rounded down (torch.chunk rounds up)"),
    Mutant("issue33:planner-no-overlap", "modelopt_k3/memory/planner.py",
           "unit_bytes * (2 if run.accel else 1)", "unit_bytes",
           "planner: an accelerator's overlapping next all-gather not counted"),
    Mutant("issue33:planner-fits-strict", "modelopt_k3/memory/planner.py",
           "self.peak <= budget", "self.peak < budget", "planner: a plan using exactly the budget does not fit"),
    # issue 33, second part: the run's settings and preflight (runplan), layerwise calibration and its
    # resume (layerwise), the calibrators and their numerics (calibrators).
    Mutant("issue33:runplan-config-dtype", "modelopt_k3/run/planning.py",
           "return getattr(torch, config.dtype) if config.dtype else load_dtype(raw)",
           "return load_dtype(raw)",
           "RunPlan: the load dtype from config.json even when --dtype is given"),
    Mutant("issue33:runplan-positive-off-by-one", "modelopt_k3/run/plan.py",
           "if getattr(self, name) < 1:", "if getattr(self, name) < 0:",
           "PtqConfig: calib_size / batch_size / calib_seq / max_shard_size_mb of 0 accepted"),
    Mutant("issue33:runplan-heldout-unchecked", "modelopt_k3/run/plan.py",
           'for name in ("eval_kl", "min_expert_tokens", "report_heldout"):',
           'for name in ("eval_kl", "min_expert_tokens"):',
           "PtqConfig: a negative report_heldout accepted"),
    Mutant("issue33:runplan-no-tokenizer-check", "modelopt_k3/run/preflight.py",
           "if not any((ctx.checkpoint / name).is_file() for name in TOKENIZER_FILES):", "if False:",
           "preflight: a checkpoint without tokenizer files passes (fails after the load)"),
    Mutant("issue33:runplan-heldout-not-sized", "modelopt_k3/run/plan.py",
           "return max(self.report_heldout or 0, self.eval_kl)", "return self.eval_kl",
           "preflight: the calibration-size check leaves --report_heldout's sequences out"),
    Mutant("issue33:runplan-calib-seq-at-limit", "modelopt_k3/run/preflight.py",
           "0 < limit < ctx.config.calib_seq:", "0 < limit <= ctx.config.calib_seq:",
           "preflight: --calib_seq equal to max_position_embeddings refused"),
    Mutant("issue33:runplan-recipe-ckpt-dir-wins", "modelopt_k3/run/plan.py",
           "ckpt = config.layerwise_checkpoint_dir or (Path(lw.checkpoint_dir) if lw.checkpoint_dir else None)",
           "ckpt = (Path(lw.checkpoint_dir) if lw.checkpoint_dir else None) or config.layerwise_checkpoint_dir",
           "RunPlan: the recipe's layerwise.checkpoint_dir wins over --layerwise_checkpoint_dir"),
    Mutant("issue33:runplan-ckpt-dir-holds-export", "modelopt_k3/run/preflight.py",
           "if here == export or export in here.parents or here in export.parents:",
           "if here == export or export in here.parents:",
           "preflight: a --layerwise_checkpoint_dir that contains the export path passes"),
    Mutant("issue33:lw-resume-any-source", "modelopt_k3/layerwise/state.py",
           "if old.fingerprint.get(k) != self.state.fingerprint.get(k))",
           'if k != "source checkpoint" and old.fingerprint.get(k) != self.state.fingerprint.get(k))',
           "layerwise resume: a checkpoint whose source digest differs is trusted"),
    Mutant("issue33:lw-source-digest-no-mtime", "modelopt_k3/load/layerwise.py",
           "if info.file in suspect and self.reader.sha256(read) != sha:", "if False:",
           "layerwise resume: a source shard rewritten in place (same size) not noticed"),
    Mutant("issue33:lw-qdq-first-pass-captures", "modelopt_k3/layerwise/__init__.py",
           "first = not settings.qdq_inputs and not last and len(next_cache) == 0",
           "first = not last and len(next_cache) == 0",
           "layerwise: with qdq_inputs the next layer gets this layer's unquantized outputs"),
    Mutant("issue33:lw-agree-on-most", "modelopt_k3/layerwise/__init__.py",
           "    return least\n", "    return most\n",
           "layerwise resume: ranks resume at the largest committed count, not the smallest"),
    Mutant("issue33:lw-commit-drops-own-inputs", "modelopt_k3/layerwise/state.py",
           "(self.path / self.inputs_name(i - 1)).unlink(missing_ok=True)",
           "(self.path / self.inputs_name(i)).unlink(missing_ok=True)",
           "layerwise commit: layer i's inputs deleted (a rank one layer behind cannot resume)"),
    Mutant("issue33:lw-rollback-drops-inputs", "modelopt_k3/layerwise/state.py",
           "keep |= {self.inputs_name(done)} if done else set()", "keep |= set()",
           "layerwise resume: the roll-back deletes the inputs of the layer it resumes at"),
    Mutant("issue33:lw-current-is-skipped", "modelopt_k3/layerwise/replay.py",
           "if i < self.current:", "if i <= self.current:",
           "layerwise replay: the layer being calibrated returns a placeholder"),
    Mutant("issue33:lw-skip-not-consumed", "modelopt_k3/load/layerwise.py",
           "self._consumed.update(self._keys[name])", "pass",
           "layerwise resume: a skipped layer's source keys left unconsumed (finish refuses them)"),
    Mutant("issue33:cal-search-max-error", "modelopt_k3/numerics/nvfp4_search.py",
           "            better = err < best_err", "            better = err > best_err",
           "MSE search: every block keeps the candidate with the largest error"),
    Mutant("issue33:cal-search-tie-last", "modelopt_k3/numerics/nvfp4_search.py",
           "better = err < best_err", "better = err <= best_err",
           "MSE search: a tie keeps the last (largest) candidate, not the first"),
    Mutant("issue33:cal-four-over-six-divides", "modelopt_k3/numerics/nvfp4_search.py",
           "return _scales_from_amax(amax * mults[i], denom)", "return _scales_from_amax(amax / mults[i], denom)",
           "four-over-six: the x1.5 candidate maps the block max to 9, not 4"),
    Mutant("issue33:cal-four-over-six-448", "modelopt_k3/quant/calibrators/mse.py",
           "global_scale = (lambda q: nvfp4_global_scale_46(q.amax)) if self.four_over_six else None",
           "global_scale = None",
           "four-over-six calibrator: the global scale stays max's (448), so x1.5 clips"),
    Mutant("issue33:gptq-absolute-damp", "modelopt_k3/numerics/gptq.py",
           "h[idx, idx] += perc_damp * torch.diag(h).mean()", "h[idx, idx] += perc_damp",
           "GPTQ: perc_damp added as is, not times the mean diagonal"),
    Mutant("issue33:gptq-err-unscaled", "modelopt_k3/numerics/gptq.py",
           "err = (col - qcol) / h_blk[i, i]", "err = col - qcol",
           "GPTQ: a column's error not divided by its inverse-Hessian diagonal"),
    Mutant("issue33:gptq-no-cross-block", "modelopt_k3/numerics/gptq.py",
           "w[:, stop:] -= errs @ h_inv[start:stop, stop:]", "pass",
           "GPTQ: a column block's errors never reach the blocks after it"),
    Mutant("issue33:gptq-lower-factor", "modelopt_k3/numerics/gptq.py",
           "torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)",
           "torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)))",
           "GPTQ: the lower Cholesky factor of H^-1 used where the upper one is meant"),
    Mutant("issue33:cal-bool-as-int", "modelopt_k3/quant/calibrators/base.py",
           "if not isinstance(v, typ) or (typ is not bool and isinstance(v, bool)):", "if not isinstance(v, typ):",
           "recipe algorithm: block_size: true accepted as 1"),
    Mutant("issue33:cal-lh-quantized-input", "modelopt_k3/quant/calibrators/local_hessian.py",
           "moments = input_moments(model, forward_loop, blocks=True, raw_input=True, experts=experts)",
           "moments = input_moments(model, forward_loop, blocks=True, raw_input=False, experts=experts)",
           "local_hessian: H from the Linear's fake-quantized input, not the input as it arrives"),
)

# Surviving mutants that change no observable behaviour: id -> why.
EQUIVALENT: dict[str, str] = {
    "modelopt_k3/export/writer.py::<module>::int+1#7":
        "DEFAULT_SPILL_BYTES 64 -> 128 MiB: only when buffered tensors move to the spill file, not what the "
        "shard holds (test_writer checks spilled and buffered shards are byte-identical)",
    "modelopt_k3/convert/shard.py::_ShardConverter._shared_scale::IsNot->Is#1":
        "the job's own weight is decoded again instead of reused: the same bytes, so the same amax and scale "
        "(every caller on this branch passes the weight; only an extra read)",
    "modelopt_k3/layerwise/state.py::digest::int+1#1":
        "fingerprint digests one hex digit longer: a resume compares digests this same code wrote, so the same "
        "fields match or differ (no state written by another version is read: its VERSION would differ)",
    "modelopt_k3/layerwise/__init__.py::<module>::int+1#1":
        "the default host cache of captured inputs 4096 -> 4097 MiB: only where inputs spill to disk, and a "
        "spilled entry reads back the same tensors (test_captured_arguments_round_trip_through_safetensors)",
    "modelopt_k3/layerwise/replay.py::LayerReplay._patched.forward::And->Or#1":
        "with capture off the forward stops at the current layer (or it is the last), so a later layer reaches "
        "this test only while capturing and as layer current + 1: `and` and `or` agree on every reachable call",
}

_SWAP = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitOr, ast.Pow: ast.Mult, ast.And: ast.Or, ast.Or: ast.And,
}
_NAME_SWAP = {"max": "min", "min": "max", "amax": "amin", "amin": "amax", "maximum": "minimum",
              "minimum": "maximum", "any": "all", "all": "any"}
_QUIET_CALLS = {"debug", "info", "warning", "warn", "error", "exception", "say", "print", "log"}


def _skipped_subtrees(tree: ast.AST) -> set[int]:
    """ids of nodes whose mutation only changes a message, an annotation or a docstring."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.Raise):
            mark(node.exc)
        elif isinstance(node, ast.JoinedStr):
            mark(node)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in _QUIET_CALLS:
                mark(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
            for a in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs, node.args.vararg,
                      node.args.kwarg]:
                if a is not None:
                    mark(a.annotation)
        elif isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        elif isinstance(node, ast.Assert):
            mark(node.msg)
    return skip


def _scopes(tree: ast.AST) -> dict[int, str]:
    """node id -> qualified name of the innermost def/class holding it ("<module>" at top level)."""
    out: dict[int, str] = {}

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
            out[id(child)] = inner
            visit(child, inner)

    visit(tree, "<module>")
    return out


def _offsets(text: str) -> list[int]:
    starts, total = [], 0
    for line in text.splitlines(keepends=True):
        starts.append(total)
        total += len(line)
    return starts


def _is_path_join(node: ast.BinOp) -> bool:
    """``a / "name"`` or ``a / f"..."``: a Path join (``*`` there is a TypeError at once, not a test of anything)."""
    return isinstance(node.op, ast.Div) and any(
        isinstance(x, ast.JoinedStr) or (isinstance(x, ast.Constant) and isinstance(x.value, str))
        for x in (node.left, node.right))


def operator_mutants(path: str) -> list[Mutant]:
    """Every operator mutant of one module; ids are ``path::scope::kind#n`` (stable under edits elsewhere)."""
    text = (REPO / path).read_text()
    tree = ast.parse(text)
    skip, scopes, starts = _skipped_subtrees(tree), _scopes(tree), _offsets(text)
    counters: dict[tuple[str, str], int] = {}
    out: list[Mutant] = []

    def add(node: ast.AST, kind: str, new_node: ast.AST) -> None:
        scope = scopes.get(id(node), "<module>")
        n = counters[scope, kind] = counters.get((scope, kind), 0) + 1
        a = starts[node.lineno - 1] + node.col_offset
        b = starts[node.end_lineno - 1] + node.end_col_offset
        old = text[a:b]
        new = ast.unparse(new_node)
        if isinstance(new_node, ast.expr) and not isinstance(new_node, (ast.Name, ast.Constant, ast.Attribute)):
            new = f"({new})"
        shown = " ".join(f"`{old}` -> `{new}`".split()).replace("|", "\\|")
        note = f"line {node.lineno}: {shown if len(shown) <= 90 else shown[:87] + '...'}"
        out.append(Mutant(f"{path}::{scope}::{kind}#{n}", path, old, new, note, a))

    def copy(node: ast.AST) -> ast.AST:
        return ast.parse(ast.unparse(node), mode="eval").body

    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "lineno"):
            continue
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _SWAP:
                    m = copy(node)
                    m.ops[i] = _SWAP[type(op)]()
                    add(node, f"{type(op).__name__}->{_SWAP[type(op)].__name__}", m)
        elif (isinstance(node, ast.BinOp) and type(node.op) in _SWAP and not _is_path_join(node)
              or isinstance(node, ast.BoolOp)):
            m = copy(node)
            m.op = _SWAP[type(node.op)]()
            add(node, f"{type(node.op).__name__}->{type(m.op).__name__}", m)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add(node, "drop-not", copy(node.operand))
        elif (isinstance(node, ast.Constant) and type(node.value) is int and not isinstance(node.value, bool)):
            add(node, "int+1", ast.Constant(node.value + 1))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in _NAME_SWAP:
                m = copy(node)
                if isinstance(m.func, ast.Attribute):
                    m.func.attr = _NAME_SWAP[name]
                else:
                    m.func.id = _NAME_SWAP[name]
                add(node, f"{name}->{_NAME_SWAP[name]}", m)
    return out


def area_of(path: str, area_name: str = "") -> tuple[str, Area]:
    """The area a module's mutants belong to: one that names it exactly, else the first whose glob matches."""
    if area_name:
        return area_name, AREAS[area_name]
    exact = [(n, a) for n, a in AREAS.items() if path in a.modules]
    globbed = [(n, a) for n, a in AREAS.items() if any(fnmatch.fnmatch(path, g) for g in a.modules)]
    for name, area in exact or globbed:
        return name, Area(area.modules, MODULE_TESTS[path], area.markers) if path in MODULE_TESTS else area
    if path in EXTRA_TESTS:
        return "other", EXTRA_TESTS[path]
    raise KeyError(f"{path} is in no area")


def area_modules(area: Area) -> list[str]:
    """The modules whose operator mutants are ``area``'s (a module another area names exactly is that area's)."""
    found = sorted({str(p.relative_to(REPO)) for g in area.modules for p in REPO.glob(g)})
    name = next(n for n, a in AREAS.items() if a is area)
    return [p for p in found if (not p.endswith("__init__.py") or p in area.modules) and area_of(p)[0] == name]


def select(curated: bool, sample: int, seed: int, only: list[str], areas: list[str]) -> list[Mutant]:
    chosen: list[Mutant] = []
    for name in areas or list(AREAS):
        if sample:
            pool = [m for p in area_modules(AREAS[name]) for m in operator_mutants(p)]
            chosen += random.Random(f"{seed}:{name}").sample(pool, min(sample, len(pool)))
    if curated:
        chosen += [m for m in CURATED if not areas or area_of(m.path, m.area)[0] in areas]
    if only:
        every = {m.id: m for m in CURATED}
        for area in AREAS.values():
            every.update((m.id, m) for p in area_modules(area) for m in operator_mutants(p))
        missing = [i for i in only if i not in every]
        if missing:
            raise SystemExit(f"unknown mutant id(s): {missing}")
        chosen += [every[i] for i in only if every[i] not in chosen]
    return chosen


@dataclass
class Result:
    id: str
    area: str
    outcome: str  # killed | timeout | survived | broken (did not apply)
    seconds: float
    note: str = ""
    tail: list[str] = field(default_factory=list)
    selection: str = ""  # the tests it ran (pytest arguments)
    fast: str = ""  # does the fast set alone kill it: "killed" | "survived" | "" (not known)


def run_one(m: Mutant, tree: Path, timeout: float, tests: list[str] | None = None, fast: bool = False) -> Result:
    area_name, area = area_of(m.path, m.area)
    if tests:
        area = Area(area.modules, tuple(tests), markers="")
    if fast:  # the area's test files, only their fast tests: what the fast set alone would say
        area = Area(area.modules, area.tests, markers=FAST)
    target = tree / m.path
    original = target.read_text()
    try:
        mutated = m.apply(original)
        compile(mutated, m.path, "exec")
    except (ValueError, SyntaxError) as e:
        return Result(m.id, area_name, "broken", 0.0, str(e))
    target.write_text(mutated)
    args = [sys.executable, "-m", "pytest", *PYTEST, *area.tests]
    if area.markers:
        args += ["-m", area.markers]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    # Its own session: on a timeout (or when this script is stopped) the whole group goes, torchrun ranks too.
    proc = subprocess.Popen(args, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        # 5: no test collected (e.g. every test of the selection is slow under --fast): nothing noticed it
        outcome = "survived" if proc.returncode in (0, 5) else "killed"
        lines = out.strip().splitlines()
        tail = [line for line in lines if line.startswith(("FAILED", "ERROR"))][:1] or lines[-3:]
    except subprocess.TimeoutExpired:
        outcome, tail = "timeout", []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        target.write_text(original)
    selection = " ".join([*area.tests, *(["-m", repr(area.markers)] if area.markers else [])])
    return Result(m.id, area_name, outcome, round(time.monotonic() - start, 1), m.note, tail, selection)


def _copy_tree(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        src = REPO / name
        (shutil.copytree(src, dst / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, dst / name))


BEGIN, END = "<!-- mutate.py: generated results begin -->", "<!-- mutate.py: generated results end -->"


def _killer(r: Result) -> str:
    # The node id runs to " - " (a parametrized id may hold spaces: "test_x[calib_seq beyond positions]").
    failed = [t.split(" - ")[0].split(maxsplit=1)[1] for t in r.tail if t.startswith(("FAILED ", "ERROR "))]
    return failed[0] if failed else ""


def _rate(killed: int, of: int) -> str:
    return f"{100.0 * killed / of:.0f}%" if of else "-"


def summary(results: list[Result], runs: list[str]) -> str:
    counted = [r for r in results if r.outcome != "broken"]
    equivalent = [r for r in counted if r.outcome == "survived" and r.id in EQUIVALENT]
    killed = [r for r in counted if r.outcome in ("killed", "timeout")]
    denominator = len(counted) - len(equivalent)
    rate = 100.0 * len(killed) / denominator if denominator else 0.0
    lines = [BEGIN, "", "Runs (later ones replace the results of the mutants they ran again):", "",
             *(f"- `{run}`" for run in runs), "",
             f"**Kill rate {rate:.1f}%**: {len(killed)} killed ({sum(r.outcome == 'timeout' for r in killed)} by "
             f"timeout) of {denominator} mutants; {len(equivalent)} equivalent (not counted); "
             f"{len(results) - len(counted)} did not apply.", "",
             "*fast set*: killed by the area's tests under `-m \"not slow and not multiprocess\"` (the killing "
             "test is a fast one, or a `--fast` run); `?`: not measured.", "",
             "| area | mutants | killed | survived | equivalent | kill rate | fast set kills | fast-set rate |",
             "|---|---|---|---|---|---|---|---|"]
    for area in sorted({r.area for r in counted}):
        rs = [r for r in counted if r.area == area]
        k = sum(r.outcome in ("killed", "timeout") for r in rs)
        eq = sum(r.outcome == "survived" and r.id in EQUIVALENT for r in rs)
        fast = sum(r.fast == "killed" for r in rs)
        unknown = sum(r.outcome in ("killed", "timeout") and not r.fast for r in rs)
        lines.append(f"| {area} | {len(rs)} | {k} | {len(rs) - k - eq} | {eq} | {_rate(k, len(rs) - eq)} | "
                     f"{fast}{f' (+{unknown} ?)' if unknown else ''} | {_rate(fast, len(rs) - eq)} |")
    fast_all = sum(r.fast == "killed" for r in counted)
    lines += ["", f"Fast set alone: {fast_all} of {denominator} ({_rate(fast_all, denominator)}).", "",
              "| mutant | where | outcome | fast set | seconds | tests run |", "|---|---|---|---|---|---|"]
    for r in results:
        outcome = f"equivalent: {EQUIVALENT[r.id]}" if r.outcome == "survived" and r.id in EQUIVALENT else r.outcome
        if r.outcome == "killed" and _killer(r):
            outcome += f" by `{_killer(r)}`"
        selection = f"`{r.selection}`" if r.selection else ""
        lines.append(f"| `{r.id}` | {r.note} | {outcome} | {r.fast or '?'} | {r.seconds} | {selection} |")
    return "\n".join([*lines, "", END])


def fast_test_ids(results: list[Result]) -> set[str]:
    """Node ids the fast set holds among the files the results' killing tests are in (one collection)."""
    # Only files that still exist: a killer recorded before a test file moved would fail the whole collection.
    files = sorted({f for r in results if _killer(r) for f in [_killer(r).split("::")[0]] if (REPO / f).is_file()})
    if not files:
        return set()
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", FAST, *files], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return {line.strip() for line in out.stdout.splitlines() if "::" in line}


def record(doc: Path, text: str) -> None:
    old = doc.read_text() if doc.exists() else f"# Mutation testing\n\n{BEGIN}\n{END}\n"
    if BEGIN not in old:
        old = f"{old.rstrip()}\n\n{BEGIN}\n{END}\n"
    head, _, rest = old.partition(BEGIN)
    _, _, tail = rest.partition(END)
    doc.write_text(head + text + tail)


def _stop(signum: int, frame) -> None:
    raise KeyboardInterrupt  # unwinds: the running tests are killed, the private tree removed


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--curated", action="store_true", help="run the hand-written mutants (CURATED)")
    ap.add_argument("--sample", type=int, default=0, help="operator mutants drawn per area")
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--areas", nargs="*", default=[], choices=list(AREAS), help="sample only these areas")
    ap.add_argument("--only", nargs="*", default=[], help="mutant ids to run")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant (a timeout counts as killed)")
    ap.add_argument("--tests", nargs="*", default=[], help="run these tests (pytest node ids) instead of the area's")
    ap.add_argument("--fast", action="store_true",
                    help=f"run only the area's fast tests (-m '{FAST}'): does the fast set alone kill it?")
    ap.add_argument("--classify-fast", action="store_true",
                    help="with --merge: mark killed mutants whose killing test is in the fast set (no mutant runs)")
    ap.add_argument("--list", action="store_true", help="print the chosen mutants and exit")
    ap.add_argument("--count", action="store_true", help="print how many operator mutants each area has")
    ap.add_argument("--json", type=Path, help="write the results here (after every mutant)")
    ap.add_argument("--merge", action="store_true",
                    help="start from --json's results: a mutant run again replaces its old result")
    ap.add_argument("--record", type=Path, help="rewrite the generated section of this markdown file")
    args = ap.parse_args(argv)
    if args.count:
        for name, area in AREAS.items():
            print(f"{name:10s} {sum(len(operator_mutants(p)) for p in area_modules(area)):5d}  {area_modules(area)}")
        return 0
    chosen = select(args.curated, args.sample, args.seed, args.only, args.areas)
    if args.list:
        for m in chosen:
            print(f"{m.id}  [{m.note}]  {m.old!r} -> {m.new!r}")
        return 0
    runs: list[str] = []
    previous: dict[str, Result] = {}
    if args.merge and args.json and args.json.exists():
        saved = json.loads(args.json.read_text())
        runs = saved["runs"]
        previous = {r["id"]: Result(**r) for r in saved["results"]}
    runs.append(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: python scripts/mutate.py "
                + " ".join(argv if argv is not None else sys.argv[1:]))
    results: dict[str, Result] = dict(previous)

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps({"runs": runs, "results": [r.__dict__ for r in results.values()]},
                                            indent=1) + "\n")

    if args.classify_fast:
        fast = fast_test_ids(list(results.values()))
        for r in results.values():
            if r.outcome == "killed" and not r.fast and _killer(r) in fast:
                r.fast = "killed"
            elif r.outcome == "survived":
                r.fast = "survived"  # the fast set is a subset of the tests that let it through
        chosen = []
        save()
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        for i, m in enumerate(chosen, 1):
            r = run_one(m, tree, args.timeout, args.tests, args.fast)
            if args.fast:
                r.fast = "killed" if r.outcome in ("killed", "timeout") else "survived"
            if args.fast and m.id in results:  # a fast-only run answers only the fast-set question
                results[m.id].fast = r.fast
            else:
                results[m.id] = r
            save()  # after every mutant: an interrupted run keeps what it measured
            print(f"[{i}/{len(chosen)}] {r.outcome:8s} {r.seconds:6.1f}s {m.id}  {m.old!r} -> {m.new!r}", flush=True)
            print("         " + " | ".join(r.tail), flush=True)
    text = summary(list(results.values()), runs)
    print(text)
    if args.record:
        record(args.record, text)
    return 0 if all(r.outcome != "survived" or r.id in EQUIVALENT for r in results.values()) else 1

if __name__ == "__main__":
    sys.exit(main())
