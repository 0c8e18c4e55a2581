"""The experts base (``modelopt_k3/experts/base.py``) on a toy model: the eager loop equals a dense per-token
reference (with and without biases, with the down-input hook), ``place`` keeps the right rows at EP degree 2,
a placed rank computes its experts' pairs bit for bit as the whole module does, and ``dist/`` imports
nothing of the experts layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers.integrations.moe import use_experts_implementation

import modelopt_k3
from modelopt_k3.dist.placement import ExpertPlacement
from modelopt_k3.experts import FusedExperts
from modelopt_k3.experts.packed import implementation

E, H, I, N, K = 4, 8, 6, 7, 2  # noqa: E741 - the shape legend of experts/base.py


def _toy(has_bias: bool):
    @use_experts_implementation(has_bias=has_bias)
    class Toy(FusedExperts):
        def __init__(self, config) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(3)
            self.num_experts, self.hidden_dim, self.intermediate_dim = E, H, I
            self.placement = ExpertPlacement(E)
            self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64))
            self.down_proj = torch.nn.Parameter(torch.randn(E, H, I, generator=g, dtype=torch.float64))
            if has_bias:
                self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(E, 2 * I, generator=g, dtype=torch.float64))
                self.down_proj_bias = torch.nn.Parameter(torch.randn(E, H, generator=g, dtype=torch.float64))

        def activation(self, gate_up: torch.Tensor) -> torch.Tensor:  # a trivial gate: gate * up
            gate, up = gate_up.chunk(2, dim=-1)
            return gate * up

    config = type("Cfg", (), {"_experts_implementation": "eager"})()
    return Toy(config)


def _routing(seed: int = 0, num_experts: int = E) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:K] for _ in range(N)])
    weights = torch.rand(N, K, generator=g)
    return x, ids, weights


def _dense_reference(m: FusedExperts, x, ids, weights, hook=lambda h: h) -> torch.Tensor:
    """Per token, per slot: down(hook(act(gate_up x + b)) + b), weighted, summed (float64; the base combines
    in fp32, hence the tolerance: a wrong expert, row, bias or weight is off by O(1))."""
    out = torch.zeros(N, H, dtype=torch.float64)
    for t in range(N):
        for j in range(K):
            e = int(ids[t, j])
            gu = m.gate_up_proj[e] @ x[t] + (m.gate_up_proj_bias[e] if m.has_bias else 0)
            h = hook(gu[:I] * gu[I:])
            y = m.down_proj[e] @ h + (m.down_proj_bias[e] if m.has_bias else 0)
            out[t] += float(weights[t, j]) * y
    return out


@pytest.mark.parametrize("has_bias", [False, True])
def test_eager_loop_equals_dense_reference(has_bias: bool) -> None:
    m = _toy(has_bias)
    x, ids, weights = _routing()
    with torch.no_grad():
        got = m(x, ids, weights)
        torch.testing.assert_close(got, _dense_reference(m, x, ids, weights), rtol=1e-6, atol=1e-5)
        m.down_input_hook = lambda h: h * 3.0  # the declared point: between the activation and down_proj
        got = m(x, ids, weights)
        torch.testing.assert_close(got, _dense_reference(m, x, ids, weights, lambda h: h * 3.0), rtol=1e-6, atol=1e-5)


def test_eager_is_the_unwrapped_forward_and_uses_the_module_combine() -> None:
    m = _toy(False)
    assert implementation(m, "eager") is FusedExperts.forward  # below the interface dispatch
    x, ids, weights = _routing()
    seen = []
    m.combine = lambda per_slot, i, w, dtype: seen.append(per_slot.shape) or per_slot.sum(1).to(dtype)
    with torch.no_grad():
        m(x, ids, weights)
    assert seen == [torch.Size([N, K, H])]


@pytest.mark.parametrize("has_bias", [False, True])
def test_place_keeps_each_ranks_rows_at_ep2(has_bias: bool) -> None:
    whole = _toy(has_bias)
    names = ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if has_bias else ())
    assert whole.fused_params == names
    for rank, rows in ((0, slice(0, 2)), (1, slice(2, 4))):
        m = _toy(has_bias)
        m.place(ExpertPlacement(E, ep_size=2, ep_rank=rank))
        for name in names:
            assert torch.equal(getattr(m, name), getattr(whole, name)[rows]), (rank, name)
            assert isinstance(m._parameters[name], torch.nn.Parameter)
        assert (len(m), m.num_experts, m.expert_offset, m.num_global_experts) == (2, 2, rows.start, E)
        assert m.extra_repr() == f"experts=2 (global {rows.start}..{rows.stop - 1} of 4), hidden=8, intermediate=6"
        with pytest.raises(ValueError, match=r"place\(\) needs a module holding all 4 experts; this one holds 2 of 4"):
            m.place(ExpertPlacement(E, ep_size=2, ep_rank=rank))


def test_placed_rank_computes_its_experts_as_the_whole_module() -> None:
    whole, rank1 = _toy(True), _toy(True)
    rank1.place(ExpertPlacement(E, ep_size=2, ep_rank=1))
    x, ids, weights = _routing(seed=1, num_experts=2)
    with torch.no_grad():  # tokens routed to experts 2 and 3 only: rank 1 sees them as local 0 and 1
        assert torch.equal(rank1(x, ids, weights), whole(x, ids + 2, weights))


def _imports(path: Path) -> set[str]:
    package = "modelopt_k3." + ".".join(path.relative_to(Path(modelopt_k3.__file__).parent).parent.parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            names.add(f"{base}.{node.module}" if node.level and node.module else base or node.module or "")
    return names


def test_dist_imports_nothing_of_the_experts_layer() -> None:
    dist_dir = Path(modelopt_k3.__file__).parent / "dist"
    upward = {
        f"{p.name}: {name}"
        for p in dist_dir.glob("*.py")
        for name in _imports(p)
        if name.startswith(("modelopt_k3.experts", "modelopt_k3.models", "modelopt_k3.packed_experts"))
    }
    assert not upward, upward
