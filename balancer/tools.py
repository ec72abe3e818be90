"""Tool calling on the chat API: OpenAI's tools, tool_choice and parallel_tool_calls.

The tools travel to the replica (ChatMessages.tools_json), whose chat template renders them. What the model answers
becomes tool calls in one of two ways, as vLLM does:
- tool_choice "required" or a named function: a JSON-schema constraint (balancer/structured.py's Constraint) makes
  the output the calls themselves: the named function's arguments object, or a list of {"name", "parameters"}
  (one item unless parallel_tool_calls), so the arguments always parse and hold the required keys;
- "auto" (the default with tools): the model's own text, parsed by the parser of its family (--tool-call-parser):
  hermes and qwen3 (<tool_call>{json}</tool_call> blocks), llama3_json (a JSON object, or several separated by
  ";"), mistral ([TOOL_CALLS] then a JSON list).
"none" sends the tools to the template but never parses calls. Pure: no I/O, no torch."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ..proto import fastgen_pb2
from .limits import MAX_TOOLS

TOOL_CALL_PARSERS = ("auto", "hermes", "qwen3", "llama3_json", "mistral")
DEFAULT_TOOL_CALL_PARSER = "auto"  # from the chat template when the balancer has it (parser_for_template), else hermes


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How one chat call's output becomes tool calls."""

    names: tuple[str, ...]
    choice: str  # "auto" | "required" | "named" | "none"
    named: str | None = None  # the function of a named choice
    parallel: bool = True
    parser: str = DEFAULT_TOOL_CALL_PARSER

    @property
    def forced(self) -> bool:
        """The output is the calls, by grammar."""
        return self.choice in ("required", "named")


def parse_tools(body: dict, parser: str = DEFAULT_TOOL_CALL_PARSER):
    """(plan, tools_json, constraint) of a chat body; (None, "", None) without tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None, "", None
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools may have at most {MAX_TOOLS} entries, got {len(tools)}", "tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = tuple(f["name"] for f in functions)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError('tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
        if fn["name"] not in names:
            raise ToolError(f"tool_choice names {fn['name']!r}, which is not among the tools", "tool_choice")
        choice, named = "named", fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise ToolError('tool_choice must be "none", "auto", "required" or a named function', "tool_choice")
    plan = ToolPlan(names, choice, named, parallel, parser if parser != "auto" else "hermes")
    tools_json = json.dumps([{"type": "function", "function": f} for f in functions], separators=(",", ":"))
    return plan, tools_json, _constraint(plan, functions)


def _function(tool: object, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolError(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolError(f"{where}.function needs a name", where)
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object", where)
    out = {"name": fn["name"], "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return out


def _constraint(plan: ToolPlan, functions: list[dict]) -> fastgen_pb2.Constraint | None:
    if plan.choice == "named":
        (params,) = [f["parameters"] for f in functions if f["name"] == plan.named]
        return fastgen_pb2.Constraint(json_schema=json.dumps(_object_schema(params), separators=(",", ":")))
    if plan.choice != "required":
        return None
    item = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "parameters": _object_schema(f["parameters"])},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }
    schema = {"type": "array", "items": item, "minItems": 1}
    if not plan.parallel:
        schema["maxItems"] = 1
    return fastgen_pb2.Constraint(json_schema=json.dumps(schema, separators=(",", ":")))


def _object_schema(params: dict) -> dict:
    """Arguments are an object, whatever the schema leaves open."""
    return {"type": "object", **params} if "type" not in params else params


def parser_for_template(template: str | None) -> str:
    """The parser of the family whose chat template this is, by the markers its tool-call turns are written with:
    Hermes, Qwen 2.5 and Qwen 3 wrap calls in <tool_call>, Mistral opens them with [TOOL_CALLS], Llama 3.1+ has
    <|python_tag|> or asks for a JSON {"name", "parameters"}. Anything else (or no template known): hermes."""
    template = template or ""
    if "<tool_call>" in template:
        return "qwen3" if "<think>" in template else "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|eot_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


# ---- output -> calls ----------------------------------------------------------------------------------------------
def call(name: str, arguments: object) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def extract(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished output."""
    if plan.choice == "named":
        assert plan.named is not None, "a named choice names its function (parse_tools)"
        return None, [call(plan.named, text)]
    if plan.choice == "required":
        try:
            items = json.loads(text)
            return None, [call(i["name"], i["parameters"]) for i in items]
        except (ValueError, TypeError, KeyError):  # cut off by max_tokens: no call to give
            return text, []
    if plan.choice == "none":
        return text, []
    return _parse_auto(plan, text)


HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _parse_auto(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    if plan.parser in ("hermes", "qwen3"):
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = [c for c in (_named_call(m, plan) for m in HERMES.findall(text[start:])) if c]
        content = text[:start].strip() or None
    elif plan.parser == "mistral":
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        try:
            items = json.loads(text[start + len("[TOOL_CALLS]") :].strip())
        except ValueError:
            return text, []
        calls = [c for c in (_named_call(json.dumps(i), plan) for i in _as_list(items)) if c]
        content = text[:start].strip() or None
    else:  # llama3_json: the whole answer is the call(s)
        stripped = text.strip().removeprefix("<|python_tag|>")
        if not stripped.startswith("{"):
            return text, []
        calls = [c for c in (_named_call(part, plan) for part in stripped.split(";")) if c]
        content = None
    if not calls:
        return text, []
    return content, calls if plan.parallel else calls[:1]


def _as_list(value: object) -> list:
    return value if isinstance(value, list) else [value]


def _named_call(raw: str, plan: ToolPlan) -> dict | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in plan.names:
        return None
    return call(value["name"], value.get("arguments", value.get("parameters", {})))


# ---- streams ------------------------------------------------------------------------------------------------------
MARKERS = {"hermes": "<tool_call>", "qwen3": "<tool_call>", "mistral": "[TOOL_CALLS]"}


@dataclass
class ToolStream:
    """One choice's streamed output as OpenAI deltas: content while it is plain text; the calls once known. Forced
    calls (named, required) stream their arguments as they come; parsed ones ("auto") are sent whole when the choice
    ends (a client's SDK accumulates either). Text that may begin a call's marker is held back until it is known not
    to."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of text sent as content
    calling: bool = False  # a call has begun: nothing more goes out as content
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    # required: per call, [where its arguments start, characters of them sent, 1 once they are closed]
    items: list[list[int]] = field(default_factory=list)

    @property
    def called(self) -> bool:
        """A call has been sent (the choice's finish reason is then tool_calls)."""
        return bool(self.items) or (self.plan.choice == "named" and self.sent > 0) or self._whole_sent

    _whole_sent: bool = False

    def feed(self, new: str, finished: bool) -> list[dict]:
        self.text += new
        if self.plan.choice == "named":
            return self._named(new)
        if self.plan.choice == "required":
            return self._required(finished)
        if self.plan.choice == "none":
            return [{"content": new}] if new else []
        deltas = []
        if not self.calling and self.plan.choice == "auto":
            end = self._plain_end()
            if end > self.sent:
                deltas.append({"content": self.text[self.sent : end]})
                self.sent = end
        if finished:
            content, calls = extract(self.plan, self.text)
            if calls:
                deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
                self._whole_sent = True
            elif self.sent < len(self.text):
                deltas.append({"content": self.text[self.sent :]})
        return deltas

    def _plain_end(self) -> int:
        """Where the text known to be content ends; sets `calling` when a call has begun."""
        if self.plan.parser == "llama3_json":  # only an answer that opens with "{" is a call
            head = self.text.lstrip()
            if not head or "<|python_tag|>".startswith(head[:14]) and len(head) < 14:
                return self.sent  # undecided yet
            self.calling = head.startswith(("{", "<|python_tag|>"))
            return self.sent if self.calling else len(self.text)
        marker = MARKERS[self.plan.parser]
        at = self.text.find(marker, self.sent)
        self.calling = at >= 0
        return at if at >= 0 else len(self.text) - _partial_marker(self.text, marker)

    def _required(self, finished: bool) -> list[dict]:
        """The grammar's [{"name": ..., "parameters": {...}}, ...] as it grows: a call's header once its name is
        complete, then its arguments object piece by piece up to its closing brace."""
        deltas = []
        for m in REQUIRED_ITEM.finditer(self.text, self.items[-1][0] if self.items else 0):
            if self.items and m.end() <= self.items[-1][0]:
                continue
            self.items.append([m.end(), 0, 0])
            head = {"index": len(self.items) - 1, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
            deltas.append({"tool_calls": [{**head, "function": {"name": json.loads(m.group(1)), "arguments": ""}}]})
        for index, item in enumerate(self.items):
            start, sent, closed = item
            if closed:
                continue
            end = _object_end(self.text, start)
            item[2] = end is not None
            stop = end if end is not None else len(self.text)
            if stop > start + sent:
                piece = self.text[start + sent : stop]
                item[1] = stop - start
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        if finished and not self.items and self.text:  # cut off before a call began: the text as it is
            deltas.append({"content": self.text})
        return deltas

    def _named(self, new: str) -> list[dict]:
        if self.sent == 0:
            self.sent = 1
            head = {"index": 0, "id": self.call_id, "type": "function"}
            return [{"tool_calls": [{**head, "function": {"name": self.plan.named, "arguments": new}}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": new}}]}] if new else []


REQUIRED_ITEM = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


def _object_end(text: str, start: int) -> int | None:
    """The index after the JSON object that opens at text[start] (None while it is still open)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of text could begin the marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
