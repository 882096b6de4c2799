"""Sampling: a step's tokens from its logits, one row per request.

- `sampler`: `sample()`, which plans which rows take which path, and prompt scoring (`score_tokens`).
- `processing`: `SamplingRow`, and the processing of its logits before temperature (vLLM's order).
- `filters`: temperature scales and the top-k / top-p / min_p bounds.
- `draw`: the inverse-CDF draw and each row's hashed uniforms.
- `passes`: passes over the vocabulary (their kernel in `pegaserve.cpu.vocab_passes`) and row helpers.
- `screened`: tokens from the screened LM head (`pegaserve.cpu.lm_head`), by the same laws.
- `on_device`: sampling and scoring where the logits are, for an accelerator.
- `grammar`: structured outputs, as a mask of the allowed tokens.
"""
