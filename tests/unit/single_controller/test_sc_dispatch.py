"""DP_COMPUTE_PROTO dispatch logic without Ray: split / gather order, padding, SP layouts."""

from __future__ import annotations

import pytest
import torch

from rlhf_ops.protocol import DataProto
from workers.single_controller.dispatch import (
    DPLayout,
    DPRankInfo,
    collect_dp_outputs,
    gather_from_dp,
    sequence_parallel_rank_info,
    split_args_for_dp,
    split_for_dp,
)


def _batch(n: int) -> DataProto:
    """Row i holds x = [i, 10 * i] and uid = f"u{i}", so every row is recognisable after a round trip."""
    x = torch.stack([torch.arange(n), 10 * torch.arange(n)], dim=1)
    return DataProto.from_dict({"x": x}, non_tensors={"uid": [f"u{i}" for i in range(n)]})


def _rows(data: DataProto) -> list[int]:
    assert data.batch is not None
    return data.batch["x"][:, 0].tolist()


@pytest.mark.parametrize(
    ("n", "dp", "pad", "chunks"),
    [
        # 5 rows, dp 2: pad 1 by repeating row 0 -> [0 1 2 | 3 4 0]
        (5, 2, 1, [[0, 1, 2], [3, 4, 0]]),
        # 5 rows, dp 4: pad 3 by repeating rows 0-2 -> 8 rows in chunks of 2
        (5, 4, 3, [[0, 1], [2, 3], [4, 0], [1, 2]]),
        # 7 rows, dp 2: pad 1 -> [0 1 2 3 | 4 5 6 0]
        (7, 2, 1, [[0, 1, 2, 3], [4, 5, 6, 0]]),
        # 7 rows, dp 4: pad 1 -> chunks of 2
        (7, 4, 1, [[0, 1], [2, 3], [4, 5], [6, 0]]),
        # 2 rows, dp 4 (fewer rows than ranks): pad 2, rows repeat cyclically
        (2, 4, 2, [[0], [1], [0], [1]]),
        # already divisible: no padding
        (4, 2, 0, [[0, 1], [2, 3]]),
    ],
)
def test_split_pads_with_leading_rows_and_chunks_in_order(n: int, dp: int, pad: int, chunks: list[list[int]]) -> None:
    parts, pad_size = split_for_dp(_batch(n), dp)
    assert pad_size == pad
    assert [_rows(p) for p in parts] == chunks


@pytest.mark.parametrize(("n", "dp"), [(5, 2), (5, 4), (7, 2), (7, 4), (1, 4), (6, 3)])
def test_gather_inverts_split_exactly(n: int, dp: int) -> None:
    data = _batch(n)
    parts, pad_size = split_for_dp(data, dp)
    back = gather_from_dp(parts, pad_size)
    assert len(back) == n
    assert back.batch is not None and data.batch is not None
    assert torch.equal(back.batch["x"], data.batch["x"])
    assert back.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(n)]


def test_gather_keeps_each_chunks_result_in_input_row_order() -> None:
    # 5 rows over dp 2: chunk 0 = rows [0, 1, 2], chunk 1 = rows [3, 4, 0(pad)].
    # Each "rank" adds 100 * dp_rank to x[:, 0]: rows 0-2 -> +0, rows 3-4 -> +100; the pad row is dropped.
    parts, pad_size = split_for_dp(_batch(5), 2)
    outs = []
    for dp_rank, part in enumerate(parts):
        assert part.batch is not None
        y = part.batch["x"][:, 0] + 100 * dp_rank
        outs.append(DataProto.from_dict({"y": y}, non_tensors={"uid": part.non_tensor_batch["uid"]}))
    back = gather_from_dp(outs, pad_size)
    assert back.batch is not None
    assert back.batch["y"].tolist() == [0, 1, 2, 103, 104]
    assert back.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3", "u4"]


def test_split_rejects_empty_batch_and_bad_dp_size() -> None:
    with pytest.raises(ValueError, match="dp_size=0"):
        split_for_dp(_batch(3), 0)
    empty = DataProto.from_dict({"x": torch.zeros(0, 2)})
    with pytest.raises(ValueError, match="empty DataProto"):
        split_for_dp(empty, 2)


