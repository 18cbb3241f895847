"""Request bodies of the OpenAI-compatible API, as pydantic models.

Unknown parameters are refused (`extra="forbid"`, reported as a 400 naming the parameter), so
nothing a client asks for is silently ignored. A few OpenAI parameters we do not implement are
still accepted at their neutral value (`suffix: ""`, `best_of` equal to `n`,
...), because clients send them with defaults filled in; so are nulls anywhere in a message (an
SDK's dump of an earlier reply carries `refusal: null`, `tool_calls: null`, ...). Bookkeeping
fields that ask nothing of generation (`user`, `store`, `metadata`) are accepted and unused.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.tokenizer import RESERVED_TEMPLATE_KWARGS

# Names a request's chat_template_kwargs may not take: the template call's own arguments, and
# those of the functions that hand the options on.
TEMPLATE_ARGUMENTS = RESERVED_TEMPLATE_KWARGS | {"messages", "tokenizer"}

# Parameters we do not implement, and the values that ask for nothing.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
}
# Message fields an SDK fills in on replies it returns, at the values that say nothing.
NEUTRAL_MESSAGE_VALUES: dict[str, tuple[Any, ...]] = {
    "tool_calls": ([],),
    "annotations": ([],),
}


def _body_error(param: str, message: str) -> PydanticCustomError:
    """A failed check across fields; `param` names the one to blame in the 400."""
    return PydanticCustomError("invalid_combination", message, {"param": param})


class _Strict(BaseModel):
    """Unknown fields are refused. A field sent as null takes its default, at any depth
    (OpenAI's "use the default": clients that fill in every field send nulls, and so does an
    SDK's dump of an earlier reply), for fields we do not implement too."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {name: value for name, value in data.items() if value is not None}


def _drop_neutral(data: Any, neutral_values: dict[str, tuple[Any, ...]]) -> Any:
    """Removes unimplemented fields that carry a value asking for nothing; others stay and
    fail."""
    if not isinstance(data, dict):
        return data
    return {
        name: value
        for name, value in data.items()
        if not (name in neutral_values and value in neutral_values[name])
    }


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far.
    continuous_usage_stats: bool = False
    # OpenAI pads chunks against length side channels when this is on; tandem never pads.
    include_obfuscation: bool | None = None


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # {}: any JSON value
    strict: bool | None = None  # the schema is always held to


class ResponseFormat(_Strict):
    """OpenAI's: "text" (anything), "json_object" (a JSON object), "json_schema" (JSON that
    fits the schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise _body_error("response_format", 'type "json_schema" needs its json_schema')
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a schema
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [f for f in ("json_", "regex", "choice", "json_object") if getattr(self, f)]
        if len(given) != 1:
            raise _body_error("structured_outputs", "give exactly one of json, regex, choice")
        return self

    def structure(self) -> tuple[str, str]:
        if self.json_object:
            return ("json_object", "")
        if self.json_ is not None:
            text = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return ("json_schema", text)
        if self.choice is not None:
            return ("regex", "|".join(f"({re.escape(c)})" for c in self.choice))
        return ("regex", self.regex or "")


class SamplingRequest(_Strict):
    """Parameters shared by completions and chat; None means the default."""

    model: str | None = None
    n: int = Field(1, ge=1)  # capped by ServerSettings.max_n
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # any signed 64-bit integer
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # token id (a decimal string in JSON) -> bias
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    user: str | None = None  # an end-user id for the client's own records; kept, never used
    store: bool | None = None  # OpenAI's stored completions: nothing is stored here
    metadata: dict[str, str] | None = None  # tags for stored completions: unused
    safety_identifier: str | None = None  # OpenAI's successor to `user`: kept, never used
    # OpenAI's hint for routing to a prompt cache: tandem's prefix cache needs none.
    prompt_cache_key: str | None = None
    # vLLM's extension: each prompt token's logprob given those before it, with this many
    # alternatives (a whole response's field: not when streaming, as in vLLM)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # chat's tool_choice "required" makes exactly one call with False; completions ignore it
    parallel_tool_calls: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        data = _drop_neutral(data, NEUTRAL_VALUES)
        if isinstance(data, dict) and "best_of" in data and data["best_of"] == data.get("n", 1):
            del data["best_of"]  # one draw per choice is what `n` asks for anyway
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise _body_error("stream_options", "stream_options needs stream set to true")
        if self.prompt_logprobs is not None and self.stream:
            raise _body_error("prompt_logprobs", "prompt_logprobs is not available when streaming")
        return self

    @property
    def scored_prompt(self) -> int | None:
        """SamplingParams.prompt_logprobs: the alternatives per prompt token, or None."""
        return self.prompt_logprobs

    @model_validator(mode="after")
    def _one_structure(self) -> SamplingRequest:
        if self.structured_outputs is not None and self.response_format is not None:
            raise _body_error("structured_outputs", "give response_format or structured_outputs")
        return self

    def structure(self) -> tuple[str, str] | None:
        """What the output must be (protocol/sampling.py SamplingParams.structure), or None."""
        if self.structured_outputs is not None:
            return self.structured_outputs.structure()
        response_format = self.response_format
        if response_format is None or response_format.type == "text":
            return None
        if response_format.type == "json_object":
            return ("json_object", "")
        schema = response_format.json_schema.schema_  # (given: the format's validator)
        return ("json_schema", json.dumps(schema)) if schema else ("json_object", "")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # this many alternatives per token, with the chosen one's
    echo: bool = False  # the prompt's text before the completion's (with logprobs: its too)

    @model_validator(mode="after")
    def _prompt_only_scores(self) -> CompletionRequest:
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            message = "max_tokens 0 returns only the prompt: it needs echo or prompt_logprobs"
            raise _body_error("max_tokens", message)
        return self

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0: the prompt (echoed, scored), nothing generated, as vLLM does."""
        return self.max_tokens == 0

    @property
    def scored_prompt(self) -> int | None:
        """echo with logprobs shows the prompt's tokens' logprobs, as OpenAI's API did."""
        wanted = [n for n in (self.prompt_logprobs, self.echoed_logprobs) if n is not None]
        return max(wanted) if wanted else None

    @property
    def echoed_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        # Checked up front: pydantic's own union errors name every member and confuse.
        if isinstance(prompt, str) or _is_ids(prompt):
            return prompt
        if isinstance(prompt, list) and (
            all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt)
        ):
            return prompt
        raise PydanticCustomError(
            "prompt_shape",
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of token id lists",
        )


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any]  # a JSON object as text (OpenAI) or already parsed


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def as_template_input(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    refusal: str | None = None  # an assistant turn's refusal text (never rendered)

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        return _drop_neutral(data, NEUTRAL_MESSAGE_VALUES)

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else ():
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise PydanticCustomError(
                    "content_part",
                    "only text content parts (type 'text' with a 'text' string) are supported",
                )
        return content

    def as_template_input(self) -> dict[str, Any]:
        """The plain dict a chat template reads; text parts are joined."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            # Templates read the arguments as a mapping (`| tojson`), as transformers' chat
            # templating documents; OpenAI sends them as JSON text.
            message["tool_calls"] = [
                {
                    **({"id": call.id} if call.id is not None else {}),
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """A call's arguments as a mapping when they are a JSON object, else as sent."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # (nested past the parser's depth)
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


