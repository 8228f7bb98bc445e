"""Structured outputs on SmolLM2 (CPU; the batch test also on CUDA, marked gpu): every output,
greedy and sampled, streamed delta by delta, parses and validates against its JSON schema.
The schemas run as one batch."""

import json

import jsonschema
import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.engine.grammar import StructuredOutput

pytestmark = pytest.mark.timeout(300)

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": NAME, "population": {"type": "integer", "minimum": 1, "maximum": 99999999}},
     "required": ["city"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "string", "maxLength": 20},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}, "required": ["id"]},
    {"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": NAME, "author": {"type": "object", "properties": {"first": NAME, "last": NAME},
                                  "required": ["first", "last"]}}, "required": ["title", "author"]}},
     "required": ["book"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "code": {"type": "integer", "minimum": 100, "maximum": 599}},
     "required": ["status", "code"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "boolean"}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 10}}, "required": ["note"]},
    {"type": "object", "properties": {"temps": {"type": "array", "items": {
        "type": "number", "minimum": -50, "maximum": 50}, "maxItems": 3}}, "required": ["temps"]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -5, "maximum": 5}, "b": NAME, "c": {"type": "boolean"}},
     "required": ["a", "b", "c"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"grid": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 2}}},
     "required": ["grid"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "label": {"enum": ["low", "high"]}},
     "required": ["level", "label"]},
]
PROMPT = [{"role": "user", "content": "Reply with a short JSON value for a small example record."}]


def _engine(path: str, device: str) -> Engine:
    return Engine(SpinConfig.from_dict({"model": {"path": path, "device": device, "dtype": "float32",
                                                  "max_model_len": 1024},
                                        "scheduler": {"max_num_seqs": 64}}), progress=False)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return _engine(smollm2_path, "cpu")


@pytest.fixture(scope="module")
def cuda_engine(smollm2_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return _engine(smollm2_path, "cuda")


def _params(schema, greedy: bool, i: int) -> SamplingParams:
    sampling = {"temperature": 0} if greedy else {"temperature": 0.8, "seed": i}
    return SamplingParams(max_tokens=64, structured_output=StructuredOutput.from_schema(schema), **sampling)


def test_every_output_validates_against_its_schema(engine):
    _every_output_validates(engine)


@pytest.mark.gpu
def test_every_output_validates_against_its_schema_on_cuda(cuda_engine):
    """The bitmask on the GPU: the mask applied to CUDA logits, the CUDA graphs of decode steps
    and pipelined decode for the unconstrained rows (none here: every row has a grammar)."""
    _every_output_validates(cuda_engine)


def _every_output_validates(engine):
    assert len(SCHEMAS) >= 20
    cases = [(schema, greedy) for schema in SCHEMAS for greedy in (True, False)]
    prompt_ids = engine.tokenizer.chat_prompt_ids(PROMPT)
    rids = [engine.add_request(prompt_ids, _params(s, g, i)) for i, (s, g) in enumerate(cases)]
    streamed = {rid: "" for rid in rids}
    final = {}
    while len(final) < len(rids):
        for out in engine.step():
            streamed[out.request_id] += out.new_text
            if out.finished:
                final[out.request_id] = out
    unfinished = [(schema, final[rid].text) for rid, (schema, _) in zip(rids, cases) if final[rid].finish_reason != "stop"]
    assert not unfinished
    assert engine.grammars.refused == 0  # every sampled token was one its grammar allowed
    failed = []
    for rid, (schema, greedy) in zip(rids, cases):
        out = final[rid]
        assert streamed[rid] == out.text
        try:
            jsonschema.validate(json.loads(out.text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            failed.append(("greedy" if greedy else "sampled", out.text, out.token_ids, str(e).splitlines()[0]))
    assert not failed, failed
    engine.check_integrity()


def test_json_object_gives_an_object(engine):
    person = [{"role": "user", "content": "Give me a person as JSON with name and age."}]
    out = engine.chat(person, SamplingParams(temperature=0, max_tokens=64,
                                             structured_output=StructuredOutput("json_object")))
    assert isinstance(json.loads(out.text), dict)


def test_a_schema_that_does_not_compile_is_a_value_error_naming_response_format(engine):
    bad = StructuredOutput.from_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(ValueError, match="response_format: the JSON schema cannot be compiled"):
        engine.add_request("Hi", SamplingParams(structured_output=bad))
    assert not engine.has_unfinished()


def test_compiled_grammars_are_cached(engine):
    spec = StructuredOutput.from_schema(SCHEMAS[0])
    assert engine.grammars.compile(spec) is engine.grammars.compile(StructuredOutput.from_schema(dict(SCHEMAS[0])))


def test_min_tokens_cannot_be_combined_with_a_grammar():
    with pytest.raises(ValueError, match="min_tokens=3: cannot be combined with response_format"):
        SamplingParams(min_tokens=3, structured_output=StructuredOutput("json_object"))


def test_the_engines_stop_ids_end_only_a_complete_output(engine):
    """Every id the engine stops on is a stop id of the grammar: masked where the output is
    not complete (inside a string here), allowed where it is. An id the grammar took for an
    ordinary token would let a string hold it, and the engine would end the request there."""
    from spin_cluster.engine.grammar import Grammars

    tok = engine.tokenizer.hf_tokenizer
    a, b = (tok.encode(t, add_special_tokens=False)[0] for t in ("a", "b"))
    V = engine.grammars.vocab_size
    grammars = Grammars(tok, V, [2, a])  # "a" stands in for a second EOS of a model's config
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    grammars.start("r", StructuredOutput.from_schema(schema))
    for t in tok.encode('{"s": "', add_special_tokens=False):
        assert not grammars.accept("r", t)
    logits = torch.zeros(1, V)
    grammars.mask(logits, ["r"])
    assert logits[0, a] == float("-inf") and logits[0, 2] == float("-inf") and logits[0, b] == 0
    for t in tok.encode('b"}', add_special_tokens=False):
        assert not grammars.accept("r", t)
    logits = torch.zeros(1, V)
    grammars.mask(logits, ["r"])
    assert logits[0, a] == 0 and logits[0, 2] == 0  # complete: either stop id may end it
    assert grammars.accept("r", a) and grammars.refused == 0
