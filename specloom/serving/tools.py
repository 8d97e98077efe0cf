"""OpenAI `tools` / `tool_choice` / `response_format` -> a plan: the messages to encode, the chat-template
arguments, the parser that reads tool calls from the output and the grammar that constrains it.

The tool-call format follows the chat template:

* the template mentions `<tool_call>` -> Hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  Hermes-2-Pro, Qwen2.5/3), tools passed to the template (`tools=`);
* the template carries Llama-3 markers (`<|python_tag|>`, `ipython`) -> Llama-3 JSON (`{"name": ...,
  "parameters": {...}}`), tools passed to the template;
* otherwise (e.g. SmolLM2-135M, whose template knows nothing of tools) -> Hermes, with the tool definitions and
  an instruction written into the system message, and the history's assistant `tool_calls` and `tool` results
  rendered as text in that format.

Grammars (see specloom.serving.grammar): a named `tool_choice` forces exactly one call of that function with
arguments valid against its schema; "required" forces one call of any of the tools; `response_format`
json_schema / json_object forces JSON (when no tool call is forced). "auto", "none" and no tools: no grammar.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..tokenizer import Tokenizer
from .grammar import GrammarError, GrammarSpec, lark_json, lark_literal
from .schema_satisfiable import unsatisfiable

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function and schema names

HERMES, LLAMA3_JSON = "hermes", "llama3_json"


class ToolRequestError(Exception):
    """A bad `tools` / `tool_choice` / `response_format` / `messages`: the API answers 400 with this message
    and `param`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class ToolPlan:
    messages: list[dict]
    template_kwargs: dict = field(default_factory=dict)
    parser: str | None = None  # "hermes" | "llama3_json" | None
    grammar: GrammarSpec | None = None
    forced_tool: bool = False  # the grammar forces a tool call: finish_reason "tool_calls"


@dataclass(frozen=True)
class ToolFormat:
    parser: str  # HERMES | LLAMA3_JSON
    native: bool  # the chat template renders tools itself (tools=..., tool_calls, role "tool")


