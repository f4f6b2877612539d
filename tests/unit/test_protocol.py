"""Tests for rlhf_ops.protocol.DataProto and the padding helpers in rlhf_ops.padding."""

from __future__ import annotations

import copy
import pickle

import cloudpickle
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rlhf_ops.padding import (
    build_full_sequence,
    compute_position_ids,
    get_response_mask,
    pad_sequences_left,
)
from rlhf_ops.protocol import DataProto, DataProtoItem


def make(n: int = 5, **meta: object) -> DataProto:
    """Row i holds ids [10 i, 10 i + 1], score i / 2 and uid "u<i>"; rows are easy to identify."""
    ids = torch.arange(n * 2).reshape(n, 2) * 5  # row i: [10 i, 10 i + 5]
    return DataProto.from_dict(
        {"ids": ids, "score": torch.arange(n, dtype=torch.float32) / 2},
        non_tensors={"uid": [f"u{i}" for i in range(n)]},
        meta_info=meta or {"timing": {"gen": 0.7}},
    )


def rows(data: DataProto) -> list[int]:
    """Recovers the source row of each row of ``make`` output from the ids column."""
    assert data.batch is not None
    return (data.batch["ids"][:, 0] // 10).tolist()


def assert_same(a: DataProto, b: DataProto) -> None:
    assert a.batch is not None and b.batch is not None
    assert set(a.batch.keys()) == set(b.batch.keys())
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert a.non_tensor_batch.keys() == b.non_tensor_batch.keys()
    for key, value in a.non_tensor_batch.items():
        np.testing.assert_array_equal(value, b.non_tensor_batch[key])
    assert a.meta_info == b.meta_info


# ----------------------------------------------------------------------------------------- construction
def test_from_dict_builds_batch_columns_and_meta():
    data = make(3)
    assert len(data) == 3
    assert data.batch is not None and data.batch.batch_size == torch.Size([3])
    assert data.non_tensor_batch["uid"].dtype == object
    assert data.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2"]
    assert data.meta_info == {"timing": {"gen": 0.7}}


def test_from_dict_length_mismatch_names_both_keys():
    with pytest.raises(ValueError, match=r"'b' has 2 rows but 'a' has 3"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"'uid' has 4 rows but 'a' has 3"):
        DataProto.from_dict({"a": torch.zeros(3)}, non_tensors={"uid": ["x"] * 4})


def test_direct_construction_validates_columns_and_batch():
    td = TensorDict({"a": torch.zeros(3)}, batch_size=[3])
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] has 2 rows but the batch has 3"):
        DataProto(batch=td, non_tensor_batch={"uid": np.array(["x", "y"], dtype=object)})
    with pytest.raises(ValueError, match="batch_size \\[B\\]"):
        DataProto(batch=TensorDict({"a": torch.zeros(3, 2)}, batch_size=[3, 2]))
    nested = TensorDict({"x": TensorDict({"y": torch.zeros(3)}, batch_size=[3])}, batch_size=[3])
    with pytest.raises(ValueError, match=r"batch\['x'\].*flat tensors"):
        DataProto(batch=nested)


def test_scalar_tensor_and_bad_column_types_are_rejected():
    with pytest.raises(ValueError, match="'t' is 0-d; put batch-wide scalars in meta_info"):
        DataProto.from_dict({"t": torch.tensor(1.0)})
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] is a str"):
        DataProto.from_dict(non_tensors={"uid": "abc"})


def test_columns_of_equal_length_lists_stay_one_dimensional():
    data = DataProto.from_dict(non_tensors={"raw_prompt": [[{"role": "user"}], [{"role": "user"}]]})
    assert data.non_tensor_batch["raw_prompt"].shape == (2,)
    assert len(data) == 2 and data.batch is None


