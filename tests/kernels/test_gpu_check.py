"""`make gpu-check` runs only where a GPU is lent: rarely, and on a clock that a broken script would
waste. Its dry run (every section's code at tiny sizes on the CPU, kernels interpreted) keeps it
working in between."""

import pytest
import torch

from benchmarks import gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, `make gpu-check` runs the real sections")
def test_the_gpu_checks_dry_run_renders_every_section(capsys):
    assert gpu.dry_run() == 0
    report = capsys.readouterr().out
    for heading in (
        "## Kernel benchmarks, tiny shapes interpreted",
        "## Engine vs transformers",
        "## Decode launch plans, tiny shapes interpreted",
        "## Table rendering",
    ):
        assert heading in report
    assert "| batch 2, ctx 9-20 | block_n=16 num_warps=1 num_splits=1 |" in report  # the default plan, first
    assert "| engine triton T=1 tok/s |" in report  # the sampled engine column
    assert "Sampling per engine step at batch 2" in report  # both sampling routes measured
    assert "**Failed:**" not in report
