"""The app's arguments are validated at the edge with clear errors."""

import pytest
import torch
from pydantic import ValidationError

from pegaserve.config import Role
from pegaserve.deployments.config import AppArgs
from pegaserve.deployments.replica import engine_config


def test_defaults_are_the_cpu_pd_app(tiny_model_dir):
    args = AppArgs()
    assert (args.model, args.mode, args.transport, args.engine.device) == ("qwen3-tiny", "pd", "shm", "cpu")


def test_the_scheduling_policy_reaches_every_engine_role():
    args = AppArgs.model_validate({"engine": {"scheduling_policy": "priority"}})
    assert {engine_config(args, role).scheduling_policy for role in Role} == {"priority"}
    assert engine_config(AppArgs(), Role.DECODE).scheduling_policy == "fcfs"


@pytest.mark.parametrize("bad,needle", [
    ({"modle": "qwen3-tiny"}, "modle"),
    ({"model": "/nonexistent/model"}, "/nonexistent/model"),
    ({"transport": "carrier-pigeon"}, "transport"),
    ({"transport": "nccl"}, "nccl"),
    pytest.param({"engine": {"device": "cuda"}}, "cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="valid where CUDA exists")),
    ({"engine": {"block_size": 0}}, "block_size"),
    ({"engine": {"num_blockz": 4}}, "num_blockz"),
    ({"engine": {"scheduling_policy": "lifo"}}, "scheduling_policy"),
])
def test_bad_args_fail_with_a_message_naming_the_problem(tiny_model_dir, bad, needle):
    with pytest.raises(ValidationError) as info:
        AppArgs.model_validate(bad)
    assert needle in str(info.value)


def test_the_engine_replicas_are_given_no_key(monkeypatch):
    """Keys are the ingress's alone: the engine deployments' arguments (readable through Serve's
    config API and the dashboard) hold none."""
    from pegaserve.deployments.app import build_app

    app = build_app({"api_keys": ["key-a"], "admin_api_keys": ["admin-a"]})
    ingress = app._bound_deployment  # Ingress.bind(args, prefill=..., decode=...)
    assert ingress.init_args[0]["api_keys"] == ["key-a"]
    for engine in ingress.init_kwargs.values():
        assert engine._bound_deployment.init_args[0]["api_keys"] == []
        assert engine._bound_deployment.init_args[0]["admin_api_keys"] == []
    monkeypatch.setenv("PEGASERVE_ADMIN_API_KEYS", "admin-b, admin-c")
    assert AppArgs(admin_api_keys=["admin-a"]).all_admin_api_keys() == ("admin-a", "admin-b", "admin-c")
