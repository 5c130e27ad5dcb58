"""HTTP bodies of the API as pydantic models: OpenAI requests/responses and control bodies.

The request models are the first line of validation (types, ranges, finite numbers,
unknown keys); they also generate the OpenAPI schema that clients and the property
tests read, so their bounds must be the ones the handlers really enforce. Models here
hold no behaviour beyond validation and must not touch the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from wattserve.controller.schema import PolicyModel

# Bounds shared with the engine's SamplingParams checks.
_PRIORITY_MIN = -(2**31)
_PRIORITY_MAX = 2**31 - 1
_SEED_MAX = 2**63 - 1
_MAX_STOP = 16
_MAX_STOP_CHARS = 1024
_MAX_N = 16  # choices per prompt
_MAX_PROMPTS = 16  # prompts in one completions request
_MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows
_MAX_LOGIT_BIAS = 1024  # entries
_MAX_TOOLS = 128
_FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


# OpenAI fields this server accepts only at the value that changes nothing: anything else
# asks for behaviour it does not implement, so it is refused rather than ignored.
# vLLM's beam-search and detokenization extras that its clients send at their defaults are
# here too: beam search does not exist here, so only "off" is true to what happens.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "early_stopping": (False,),
    "spaces_between_special_tokens": (True,),
    "suffix": ("",),
    # /tokenize: generation here never adds special tokens to a prompt, so neither may this.
    "add_special_tokens": (False,),
}


def _neutral_schema(name: str, nullable: bool = True) -> dict[str, Any]:
    """The OpenAPI side of _NEUTRAL: the schema admits only the neutral values."""
    values = list(_NEUTRAL[name])
    if isinstance(values[0], (list, dict)):
        # Containers: say "empty" through their size keywords (null stays allowed).
        key = "maxItems" if isinstance(values[0], list) else "maxProperties"
        return {key: 0} if not values[0] else {"enum": [*values, *([None] if nullable else [])]}
    return {"enum": [*values, *([None] if nullable else [])]}


def _require_neutral(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or ""
    allowed = _NEUTRAL[name]
    # bool is an int: False must not pass as 0 for numeric fields and vice versa.
    if value is None or any(type(value) is type(a) and value == a for a in allowed):
        return value
    if isinstance(value, float) and any(type(a) is int and value == a for a in allowed):
        return value
    raise ValueError(f"{name} is not supported (allowed: {', '.join(repr(a) for a in allowed)})")


class _Body(BaseModel):
    # Unknown keys are rejected by name: a typo ("max_token") must not pass silently.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


StopStrings = Annotated[
    Annotated[str, Field(min_length=1, max_length=_MAX_STOP_CHARS)]
    | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=_MAX_STOP_CHARS)]],
        Field(max_length=_MAX_STOP),
    ]
    | None,
    Field(description="Up to 16 strings; generation ends before the first one produced."),
]


class StreamOptions(_Body):
    include_usage: bool = False


_MAX_CHOICES = 1024  # guided_choice alternatives
_MAX_PATTERN_CHARS = 1 << 16  # regex / grammar text


class JSONSchemaFormat(_Body):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(
        ..., alias="schema", description="The JSON schema the output must validate against."
    )
    strict: bool | None = Field(
        None, description="Accepted; the output always follows the schema (strict or not)."
    )


class ResponseFormatText(_Body):
    type: Literal["text"]


class ResponseFormatJSONObject(_Body):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Body):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
    Field(discriminator="type"),
]
GuidedChoices = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=_MAX_STOP_CHARS)]],
    Field(min_length=1, max_length=_MAX_CHOICES),
]
PatternText = Annotated[str, Field(min_length=1, max_length=_MAX_PATTERN_CHARS)]


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: PatternText | None = None
    choice: GuidedChoices | None = None
    grammar: PatternText | None = Field(None, description="A Lark or GBNF grammar.")
    json_object: bool | None = None


class _SamplingFields(_Body):
    """Fields shared by both generation endpoints."""

    model: str | None = Field(None, description="Served model name; omitted means the one model.")
    max_tokens: int | None = Field(None, ge=1, description="Upper bound on generated tokens.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables top-k (extension).")
    seed: int | None = Field(None, ge=0, le=_SEED_MAX)
    stop: StopStrings = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=64, description="Token ids that end generation (extension)."
    )
    n: int = Field(
        1, ge=1, le=_MAX_N, description="Choices per prompt, each sampled independently."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    priority: int = Field(
        0, ge=_PRIORITY_MIN, le=_PRIORITY_MAX, description="Lower is served first (extension)."
    )
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence (extension).")
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="Subtracted from each token already generated."
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="Subtracted per occurrence in the generated tokens."
    )
    repetition_penalty: float | None = Field(
        None,
        ge=0.01,
        le=10,
        description="Divides positive / multiplies negative logits of prompt and generated "
        "tokens; 1 is off (extension).",
    )
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                Annotated[float, Field(ge=-100, le=100)],
            ],
            Field(max_length=_MAX_LOGIT_BIAS),
        ]
        | None
    ) = Field(None, description="Token id (as a string) -> added to its logit, -100..100.")
    min_p: float | None = Field(
        None, ge=0, le=1, description="Drop tokens below min_p x the top probability (extension)."
    )
    min_tokens: int = Field(
        0, ge=0, description="EOS and stop_token_ids are banned until this many (extension)."
    )
    include_stop_str_in_output: bool = Field(
        False, description="Keep the matched stop string at the end of the text (extension)."
    )
    skip_special_tokens: bool = Field(
        True, description="Leave special tokens out of the text (extension)."
    )
    # Structured outputs (wattserve/daemon/api/structured.py): at most one of these.
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema {name, schema, strict}."
    )
    guided_json: dict[str, Any] | str | None = Field(
        None, description="A JSON schema the output follows (vLLM)."
    )
    guided_regex: PatternText | None = Field(None, description="A regex the output matches.")
    guided_choice: GuidedChoices | None = Field(
        None, description="The output is exactly one of these strings (vLLM)."
    )
    guided_grammar: PatternText | None = Field(
        None, description="A Lark or GBNF grammar the output follows (vLLM)."
    )
    structured_outputs: StructuredOutputs | None = None
    # vLLM extras accepted only at their neutral value (see _NEUTRAL).
    use_beam_search: bool = Field(
        False,
        description="Beam search is not supported: must be false.",
        json_schema_extra=_neutral_schema("use_beam_search", nullable=False),
    )
    length_penalty: float | None = Field(
        None,
        description="Beam search only: must be 1.",
        json_schema_extra=_neutral_schema("length_penalty"),
    )
    early_stopping: bool | None = Field(
        None,
        description="Beam search only: must be false.",
        json_schema_extra=_neutral_schema("early_stopping"),
    )
    spaces_between_special_tokens: bool | None = Field(
        None,
        description="Only true.",
        json_schema_extra=_neutral_schema("spaces_between_special_tokens"),
    )
    # Accepted and ignored: bookkeeping fields that do not change the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = Field(None, max_length=64)

    @field_validator(
        "use_beam_search", "length_penalty", "early_stopping", "spaces_between_special_tokens"
    )
    @classmethod
    def _neutral_sampling(cls, v: Any, info: ValidationInfo) -> Any:
        return _require_neutral(v, info)

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[
            list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=_MAX_PROMPTS)
        ]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=_MAX_PROMPTS)]
    ) = Field(
        ...,
        description="Text, token ids, or a list of up to 16 of either: choices are indexed "
        "prompt by prompt (prompt i, sample j -> index i * n + j).",
    )
    max_tokens: int | None = Field(
        None, ge=0, description="Upper bound on generated tokens; 0 only with echo."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=_MAX_LOGPROBS,
        description="Return each token's logprob and the top `logprobs` alternatives.",
    )
    echo: bool = Field(False, description="Prepend the prompt (and its logprobs) to the answer.")
    best_of: int | None = Field(
        None, ge=1, le=_MAX_N, description="Accepted only equal to n (no ranking is done)."
    )
    suffix: str | None = Field(
        None,
        description="Not supported: must be empty.",
        json_schema_extra=_neutral_schema("suffix"),
    )

    @field_validator("suffix")
    @classmethod
    def _neutral_completion(cls, v: Any, info: ValidationInfo) -> Any:
        return _require_neutral(v, info)

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts, each as text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]


class TextPart(_Body):
    """A text content part: the only kind served (the model's text part; Gemma 3's vision
    tower is not run), so an image, audio or file part is refused by name."""

    type: Literal["text"]
    text: str

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, kind: Any) -> Any:
        if isinstance(kind, str) and kind != "text":
            what = "image" if "image" in kind else "non-text"
            raise ValueError(
                f"{what} inputs are not supported (content part type {kind!r}); "
                "this server takes text parts only"
            )
        return kind


class ToolCallFunction(_Body):
    name: str = Field(..., max_length=256)
    arguments: str = Field(..., description="The arguments as JSON text.")


class MessageToolCall(_Body):
    """A tool call of an earlier assistant turn, as the API returned it."""

    id: str = Field(..., max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


MessageContent = str | Annotated[list[TextPart], Field(min_length=1)]


class _Turn(_Body):
    name: str | None = Field(None, max_length=256)
    content: MessageContent | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class SystemTurn(_Turn):
    role: Literal["system", "developer"]
    content: MessageContent


class UserTurn(_Turn):
    role: Literal["user"]
    content: MessageContent


class AssistantTurn(_Turn):
    role: Literal["assistant"]
    content: MessageContent | None = Field(None, description="Required without tool_calls.")
    tool_calls: list[MessageToolCall] | None = Field(
        None, max_length=_MAX_TOOLS, description="The calls this turn made."
    )
    refusal: str | None = Field(None, description="Accepted, not rendered.")

    @model_validator(mode="after")
    def _has_content(self) -> AssistantTurn:
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (except with tool_calls)")
        return self


class ToolTurn(_Turn):
    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str = Field(..., max_length=256, description="The call this answers.")


_TURN_TAGS = {
    "system": "SystemTurn",
    "developer": "SystemTurn",
    "user": "UserTurn",
    "assistant": "AssistantTurn",
    "tool": "ToolTurn",
}


def _turn_tag(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return _TURN_TAGS.get(role) if isinstance(role, str) else None


# One model per role (as OpenAI's own schema has it), so the schema says which fields a
# role needs. Tags are capitalised so error params leave them out (errors.py).
ChatMessage = Annotated[
    Annotated[SystemTurn, Tag("SystemTurn")]
    | Annotated[UserTurn, Tag("UserTurn")]
    | Annotated[AssistantTurn, Tag("AssistantTurn")]
    | Annotated[ToolTurn, Tag("ToolTurn")],
    Discriminator(
        _turn_tag,
        custom_error_type="invalid_role",
        custom_error_message="role must be one of: " + ", ".join(_TURN_TAGS),
    ),
]


class FunctionDefinition(_Body):
    name: str = Field(..., pattern=_FUNCTION_NAME)
    description: str | None = Field(None, max_length=1 << 16)
    parameters: dict[str, Any] | None = Field(
        None,
        description="The arguments' JSON schema; a forced call is decoded under it. "
        "Omitted: no arguments.",
    )
    strict: bool | None = Field(
        None, description="Accepted; a forced call always follows the schema."
    )


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str = Field(..., pattern=_FUNCTION_NAME)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


Tools = Annotated[
    list[ToolDefinition],
    Field(
        max_length=_MAX_TOOLS,
        description="Functions the model may call (names unique); rendered through the "
        "chat template.",
    ),
]
ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    Field(
        description="none: no call (tools left out of the prompt); auto: the model decides; "
        "required / a named function: a call is decoded under the tools' JSON schema. "
        "Default: auto with tools, none without."
    ),
]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="Return each token's logprob.")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=_MAX_LOGPROBS,
        description="Alternatives per token (needs logprobs: true).",
    )
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call per answer (default: several allowed)."
    )

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# ---- responses ---------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per token: its text, logprob (null for an echoed prompt's first token), the top
    alternatives {text: logprob}, and its offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ResponseFunction(BaseModel):
    name: str
    arguments: str = Field(..., description="JSON text.")


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = Field(
        None, description="Present when the answer called tools (finish_reason tool_calls)."
    )


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion (`usage` only with include_usage)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of tool call `index`: first its id, type and name (arguments ""), then
    pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (`usage` only with include_usage)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str = Field(..., max_length=1 << 20)
    add_special_tokens: bool | None = Field(
        None,
        description="Only false: completions here never add special tokens (vLLM's "
        "benchmark client sends false).",
        json_schema_extra=_neutral_schema("add_special_tokens"),
    )

    @field_validator("add_special_tokens")
    @classmethod
    def _neutral_tokenize(cls, v: Any, info: ValidationInfo) -> Any:
        return _require_neutral(v, info)


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    add_generation_prompt: bool = True
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(..., max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "wattserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- operational and control bodies -------------------------------------------------


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
    phase: str


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"
    model: str


class KnobsUpdate(_Body):
    """Manual knob settings; omitted or null fields keep their value."""

    max_num_seqs: int | None = Field(None, ge=1, le=65_536, description="Batch cap, sequences.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, le=1 << 20, description="Token budget of one engine step."
    )
    quant_level: str | None = Field(
        None, max_length=32, description="Weight quantization level (fp32, bf16, int8, int4, ...)."
    )
    clock_mhz: int | None = Field(
        None, ge=1, le=10_000, description="SM clock lock, MHz (device.mode = control)."
    )
    decode_interval_ms: float | None = Field(
        None,
        ge=0,
        le=60_000,
        description="Decode pacing: a decode-only step no sooner than this after the step "
        "before while no request waits; 0: off.",
    )


class Knobs(BaseModel):
    """The knob values in force."""

    max_num_seqs: int
    max_num_batched_tokens: int
    quant_level: str
    sm_clock_lock_mhz: list[int] | None = None
    decode_interval_ms: float = 0.0


class StatusResponse(BaseModel):
    """One snapshot for people and scripts; sections absent in this build are null."""

    phase: str
    model: str | None
    server: dict[str, Any]
    engine: dict[str, Any] | None
    policy: PolicyModel
    device: dict[str, Any] | None = None
    controller: dict[str, Any] | None = None
