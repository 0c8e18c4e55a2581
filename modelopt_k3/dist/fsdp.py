"""The ``fsdp2`` plan: dense part and experts sharded over the world with FSDP2 ``fully_shard``.

Units (``shard_model``): every fused experts module, every instance of a class the model lists in
``_no_split_modules`` (the decoder layers: Hugging Face's own wrap boundary, inside which the remote
code reads child weights directly, e.g. ``conv.weight`` and the attention-residual ``proj.weight``), and
the root for the rest (embeddings, final norms, ``lm_head``). Each unit's parameters are ``Shard(0)``
DTensors (torch.chunk rows: ``ceil(n/world)`` per rank, trailing ranks may hold fewer or none); a
unit all-gathers them for its forward and reshards right after (``reshard_after_forward=True``, the
root included), so the full weights of one layer exist only while that layer runs.

Mixed dtypes in one unit (the Kimi decoder layer holds fp32 ``A_log``/``dt_bias``/
``e_score_correction_bias`` next to bf16 weights): FSDP2 insists on one dtype only for parameters
that require grad, and all-gathers a mixed group as bytes. Post-training quantization never trains,
so every parameter is frozen before sharding and the source dtypes are kept as they are.

Everything else here is what the generic code needs to read a sharded tensor without gathering it:
which rows this rank holds (``local_rows``/``local_experts``), the full-tensor amax of a sharded
weight (``full_amax``: local amax, then an all-reduce or a gather of ``[E]``), a dim-0 gather
(``gather_rows``) and a gather of one tensor to the rank that exports it (``gather_to_owner``).
Every function is the identity (no collective) for plain tensors, so callers write one path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..spec import ModelSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

AMAX_ROWS_PER_PASS = 16

__all__ = [
    "check_partition",
    "full_amax",
    "gather_rows",
    "gather_to_owner",
    "is_sharded",
    "local_experts",
    "local_rows",
    "local_tensor",
    "row_gatherer",
    "shard_model",
    "shard_units",
]


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``t`` (``t`` itself when it is not sharded). Writes go to FSDP's storage."""
    return t.to_local() if isinstance(t, DTensor) else t


def _mesh_info(t: DTensor) -> tuple[int, int, dist.ProcessGroup]:
    if len(t.placements) != 1 or t.placements[0] != Shard(0):
        raise ValueError(f"expected a 1-D mesh with Shard(0), got placements {t.placements}")
    mesh = t.device_mesh
    return mesh.get_local_rank(), mesh.size(), mesh.get_group()


def local_rows(t: torch.Tensor) -> range:
    """The dim-0 indices of ``t`` this rank holds: all of them unless ``t`` is a Shard(0) DTensor."""
    if not isinstance(t, DTensor):
        return range(t.shape[0])
    rank, world, _ = _mesh_info(t)
    n = t.shape[0]
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    rows = range(start, min(start + chunk, n))
    if len(rows) != t.to_local().shape[0]:
        raise RuntimeError(f"FSDP shard of {list(t.shape)} holds {t.to_local().shape[0]} rows, expected {len(rows)}")
    return rows


def local_experts(module: nn.Module, spec: ModelSpec) -> range:
    """Global ids of the experts of a fused experts module that this rank holds.

    Expert parallel: the module's placement block. FSDP2: the rows of its sharded expert dimension (the
    spec's expert dimension must be 0, checked by the plan).
    """
    return module.placement.global_ids(local_rows(getattr(module, next(iter(spec.experts.sharded_params)))))


def gather_rows(local: torch.Tensor, like: DTensor) -> torch.Tensor:
    """Concatenate every rank's ``local`` (its rows of ``like``'s dim 0) into ``like.shape[0]`` rows, on all ranks."""
    _, world, pg = _mesh_info(like)
    n = like.shape[0]
    chunk = -(-n // world)
    padded = local.new_zeros((chunk, *local.shape[1:]))
    padded[: local.shape[0]] = local
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=pg)
    return torch.cat(out)[:n]


def row_gatherer(t: torch.Tensor):
    """``gather_rows`` bound to ``t`` when it is sharded, else None (nothing to gather)."""
    if not isinstance(t, DTensor):
        return None
    return lambda local: gather_rows(local, t)


