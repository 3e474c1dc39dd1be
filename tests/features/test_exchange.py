"""`ShardedTier` alone (the exchange of `datapath.features.exchange`): 2 and 3 gloo processes, one shard each."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from datapath.apps import init_distributed, launch
from datapath.features import new_exchange_group
from datapath.features.exchange import ShardedTier
from datapath.graph import ShardLayout

N, F = 1000, 7  # 28-byte rows


def _table() -> torch.Tensor:
    return torch.randn(N, F, generator=torch.Generator().manual_seed(1))


def _ids(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s requests: random ids of the whole table (repeats, 2-D), uneven sizes, some empty."""
    g = torch.Generator().manual_seed(20 + rank)
    sizes = [0, 3, 400, 1, 0, 1000, 57]
    out = [torch.randint(0, N, (sizes[(i + rank) % len(sizes)],), generator=g) for i in range(len(sizes))]
    out.append(torch.randint(0, N, (6, 5), generator=g))
    return out


def _exchange_in_pieces() -> dict:
    ctx = init_distributed("cpu")
    layout = ShardLayout.even(N, ctx.world_size)
    lo, hi = layout.rows(ctx.rank)
    # pieces of ~64 bytes: every exchange with more than 2 rows for a rank goes in up to 4 pieces
    tier = ShardedTier(_table()[lo:hi], layout, ctx.rank, new_exchange_group(), torch.device("cpu"), piece_bytes=64)
    equal = [torch.equal(tier.exchange(ids), _table()[ids.reshape(-1)]) for ids in _ids(ctx.rank)]  # (k, F)
    return {"equal": equal, "stats": tier.stats.as_dict(1), "lo_hi": (lo, hi)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_exchange_in_pieces_returns_the_rows_and_counts_them(world: int) -> None:
    res = launch(_exchange_in_pieces, world)
    for r, out in enumerate(res):
        assert all(out["equal"]), (r, out["equal"])
        lo, hi = out["lo_hi"]
        st = out["stats"]
        mine = [ids.reshape(-1) for ids in _ids(r)]
        received = sum(int(((ids < lo) | (ids >= hi)).sum()) for ids in mine)  # rows other ranks hold
        sent = sum(int(((ids >= lo) & (ids < hi)).sum()) for q in range(world) if q != r
                   for ids in (i.reshape(-1) for i in _ids(q)))  # rows of this shard the other ranks asked for
        assert st["exchanges"] == len(mine)
        assert st["received_rows"] == received and st["received_bytes"] == received * F * 4
        assert st["sent_rows"] == sent and st["sent_bytes"] == sent * F * 4
        assert st["id_bytes"] == (received + sent) * 4  # int32 row numbers, each way
        assert st["rows"] == sum(ids.numel() for ids in mine)  # every row asked for, its own shard's included


def _fail_before_the_exchange() -> list[str]:
    init_distributed("cpu")
    rank = dist.get_rank()
    layout = ShardLayout.even(N, 2)
    lo, hi = layout.rows(rank)
    tier = ShardedTier(_table()[lo:hi], layout, rank, new_exchange_group(), torch.device("cpu"))
    said = []
    for ids in ([5, 700], "not a tensor" if rank == 1 else [700, 5], [999, 0]):
        try:
            rows = tier.exchange(torch.tensor(ids) if isinstance(ids, list) else ids)
            said.append("ok" if torch.equal(rows, _table()[ids]) else "wrong rows")
        except Exception as exc:  # noqa: BLE001 - the test reads it
            said.append(f"{type(exc).__name__}: {exc}")
    return said


@pytest.mark.slow
def test_a_rank_failing_before_the_exchange_stops_the_others_naming_it() -> None:
    t0 = time.perf_counter()
    r0, r1 = launch(_fail_before_the_exchange, 2)
    assert r0[0] == r1[0] == "ok" and r0[2] == r1[2] == "ok"  # the group still pairs up afterwards
    assert r1[1].startswith("AttributeError")
    assert r0[1] == "ShardExchangeError: rank 0 of 2 stops: rank 1 could not fetch its feature rows (see its own error)"
    assert time.perf_counter() - t0 < 60  # rank 0 did not wait out the group's timeout
