"""ZDS wire format: zds.md's byte vectors both ways, the schema, validation, and a decoder fuzz."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ztwisted.inpod import wire, zds_pb2
from ztwisted.inpod.wire import (
    Ack,
    AddWorkload,
    DelWorkload,
    KeepWorkload,
    ShutdownStarting,
    SnapshotSent,
    WorkloadInfo,
    ZdsProtocolError,
)

H = bytes.fromhex

# -- zds.md's known byte strings, both directions ---------------------------------


def test_hello_vector():
    assert wire.encode_hello() == H("08 01")
    assert wire.decode_hello(H("08 01")) == wire.VERSION_V1


def test_success_ack_vector():
    assert wire.encode_ack() == H("0a 00")
    assert wire.decode_response(H("0a 00")) == Ack("")
    assert wire.decode_response(H("0a 00")).ok


def test_snapshot_sent_vector():
    assert wire.encode_request(SnapshotSent()) == H("1a 00")
    assert wire.decode_request(H("1a 00")) == SnapshotSent()


def test_del_vector_uses_field_2_inside():
    assert wire.encode_request(DelWorkload("u")) == H("12 03 12 01 75")
    assert wire.decode_request(H("12 03 12 01 75")) == DelWorkload("u")


def test_error_ack_carries_its_text():
    data = wire.encode_ack("boom")
    assert data == H("0a 06 0a 04") + b"boom"
    assert wire.decode_response(data) == Ack("boom")
    assert not wire.decode_response(data).ok


def test_add_encoding_is_byte_exact():
    add = AddWorkload("u", WorkloadInfo("n", "ns", "sa"))
    expected = H("0a 10 0a 01 75 12 0b 0a 01 6e 12 02 6e 73 1a 02 73 61")
    assert wire.encode_request(add) == expected
    assert wire.decode_request(expected) == add


def test_keep_encoding():
    assert wire.encode_request(KeepWorkload("u")) == H("2a 03 0a 01 75")
    assert wire.decode_request(H("2a 03 0a 01 75")) == KeepWorkload("u")


def test_shutdown_starting_is_field_1191():
    # tag (1191 << 3) | 2 = 9530 = varint ba 4a
    assert wire.encode_request(ShutdownStarting("u")) == H("ba 4a 03 0a 01 75")
    assert wire.decode_request(H("ba 4a 03 0a 01 75")) == ShutdownStarting("u")


def test_add_with_all_empty_workload_info_still_marks_it_present():
    data = wire.encode_request(AddWorkload("u", WorkloadInfo("", "", "")))
    assert data == H("0a 05 0a 01 75 12 00")
    assert wire.decode_request(data) == AddWorkload("u", WorkloadInfo("", "", ""))


def test_newer_agent_fields_inside_add_are_ignored():
    # istio's AddWorkload has windows_namespace = 3 (a message): an old field set we skip.
    data = H("0a 0b 0a 01 75 12 00 1a 04 0a 02 6e 73")
    assert wire.decode_request(data) == AddWorkload("u", WorkloadInfo("", "", ""))


# -- the schema is zds.md's ------------------------------------------------------------


def _fields(message):
    return {f.name: (f.number, f.type) for f in message.DESCRIPTOR.fields}


def test_schema_field_numbers():
    fd = zds_pb2.DESCRIPTOR
    assert fd.package == "istio.workload.zds"
    string, message, enum = 9, 11, 14
    assert _fields(zds_pb2.ZdsHello) == {"version": (1, enum)}
    assert _fields(zds_pb2.WorkloadInfo) == {
        "name": (1, string),
        "namespace": (2, string),
        "service_account": (3, string),
    }
    assert _fields(zds_pb2.AddWorkload) == {"uid": (1, string), "workload_info": (2, message)}
    assert _fields(zds_pb2.KeepWorkload) == {"uid": (1, string)}
    assert _fields(zds_pb2.DelWorkload) == {"uid": (2, string)}
    assert _fields(zds_pb2.SnapshotSent) == {}
    assert _fields(zds_pb2.ShutdownStarting) == {"uid": (1, string)}
    assert _fields(zds_pb2.Ack) == {"error": (1, string)}
    assert _fields(zds_pb2.WorkloadRequest) == {
        "add": (1, message),
        "del": (2, message),
        "snapshot_sent": (3, message),
        "keep": (5, message),
        "shutdown_starting": (1191, message),
    }
    assert _fields(zds_pb2.WorkloadResponse) == {"ack": (1, message)}
    assert [f.name for f in zds_pb2.WorkloadRequest.DESCRIPTOR.oneofs_by_name["payload"].fields] == [
        "add",
        "del",
        "snapshot_sent",
        "keep",
        "shutdown_starting",
    ]
    assert dict(zds_pb2.Version.items()) == {"NOT_USED": 0, "V1": 1}


def test_workload_info_reserves_trust_domain():
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.DescriptorProto()
    zds_pb2.WorkloadInfo.DESCRIPTOR.CopyToProto(proto)
    assert list(proto.reserved_name) == ["trust_domain"]
    assert [(r.start, r.end) for r in proto.reserved_range] == [(4, 5)]


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty_message"),
        (H("22 00"), "unknown_message"),  # field 4: not in the oneof
        (H("c2 3e 00"), "unknown_message"),  # field 1000
        (H("ff"), "decode_error"),
        (H("0a 05 0a 01"), "decode_error"),  # length runs past the end
        (H("0a 03 0a 01 75"), "missing_workload_info"),
        (H("0a 02 12 00"), "missing_uid"),
        (H("2a 00"), "missing_uid"),
        (H("12 00"), "missing_uid"),
        (H("ba 4a 00"), "missing_uid"),
        (H("0a 04 0a 02 c3 28"), "decode_error"),  # invalid UTF-8 in a proto3 string
    ],
)
def test_bad_requests(data, reason):
    with pytest.raises(ZdsProtocolError) as info:
        wire.decode_request(data)
    assert info.value.reason == reason
    assert info.value.message == str(info.value)


def test_unknown_message_names_the_field():
    with pytest.raises(ZdsProtocolError, match="field number 4"):
        wire.decode_request(H("22 00"))


def test_add_without_workload_info_names_the_uid():
    with pytest.raises(ZdsProtocolError, match="'u' without workload_info"):
        wire.decode_request(H("0a 03 0a 01 75"))


@pytest.mark.parametrize(
    ("data", "reason"), [(b"", "empty_message"), (H("12 00"), "unknown_message"), (H("0a"), "decode_error")]
)
def test_bad_responses(data, reason):
    with pytest.raises(ZdsProtocolError) as info:
        wire.decode_response(data)
    assert info.value.reason == reason


@pytest.mark.parametrize(("data", "reason"), [(b"", "bad_hello"), (H("08"), "decode_error")])
def test_bad_hellos(data, reason):
    with pytest.raises(ZdsProtocolError) as info:
        wire.decode_hello(data)
    assert info.value.reason == reason


def test_encode_request_refuses_other_objects():
    with pytest.raises(TypeError, match="not a ZDS request"):
        wire.encode_request("del u")


# -- property tests ---------------------------------------------------------------------------

text = st.text(max_size=40)
uids = st.text(min_size=1, max_size=40)
infos = st.builds(WorkloadInfo, text, text, text)
requests = st.one_of(
    st.builds(AddWorkload, uids, infos),
    st.builds(KeepWorkload, uids),
    st.builds(DelWorkload, uids),
    st.just(SnapshotSent()),
    st.builds(ShutdownStarting, uids),
)


@given(requests)
def test_requests_round_trip(request):
    assert wire.decode_request(wire.encode_request(request)) == request


@given(text)
def test_acks_round_trip(error):
    assert wire.decode_response(wire.encode_ack(error)) == Ack(error)


def _only_protocol_errors(decode, data):
    try:
        decode(data)
    except ZdsProtocolError as err:
        assert err.reason and err.message
    # Anything else propagates and fails the test.


@settings(max_examples=2000)
@given(st.binary(max_size=300))
def test_fuzz_decode_request_raises_only_protocol_errors(data):
    _only_protocol_errors(wire.decode_request, data)


@settings(max_examples=500)
@given(requests, st.binary(max_size=20), st.integers(min_value=0, max_value=400))
def test_fuzz_mutated_requests(request, junk, position):
    # Near-valid input reaches deeper into the parser than random bytes.
    data = bytearray(wire.encode_request(request))
    position = min(position, len(data))
    data[position : position + len(junk)] = junk
    _only_protocol_errors(wire.decode_request, bytes(data))


@settings(max_examples=1000)
@given(st.binary(max_size=200))
def test_fuzz_decode_response_and_hello(data):
    _only_protocol_errors(wire.decode_response, data)
    _only_protocol_errors(wire.decode_hello, data)


def test_deep_nesting_of_unknown_groups_is_a_protocol_error():
    # Start-group tags nested very deep: parsers refuse this by recursion limit.
    data = H("23") * 20000
    with pytest.raises(ZdsProtocolError):
        wire.decode_request(data)