def test_meta_unknown_key_and_wrong_type():
    with pytest.raises(ValueError, match="meta_info key 'temprature' is unknown.*Add it to MetaInfo"):
        DataProto.from_dict({"a": torch.zeros(2)}, meta_info={"temprature": 1.0})
    with pytest.raises(TypeError, match=r"meta_info\['timing'\] must be"):
        DataProto.from_dict({"a": torch.zeros(2)}, meta_info={"timing": 0.7})
    # Control values are arguments now, never meta_info: the old keys are refused like a typo.
    for old in ("temperature", "global_steps", "n", "micro_batch_size"):
        with pytest.raises(ValueError, match=f"meta_info key '{old}' is unknown"):
            DataProto.from_dict({"a": torch.zeros(2)}, meta_info={old: 1})
    ok = {"timing": {"gen": 1.0}, "metrics": {}}
    assert DataProto.from_dict({"a": torch.zeros(2)}, meta_info=ok).meta_info["timing"] == {"gen": 1.0}


def test_len_without_tensors_and_empty():
    assert len(DataProto()) == 0
    assert len(DataProto.from_dict(non_tensors={"uid": ["a", "b"]})) == 2


def test_tensors_property_is_the_batch_or_a_clear_error():
    data = make(2)
    assert data.tensors is data.batch
    with pytest.raises(ValueError, match="has no tensors"):
        _ = DataProto.from_dict(non_tensors={"uid": ["a"]}).tensors


# ----------------------------------------------------------------------------------------- indexing
def test_int_index_returns_a_row_item():
    item = make()[-2]
    assert isinstance(item, DataProtoItem)
    assert item.batch is not None and item.batch["ids"].tolist() == [30, 35]
    assert item.non_tensor_batch == {"uid": "u3"} and item.meta_info == {"timing": {"gen": 0.7}}
    with pytest.raises(IndexError, match="row 5 is out of range"):
        make()[5]


def test_slice_is_a_view_and_index_forms_gather():
    data = make()
    view = data[1:3]
    assert rows(view) == [1, 2] and view.non_tensor_batch["uid"].tolist() == ["u1", "u2"]
    view.batch["ids"][0, 0] = -1  # a view: writes reach the parent
    assert data.batch["ids"][1, 0] == -1
    data = make()
    assert rows(data[[4, 0, -1]]) == [4, 0, 4]
    assert rows(data[np.array([2, 1])]) == [2, 1]
    assert data[torch.tensor([3])].non_tensor_batch["uid"].tolist() == ["u3"]
    assert rows(data[torch.tensor([True, False, True, False, False])]) == [0, 2]
    assert len(data[[]]) == 0


def test_bad_indices_raise_index_error():
    data = make()
    with pytest.raises(IndexError, match="boolean mask has 2 entries but the DataProto has 5"):
        data[np.array([True, False])]
    with pytest.raises(IndexError, match="out of range"):
        data[[0, 5]]
    with pytest.raises(IndexError, match="integers or bools"):
        data[np.array([0.5])]


def test_iteration_yields_rows():
    assert [item.non_tensor_batch["uid"] for item in make(3)] == ["u0", "u1", "u2"]


# ----------------------------------------------------------------------------------------- keys
def test_select_shares_storage_unless_deepcopy():
    data = make()
    sel = data.select(["ids"], non_tensor_batch_keys="uid", meta_info_keys=[])
    assert list(sel.batch.keys()) == ["ids"] and list(sel.non_tensor_batch) == ["uid"] and sel.meta_info == {}
    assert sel.batch["ids"].data_ptr() == data.batch["ids"].data_ptr()
    everything = data.select()
    assert set(everything.batch.keys()) == {"ids", "score"} and everything.meta_info == {"timing": {"gen": 0.7}}
    deep = data.select(deepcopy=True)
    deep.batch["ids"][0, 0] = 99
    deep.non_tensor_batch["uid"][0] = "changed"
    assert data.batch["ids"][0, 0] == 0 and data.non_tensor_batch["uid"][0] == "u0"


def test_select_missing_key_raises_key_error():
    with pytest.raises(KeyError, match="batch has no key\\(s\\) \\['values'\\]"):
        make().select(["values"])
    with pytest.raises(KeyError, match="meta_info has no key"):
        make().select(meta_info_keys=["metrics"])


