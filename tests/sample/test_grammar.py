"""Structured outputs in the engine: every token a request with a grammar samples keeps its output
inside the grammar, greedy and drawn; it ends at EOS only once the output is whole; prefill then
decode gives the colocated tokens; such requests take no drafts."""

import json

import pytest
import torch
import xgrammar

from pegaserve.config import EngineConfig, Role, SpeculativeConfig
from pegaserve.engine.build import load_engine
from pegaserve.messages import EngineRequest, Handoff, SamplingParams
from pegaserve.sample.grammar import Constraint, GrammarSpec, allowed_by, as_xgrammar
from pegaserve.sample.processing import SamplingRow
from pegaserve.sample.sampler import process_logits
from pegaserve.stop import Eos, StopPolicy
from pegaserve.tokenizer import Tokenizer
from tests.helpers import EOS_IDS, PROMPTS, run_to_completion, token_ids

SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}
GRAMMARS = {
    "regex": GrammarSpec("regex", "[0-9]{3}(-[a-c]{1,4})?"),
    "choice": GrammarSpec("choice", json.dumps(["red", "green", "blue"])),
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "json_object": GrammarSpec("json_object"),
    "ebnf": GrammarSpec("ebnf", 'root ::= "x" [0-9] | "yes"'),
}
MAX_TOKENS = 48


def request(rid: str, prompt, grammar: GrammarSpec, temperature: float, seed: int = 0) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(temperature=temperature, seed=seed, grammar=grammar),
                         StopPolicy(MAX_TOKENS, eos_token_ids=EOS_IDS))


