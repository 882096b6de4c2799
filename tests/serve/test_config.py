"""The app's arguments are validated at the edge with clear errors."""

import pytest
import torch
from pydantic import ValidationError

from deployments.config import AppArgs


def test_defaults_are_the_cpu_pd_app(tiny_model_dir):
    args = AppArgs()
    assert (args.model, args.mode, args.transport, args.engine.device) == ("qwen3-tiny", "pd", "shm", "cpu")


@pytest.mark.parametrize("bad,needle", [
    ({"modle": "qwen3-tiny"}, "modle"),
    ({"model": "/nonexistent/model"}, "/nonexistent/model"),
    ({"transport": "carrier-pigeon"}, "transport"),
    ({"transport": "nccl"}, "nccl"),
    pytest.param({"engine": {"device": "cuda"}}, "cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="valid where CUDA exists")),
    ({"engine": {"block_size": 0}}, "block_size"),
    ({"engine": {"num_blockz": 4}}, "num_blockz"),
])
def test_bad_args_fail_with_a_message_naming_the_problem(tiny_model_dir, bad, needle):
    with pytest.raises(ValidationError) as info:
        AppArgs.model_validate(bad)
    assert needle in str(info.value)