def test_split_args_splits_every_dataproto_and_broadcasts_the_rest() -> None:
    data, other = _batch(5), _batch(5)
    per_dp, pad_size = split_args_for_dp((data, 7), {"ref": other, "flag": True}, dp_size=2)
    assert pad_size == 1
    assert len(per_dp) == 2
    (args1, kwargs1) = per_dp[1]
    assert _rows(args1[0]) == [3, 4, 0] and args1[1] == 7
    assert _rows(kwargs1["ref"]) == [3, 4, 0] and kwargs1["flag"] is True


def test_split_args_errors_name_the_problem() -> None:
    with pytest.raises(TypeError, match="at least one DataProto"):
        split_args_for_dp((1, 2), {}, dp_size=2)
    with pytest.raises(ValueError, match="same length"):
        split_args_for_dp((_batch(5),), {"other": _batch(4)}, dp_size=2)


def _sp_layout(world_size: int, *, sp_size: int) -> DPLayout:
    """What RayWorkerGroup.dp_layout builds: every rank reports sequence_parallel_rank_info (Worker.dp_info)."""
    return DPLayout(
        tuple(sequence_parallel_rank_info(r, world_size=world_size, sp_size=sp_size) for r in range(world_size))
    )


def test_sequence_parallel_ranks_share_a_chunk_and_one_is_collected() -> None:
    # world 4, sp 2: ranks (0, 1) form dp group 0, ranks (2, 3) dp group 1; sp_rank 0 is collected.
    layout = _sp_layout(4, sp_size=2)
    assert layout.dp_size == 2
    assert [layout.dp_rank_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert layout.collect_ranks() == [0, 2]
    assert sequence_parallel_rank_info(3, world_size=4, sp_size=2) == DPRankInfo(
        dp_rank=1, dp_size=2, is_collect_rank=False
    )
    plain = _sp_layout(3, sp_size=1)  # plain data parallelism
    assert [plain.dp_rank_of(r) for r in range(3)] == [0, 1, 2] and plain.collect_ranks() == [0, 1, 2]


def test_sequence_parallel_size_must_divide_world_size() -> None:
    with pytest.raises(ValueError, match="sp_size=3 must be >= 1 and divide world_size=4"):
        sequence_parallel_rank_info(0, world_size=4, sp_size=3)


@pytest.mark.parametrize(
    ("infos", "match"),
    [
        # two collect ranks for dp_rank 0, none for dp_rank 1
        ([(0, 2, True), (0, 2, True)], "exactly one collect rank"),
        ([(0, 2, True), (1, 3, True)], "dp_size=3"),
        ([(0, 1, True), (1, 1, False)], "outside"),
    ],
)
def test_layout_rejects_inconsistent_rank_reports(infos: list[tuple[int, int, bool]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DPLayout(tuple(DPRankInfo(dp_rank=d, dp_size=s, is_collect_rank=c) for d, s, c in infos))


def test_collect_with_sequence_parallel_keeps_one_result_per_group() -> None:
    # world 4, sp 2, batch 5: dp chunks [0 1 2] -> ranks 0, 1 and [3 4 0] -> ranks 2, 3.
    layout = _sp_layout(4, sp_size=2)
    per_dp, pad_size = split_args_for_dp((_batch(5),), {}, dp_size=layout.dp_size)
    outputs = []
    for rank in range(4):
        chunk = per_dp[layout.dp_rank_of(rank)][0][0]
        assert chunk.batch is not None
        # every rank adds its global rank: collected ranks 0 and 2 give rows 0-2 (+0) and rows 3-4 (+2)
        outputs.append(DataProto.from_dict({"y": chunk.batch["x"][:, 0] + rank}))
    gathered = collect_dp_outputs(outputs, layout, pad_size=pad_size, method="compute")
    assert gathered.batch is not None
    assert gathered.batch["y"].tolist() == [0, 1, 2, 5, 6]


def test_collect_requires_dataproto_from_collect_ranks() -> None:
    layout = _sp_layout(2, sp_size=2)
    # rank 1 is not collected, so its non-DataProto output is ignored; rank 0's must be a DataProto
    ok = collect_dp_outputs([_batch(2), None], layout, pad_size=0, method="m")
    assert _rows(ok) == [0, 1]
    with pytest.raises(TypeError, match=r"update_actor is registered with Dispatch.DP_COMPUTE_PROTO.*rank 0 returned"):
        collect_dp_outputs([{"loss": 1.0}, None], layout, pad_size=0, method="update_actor")
