"""What a conversion did: per-shard counters (``ConvertStats``) and one call's report (``ConvertReport``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ConvertStats:
    """Counters of converted shards. ``tensors``: source tensors by what became of them
    (``NVFP4``, ``FP8_PB_WO``, ..., ``copied``, ``decoded``); ``modules``: quantized Linears by algo.
    Expert blocks are NVFP4 blocks of 16 produced from MXFP4."""

    shards: int = 0
    tensors: Counter = field(default_factory=Counter)
    modules: Counter = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    expert_blocks_lossless: int = 0
    expert_blocks_requantized: int = 0
    # Copied tensors with NaN/Inf let through unchanged (--allow_nonfinite_passthrough): name -> what.
    nonfinite_passthrough: dict[str, str] = field(default_factory=dict)

    def add(self, other: ConvertStats) -> None:
        self.shards += other.shards
        self.tensors.update(other.tensors)
        self.modules.update(other.modules)
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.expert_blocks_lossless += other.expert_blocks_lossless
        self.expert_blocks_requantized += other.expert_blocks_requantized
        self.nonfinite_passthrough.update(other.nonfinite_passthrough)

    def to_dict(self) -> dict:
        return {
            "shards": self.shards,
            "tensors": dict(sorted(self.tensors.items())),
            "modules": dict(sorted(self.modules.items())),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "expert_blocks_lossless": self.expert_blocks_lossless,
            "expert_blocks_requantized": self.expert_blocks_requantized,
            "nonfinite_passthrough": dict(sorted(self.nonfinite_passthrough.items())),
        }

    @classmethod
    def from_dict(cls, d: dict) -> ConvertStats:
        return cls(
            shards=int(d["shards"]),
            tensors=Counter(d["tensors"]),
            modules=Counter(d["modules"]),
            bytes_in=int(d["bytes_in"]),
            bytes_out=int(d["bytes_out"]),
            expert_blocks_lossless=int(d["expert_blocks_lossless"]),
            expert_blocks_requantized=int(d["expert_blocks_requantized"]),
            nonfinite_passthrough=dict(d.get("nonfinite_passthrough", {})),
        )

    def lines(self, indent: str = "  ") -> list[str]:
        out = [f"{indent}source tensors by output format:"]
        for what, n in sorted(self.tensors.items()):
            mods = f"  ({self.modules[what]} modules)" if self.modules.get(what) else ""
            out.append(f"{indent}  {what:<12} {n:>9}{mods}")
        blocks = self.expert_blocks_lossless + self.expert_blocks_requantized
        if blocks:
            out.append(
                f"{indent}routed-expert NVFP4 blocks: {self.expert_blocks_lossless} lossless (MXFP4 codes "
                f"carried over), {self.expert_blocks_requantized} requantized"
            )
        out.append(f"{indent}bytes: {_mib(self.bytes_in)} in, {_mib(self.bytes_out)} out ({self.shards} shards)")
        if self.nonfinite_passthrough:
            from ..checkpoint.nonfinite import describe

            out.append(f"{indent}WARNING: copied unchanged with non-finite values: {describe(self.nonfinite_passthrough)}")
        return out


@dataclass
class ConvertReport:
    """What one ``convert_checkpoint`` call did. ``stats`` covers this rank's shards (converted now
    or found complete); ``total`` covers every shard once the output is complete."""

    src: Path
    dst: Path
    recipe: str
    rank: int
    world_size: int
    shards_total: int
    converted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    stats: ConvertStats = field(default_factory=ConvertStats)
    total: ConvertStats | None = None
    complete: bool = False
    finalized: bool = False
    nothing_to_do: bool = False  # dst already held this job's complete output
    notes: list[str] = field(default_factory=list)  # what was checked, recovered or left alone
    wall_s: float = 0.0

    def summary(self) -> str:
        head = f"modelopt_k3 convert: {self.src} -> {self.dst} (recipe {self.recipe}), rank {self.rank} of {self.world_size}"
        if self.nothing_to_do:
            return "\n".join([head, *(f"  {n}" for n in self.notes),
                              "  output already complete (same source and recipe): nothing to do; --overwrite "
                              "converts again"])
        lines = [
            head,
            *(f"  {n}" for n in self.notes),
            f"  shards: {self.shards_total} in the checkpoint; this rank converted {len(self.converted)}, "
            f"found {len(self.skipped)} already complete",
        ]
        lines += self.stats.lines("  ")
        rate = self.stats.bytes_in / self.wall_s if self.wall_s > 0 else 0.0
        lines.append(f"  time: {self.wall_s:.2f} s ({_mib(rate)}/s of source read)")
        if self.complete and self.total is not None:
            who = "finalized by this call" if self.finalized else "already finalized"
            lines.append(f"  output complete ({who}); all shards:")
            lines += self.total.lines("    ")
        else:
            lines.append(
                f"  output not complete yet: {len(self.pending)} shard(s) of other ranks pending; the rank that "
                "finishes last finalizes (or run finalize_conversion / --finalize)"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"