@torch.no_grad()
def full_amax(t: torch.Tensor, reduce_dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """``|t|.amax(reduce_dims)`` of the FULL tensor, in fp32, the same on every rank.

    Per-tensor (``reduce_dims`` None): local amax, then all-reduce max. Per-row (dim 0 kept, e.g. one
    amax per expert): local amax over ``reduce_dims``, then the ``[n]`` rows gathered. Collective
    when ``t`` is sharded; an empty local shard contributes 0 (``|x| >= 0``).
    """
    if not isinstance(t, DTensor):
        if reduce_dims is None:
            return t.detach().float().abs().amax()
        if 0 in reduce_dims:
            return t.detach().float().abs().amax(dim=reduce_dims)
        # Per row (e.g. per expert), a few rows at a time: the fp32 copy stays small next to the weight.
        return torch.cat([r.float().abs().amax(dim=reduce_dims) for r in t.detach().split(AMAX_ROWS_PER_PASS)])
    _, _, pg = _mesh_info(t)
    x = t.to_local().detach().float().abs()
    if reduce_dims is None:
        value = x.amax() if x.numel() else x.new_zeros(())
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=pg)
        return value
    if 0 in reduce_dims:
        raise ValueError("full_amax keeps the sharded dim 0; reduce over the other dims or all of them")
    value = x.amax(dim=reduce_dims) if x.numel() else x.new_zeros(x.shape[0])
    return gather_rows(value, t)


def gather_to_owner(t: torch.Tensor, owner: int) -> torch.Tensor | None:
    """The full ``t`` on rank ``owner`` (None elsewhere); collective when ``t`` is sharded.

    Memory: the owner holds one full tensor at a time (the largest dense weight bounds it); the other
    ranks only send their rows. A plain tensor is returned as is on every rank, with no communication.
    """
    if not isinstance(t, DTensor):
        return t.detach()
    rank, world, pg = _mesh_info(t)
    n = t.shape[0]
    chunk = -(-n // world)
    local = t.to_local().detach()
    padded = local.new_zeros((chunk, *local.shape[1:]))
    padded[: local.shape[0]] = local
    out = [torch.empty_like(padded) for _ in range(world)] if rank == owner else None
    dist.gather(padded, out, group_dst=owner, group=pg)
    return torch.cat(out)[:n] if rank == owner else None


def shard_units(model: nn.Module, spec: ModelSpec, *, experts: bool = True) -> list[str]:
    """Names of the modules that become FSDP2 units (children before parents), the root excluded.

    ``experts=False``: the fused experts modules are left out (expert parallelism holds them).
    """
    no_split = set()
    for module in model.modules():
        no_split.update(getattr(module, "_no_split_modules", None) or ())
    units = [
        name
        for name, module in model.named_modules()
        if name and ((experts and spec.is_experts_module(name, module)) or type(module).__name__ in no_split)
    ]
    return units[::-1]  # named_modules is pre-order: reversed, every unit comes after the units inside it


def shard_model(model: nn.Module, mesh: DeviceMesh, spec: ModelSpec, *, shard_experts: bool = True) -> list[str]:
    """Apply ``fully_shard`` over the 1-D ``mesh`` (``Placement.fsdp_mesh``) to the units and the root of a
    meta-built model; returns the unit names.

    Call before ``model.to_empty(device=...)``; the parameters are then empty local shards to fill.
    ``shard_experts=False`` (expert parallel with an FSDP2 dense part): the experts' parameters stay
    plain tensors, ignored by every unit, and all-to-all serves them as usual.
    """
    from torch.distributed.fsdp import fully_shard

    for param in model.parameters():
        param.requires_grad_(False)  # PTQ never trains; lets one unit hold fp32 and bf16 (see module doc)
    units = shard_units(model, spec, experts=shard_experts)
    modules = dict(model.named_modules())
    ignored: set[nn.Parameter] = set()
    if not shard_experts:
        for module in spec.experts_modules(model).values():
            ignored.update(module.parameters())
    for name in units:
        fully_shard(modules[name], mesh=mesh, reshard_after_forward=True, ignored_params=ignored or None)
    # The root owns what no unit holds; resharded after forward too (FSDP2 keeps a root's gathered for training).
    fully_shard(model, mesh=mesh, reshard_after_forward=True, ignored_params=ignored or None)
    return units


def check_partition(model: nn.Module) -> None:
    """Every element of every sharded parameter is held by exactly one rank (rows over ranks add up).

    One all-reduce of the per-parameter local row counts. Together with the loader's per-rank checks
    (each local shard read once, at the rows ``local_rows`` names) this proves every element was filled once.
    """
    sharded = [(name, p) for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if not sharded:
        return
    _, _, pg = _mesh_info(sharded[0][1])
    counts = torch.tensor([len(local_rows(p)) for _, p in sharded], dtype=torch.int64)
    dist.all_reduce(counts, group=pg)
    wrong = [f"{name} ({int(c)} of {p.shape[0]} rows)" for (name, p), c in zip(sharded, counts) if int(c) != p.shape[0]]
    if wrong:
        raise RuntimeError(f"FSDP2 shards do not cover these parameters exactly once: {', '.join(wrong[:8])}")
