"""Tool calls without a server: the choice modes and their schemas, the parsing of outputs,
the streamed deltas of a choice, and the prompt of a template without a tools section."""

import json

import jsonschema
import pytest

from spin_cluster.deployments import tool_calls
from spin_cluster.deployments.choices import Choice
from spin_cluster.deployments.errors import ApiError
from spin_cluster.deployments.messages import Delta
from spin_cluster.deployments.tool_calls import Tool

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "add", "parameters": ADD}}),
         Tool.model_validate({"type": "function", "function": {"name": "now"}})]
NAMES = ("add", "now")


@pytest.mark.parametrize("tools, choice, mode", [
    (None, None, ("none", None)), (TOOLS, None, ("auto", None)), (TOOLS, "none", ("none", None)),
    (TOOLS, "required", ("required", None)), (TOOLS, {"type": "function", "function": {"name": "now"}}, ("named", "now")),
])
def test_choice_modes(tools, choice, mode):
    assert tool_calls.choice_mode(tools, choice) == mode


@pytest.mark.parametrize("tools, choice", [(None, "auto"), (TOOLS, "any"), (TOOLS, {"type": "function"}),
                                           (TOOLS, {"type": "function", "function": {"name": "sub"}})])
def test_choices_the_tools_cannot_meet_are_400(tools, choice):
    with pytest.raises(ApiError) as e:
        tool_calls.choice_mode(tools, choice)
    assert e.value.status == 400 and e.value.param == "tool_choice"


def test_required_schema_takes_one_call_per_tool_and_bounds_parallel_calls():
    schema = json.loads(tool_calls.constraint("required", None, TOOLS, parallel=False)["schema"])
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}], schema)
    for bad in ([], [{"name": "add", "parameters": {"a": 1}}], [{"name": "now", "parameters": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = tool_calls.constraint("named", "add", TOOLS, parallel=True)
    assert json.loads(named["schema"]) == ADD and named["source"] == "tools"
    assert tool_calls.constraint("auto", None, TOOLS, parallel=True) is None


def test_outputs_parse_into_calls():
    content, calls = tool_calls.parse('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                                      '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>', "auto", None)
    assert content == "Let me add." and [c["function"]["name"] for c in calls] == ["add", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert tool_calls.parse('<tool_call>{"name": "add", "argu', "auto", None) == ('<tool_call>{"name": "add", "argu', [])
    assert tool_calls.parse('[{"name": "now", "parameters": {}}]', "required", None)[1][0]["function"] == {
        "name": "now", "arguments": "{}"}
    assert tool_calls.parse('{"a": 1, "b"', "named", "add")[1][0]["function"]["arguments"] == '{"a": 1, "b"'
    assert tool_calls.parse("<tool_call>x</tool_call>", "none", None) == ("<tool_call>x</tool_call>", [])


@pytest.mark.parametrize("text, call", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', ("add", {"a": 1, "b": 2})),
    (' {"name": "now", "parameters": {}}\n', ("now", {})),  # Llama 3's key
    ('{"name": "sub", "arguments": {}}', None),  # not a tool
    ('{"name": "add", "arguments": "1, 2"}', None),
    ('{"name": "add", "arguments": {}} and more', None),
    ('["add"]', None),
])
def test_a_bare_json_call_to_a_tool_is_a_call(text, call):
    content, calls = tool_calls.parse(text, "auto", None, NAMES)
    if call is None:
        assert (content, calls) == (text, [])
    else:
        assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [call]


def test_auto_holds_a_json_answer_back_until_it_is_known_to_be_a_call_or_not():
    calls = _stream(Choice(0, ("auto", None, NAMES)), ['{"name": "add", ', '"arguments": {"a": 1, "b": 2}}'])
    assert [d["tool_calls"][0]["function"]["name"] for d in calls] == ["add"]
    text = _stream(Choice(0, ("auto", None, NAMES)), ['{"colour": ', '"red"}'])
    assert text == [{"content": '{"colour": "red"}'}]


def _stream(choice, parts):
    out = []
    for i, text in enumerate(parts):
        last = i == len(parts) - 1
        delta = Delta(text, (i,), last, "stop" if last else None)
        choice.add(delta)
        out += choice.stream_deltas(delta)
    return out


def test_auto_streams_content_until_a_call_may_begin_then_the_calls():
    choice = Choice(0, ("auto", None, NAMES))
    deltas = _stream(choice, ["Sure, <to", "ol_call>", '{"name": "add", "arguments": {"a": 1, "b": 2}}', "</tool_call>"])
    assert deltas[0] == {"content": "Sure, "} and len(deltas) == 2
    call = deltas[1]["tool_calls"][0]
    assert call["index"] == 0 and call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert choice.final_reason() == "tool_calls"


def test_auto_without_a_call_streams_all_its_text():
    choice = Choice(0, ("auto", None, NAMES))
    deltas = _stream(choice, ["a < b", " and <t", "ea>"])
    assert "".join(d["content"] for d in deltas) == "a < b and <tea>" and choice.final_reason() == "stop"


def test_a_named_call_streams_its_arguments():
    choice = Choice(0, ("named", "add", NAMES))
    deltas = _stream(choice, ['{"a": ', "1, ", '"b": 2}'])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": '}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"a": 1, "b": 2}'
    assert choice.final_reason() == "stop"  # vLLM's for a named call


def test_a_template_without_tools_gets_them_in_the_system_message():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "3", "tool_call_id": "c1"}]
    tools = [t.model_dump(exclude_none=True) for t in TOOLS]
    plain, none = tool_calls.template_input(messages, tools, template_lists_tools=False)
    assert none is None and [m["role"] for m in plain] == ["system", "user", "assistant", "user"]
    assert "<tools>\n" + json.dumps(tools[0]) in plain[0]["content"]
    assert plain[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert plain[3]["content"] == "<tool_response>\n3\n</tool_response>"
    kept, same = tool_calls.template_input(messages, tools, template_lists_tools=True)
    assert same == tools and kept[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
