"""The all-to-all permutation of ``torch_a2a`` against hand-worked index tables (CPU, no process group).

Two EP ranks, 8 global experts (4 per rank), top-2, 3 tokens per rank. The exchange is simulated by
splitting every rank's send buffer by its send counts and concatenating, per receiver, in sender order
(what ``all_to_all_single`` does).
"""

from __future__ import annotations

import torch

from modelopt_k3.dist.a2a import dispatch_layout
from modelopt_k3.dist.placement import ExpertPlacement

PLACEMENTS = [ExpertPlacement(8, ep_size=2, ep_rank=r) for r in range(2)]
ROUTING = [
    torch.tensor([[5, 1], [0, 6], [7, 4]]),  # rank 0: pairs (token, slot) flat = [5, 1, 0, 6, 7, 4]
    torch.tensor([[2, 3], [3, 6], [1, 0]]),  # rank 1: flat = [2, 3, 3, 6, 1, 0]
]

# Hand-worked. Rank 0: owners of [5,1,0,6,7,4] = [1,0,0,1,1,1] -> rank 0's pairs 1, 2 first, then 0, 3, 4, 5.
# Rank 1: owners of [2,3,3,6,1,0] = [0,0,0,1,0,0] -> pairs 0, 1, 2, 4, 5 to rank 0, then pair 3 to rank 1.
EXPECTED_ORDER = [[1, 2, 0, 3, 4, 5], [0, 1, 2, 4, 5, 3]]
EXPECTED_TOKEN_ROWS = [[0, 1, 0, 1, 2, 2], [0, 0, 1, 2, 2, 1]]
EXPECTED_OWNER_LOCAL_IDS = [[1, 0, 1, 2, 3, 0], [2, 3, 3, 1, 0, 2]]
EXPECTED_SEND_COUNTS = [[2, 4], [5, 1]]
# Received, per receiver in sender order: counts [from rank 0, from rank 1] and the owner-local ids.
EXPECTED_RECV_COUNTS = [[2, 5], [4, 1]]
EXPECTED_RECV_IDS = [[1, 0, 2, 3, 3, 1, 0], [1, 2, 3, 0, 2]]
# restore(): the row received back in send position j lands at pair order[j]; i.e. pair p reads send
# position inverse[p].
EXPECTED_INVERSE = [[2, 0, 1, 3, 4, 5], [0, 1, 2, 5, 3, 4]]


def _all_to_all(send: list[torch.Tensor], counts: list[list[int]]) -> list[torch.Tensor]:
    """Rank r receives, in sender order, sender s's chunk r (``counts[s]`` splits sender s's buffer)."""
    chunks = [list(torch.split(buf, c)) for buf, c in zip(send, counts)]
    return [torch.cat([chunks[s][r] for s in range(len(send))]) for r in range(len(send))]


def test_dispatch_layout_matches_the_hand_worked_tables() -> None:
    layouts = [dispatch_layout(ids, p) for ids, p in zip(ROUTING, PLACEMENTS)]
    for r, layout in enumerate(layouts):
        assert layout.order.tolist() == EXPECTED_ORDER[r]
        assert layout.token_rows.tolist() == EXPECTED_TOKEN_ROWS[r]
        assert layout.owner_local_ids.tolist() == EXPECTED_OWNER_LOCAL_IDS[r]
        assert layout.send_counts.tolist() == EXPECTED_SEND_COUNTS[r]
        marks = torch.arange(6)  # restore() puts send position j back at pair order[j]
        assert layout.restore(marks).tolist() == EXPECTED_INVERSE[r]

    send_counts = [lay.send_counts.tolist() for lay in layouts]
    recv_counts = [[send_counts[s][r] for s in range(2)] for r in range(2)]
    assert recv_counts == EXPECTED_RECV_COUNTS
    recv_ids = _all_to_all([lay.owner_local_ids for lay in layouts], send_counts)
    assert [t.tolist() for t in recv_ids] == EXPECTED_RECV_IDS


def test_simulated_exchange_equals_one_process_routing() -> None:
    """Tokens sent, run by their owner's local experts, sent back and restored equal a one-process run."""
    torch.manual_seed(0)
    hidden = [torch.randn(3, 5) for _ in range(2)]
    scale = torch.arange(1, 9, dtype=torch.float32)  # expert e multiplies by e + 1: every id is visible

    layouts = [dispatch_layout(ids, p) for ids, p in zip(ROUTING, PLACEMENTS)]
    send_counts = [lay.send_counts.tolist() for lay in layouts]
    recv_counts = [[send_counts[s][r] for s in range(2)] for r in range(2)]
    recv_x = _all_to_all([h[lay.token_rows] for h, lay in zip(hidden, layouts)], send_counts)
    recv_ids = _all_to_all([lay.owner_local_ids for lay in layouts], send_counts)
    outputs = [x * scale[PLACEMENTS[r].local.start + ids].unsqueeze(1) for r, (x, ids) in enumerate(zip(recv_x, recv_ids))]
    back = _all_to_all(outputs, recv_counts)

    for r, layout in enumerate(layouts):
        per_slot = layout.restore(back[r]).view(3, 2, 5)
        expected = hidden[r].unsqueeze(1) * scale[ROUTING[r]].unsqueeze(-1)
        assert torch.equal(per_slot, expected)


def test_expert_placement_answers_ownership_once() -> None:
    p = ExpertPlacement(8, ep_size=4, ep_rank=2, writes_experts=False)
    assert p.per_rank == 2
    assert p.local == range(4, 6) and p.local_range(0) == range(0, 2) and p.local_range(3) == range(6, 8)
    assert [p.owner(e) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert p.owner(torch.tensor([7, 0, 5])).tolist() == [3, 0, 2]
    assert p.global_ids(range(0, 2)) == range(4, 6) and p.global_ids(range(1, 2)) == range(5, 6)
    assert ExpertPlacement(8).local == range(8)