class TemplateOptions(_Strict):
    """What a conversation's chat template reads besides the messages."""

    tools: list[Tool] | None = None  # function schemas, rendered by the template
    # vLLM's extensions to the chat request.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # to the template

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(TEMPLATE_ARGUMENTS.intersection(kwargs or {}))
        if taken:
            raise PydanticCustomError(
                "reserved", "chat_template_kwargs may not set {names}", {"names": ", ".join(taken)}
            )
        return kwargs

    def template_options(self) -> dict[str, Any]:
        options: dict[str, Any] = dict(self.chat_template_kwargs or {})
        if self.tools:
            options["tools"] = [tool.as_template_input() for tool in self.tools]
        if self.reasoning_effort is not None:
            options["reasoning_effort"] = self.reasoning_effort
        options["add_generation_prompt"] = self.add_generation_prompt
        return options


class ChatCompletionRequest(TemplateOptions, SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    # "auto" (the default with tools) needs the server's tool-call parser (chat.py checks);
    # a named function is a forced call, its arguments held to its parameters' schema;
    # "required": one call or more, each to one of the tools, held to its schema.
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _logprob_flags(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _body_error("top_logprobs", "top_logprobs needs logprobs set to true")
        if self.tool_choice == "required" and not self.tools:
            raise _body_error("tool_choice", 'tool_choice "required" needs tools')
        if isinstance(self.tool_choice, dict):
            self._forced_tool()  # a named function that is not among the tools: a 400 now
        if self.forces_calls and (
            self.response_format is not None or self.structured_outputs is not None
        ):
            raise _body_error("tool_choice", "a forced call takes no response_format")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise _body_error("max_tokens", "max_tokens and max_completion_tokens differ")
        return self

    def _forced_tool(self) -> Tool:
        choice = self.tool_choice
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _body_error(
                "tool_choice",
                'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            )
        for tool in self.tools or []:
            if tool.function.name == name:
                return tool
        raise _body_error("tool_choice", f"tool_choice names {name!r}, which is not in tools")

    @property
    def forced_tool(self) -> Tool | None:
        """The function tool_choice names: the reply is one call to it."""
        return self._forced_tool() if isinstance(self.tool_choice, dict) else None

    @property
    def forces_calls(self) -> bool:
        """The reply is tool calls and nothing else: a named function, or "required"."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    def structure(self) -> tuple[str, str] | None:
        tool = self.forced_tool
        if tool is not None:
            return ("json_schema", json.dumps(_parameters(tool)))
        if self.tool_choice == "required":
            return ("json_schema", json.dumps(self._calls_schema()))
        return super().structure()

    def _calls_schema(self) -> dict[str, Any]:
        """What "required" holds the reply to: a JSON array of calls, each
        {"name": one of the tools, "parameters": that tool's arguments}. A tool whose
        parameters refer within themselves ("$ref": "#/$defs/...") moves under the schema's own
        $defs, its references re-rooted there: "#" means the whole schema now."""
        calls, defs = [], {}
        for i, tool in enumerate(self.tools or []):
            parameters = _parameters(tool)
            rerooted = _rerooted(parameters, f"#/$defs/tool{i}")
            if rerooted != parameters:  # it has local references
                defs[f"tool{i}"] = rerooted
                parameters = {"$ref": f"#/$defs/tool{i}"}
            calls.append({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            })  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def _rerooted(schema: Any, root: str) -> Any:
    """`schema` with its local references ("#...") pointing under `root` instead of "#"."""
    if isinstance(schema, dict):
        return {
            key: root + value[1:] if key == "$ref" and isinstance(value, str)
            and value.startswith("#") else _rerooted(value, root)
            for key, value in schema.items()
        }  # fmt: skip
    if isinstance(schema, list):
        return [_rerooted(item, root) for item in schema]
    return schema


class TokenizeRequest(TemplateOptions):
    """A prompt's tokens, or a conversation's as the chat route renders it (same options)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _body_error("prompt", "send exactly one of prompt and messages")
        if self.prompt is not None and (self.tools or self.chat_template_kwargs):
            raise _body_error("prompt", "tools and chat_template_kwargs go with messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt]  # not true, 1.0 or "1", which lax parsing would take for token 1