def test_pop_removes_from_self_and_returns_popped():
    data = make()
    popped = data.pop(["score"], non_tensor_batch_keys=["uid"], meta_info_keys=["timing"])
    assert list(popped.batch.keys()) == ["score"] and list(popped.non_tensor_batch) == ["uid"]
    assert popped.meta_info == {"timing": {"gen": 0.7}}
    assert list(data.batch.keys()) == ["ids"] and data.non_tensor_batch == {} and data.meta_info == {}
    assert len(data) == len(popped) == 5
    with pytest.raises(KeyError):
        data.pop(["ids", "missing"])
    assert list(data.batch.keys()) == ["ids"]  # nothing removed on error


def test_rename_returns_new_and_checks_names():
    data = make()
    renamed = data.rename(["ids", "uid"], ["input_ids", "group"])
    assert set(renamed.batch.keys()) == {"input_ids", "score"} and list(renamed.non_tensor_batch) == ["group"]
    assert set(data.batch.keys()) == {"ids", "score"}  # self unchanged
    with pytest.raises(ValueError, match="already exist"):
        data.rename("ids", "score")
    with pytest.raises(KeyError):
        data.rename("nope", "x")
    with pytest.raises(ValueError, match="as many distinct new keys"):
        data.rename(["ids", "score"], ["x"])


def test_union_merges_and_accepts_equal_shared_keys():
    data = make()
    data.batch["score"][0] = float("nan")  # NaN in a shared key still counts as equal
    other = DataProto.from_dict(
        {"ids": data.batch["ids"].clone(), "score": data.batch["score"].clone(), "values": torch.ones(5)},
        non_tensors={"uid": data.non_tensor_batch["uid"].copy(), "data_source": ["s"] * 5},
        meta_info={"timing": {"gen": 0.7}, "metrics": {"x": 2}},
    )
    merged = data.union(other)
    assert set(merged.batch.keys()) == {"ids", "score", "values"}
    assert set(merged.non_tensor_batch) == {"uid", "data_source"}
    assert merged.meta_info == {"timing": {"gen": 0.7}, "metrics": {"x": 2}}
    assert set(data.batch.keys()) == {"ids", "score"}  # self unchanged
    meta_only = data.union(DataProto(meta_info={"metrics": {"x": 1}}))
    assert len(meta_only) == 5 and meta_only.meta_info["metrics"] == {"x": 1}


@pytest.mark.parametrize(
    ("other", "where"),
    [
        (DataProto.from_dict({"ids": torch.zeros(5, 2, dtype=torch.long)}), r"batch\['ids'\]"),
        (DataProto.from_dict(non_tensors={"uid": ["x"] * 5}), r"non_tensor_batch\['uid'\]"),
        (DataProto(meta_info={"timing": {"gen": 1.0}}), r"meta_info\['timing'\]"),
    ],
)
def test_union_conflict_names_the_key(other: DataProto, where: str):
    with pytest.raises(ValueError, match="union conflict on " + where):
        make().union(other)


def test_union_length_mismatch():
    with pytest.raises(ValueError, match="union needs equal lengths, got 5 and 4"):
        make().union(make(4))


# ----------------------------------------------------------------------------------------- splitting
def test_chunk_and_concat_are_inverse():
    data = make(6)
    pieces = data.chunk(3)
    assert [rows(p) for p in pieces] == [[0, 1], [2, 3], [4, 5]]
    assert [p.non_tensor_batch["uid"].tolist() for p in pieces][2] == ["u4", "u5"]
    assert_same(DataProto.concat(pieces), data)


def test_chunk_errors():
    with pytest.raises(ValueError, match=r"cannot chunk 5 rows into 2 equal parts; pad first.*pad_to_divisor\(2\)"):
        make().chunk(2)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        make().chunk(0)


def test_split_last_piece_shorter():
    assert [rows(p) for p in make().split(2)] == [[0, 1], [2, 3], [4]]
    assert make(0).split(3) == []
    with pytest.raises(ValueError, match="split_size must be >= 1"):
        make().split(0)


