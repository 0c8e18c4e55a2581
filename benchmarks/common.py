"""Shared pieces of the benchmark suite: timing, figures, machine facts, resident-memory probes.

Timing rule: every figure times our code and its reference in the same process, interleaved
(ours, reference, ours, reference, ...) after one untimed warm-up call of each, so that caches,
lazily built tables and background load hit both sides alike. A figure's ratio is computed from
the medians; the per-repeat (paired) ratios give its min/max.
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9
MiB = 2**20


def summary(samples: list[float]) -> dict[str, Any]:
    """min/median/max of a list of samples (and the samples, for the record)."""
    return {
        "min": min(samples),
        "median": statistics.median(samples),
        "max": max(samples),
        "n": len(samples),
        "samples": [round(s, 6) for s in samples],
    }


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    before: dict[str, Callable[[], Any]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function, called in turn ``repeats`` times after ``warmup`` calls each.

    ``before[name]``, if given, runs untimed before every call of ``fns[name]`` (e.g. to remove the
    previous call's output files).
    """
    before = before or {}
    for _ in range(warmup):
        for name, fn in fns.items():
            before.get(name, lambda: None)()
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    gc.disable()  # as timeit does: no collector pause lands in one side's timing
    try:
        for i in range(repeats):
            order = list(fns.items())
            if i % 2:
                order.reverse()  # alternate who runs first: neither side always gets the warmer cache
            for name, fn in order:
                before.get(name, lambda: None)()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return times


@dataclass
class Figure:
    """One benchmark figure: ours vs a reference measured in the same run, with a target.

    ``ratio`` is "how many times better ours is" for timings (reference seconds / our seconds), or
    the fraction asked for (e.g. our GB/s / copy GB/s). ``target`` None means report-only; the
    figure meets its target when ``ratio >= target`` (``ratio <= target`` if not ``higher_is_better``).

    Every figure gets a verdict (``met``, ``missed`` or ``report``). A figure with a target must say
    what bounds it (``bound``, or ``details["bound"]``), so that a miss is reported with its cause
    rather than lowered. ``checks`` are correctness checks made on the measured outputs (e.g. bit
    equality with the reference); a failed check, unlike a missed target, fails the run.
    """

    name: str
    area: str
    title: str
    ours: dict[str, Any]
    reference: dict[str, Any]
    ratio: float
    ratio_range: tuple[float, float] | None = None
    target: float | None = None
    target_text: str = ""
    unit: str = "s"
    higher_is_better: bool = True
    details: dict[str, Any] = field(default_factory=dict)
    bound: str = ""  # what bounds the figure: the cause to report if the target is missed
    checks: dict[str, bool] = field(default_factory=dict)  # correctness checks on the measured outputs

    skipped: str = ""  # why the figure was not measured (then ``ratio`` is NaN and nothing else is judged)

    def __post_init__(self) -> None:
        self.bound = self.bound or self.details.get("bound", "")
        if self.target is not None and not self.bound:
            raise ValueError(f"benchmark figure {self.name!r} has a target but no bound: say what limits it")
        if not self.target_text:
            raise ValueError(f"benchmark figure {self.name!r} has no target_text (say 'report only' if none)")
        if not self.skipped:
            _check_measured(self)
            unnamed = [side for side, d in (("ours", self.ours), ("reference", self.reference)) if not d.get("label")]
            if unnamed:  # RESULTS.md says what each side ran; a figure that cannot say it is not a comparison
                raise ValueError(f"benchmark figure {self.name!r} does not say what its {' and '.join(unnamed)} "
                                 "side ran: give each side a 'label'")

    @classmethod
    def not_measured(cls, name: str, area: str, title: str, why: str, *, target: float | None,
                     target_text: str, bound: str = "", higher_is_better: bool = True) -> Figure:
        """A figure that could not be measured in this run (e.g. no peer installed): it is listed as skipped
        with ``why``, never left out silently, and a skipped figure with a target fails the run."""
        return cls(name=name, area=area, title=title, ours={}, reference={}, ratio=float("nan"), target=target,
                   target_text=target_text, bound=bound or why, higher_is_better=higher_is_better, skipped=why)

    @property
    def passed(self) -> bool | None:
        if self.target is None or self.skipped:
            return None
        return bool(self.ratio >= self.target) if self.higher_is_better else bool(self.ratio <= self.target)

    @property
    def verdict(self) -> str:
        if self.skipped:
            return "skipped"
        return {True: "met", False: "missed", None: "report"}[self.passed]

    @property
    def failed_checks(self) -> list[str]:
        return [name for name, ok in self.checks.items() if not ok]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["verdict"] = self.verdict
        d["failed_checks"] = self.failed_checks
        if self.passed is False:
            if self.higher_is_better:
                how = f"{self.ratio / self.target:.2f} of the target" + (
                    f", {self.target / self.ratio:.1f}x short" if self.ratio > 0 else "")
                d["shortfall"] = f"{self.ratio:.3g} vs target >= {self.target:g}: {how}"
            else:
                d["shortfall"] = (f"{self.ratio:.3g} vs target <= {self.target:g}: "
                                  f"{(self.ratio / self.target - 1) * 100:.1f}% over")
        return d


