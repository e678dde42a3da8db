"""Bus records: round trips, schema versions, tolerance of unknown fields."""

import array
import json
import pickle
import struct

import msgspec
import pytest

from flywheel.bus import (
    SCHEMA_VERSION,
    Sample,
    Segment,
    SessionEvent,
    Trajectory,
    Turn,
    WeightUpdate,
    decode,
    encode,
)
from flywheel.bus.arrays import Float64s, Int32s

from factories import make_turn


def test_turn_round_trip_keeps_exact_tokens():
    turn = make_turn()
    back = decode(encode(turn), Turn)
    assert back == turn
    assert back.output_ids == [4, 5] and back.output_logprobs == [-0.1, -0.2]
    assert back.oldest_version == 3
    assert back.schema == SCHEMA_VERSION


def test_nested_records_round_trip():
    seg = Segment(token_ids=[1, 2, 4], loss_mask=[0, 0, 1], logprobs=[0, 0, -0.5], versions=[-1, -1, 2], turn_spans=[(0, 2, 3)])
    traj = Trajectory(id="s1#x", session_id="s1", segments=[seg], turns=[make_turn()], close_reason="feedback",
                      feedback=[SessionEvent(id="e", session_id="s1", kind="feedback", reward=1.0)])
    sample = Sample(id="s1#x", trajectory=traj, reward=1.0, judge="rule")
    back = decode(encode(sample), Sample)
    assert back == sample
    assert back.trajectory.oldest_version == 2
    assert back.trajectory.num_sampled_tokens == 1
    update = WeightUpdate(id="w1", version=7, path="/x/v7", step=7)
    assert decode(encode(update), WeightUpdate) == update


def test_unknown_fields_are_ignored_and_newer_schemas_rejected():
    raw = msgspec.msgpack.decode(encode(make_turn()))
    raw["added_later"] = {"anything": 1}
    assert decode(msgspec.msgpack.encode(raw), Turn).id == "t1"
    raw["schema"] = SCHEMA_VERSION + 1
    with pytest.raises(msgspec.ValidationError, match="schema"):
        decode(msgspec.msgpack.encode(raw), Turn)


def test_malformed_records_raise_validation_errors():
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"id": "x", "session_id": 5}), SessionEvent)
    with pytest.raises(msgspec.DecodeError):
        decode(b"\xc1 not msgpack", SessionEvent)


def test_json_codec_for_files_and_people_round_trips_exactly():
    turn = make_turn(output_logprobs=[-0.1234567890123, -1e-300])
    assert json.loads(encode(turn, "json"))["output_logprobs"] == turn.output_logprobs
    assert decode(encode(turn, "json"), Turn, "json") == turn == decode(encode(turn), Turn)


def test_token_arrays_travel_as_raw_bytes_and_behave_like_lists():
    turn = make_turn(prompt_ids=list(range(1000)), output_logprobs=[-0.1, -2.5e-7])
    assert isinstance(turn.prompt_ids, Int32s) and isinstance(turn.output_logprobs, Float64s)
    raw = msgspec.msgpack.decode(encode(turn))
    assert raw["prompt_ids"] == array.array("i", range(1000)).tobytes()  # one bin, not 1000 ints
    assert raw["output_logprobs"] == struct.pack("<2d", -0.1, -2.5e-7)  # exact float64
    back = decode(encode(turn), Turn)
    assert back.prompt_ids == list(range(1000)) and back.prompt_ids[:3] == Int32s([0, 1, 2])
    assert back.prompt_ids != list(range(999)) and back.output_versions == (3, 4)
    assert pickle.loads(pickle.dumps(back.output_logprobs)) == [-0.1, -2.5e-7]  # Ray pickles records
    assert type(pickle.loads(pickle.dumps(back.output_logprobs))) is Float64s


def test_records_with_lists_for_arrays_still_decode():
    """Schema 1 wrote per-token fields as lists; both codecs still read them."""
    raw = msgspec.msgpack.decode(encode(make_turn()))
    raw.update(schema=1, prompt_ids=[7, 8], output_logprobs=[-1.5, -0.25])
    old = decode(msgspec.msgpack.encode(raw), Turn)
    assert old.prompt_ids == [7, 8] and old.output_logprobs == [-1.5, -0.25] and isinstance(old.prompt_ids, Int32s)


def test_malformed_arrays_are_validation_errors():
    raw = msgspec.msgpack.decode(encode(make_turn()))
    for bad in (b"\x01\x02\x03", ["x"], [2**40], "text"):
        raw["prompt_ids"] = bad
        with pytest.raises(msgspec.ValidationError):
            decode(msgspec.msgpack.encode(raw), Turn)


def test_a_sample_carries_its_trajectory_or_refers_to_it():
    referring = Sample(id="s1#x", trajectory_seq=12, reward=0.5, judge="rule")
    assert decode(encode(referring), Sample) == referring
    for neither_or_both in ({}, {"trajectory_seq": 3, "trajectory": Trajectory(
            id="s1#x", session_id="s1", segments=[], turns=[], close_reason="done")}):
        with pytest.raises(ValueError, match="exactly one"):
            Sample(id="s1#x", reward=0.5, judge="rule", **neither_or_both)