def tool_format(tokenizer: Tokenizer) -> ToolFormat:
    template = getattr(tokenizer.hf, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = " ".join(template.values())
    if "<tool_call>" in template:
        return ToolFormat(HERMES, True)
    if "<|python_tag|>" in template or "ipython" in template:
        return ToolFormat(LLAMA3_JSON, True)
    return ToolFormat(HERMES, False)


# -- validation -----------------------------------------------------------------------------------------------

def _check_tools(tools) -> list[dict]:
    """The tools as given, checked: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}. Returns normalised copies (parameters defaulted to an empty object schema)."""
    if not isinstance(tools, list):
        raise ToolRequestError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ToolRequestError(f"{where}: each tool must be an object with \"type\": \"function\"", where)
        f = t.get("function")
        if not isinstance(f, dict):
            raise ToolRequestError(f"{where}.function must be an object with a name", f"{where}.function")
        name = f.get("name")
        if not isinstance(name, str):
            raise ToolRequestError(f"{where}.function.name must be a string", f"{where}.function.name")
        if not NAME_RE.match(name):
            raise ToolRequestError(
                f"{where}.function.name {name!r} is invalid: use 1 to 64 letters, digits, underscores or dashes",
                f"{where}.function.name")
        if name in seen:
            raise ToolRequestError(f"{where}: a second function named {name!r}", f"{where}.function.name")
        seen.add(name)
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolRequestError(f"{where}.function.description (function {name!r}) must be a string",
                                   f"{where}.function.description")
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolRequestError(f"function {name!r}: parameters must be a JSON Schema object",
                                   f"{where}.function.parameters")
        kind = params.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise ToolRequestError(
                f"function {name!r}: parameters must describe an object (\"type\": \"object\"), got {kind!r}",
                f"{where}.function.parameters")
        _check_schema(params, lenient=True, what=f"function {name!r}: invalid parameters schema",
                      param=f"{where}.function.parameters")
        fn = {"name": name, "parameters": params}
        if desc:
            fn["description"] = desc
        if "strict" in f:
            fn["strict"] = bool(f["strict"])
        out.append({"type": "function", "function": fn})
    return out


def _check_schema(schema, lenient: bool, what: str, param: str) -> None:
    """The schema compiles; one that is enforced (not `lenient`) must also admit some value, or the grammar
    would run out of allowed tokens part-way through the output."""
    try:
        GrammarSpec.json_schema(schema, lenient=lenient).check()
    except GrammarError as e:
        raise ToolRequestError(f"{what}: {e}", param) from None
    problem = None if lenient else unsatisfiable(schema)
    if problem:
        raise ToolRequestError(f"{what}: {problem}", param)


def _tool_choice(body: dict, tools: list[dict]) -> str | dict:
    """"none" | "auto" | "required" | the named function's tool dict."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolRequestError(
                f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                f"\"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
        if choice == "required" and not tools:
            raise ToolRequestError("tool_choice \"required\" needs at least one tool in tools", "tool_choice")
        return choice
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise ToolRequestError(
            "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
            "{\"name\": ...}}", "tool_choice")
    name = choice["function"]["name"]
    for t in tools:
        if t["function"]["name"] == name:
            return t
    known = ", ".join(repr(t["function"]["name"]) for t in tools) or "none"
    raise ToolRequestError(f"tool_choice names function {name!r}, which is not in tools (given: {known})",
                           "tool_choice")


def _response_format(body: dict) -> GrammarSpec | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ToolRequestError("response_format must be an object with a \"type\"", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ToolRequestError("response_format.json_schema must be an object with \"name\" and \"schema\"",
                                   "response_format.json_schema")
        name = js.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ToolRequestError(
                "response_format.json_schema.name must be 1 to 64 letters, digits, underscores or dashes",
                "response_format.json_schema.name")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise ToolRequestError(f"response_format.json_schema.schema ({name!r}) must be a JSON Schema object",
                                   "response_format.json_schema.schema")
        _check_schema(schema, lenient=False, what=f"response_format schema {name!r} cannot be enforced",
                      param="response_format.json_schema.schema")
        return GrammarSpec.json_schema(schema)
    raise ToolRequestError(
        f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}",
        "response_format.type")


# -- grammars -------------------------------------------------------------------------------------------------

def tool_call_grammar(tools: list[dict], fmt: str) -> GrammarSpec:
    """Exactly one call of one of `tools`, in the format's exact text: Hermes
    `<tool_call>{"name": "f", "arguments": <schema>}</tool_call>` (an optional newline inside the tags), or
    Llama-3 JSON `{"name": "f", "parameters": <schema>}`. Each function's schema is its own %json root, so its
    `$ref`s resolve as written."""
    key = "arguments" if fmt == HERMES else "parameters"
    alts, rules = [], []
    for i, t in enumerate(tools):
        f = t["function"]
        head = lark_literal(f'{{"name": "{f["name"]}", "{key}": ')
        alts.append(f"call_{i}")
        rules.append(f"call_{i}: {head} args_{i} {lark_literal('}')}")
        rules.append(f"args_{i}: {lark_json(f['parameters'])}")
    if fmt == HERMES:
        start = 'start: "<tool_call>" "\\n"? call "\\n"? "</tool_call>"'
    else:
        start = "start: call"
    return GrammarSpec.lark("\n".join([start, "call: " + " | ".join(alts), *rules]) + "\n")


def _check_forced(tools: list[dict], fmt: str, where) -> GrammarSpec:
    """Each forced function's schema must compile strictly (no ignored keywords): the output is promised to
    be valid against it."""
    for i, t in tools:
        f = t["function"]
        _check_schema(f["parameters"], lenient=False,
                      what=f"function {f['name']!r}: its parameters schema cannot be enforced",
                      param=f"{where(i)}.function.parameters")
    grammar = tool_call_grammar([t for _, t in tools], fmt)
    try:
        grammar.check()
    except GrammarError as e:
        names = ", ".join(repr(t["function"]["name"]) for _, t in tools)
        raise ToolRequestError(f"cannot build the tool-call grammar for {names}: {e}", "tools") from None
    return grammar


# -- messages -------------------------------------------------------------------------------------------------

def _text(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise ToolRequestError(f"{where}.content must be a string or a list of text parts", "messages")


def _arguments(args, where: str):
    """OpenAI sends tool-call arguments as JSON text; templates and our rendering want the object."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ToolRequestError(f"{where}.function.arguments is not valid JSON", "messages") from None
    if args is None:
        return {}
    return args


def _calls(m: dict, where: str) -> list[dict]:
    calls = m.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ToolRequestError(f"{where}.tool_calls must be a list", "messages")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ToolRequestError(f"{w} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                                   "messages")
        call = {"type": "function", "function": {"name": f["name"], "arguments": _arguments(f.get("arguments"), w)}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _render_call(call: dict, fmt: str) -> str:
    f = call["function"]
    if fmt == HERMES:
        body = json.dumps({"name": f["name"], "arguments": f["arguments"]}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"
    return json.dumps({"name": f["name"], "parameters": f["arguments"]}, ensure_ascii=False)


def _system_prompt(tools: list[dict], choice) -> str:
    lines = [
        "You can call functions to help with the user's request. The functions are:",
        "",
    ]
    for t in tools:
        f = t["function"]
        lines.append(f"- {f['name']}: {f.get('description') or '(no description)'}")
        lines.append(f"  parameters (JSON Schema): {json.dumps(f['parameters'], ensure_ascii=False)}")
    lines += [
        "",
        ("To call a function, answer with a JSON object holding the function's name and its arguments, inside "
         "<tool_call></tool_call> tags:"),
        "<tool_call>",
        '{"name": "<function name>", "arguments": {<argument name>: <value>, ...}}',
        "</tool_call>",
        "Use one such block per call. Results come back inside <tool_response></tool_response> tags.",
    ]
    if isinstance(choice, dict):
        lines.append(f"Answer now with a call of the function {choice['function']['name']}.")
    elif choice == "required":
        lines.append("Answer now with a call of one of these functions.")
    return "\n".join(lines)


def _messages(body: dict, tools: list[dict], choice, fmt: ToolFormat) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                         for m in msgs):
        raise ToolRequestError("messages must be a non-empty list of {role, content} objects", "messages")
    out: list[dict] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        role, content = m["role"], _text(m.get("content"), where)
        calls = _calls(m, where) if role == "assistant" else []
        if fmt.native:
            msg = {"role": role, "content": content if content is not None or calls else ""}
            if calls:
                msg["tool_calls"] = calls
            for k in ("tool_call_id", "name"):
                if isinstance(m.get(k), str):
                    msg[k] = m[k]
            out.append(msg)
            continue
        if role == "tool":  # a tool result, as the user turn Hermes models are trained on
            block = f"<tool_response>\n{content or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if calls:
            parts = [content] if content else []
            parts += [_render_call(c, fmt.parser) for c in calls]
            content = "\n".join(parts)
        out.append({"role": role, "content": content or ""})
    for m in out:
        m.pop("_tool_results", None)
    if tools and not fmt.native and choice != "none":
        prompt = _system_prompt(tools, choice)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + prompt).strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- the plan -------------------------------------------------------------------------------------------------

def plan_request(body: dict, tokenizer: Tokenizer) -> ToolPlan:
    """Check a chat request's tools / tool_choice / response_format / messages and plan it (raises
    ToolRequestError). With tool_choice "none" the tool definitions stay out of the prompt and nothing is parsed
    as a tool call. A forced tool call takes precedence over response_format; with a response_format grammar
    (and no forced call) the output is the JSON document, so no tool-call parser runs."""
    raw_tools = body.get("tools")
    tools = _check_tools(raw_tools) if raw_tools is not None else []
    choice = _tool_choice(body, tools)
    response = _response_format(body)
    fmt = tool_format(tokenizer)
    messages = _messages(body, tools, choice, fmt)
    kwargs = {"tools": tools} if tools and fmt.native and choice != "none" else {}
    if choice == "none" or not tools:
        return ToolPlan(messages, kwargs, None, response, False)
    index = {t["function"]["name"]: i for i, t in enumerate(tools)}
    if choice == "auto":
        return ToolPlan(messages, kwargs, None if response else fmt.parser, response, False)
    forced = [(index[choice["function"]["name"]], choice)] if isinstance(choice, dict) else list(enumerate(tools))
    grammar = _check_forced(forced, fmt.parser, lambda i: f"tools[{i}]")
    return ToolPlan(messages, kwargs, fmt.parser, grammar, True)
