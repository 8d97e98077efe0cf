"""Pydantic models of the request bodies (OpenAI's field names and types; strict: `"stream": "no"` is a 400, not a
truthy string), used to validate each body before it is planned and to give the OpenAPI document real request
schemas. The validated model is the request the server reads (serving/openai_request.py); only what depends on the
server (the model name, max_tokens against the context, n against the pool, token ids against the vocabulary) is
checked there. Fields that would change the output and are not implemented (suffix, media content parts, unknown
roles) are refused with a 400 naming them; fields without effect on the output (e.g. `user`)
are accepted."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import field_validator, model_validator

from .http_errors import APIError

# StrictFloat takes an integer too (1 as 1.0) but neither a bool nor a string; a bound on a field whose type is a
# union would be applied to every member (a 4-item cap on `stop` also capped a stop *string* at 4 characters) and
# written beside `anyOf` in the JSON schema, where no validator reads it: each bound sits on the one member it is for.
Int64 = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)
NonEmpty = Field(min_length=1)
Text = Annotated[StrictStr, NonEmpty]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Open):
    type: StrictStr
    text: StrictStr | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, v):
        if v != "text":
            raise ValueError(f"content parts of type {v!r} are not supported: this model reads text only")
        return v

    @model_validator(mode="after")
    def _text_part(self):
        if self.text is None:
            raise ValueError("a text part needs \"text\": a string")
        return self


ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(_Open):
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v):
        if v not in ROLES:
            raise ValueError(f"role {v!r} is not one of {', '.join(ROLES)}")
        return v

    @model_validator(mode="after")
    def _tool_answer(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs \"tool_call_id\": the id of the call it answers")
        return self


class FunctionDef(_Open):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Open):
    type: StrictStr = Field(description='"function"')
    function: FunctionDef


class StreamOptions(_Open):
    include_usage: StrictBool | None = None
    include_speculation: StrictBool | None = Field(
        default=None, description="specloom extension: each streamed chunk's choice carries `specloom`: the step's "
                                  "token texts and how many of them were accepted drafts (the rest: the target's own)")


class _Sampling(_Open):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | None = Field(default=None, gt=0, le=1)
    n: StrictInt | None = Field(default=None, ge=1)
    seed: StrictInt | None = Int64
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    # penalties and logit bias (specloom/penalties.py: exact under speculation, each draft-tree node penalised by
    # its own path); repetition_penalty is vLLM's extension (HF's definition, over prompt and output tokens)
    logit_bias: Annotated[dict[str, StrictFloat], Field(max_length=1024)] | None = None
    presence_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=100)
    speculate: StrictBool | None = Field(
        default=None, description="specloom extension: false decodes this request plainly (no drafter), e.g. to compare")
    sampling_rule: Literal["auto", "coupled", "rejection"] | None = Field(
        default=None, description="specloom extension: how sampled tokens are drawn under speculation (auto: "
                                  "coupled when seeded -- the text depends on the seed alone --, else rejection)")

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not key.isdigit() or len(key) > 12:
                raise ValueError(f"logit_bias keys are token ids (non-negative integers as strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return v


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v


class CompletionRequest(_Sampling):
    prompt: Text | Annotated[list[Text], NonEmpty] | Annotated[list[StrictInt], NonEmpty] | Annotated[
        list[Annotated[list[StrictInt], NonEmpty]], NonEmpty] = Field(
        description="text, a list of texts, a list of token ids, or a list of token-id lists (none empty)")
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    echo: StrictBool | None = None
    best_of: StrictInt | None = Field(default=None, ge=1)
    suffix: StrictStr | None = None

    @field_validator("echo")
    @classmethod
    def _echo(cls, v, info):
        if v and info.data.get("logprobs") is not None:
            raise ValueError("echo with logprobs is not supported (the prompt's logprobs are not computed)")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):
        if v != (info.data.get("n") or 1):
            raise ValueError("best_of must equal n: specloom returns every candidate it generates")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v


def _path(loc) -> str:
    """pydantic's location without its union-member tags: ('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or "-" in part or part in ("str", "int", "float", "bool", "dict", "list") or part[:1].isupper():
            continue  # 'list[str]', 'function-after[...]', 'ContentPart': the union member tried, not a field
        else:
            out += ("." if out else "") + part
    return out


def validate_body(body: dict, chat: bool) -> ChatCompletionRequest | CompletionRequest:
    """The body as its request model; APIError(400) naming the first field that does not fit."""
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errs = e.errors(include_url=False, include_input=False)
        top = errs[0]["loc"][:1]
        # a union tries each member: report the member that got furthest, and every reason given there
        deepest = max((x for x in errs if x["loc"][:1] == top), key=lambda x: len(_path(x["loc"])))
        where = _path(deepest["loc"])
        reasons = dict.fromkeys(x["msg"] for x in errs if x["loc"][:1] == top and _path(x["loc"]) == where)
        msg = "; or ".join(reasons)
        msg = f"{where}: {msg}" if where else msg
        raise APIError(400, f"invalid request: {msg}", where or None) from None


def openapi_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose handler reads the raw body: the model's schema as its request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def openapi_components() -> dict:
    """The request models and everything they refer to, as OpenAPI component schemas."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema([(m, "validation") for m in (ChatCompletionRequest, CompletionRequest)],
                                ref_template="#/components/schemas/{model}")
    return top.get("$defs", {})