def test_concat_keeps_first_meta_and_merges_metrics():
    a = make(2, timing={"gen": 1.0}, metrics={"loss": 0.5, "lr": [1e-6, 2e-6]})
    b = make(3, timing={"gen": 0.2}, metrics={"loss": 0.25})
    b.non_tensor_batch["uid"] = np.array(["v0", "v1", "v2"], dtype=object)
    out = DataProto.concat([a, b])
    assert len(out) == 5 and rows(out) == [0, 1, 0, 1, 2]
    assert out.non_tensor_batch["uid"].tolist() == ["u0", "u1", "v0", "v1", "v2"]
    # timing from the first item; metrics: scalars appended, lists extended, in item order
    assert out.meta_info == {"timing": {"gen": 1.0}, "metrics": {"loss": [0.5, 0.25], "lr": [1e-6, 2e-6]}}


def test_concat_errors():
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])
    with pytest.raises(ValueError, match="concat item 1 has keys"):
        DataProto.concat([make(2), make(2).select(["ids"])])


def test_repeat_interleave_and_tile_order():
    data = make(3)
    inter = data.repeat(2)
    assert rows(inter) == [0, 0, 1, 1, 2, 2]
    assert inter.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert rows(data.repeat(2, interleave=False)) == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="repeat_times must be >= 1"):
        data.repeat(0)


def test_reorder_returns_new_permuted_batch():
    data = make(4)
    out = data.reorder(torch.tensor([2, 0, 3, 1]))
    assert rows(out) == [2, 0, 3, 1] and out.non_tensor_batch["uid"].tolist() == ["u2", "u0", "u3", "u1"]
    assert rows(data) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="permutation of range\\(4\\)"):
        data.reorder([0, 0, 1, 2])


@pytest.mark.parametrize(("divisor", "pad", "order"), [(2, 1, [0, 1, 2, 3, 4, 0]), (4, 3, [0, 1, 2, 3, 4, 0, 1, 2])])
def test_pad_to_divisor_repeats_leading_rows_and_unpad_is_exact(divisor: int, pad: int, order: list[int]):
    data = make(5)
    padded, pad_size = data.pad_to_divisor(divisor)
    assert pad_size == pad and len(padded) % divisor == 0  # 5 -> 6 for divisor 2, 5 -> 8 for divisor 4
    assert rows(padded) == order
    assert padded.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in order]
    # the dispatch round trip: pad, chunk per rank, work per chunk, concat, unpad
    outputs = [c.union(DataProto.from_dict({"double": c.batch["score"] * 2})) for c in padded.chunk(divisor)]
    result = DataProto.concat(outputs).unpad(pad_size)
    assert_same(result.select(["ids", "score"]), data)
    assert result.batch["double"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]  # score i / 2 doubled


def test_pad_to_divisor_edge_cases():
    same, pad = make(4).pad_to_divisor(2)
    assert pad == 0 and rows(same) == [0, 1, 2, 3]
    cyclic, pad = make(2).pad_to_divisor(8)
    assert pad == 6 and rows(cyclic) == [0, 1, 0, 1, 0, 1, 0, 1]
    assert make(0).pad_to_divisor(4)[1] == 0
    with pytest.raises(ValueError, match="divisor must be >= 1"):
        make().pad_to_divisor(0)
    with pytest.raises(ValueError, match=r"pad_size must be in \[0, 5\]"):
        make().unpad(6)
    assert len(make().unpad(0)) == 5


def test_to_moves_tensors():
    moved = make().to("meta")  # the meta device exercises a real move without a GPU
    assert moved.batch.device == torch.device("meta") and moved.batch["ids"].device.type == "meta"
    assert moved.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3", "u4"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_cuda_and_back():
    data = make()
    back = data.to("cuda").repeat(2).to("cpu")
    assert rows(back) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


# ----------------------------------------------------------------------------------------- pickling
@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps, copy.deepcopy])
def test_pickle_round_trip(dumps):
    data = make(timing={"gen": 0.7}, metrics={"a": [1.0]})
    blob = dumps(data)
    restored = blob if isinstance(blob, DataProto) else pickle.loads(blob)
    assert_same(restored, data)
    assert restored.batch.batch_size == torch.Size([5]) and restored.batch.device == data.batch.device


