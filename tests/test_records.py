"""Bus records: round trips, schema versions, tolerance of unknown fields."""

import json

import msgspec
import pytest

from bus import SCHEMA_VERSION, Sample, Segment, SessionEvent, Trajectory, Turn, WeightUpdate, decode, encode


def make_turn(**overrides) -> Turn:
    fields = dict(
        id="t1", session_id="s1", turn_index=0, model="tiny",
        messages=[{"role": "user", "content": "hi"}], response={"role": "assistant", "content": "yo"},
        prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.1, -0.2], output_versions=[3, 4],
        finish_reason="stop",
    )
    fields.update(overrides)
    return Turn(**fields)


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
