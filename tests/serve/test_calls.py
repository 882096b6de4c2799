"""The engine replicas' Serve calls, packed once (deployments/calls.py): they come back equal, of
the kind asked for; a message holding an ObjectRef is left to Ray's serializer, which counts its
borrowers."""

from dataclasses import replace

import pytest
import ray

from pegaserve.deployments.calls import DecodeCall, PrefillResult, pack, unpack
from pegaserve.messages import EngineRequest, ParkedKv, SampledToken, SamplingParams, StepOutput
from pegaserve.net.channel import Address
from pegaserve.pd.protocol import Lease
from pegaserve.stop import Length, StopPolicy

REQUEST = EngineRequest("cmpl-1", (220, 16, 11), SamplingParams(seed=7, logit_bias=((5, 1.5),)),
                        StopPolicy(8, frozenset({151643}), frozenset({11}), min_tokens=2), n=2)
PARKED = ParkedKv((3, 4), (1, 1), 100.0)
ADDRESS = Address("127.0.0.1", 4321, "ab" * 16)
LEASE = Lease("cmpl-1", "app/Prefill#1", ADDRESS, (2, 2, 2, 16, 1, 8), "float32", 4096, PARKED)


def test_a_decode_call_and_a_prefill_result_come_back_equal():
    call = DecodeCall(REQUEST, ((0, (SampledToken(16, -0.5, ((16, -0.5), (17, -2.0))),)), (1, ())), LEASE, ADDRESS, 3)
    result = PrefillResult([StepOutput("cmpl-1/0", (SampledToken(16, -0.5),), None, parked=PARKED),
                            StepOutput("cmpl-1/1", (SampledToken(11, -1.0),), Length())], "app/Prefill#1", LEASE)
    for message in (call, result, REQUEST):
        packed = pack(message)
        assert isinstance(packed, bytes)
        assert unpack(packed, type(message)) == message


def test_a_message_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="expected DecodeCall, got EngineRequest"):
        unpack(pack(REQUEST), DecodeCall)


def test_a_message_holding_an_object_ref_travels_as_it_is():
    ref = ray.ObjectRef(b"\x01" * 28, skip_adding_local_ref=True)  # (no worker needed)
    call = DecodeCall(REQUEST, (), replace(LEASE, kv_ref=[ref]), ADDRESS, 1)
    assert pack(call) is call
    assert unpack(call, DecodeCall) is call