def test_pickled_chunk_ships_only_its_rows():
    data = DataProto.from_dict({"x": torch.zeros(1000, 64)})  # 256 kB
    full, piece = len(pickle.dumps(data)), len(pickle.dumps(data.chunk(10)[3]))
    assert piece < full / 5  # a chunk is 1/10 of the rows; without compaction it would pickle all 1000
    restored = pickle.loads(pickle.dumps(data[1::2]))  # a strided view is compacted too
    assert restored.batch["x"].shape == (500, 64)


def test_pickle_detaches_tensors_that_require_grad():
    leaf = torch.ones(3, requires_grad=True)
    data = DataProto.from_dict({"logp": leaf * 2})  # non-leaf: plain pickling would fail
    restored = pickle.loads(pickle.dumps(data))
    assert not restored.batch["logp"].requires_grad and restored.batch["logp"].tolist() == [2.0, 2.0, 2.0]


# ----------------------------------------------------------------------------------------- padding
def test_pad_sequences_left():
    seqs = [[1, 2, 3], [4], []]
    assert pad_sequences_left(seqs, pad_value=0).tolist() == [[1, 2, 3], [0, 0, 4], [0, 0, 0]]
    assert pad_sequences_left(seqs, pad_value=9, max_length=4).tolist() == [[9, 1, 2, 3], [9, 9, 9, 4], [9] * 4]
    floats = pad_sequences_left([torch.tensor([0.5]), torch.tensor([1.5, 2.5])], pad_value=0.0)
    assert floats.dtype == torch.float32 and floats.tolist() == [[0.0, 0.5], [1.5, 2.5]]
    with pytest.raises(ValueError, match="max_length=2 but the longest sequence has 3 tokens"):
        pad_sequences_left(seqs, pad_value=0, max_length=2)


def test_compute_position_ids_hand_worked():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    # cumsum - 1, clipped at 0: [0,0,0,1,2,2] and [0,1,2,3,3,3]
    assert compute_position_ids(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 3, 3]]


def test_get_response_mask_hand_worked():
    eos, pad = 2, 0
    responses = torch.tensor(
        [
            [5, 6, 2, pad, pad],  # EOS at 2: ones through index 2
            [2, pad, pad, pad, pad],  # EOS first: only the EOS counts
            [5, 6, 7, 8, 9],  # no EOS (truncated): all ones
            [5, 2, 7, 2, pad],  # second EOS ignored
        ]
    )
    expected = [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert get_response_mask(responses, eos_token_id=eos).tolist() == expected
    assert get_response_mask(responses, eos_token_id=eos).dtype == torch.int64
    # several EOS ids (HF generation configs): 7 also ends row 2 and row 3 already ended at index 1
    multi = get_response_mask(responses, eos_token_id=[2, 7], dtype=torch.float32)
    assert multi.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]


def test_build_full_sequence_hand_worked():
    prompts = pad_sequences_left([[11, 12], [13]], pad_value=0)  # [[11, 12], [0, 13]]
    prompt_mask = pad_sequences_left([[1, 1], [1]], pad_value=0)
    responses = torch.tensor([[21, 2, 0], [22, 23, 24]])
    response_mask = get_response_mask(responses, eos_token_id=2)  # [[1, 1, 0], [1, 1, 1]]
    full = build_full_sequence(prompts, prompt_mask=prompt_mask, responses=responses, response_mask=response_mask)
    assert full["input_ids"].tolist() == [[11, 12, 21, 2, 0], [0, 13, 22, 23, 24]]
    assert full["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert full["position_ids"].tolist() == [[0, 1, 2, 3, 3], [0, 0, 1, 2, 3]]
    data = DataProto.from_dict({**full, "prompts": prompts, "responses": responses, "response_mask": response_mask})
    assert len(data) == 2


def test_build_full_sequence_shape_errors():
    p, r = torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="prompt_mask .* must both be \\(B, P\\)"):
        build_full_sequence(p, prompt_mask=torch.zeros(2, 2), responses=r, response_mask=r)
    with pytest.raises(ValueError, match="prompts have B=2 rows but responses have B=3"):
        build_full_sequence(p, prompt_mask=p, responses=r, response_mask=r)