class FigureError(ValueError):
    """A figure whose numbers cannot be true (negative, NaN or infinite): an error in the benchmark's
    measurement, which fails its area, never a verdict."""


# Keys of a side that hold a measured magnitude (seconds, bytes, GB/s, a ratio): never negative, always finite.
_MAGNITUDES = ("value", "median", "min", "max", "gbps")


def _check_measured(fig: Figure) -> None:
    """Refuse a figure whose ratio or measured magnitudes are negative, NaN or infinite: such a number is a
    broken measurement (e.g. an RSS difference across processes that came out below zero), and a ratio
    below a ``<=`` target would otherwise read as "met"."""
    bad = []
    if not (isinstance(fig.ratio, (int, float)) and math.isfinite(fig.ratio) and fig.ratio >= 0):
        bad.append(f"ratio {fig.ratio!r}")
    for side_name, side in (("ours", fig.ours), ("reference", fig.reference)):
        for key in _MAGNITUDES:
            v = side.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not (math.isfinite(v) and v >= 0):
                bad.append(f"{side_name} {key} {v!r}")
    if fig.ratio_range is not None and not all(math.isfinite(x) and x >= 0 for x in fig.ratio_range):
        bad.append(f"ratio_range {fig.ratio_range!r}")
    if bad:
        raise FigureError(f"benchmark figure {fig.name!r} measured impossible numbers ({', '.join(bad)}): "
                          "a broken measurement, not a result")


def timing_figure(
    name: str,
    area: str,
    title: str,
    ours_label: str,
    ref_label: str,
    times: dict[str, list[float]],
    *,
    target: float | None,
    target_text: str,
    details: dict[str, Any] | None = None,
    bound: str = "",
    checks: dict[str, bool] | None = None,
) -> Figure:
    """A speed-up figure from interleaved timings ``{"ours": [...], "ref": [...]}``."""
    ours, ref = times["ours"], times["ref"]
    paired = [r / o for o, r in zip(ours, ref)]
    return Figure(
        name=name,
        area=area,
        title=title,
        ours={"label": ours_label, **summary(ours)},
        reference={"label": ref_label, **summary(ref)},
        ratio=statistics.median(ref) / statistics.median(ours),
        ratio_range=(min(paired), max(paired)),
        target=target,
        target_text=target_text,
        details=details or {},
        bound=bound,
        checks=checks or {},
    )


def machine_facts() -> dict[str, Any]:
    import psutil
    import safetensors
    import torch
    import transformers

    try:
        import compressed_tensors

        ct_version = compressed_tensors.__version__
    except ImportError:  # pragma: no cover - a required dependency
        ct_version = None
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu,
        "cpu_cores_logical": os.cpu_count(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "memory_total_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "compressed_tensors": ct_version,
        "safetensors": safetensors.__version__,
        "load_average_at_start": os.getloadavg(),
        **_git_state(),
    }


def _git_state() -> dict[str, Any]:
    """The commit measured and any uncommitted changes to the package (they would be measured too)."""
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "modelopt_k3"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": None, "uncommitted_package_files": None}
    return {"git_commit": commit, "uncommitted_package_files": [line[3:] for line in dirty]}


# ------------------------------------------------------------------------------ resident memory


