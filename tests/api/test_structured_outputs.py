"""Structured outputs: response_format (json_object, json_schema), vLLM's structured_outputs and its
older guided_* fields, each a grammar the output keeps to (pegaserve/sample/grammar.py), streaming
and not; a bad grammar, or two at once, is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from pegaserve.sample.grammar import GrammarSpec
from tests.api.helpers import sse_chunks
from tests.api.test_fields import post as post_to
from tests.sample.test_grammar import character_matcher

SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}


def post(server, endpoint: str, **body) -> httpx.Response:
    return post_to(server, endpoint, **{"max_tokens": 40, "temperature": 0, **body})


def text_of(response: httpx.Response) -> tuple[str, str]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return (choice["text"] if "text" in choice else choice["message"]["content"]), choice["finish_reason"]


def matches(spec: GrammarSpec, text: str, whole: bool = True) -> bool:
    """Whether `text` is a sentence of the grammar (`whole`), or the start of one."""
    matcher = character_matcher(spec)
    return matcher.accept_string(text) and (matcher.is_terminated() or not whole)


def test_response_format_json_schema_and_json_object(server):
    for endpoint in ("completions", "chat"):
        text, finish = text_of(post(server, endpoint, response_format={
            "type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}))
        assert finish == "stop" and json.loads(text)["a"] in (1, 2), text
        # any object: the script's tokens win inside its first key, which never ends
        text, finish = text_of(post(server, endpoint, response_format={"type": "json_object"}))
        assert finish == "length" and text.startswith('{"') and matches(GrammarSpec("json_object"), text, whole=False)
    assert text_of(post(server, "chat"))[0].startswith("aaa")  # unconstrained: the script's default token


def test_structured_outputs_and_the_guided_fields_agree(server):
    cases = [
        ({"regex": "[0-9]{3}"}, "guided_regex", "[0-9]{3}", GrammarSpec("regex", "[0-9]{3}")),
        ({"choice": ["yes", "no"]}, "guided_choice", ["yes", "no"], GrammarSpec("choice", '["yes", "no"]')),
        ({"json": SCHEMA}, "guided_json", json.dumps(SCHEMA), GrammarSpec("json_schema", json.dumps(SCHEMA))),
        ({"grammar": 'root ::= "b" | "ab" [0-9]'}, "guided_grammar", 'root ::= "b" | "ab" [0-9]',
         GrammarSpec("ebnf", 'root ::= "b" | "ab" [0-9]')),
    ]
    for structured, guided, value, spec in cases:
        text, finish = text_of(post(server, "completions", structured_outputs=structured))
        assert finish == "stop" and matches(spec, text), (structured, text)
        if guided is not None:
            assert text_of(post(server, "completions", **{guided: value})) == (text, finish)
    assert text_of(post(server, "completions", guided_regex="[0-9]{3}"))[0] == "000"  # lowest ids win the ties
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    assert text_of(post(server, "completions", structured_outputs=compact)) == ('{"a": 1}', "stop")
    text, _ = text_of(post(server, "completions", structured_outputs={"json_object": True}))
    assert text_of(post(server, "completions", response_format={"type": "json_object"}))[0] == text
    # the grammar allows the script's "a" then " b" or "b": the script's " b" wins, then it must end
    assert text_of(post(server, "completions", guided_regex="a( b|b)"))[0] == "a b"


def test_a_streamed_structured_output_is_the_same_text(server):
    whole = text_of(post(server, "chat", response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}))
    streamed = post(server, "chat", stream=True, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    chunks = sse_chunks(streamed.text)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert (text, [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]) == whole


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens"),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else v)
def test_a_bad_or_second_structured_output_is_a_400_naming_it(server, body, param):
    response = post(server, "completions", **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and ".cc" not in error["message"] and "/" not in error["message"], error
