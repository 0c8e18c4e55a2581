"""``hf_ptq``: load -> quantize (calibrate) -> export, in one process or under torchrun.

Flags follow ModelOpt's ``examples/llm_ptq/hf_ptq.py`` where they overlap, so existing command lines
keep working. Without ``--pyt_ckpt_path`` the embedded tiny Kimi-K3 stand-in is generated into a cache
directory and used (its remote code is this project's own, so it needs no ``--trust_remote_code``).

Before any weight is read a preflight (``modelopt_k3/run/preflight.py``) refuses what would fail later:
an export path over the source or not writable or taken, a recipe the export format cannot express, a
recipe a ``--target_engines`` engine cannot serve, a missing dataset; argument ranges are checked by the
parser. Refusals print one line per group of ranks and exit 2 on every rank (``--debug`` keeps the
traceback); SIGTERM removes the export's temporary data. After the export, ``modelopt-k3-check``'s table
is printed; the exit status is 1 when a ``--target_engines`` engine would not serve the export as calibrated.

Between calibration and export the expert-coverage guard (``--min_expert_tokens``, ``--uncovered_experts``;
``quant/coverage.py``) refuses, naming them, experts too few tokens reached when their scales depend on
calibration; after the export rank 0 writes the quantization report (``--report``, default
``EXPORT/quant_report``; ``modelopt_k3/report/``, docs/REPORT.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from ..dist.kinds import DENSE_MODES, EP_DEGREE_ENV, EXPERTS_CHOICES, PLAN_KINDS
from ..export.format_names import EXPORT_FORMAT_NAMES
from ..run.plan import DTYPE_CHOICES, KV_CACHE_CHOICES, LAYERWISE_CACHE_MIB, PtqConfig, RunPlan, qformat_names
from ._common import non_negative_int, positive_float, positive_int, run_cli

# The launcher's default for ``--hardware`` (the wall-time note's preset): read by the command line, not a stage.
HARDWARE_ENV = "MODELOPT_K3_HARDWARE"

TINY_CACHE_ENV = "MODELOPT_K3_CACHE"
# The launcher's default for ``--layerwise_cache_mib``: read by the command line, not by the layerwise stage.
LAYERWISE_CACHE_ENV = "MODELOPT_K3_LAYERWISE_CACHE_MIB"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="modelopt-k3-ptq",
        description="Post-training quantization of a Kimi-K3-class checkpoint to an NVFP4/FP8 ModelOpt checkpoint.",
    )
    p.add_argument("--pyt_ckpt_path", type=Path, default=None,
                   help="checkpoint directory (default: the embedded tiny Kimi-K3, built into a cache dir)")
    p.add_argument("--qformat", default="nvfp4", help=f"preset: {', '.join(qformat_names())}, the model's own recipe for it where its spec names one "
                   "(ignored with --recipe)")
    p.add_argument("--recipe", default=None, help="YAML recipe path or name (overrides --qformat)")
    p.add_argument("--kv_cache_qformat", default="none", choices=KV_CACHE_CHOICES)
    p.add_argument("--calib_size", type=positive_int, default=32,
                   help="number of calibration sequences (all ranks together)")
    p.add_argument("--batch_size", type=positive_int, default=4)
    p.add_argument("--calib_seq", type=positive_int, default=128, help="tokens per calibration sequence")
    p.add_argument("--dataset", default="builtin", help="local .txt/.jsonl, a datasets name, or 'builtin'")
    p.add_argument("--export_path", type=Path, default=None, help="output directory (default: ./<ckpt>-<format>)")
    p.add_argument("--trust_remote_code", action="store_true", help="allow the checkpoint's own modeling code")
    p.add_argument("--calibrate_all_experts", action="store_true",
                   help="during calibration every expert sees every token (routing output unchanged)")
    p.add_argument("--eval_kl", type=non_negative_int, default=0, metavar="N",
                   help="after calibration, report KL(original || quantized) on N held-out sequences (0: skip)")
    p.add_argument("--plan", default="auto", choices=PLAN_KINDS,
                   help="auto: expert_parallel under torchrun, else whole; fsdp2: dense and experts FSDP2-sharded")
    p.add_argument("--dense", default="replicated", choices=DENSE_MODES,
                   help="expert_parallel: keep the dense part on every rank, or shard it with FSDP2")
    # The launcher's $MODELOPT_K3_EP_DEGREE is the flag's default, read here once (argparse checks it as the flag).
    p.add_argument("--ep_degree", type=positive_int, default=os.environ.get(EP_DEGREE_ENV) or None,
                   help="expert-parallel degree (default: $MODELOPT_K3_EP_DEGREE, else the world size); must divide it")
    p.add_argument("--experts", default="auto", choices=EXPERTS_CHOICES,
                   help="routed experts held decoded (bf16) or as their MXFP4 source bytes, decoded per layer "
                        "inside the forward (packed); auto: packed when the memory planner says bf16 does not fit")
    p.add_argument("--gpu_mem_gib", type=positive_float, default=None,
                   help="memory per rank the planner checks against (default: the accelerator's, or host RAM "
                        "per local rank on CPU)")
    p.add_argument("--hardware", default=os.environ.get(HARDWARE_ENV) or None,  # the launcher's, read here once
                   help="hardware preset the preflight prices the predicted wall time on (modelopt-k3-plan --time "
                        "--hardware lists them; default: $MODELOPT_K3_HARDWARE, else h200-node on CUDA, none on CPU)")
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES, help="default: the config's dtype")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint at --export_path (deleted once the new export is complete; a "
                   "non-empty directory that is not a checkpoint is refused)")
    p.add_argument("--export_format", default="modelopt", choices=EXPORT_FORMAT_NAMES,
                   help="modelopt (hf_quant_config.json; vLLM/TRT-LLM/SGLang) or compressed-tensors nvfp4-pack-quantized")
    p.add_argument("--target_engines", default=None, metavar="ENGINES",
                   help="comma-separated serving engines (vllm, sglang, trtllm) the export must load in as calibrated: "
                        "a recipe one of them cannot serve is refused before any weight is read, and the exit "
                        "status is 1 when the final modelopt-k3-check finds one of them does not load it correctly")
    p.add_argument("--max_shard_size_mb", type=positive_int, default=5 * 1024)
    p.add_argument("--allow_nonfinite_passthrough", action="store_true",
                   help="copy source tensors with NaN/Inf that stay unquantized unchanged (with a warning) instead "
                   "of refusing; a quantized one is always refused")
    p.add_argument("--allow_unmatched", action="store_true",
                   help="run even if a recipe pattern matches no module of the checkpoint (refused by default: a typo)")
    p.add_argument("--layerwise", action="store_true",
                   help="calibrate one decoder layer at a time, each read from the checkpoint when its turn comes "
                        "and released once its export is written (peak memory: one layer, not the model); "
                        "max calibration gives the resident run's export byte for byte")
    p.add_argument("--layerwise_checkpoint_dir", type=Path, default=None, metavar="DIR",
                   help="with --layerwise: commit every completed layer here, per rank; the same command run "
                        "again resumes at the first incomplete layer (another source, recipe, world size, plan "
                        "or token set is refused)")
    p.add_argument("--layerwise_cache_mib", type=positive_int, metavar="MIB",
                   default=os.environ.get(LAYERWISE_CACHE_ENV) or LAYERWISE_CACHE_MIB,
                   help="with --layerwise: host memory per rank a layer's captured inputs may take before they "
                        f"spill to disk (default: ${LAYERWISE_CACHE_ENV}, else {LAYERWISE_CACHE_MIB})")
    _add_report_flags(p)
    p.add_argument("--debug", action="store_true", help="print the traceback of an expected failure too")
    p.add_argument("--no_progress", action="store_true")
    return p


def _add_report_flags(p: argparse.ArgumentParser) -> None:
    """The quantization report and the expert-coverage guard (modelopt_k3/report/, docs/REPORT.md)."""
    from ..quant.coverage import POLICIES

    p.add_argument("--report", default=None, metavar="DIR",
                   help="write the quantization report (report.json, report.md, PNG plots) here; default "
                        "EXPORT/quant_report; 'none': no report")
    p.add_argument("--report_heldout", type=non_negative_int, default=None, metavar="N",
                   help="held-out sequences for the report's per-layer hidden-state error, KL and top-1 "
                        "(default: --eval_kl's N when given, else one per rank; two forwards each)")
    p.add_argument("--min_expert_tokens", type=non_negative_int, default=1, metavar="N",
                   help="a routed expert that calibrated on fewer tokens is uncovered (see --uncovered_experts)")
    p.add_argument("--uncovered_experts", default="refuse", choices=POLICIES,
                   help="uncovered experts whose input scales depend on calibration: refuse naming them, accept "
                        "the layer's shared input scale, or calibrate every expert on every token "
                        "(= --calibrate_all_experts)")


def _tiny_checkpoint(group) -> Path:
    from ..dist.collectives import barrier, run_together
    from ..testing import generator_fingerprint, make_tiny_kimi_k3

    root = Path(os.environ.get(TINY_CACHE_ENV, Path.home() / ".cache" / "modelopt_k3"))
    # Keyed by the generator's own digest: an upgrade never reuses a checkpoint an older stand-in wrote.
    path = root / f"tiny_kimi_k3-{generator_fingerprint()}"

    def build() -> None:
        if group.is_main and not (path / "model.safetensors.index.json").exists():
            tmp = root / f".tiny_kimi_k3.tmp-{os.getpid()}"
            make_tiny_kimi_k3(tmp, overwrite=True)
            if path.exists():  # another run built it meanwhile
                shutil.rmtree(tmp)
            else:
                tmp.rename(path)

    run_together("build tiny checkpoint", build, group=group)
    barrier(group)
    return path


def main(argv: list[str] | None = None) -> int:
    config = PtqConfig.from_namespace(build_parser().parse_args(argv))
    return run_cli("modelopt-k3-ptq", lambda: run(config), debug=config.debug)


def _preflight(config: PtqConfig, fmt, group, ckpt: Path, trust: bool, made: list | None = None):
    """Recipe and every check that can refuse the run, before any weight is read (``preflight.py``); the
    context holds what the checks decided (``PreflightContext.run_plan`` freezes it)."""
    from ..run.preflight import PreflightContext, run_preflight

    ctx = PreflightContext(config, ckpt, trust, fmt, rank=group.rank, world_size=group.world_size,
                           device=group.device)
    if made is not None:
        made.append(ctx)
    seconds = run_preflight(ctx)
    ctx.notes.append(f"preflight passed in {seconds:.2f}s")
    return ctx


def run(config: PtqConfig | argparse.Namespace) -> int:
    """The whole job for ``config`` (or parsed arguments); raises on failure (``main`` turns that into a line
    and an exit code)."""
    from ..dist.collectives import run_together
    from ..dist.group import run_group
    from ..export.layouts import export_format

    if not isinstance(config, PtqConfig):
        config = PtqConfig.from_namespace(config)
    fmt = export_format(config.export_format)  # resolved once; preflight and export take the object
    with run_group() as group:
        say = print if group.is_main else (lambda *a, **k: None)
        progress = group.is_main and not config.no_progress
        t0 = time.perf_counter()
        ckpt, trust = (config.pyt_ckpt_path, config.trust_remote_code) if config.pyt_ckpt_path is not None else (
            _tiny_checkpoint(group), True)
        # One agreed step: a refusal prints once for all ranks, and nothing has been read yet.
        made: list = []  # the context this rank built: closed even when another rank's preflight failed
        try:
            ctx = run_together("preflight", _preflight, config, fmt, group, ckpt, trust, made, group=group)
        except BaseException:
            for c in made:
                c.close()
            raise
        try:
            for note in ctx.notes:
                say(f"[modelopt_k3] {note}")
            report_dir = run_together("report path", _report_dir, config, ctx.export_path, ckpt, group=group)
            # Decided once, with the preflight's decisions: the stages below take the plan.
            plan = ctx.run_plan(held_out=_held_out_count(config, group.world_size), report_dir=report_dir)
            return _after_preflight(plan, group, say, progress, t0)
        finally:
            ctx.close()  # the export path's lock (rank 0), however the run ends


def _after_preflight(plan: RunPlan, group, say, progress: bool, t0: float) -> int:
    """What ``run`` does once the preflight passed (rank 0 holding the export path's lock): each stage takes
    the plan and what the stage before it produced (the load's ``LoadInfo``, quantize's ``QuantPlan``)."""
    from ..dist.collectives import run_together
    from ..export.model_export import export_planned

    config = plan.config
    sequences = run_together("calibration data", _calibration_sequences, plan, group=group)
    if plan.layerwise is not None:
        return _layerwise(plan, sequences, group, say, progress, t0)
    model, info = _load(plan, progress)
    t_load = time.perf_counter()
    say(f"[modelopt_k3] loaded {plan.checkpoint} ({info.plan.describe()}), read "
        f"{info.bytes_read / 2**20:.1f} MiB on rank {group.rank} in {t_load - t0:.1f}s")
    qplan = _calibrate(plan, model, info, sequences, group, progress, say)
    coverage = run_together("expert coverage", _coverage_guard, config, model, plan.spec, say, group=group)
    t_calib = time.perf_counter()
    out = export_planned(model, qplan, plan.export_path, plan.export_format, group=group, overwrite=config.overwrite,
                         max_shard_bytes=config.max_shard_size_mb * 2**20, progress=progress)
    t_export = time.perf_counter()
    say(f"[modelopt_k3] exported {out} in {t_export - t_calib:.1f}s (total {t_export - t0:.1f}s)")
    # After the export: the held-out pass is a fake-quant forward, after which (under FSDP2) the export
    # could no longer index MXFP4-sourced experts' scales; the report reads the weights before it.
    run_together("held-out evaluation and report", _evaluate_and_report, plan, model, qplan, sequences, coverage,
                 group, say, group=group)
    return _check_served(plan, out, say) if group.is_main else 0


def _layerwise(plan: RunPlan, sequences, group, say, progress: bool, t0: float) -> int:
    """``--layerwise``: load, calibrate and export one decoder layer at a time (``modelopt_k3.layerwise``); the
    held-out passes stream through each layer, and the report is the resident run's, from what each layer left."""
    from ..data import rank_batches
    from ..dist.collectives import run_together
    from ..layerwise import run_layerwise

    config = plan.config
    batches = rank_batches(sequences[: config.calib_size], batch_size=config.batch_size, rank=group.rank,
                           world_size=group.world_size)
    result = run_layerwise(plan, batches, held_out=_held_out_batches(plan, sequences, group),
                           report=plan.report_dir is not None, progress=progress, say=say)
    say(f"[modelopt_k3] exported {result.export} layerwise in {time.perf_counter() - t0:.1f}s")
    if result.resumed_at:
        if plan.report_dir is not None or config.eval_kl:
            say(f"[modelopt_k3] no quantization report and no held-out evaluation: this run resumed a layerwise "
                f"checkpoint whose first {result.resumed_at} layer(s) an earlier run calibrated (their figures are "
                "not kept); remove the --layerwise_checkpoint_dir directory to run every layer, with the report")
    else:
        run_together("held-out evaluation and report", _evaluate_and_report, plan, result.model, result.qplan,
                     sequences, result.coverage, group, say, streamed=result, group=group)
    return _check_served(plan, result.export, say) if group.is_main else 0


def _calibration_sequences(plan: RunPlan):
    """Token sequences for calibration, then ``--eval_kl`` held-out ones, from the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    from ..data import DataError, pack_sequences

    ckpt = plan.checkpoint
    try:
        tokenizer = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=plan.trust_remote_code)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the tokenizer of {ckpt}: {' '.join(str(e).split())[:300]}") from None
    return pack_sequences(tokenizer, plan.texts, num_sequences=plan.config.calib_size + plan.held_out,
                          seq_len=plan.config.calib_seq)


def _load(plan: RunPlan, progress: bool):
    """``load_planned``: the preflight's distribution plan (``--experts auto`` resolved, the decode chunk)."""
    from ..load import load_planned

    return load_planned(plan, progress=progress)


def _calibrate(plan: RunPlan, model, info, packed, group, progress: bool, say):
    """Quantize with this rank's share of the calibration sequences, with the run's decision table; returns
    the ``QuantPlan`` the export and the report take."""
    from ..data import make_forward_loop, rank_batches
    from ..quant.api import quantize_planned

    device = plan.distribution.device  # the plan's, not read back off the model
    t0 = time.perf_counter()
    batches = rank_batches(packed[: plan.config.calib_size], batch_size=plan.config.batch_size, rank=group.rank,
                           world_size=group.world_size)
    qplan = quantize_planned(model, info, plan.recipe, make_forward_loop(batches, device=device, progress=progress),
                             table=plan.table, verbose=group.is_main)
    say(f"[modelopt_k3] calibrated on {len(batches)} batches/rank in {time.perf_counter() - t0:.1f}s")
    return qplan


def _report_dir(config: PtqConfig, export_path: Path, ckpt: Path) -> Path | None:
    """``--report``: default under the export, ``none`` for no report; never inside the source, never the export
    itself (a checkpoint), never over a file we did not write there: refused before any weight is read."""
    from ..files.paths import DestinationError, refuse_overlap
    from ..report import DEFAULT_DIR, check_report_dir

    if config.report == "none":
        return None
    if config.report is None:
        return export_path / DEFAULT_DIR  # inside the export, which is written new
    out = Path(config.report)
    refuse_overlap(ckpt, out, flag="--report")
    if out.absolute().resolve() == Path(export_path).absolute().resolve():
        raise DestinationError(f"--report {out} is the export directory (a checkpoint); leave --report out to write "
                               f"the report into {export_path / DEFAULT_DIR}, or choose another directory")
    check_report_dir(out, flag="--report")
    return out


def _held_out_count(config: PtqConfig, world_size: int) -> int:
    """Held-out sequences after the calibration ones: ``--report_heldout``/``--eval_kl``'s, else one per
    rank for the report (two forwards of one sequence per rank), none without a report."""
    if config.report_heldout is not None or config.eval_kl:
        return config.held_out_asked
    return world_size if config.report != "none" else 0


def _coverage_guard(config: PtqConfig, model, spec, say):
    """Experts below ``--min_expert_tokens`` under ``--uncovered_experts``: refuse before the export, or note."""
    from ..quant.coverage import guard_coverage

    return guard_coverage(model, spec, min_tokens=config.min_expert_tokens,
                          policy=config.uncovered_experts, say=say)


def _held_out_batches(plan: RunPlan, packed, group):
    """This rank's held-out batches: the sequences after the calibration ones in the token stream (None: none)."""
    from ..data import rank_batches

    config = plan.config
    return rank_batches(packed[config.calib_size :], batch_size=config.batch_size, rank=group.rank,
                        world_size=group.world_size) if plan.held_out else None


def _evaluate_and_report(plan: RunPlan, model, qplan, packed, coverage, group, say, streamed=None) -> None:
    """The held-out pass (per-layer hidden-state error, KL and top-1 agreement; the KL printed with
    ``--eval_kl``) and the report. ``streamed``: a layerwise run's ``LayerwiseResult``, whose held-out passes
    and weight rows were taken layer by layer; else the resident model runs them here."""
    from ..quant.evaluate import evaluate_fidelity
    from ..report import report_planned

    config = plan.config
    held_out = _held_out_batches(plan, packed, group) if streamed is None else None
    fidelity, weights = (None, None) if streamed is None else (streamed.fidelity, streamed.weights)
    t0 = time.perf_counter()
    if plan.report_dir is None:
        if fidelity is None and held_out:
            fidelity = evaluate_fidelity(model, plan.spec.decoder_layers(model), held_out, plan.distribution.device)
    else:
        run = {"calibration_sequences": config.calib_size, "calibration_seq_len": config.calib_seq,
               "held_out_sequences": plan.held_out}
        data = report_planned(model, qplan, plan.report_dir, group=group, held_out=held_out, fidelity=fidelity,
                              coverage=coverage, min_expert_tokens=config.min_expert_tokens,
                              uncovered_experts=config.uncovered_experts, run=run, weights=weights)
        say(f"[modelopt_k3] wrote the quantization report {plan.report_dir} in {time.perf_counter() - t0:.1f}s")
        final = data["final"] if data is not None else None
        if final is not None:
            fidelity = final
    if config.eval_kl and fidelity is not None:
        kl, top1 = (fidelity["kl"], fidelity["top1_agreement"]) if isinstance(fidelity, dict) else (fidelity.kl,
                                                                                                  fidelity.top1)
        say(f"[modelopt_k3] KL(original || quantized) on {plan.held_out} held-out sequences: {kl:.4f} nats/token, "
            f"top-1 agreement {100 * top1:.1f}%")


def _check_served(plan: RunPlan, out: Path, say) -> int:
    """Rank 0: ``modelopt-k3-check``'s table for the export; the status follows ``--target_engines``."""
    if not plan.export_format.engine_checked:
        say(f"[modelopt_k3] modelopt-k3-check does not replay {plan.export_format} loading; not run on this export")
        return 0
    from ..check import final_check, parse_engines

    targets = plan.config.target_engines
    return final_check(out, parse_engines(targets) if targets else (), say=say, source=plan.checkpoint)


if __name__ == "__main__":
    sys.exit(main())