def _status_kib(field_name: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return None


class PeakRSS:
    """Peak resident memory of this process over a phase.

    Linux: the kernel's exact high-water mark VmHWM, reset at the start of the phase by writing 5 to
    ``/proc/self/clear_refs``. Elsewhere (or if the reset is refused) a sampler thread polls psutil
    every ``interval`` seconds; both are kept when available, ``peak`` prefers the kernel's.
    """

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.kernel_peak: int | None = None
        self.sampled_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reset_ok = False

    def __enter__(self) -> PeakRSS:
        import psutil

        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._reset_ok = True
        except OSError:
            self._reset_ok = False
        proc = psutil.Process()
        self.sampled_peak = proc.memory_info().rss

        def sample() -> None:
            while not self._stop.wait(self.interval):
                self.sampled_peak = max(self.sampled_peak, proc.memory_info().rss)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        hwm = _status_kib("VmHWM")
        self.kernel_peak = hwm * 1024 if (hwm is not None and self._reset_ok) else None

    @property
    def peak(self) -> int:
        return self.kernel_peak if self.kernel_peak is not None else self.sampled_peak


def rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


@dataclass
class Context:
    """What a benchmark area gets from the runner."""

    quick: bool
    repeats: int
    workdir: Path  # scratch space; checkpoints built here are cached between runs
    out_dir: Path  # where results.json / RESULTS.md go
    log: Callable[[str], None] = print
    threads: int = 1  # torch threads of the runner; EP ranks split them
    convert_size: str = "default"  # the convert area's checkpoint: default (~0.5 GB) or multi-gb (~2.2 GB)
    peer_python: str | None = None  # ModelOpt's Kimi-K3 converter (bench_convert_peer.py); None: from the env
    peer_script: str | None = None
    llmc_python: str | None = None  # llm-compressor's interpreter (bench_peer_calibrators.py); None: from the env


# ------------------------------------------------------------------------------ shared checkpoints


def tiny_checkpoint(workdir: Path, log: Callable[[str], None] = print, **sizes: Any) -> Path:
    """A tiny Kimi-K3 checkpoint with ``sizes``, built once into ``workdir`` and reused while the sizes
    and the generator's source are unchanged (the generator is deterministic)."""
    import hashlib
    import json
    import shutil

    import modelopt_k3.testing.tiny as tiny

    stamp = json.dumps(
        {"sizes": sizes, "generator": hashlib.sha256(Path(tiny.__file__).read_bytes()).hexdigest()}, sort_keys=True
    )
    short = {"num_experts": "e", "moe_intermediate_size": "m", "routed_expert_hidden_size": "h"}
    name = "_".join(f"{short.get(k, k)}{v}" for k, v in sorted(sizes.items())) or "default"
    path = Path(workdir) / f"kimi_k3_{name}"  # a valid identifier: transformers imports the remote code by it
    if (path / "bench_stamp.json").exists() and (path / "bench_stamp.json").read_text() == stamp:
        return path
    t0 = time.perf_counter()
    tmp = path.parent / f".{path.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tiny.make_tiny_kimi_k3(tmp, **sizes)
    (tmp / "bench_stamp.json").write_text(stamp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    log(f"built {path} in {time.perf_counter() - t0:.1f}s")
    return path


def checkpoint_files(path: Path) -> list[Path]:
    import json

    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    return [Path(path) / f for f in sorted(set(index["weight_map"].values()))]


def warm_page_cache(paths: list[Path]) -> int:
    """Read every file once so that every timed read comes from the page cache; returns bytes."""
    total = 0
    buf = bytearray(64 * MiB)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def calibration_loop(model, ckpt: Path, *, sequences: int, seq_len: int, batch_size: int, rank: int = 0,
                     world_size: int = 1):
    """The forward loop ``hf_ptq`` builds (builtin calibration text), for ``quantize``."""
    from transformers import AutoTokenizer

    from modelopt_k3.data import load_texts, make_forward_loop, pack_sequences, rank_batches

    tokenizer = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True)
    seqs = pack_sequences(tokenizer, load_texts("builtin"), num_sequences=sequences, seq_len=seq_len)
    batches = rank_batches(seqs, batch_size=batch_size, rank=rank, world_size=world_size)
    return make_forward_loop(batches, device=model.modelopt_k3.plan.device, progress=False)
