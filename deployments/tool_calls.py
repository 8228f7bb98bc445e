"""Function calling (chat's ``tools`` / ``tool_choice``), as vLLM serves it for Hermes-style models.

    tools ──chat template (its tools section, or the Hermes one below)──▶ prompt
    tool_choice "auto"      free text; ``<tool_call>{"name", "arguments"}</tool_call>`` blocks parsed
                            out, or an output that is one bare call to a tool (Llama 3's JSON form)
    tool_choice "required"  output held to a JSON array of {"name", "parameters"} (vLLM's schema)
    tool_choice {function}  output held to that function's parameters schema: it is the arguments
    tool_choice "none"      free text, nothing parsed (the tools still reach the template, as vLLM)

The constraints are JSON schemas for the engine's grammar (xgrammar's ``json_schema``, the same
path as ``response_format``), so a forced call's arguments always validate against its schema.
Hermes' format is Qwen2.5's and NousResearch's (vLLM's ``hermes`` parser); a template without a
tools section of its own (SmolLM2's) gets Qwen2.5's wording in its system message, and earlier
calls and results rendered as that format's text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spin_cluster.deployments.errors import ApiError


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # OpenAI's; the grammar holds every forced call to its schema whatever it says.
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call the assistant made, as a client sends it back in a later turn."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def choice_mode(tools: list[Tool] | None, tool_choice: str | dict[str, Any] | None) -> tuple[str, str | None]:
    """(mode, function name) from the request: mode is none, auto, required or named; a 400
    naming tool_choice for a choice the tools cannot meet."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ApiError(400, f"tool_choice={tool_choice!r}: use none, auto, required or "
                           '{"type": "function", "function": {"name": ...}}', param="tool_choice", code="invalid_value")
        if tool_choice != "none" and not tools:
            raise ApiError(400, f"tool_choice={tool_choice!r} needs tools", param="tool_choice", code="invalid_value")
        return tool_choice, None
    name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
    if name not in {t.function.name for t in tools or ()}:
        raise ApiError(400, f"tool_choice names function {name!r}, which is not among the tools",
                       param="tool_choice", code="invalid_value")
    return "named", name


def constraint(mode: str, name: str | None, tools: list[Tool], parallel: bool) -> dict[str, Any] | None:
    """The JSON schema the output must match (SamplingParams' structured_output), or None."""
    if mode == "named":
        return _schema_field(_parameters(next(t for t in tools if t.function.name == name)))
    if mode != "required":
        return None
    calls = [{"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return _schema_field(schema)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _schema_field(schema: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "json_schema", "schema": json.dumps(schema, sort_keys=True), "source": "tools"}


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
CALL_START = "<tool_call>"


def parse(text: str, mode: str, name: str | None,
          names: tuple[str, ...] = ()) -> tuple[str | None, list[dict[str, Any]]]:
    """The model's output -> (content, tool_calls as OpenAI's objects). A Hermes block whose
    JSON does not parse stays in the content, as vLLM's parser leaves it. ``names``: the
    tools' names, which a bare JSON call (``{"name", "arguments" | "parameters"}``, the whole
    output: vLLM's ``llama3_json`` form, which small Qwen2.5 models emit too) must name."""
    if mode == "named":
        return None, [_call(name, text)]
    if mode == "required":
        try:
            return None, [_call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
        except (ValueError, KeyError, TypeError):  # cut off by max_tokens: not a whole array
            return text, []
    if mode != "auto":
        return text, []
    if CALL_START not in text:
        return bare_call(text, names)
    calls = []
    for block in _CALL.findall(text):
        try:
            found = json.loads(block)
            calls.append(_call(found["name"], json.dumps(found.get("arguments", {}))))
        except (ValueError, KeyError, TypeError):
            return text, []
    content = text[: text.index(CALL_START)].strip()
    return content or None, calls


def bare_call(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict[str, Any]]]:
    """(None, [the call]) when ``text`` is one JSON object calling one of ``names``; else (text, [])."""
    try:
        found = json.loads(text)
        arguments = found.get("arguments", found.get("parameters"))
        if found["name"] in names and isinstance(arguments, dict):
            return None, [_call(found["name"], json.dumps(arguments))]
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return text, []


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def finish_reason(mode: str, calls: list[dict[str, Any]], reason: str) -> str:
    """vLLM's: "tool_calls" when auto or required produced calls; a named call keeps the
    engine's reason ("stop")."""
    return "tool_calls" if calls and mode in ("auto", "required") and reason == "stop" else reason


# ---- prompts for templates without a tools section ------------------------------------------

_HERMES_TOOLS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                 "provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>"
                 "\n\nFor each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}}\n</tool_call>")


def template_input(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   template_lists_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: as they are for a template with a tools section
    (earlier calls' arguments as objects, which such templates print as JSON, as vLLM hands
    them); folded into role and content text (``hermes_messages``) for one without."""
    if not template_lists_tools:
        return hermes_messages(messages, tools), None
    return [_with_argument_objects(m) for m in messages], tools


def _with_argument_objects(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template that only reads role and content: the tools in the system
    message (Qwen2.5's wording), earlier calls as ``<tool_call>`` text, results as a user
    turn of ``<tool_response>`` blocks (as Qwen2.5's template renders them)."""
    out = [_plain(m) for m in messages]
    if tools:
        section = _HERMES_TOOLS.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _plain(m: dict[str, Any]) -> dict[str, Any]:
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
    calls = [f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _loads(c['function']['arguments'])})}"
             "\n</tool_call>" for c in m.get("tool_calls") or ()]
    return {"role": m["role"], "content": "\n".join(filter(None, [m.get("content") or "", *calls]))}


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