def character_matcher(spec: GrammarSpec):
    """xgrammar's own matcher of `spec`, reading characters (a vocabulary of none)."""
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([]))
    return xgrammar.GrammarMatcher(compiler.compile_grammar(as_xgrammar(xgrammar, spec)), terminate_without_stop_token=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return load_engine(tiny_model_dir, EngineConfig(num_blocks=256), "sdpa")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", GRAMMARS)
def test_every_token_keeps_the_output_inside_the_grammar(engine, tiny_model_dir, kind, temperature):
    spec, tokenizer = GRAMMARS[kind], Tokenizer(tiny_model_dir)
    requests = [request(f"{kind}-{i}", p, spec, temperature, seed=i) for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.add_request(r)
    outputs = run_to_completion(engine)
    for r in requests:
        tokens, finish = token_ids(outputs[r.request_id]), outputs[r.request_id][-1].finish
        matcher = character_matcher(spec)
        text = tokenizer.decode(tokens[:-1] if isinstance(finish, Eos) else tokens, skip_special_tokens=False)
        assert matcher.accept_string(text), (kind, text)
        if isinstance(finish, Eos):  # it ends only where the output is whole
            assert matcher.is_terminated(), (kind, text)
        else:
            assert len(tokens) == MAX_TOKENS  # (JSON: the random weights' whitespace can run to max_tokens)
        if kind in ("regex", "choice", "ebnf"):  # short languages: they always end
            assert isinstance(finish, Eos)
    assert not engine.requests


def test_prefill_then_decode_gives_the_colocated_tokens(engine, tiny_model_dir):
    prefill, decode = (load_engine(tiny_model_dir, EngineConfig(role=role, num_blocks=256), "sdpa")
                       for role in (Role.PREFILL, Role.DECODE))
    requests = [request(f"{kind}-{t}", PROMPTS[0], spec, t, seed=3) for kind, spec in GRAMMARS.items() for t in (0.0, 1.0)]
    for r in requests:
        engine.add_request(r)
        prefill.add_request(r)
    colocated = {rid: token_ids(o) for rid, o in run_to_completion(engine).items()}
    first = run_to_completion(prefill)
    for r in requests:
        (out,) = first[r.request_id]
        if out.finish is None:
            decode.add_handoff(Handoff.single(r, out.tokens[0], prefill.export_kv(r.request_id)))
            prefill.release(r.request_id)
    rest = run_to_completion(decode)
    assert {rid: token_ids(first[rid] + rest.get(rid, [])) for rid in first} == colocated


def test_requests_with_a_grammar_take_no_drafts(tiny_model_dir, engine):
    spec_config = SpeculativeConfig(num_draft_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    speculating = load_engine(tiny_model_dir, EngineConfig(num_blocks=256, speculative=spec_config), "sdpa")
    repetitive = [11, 12, 13, 14, 15] * 8
    for e in (engine, speculating):
        e.add_request(request("r", repetitive, GRAMMARS["json_object"], 0.0))
    assert token_ids(run_to_completion(speculating)["r"]) == token_ids(run_to_completion(engine)["r"])
    assert speculating.stats().num_draft_tokens == 0


def test_a_bitmask_masks_exactly_its_zero_bits():
    vocab = 70
    words = torch.tensor([0b1011, 0, -(1 << 31)], dtype=torch.int32)  # tokens 0, 1, 3 and 95 (past the vocabulary)
    assert allowed_by(words, vocab).nonzero().flatten().tolist() == [0, 1, 3]
    logits = torch.randn(1, vocab)
    processed = process_logits(logits, [SamplingRow(SamplingParams(), 0, token_bitmask=words)])[0]
    assert torch.equal(processed.isfinite(), allowed_by(words, vocab))
    assert torch.equal(processed[[0, 1, 3]], logits[0, [0, 1, 3]])


def test_a_constraint_reads_the_output_once_and_allows_only_eos_after_a_token_outside_it(tiny_model_dir, engine):
    grammars = engine.grammars
    digit = Tokenizer(tiny_model_dir).encode("7")
    constraint = grammars.constraint(GrammarSpec("regex", "[0-9]{2}"))
    assert isinstance(constraint, Constraint)
    allowed = allowed_by(constraint.bitmask(()), engine.model_config.vocab_size)
    assert allowed[digit].all() and not allowed[list(EOS_IDS)].any()
    allowed = allowed_by(constraint.bitmask((*digit, *digit)), engine.model_config.vocab_size)
    assert constraint.num_read == 2 and allowed.nonzero().flatten().tolist() == sorted(EOS_IDS)  # whole: only EOS
    broken = grammars.constraint(GrammarSpec("regex", "[0-9]{2}"))
    allowed = allowed_by(broken.bitmask(tuple(Tokenizer(tiny_model_dir).encode("x"))), engine.model_config.vocab_size)
    assert broken.broken and allowed.nonzero().flatten().tolist() == sorted(EOS_IDS)


def test_a_serving_engine_builds_its_compiler_as_it_starts_and_a_grammar_that_will_not_compile_only_ends(
        tiny_model_dir, monkeypatch):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=16), "sdpa")
    engine.grammars.warm_up().join(60)
    assert engine.grammars._compiler is not None
    monkeypatch.setattr(engine.grammars._compiler, "compile_grammar", lambda grammar: 1 / 0)
    constraint = engine.grammars.constraint(GrammarSpec("regex", "[a-z]"))
    assert constraint.broken
    assert allowed_by(constraint.bitmask(()), engine.model_config.vocab_size).nonzero().flatten().tolist() == sorted(EOS_IDS)


def test_compact_json_leaves_the_model_no_whitespace_of_its_own(engine, tiny_model_dir):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    compact = GrammarSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False)
    for r in (request("loose", PROMPTS[0], spec, 0.0), request("compact", PROMPTS[0], compact, 0.0)):
        engine.add_request(r)
    outputs = run_to_completion(engine)
    texts = {rid: Tokenizer(tiny_model_dir).decode(token_ids(o), skip_special_tokens=True) for rid, o in outputs.items()}
    assert isinstance(outputs["compact"][-1].finish, Eos) and json.loads(texts["compact"])["b"] in (True, False)
    assert "\n" not in texts["compact"] and texts["loose"].count("\n") + texts["loose"].count("\t") > 3  # (the random weights)
