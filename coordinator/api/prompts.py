"""From a request body to what the backend takes: prompt token ids and SamplingParams.

Every check that can fail is done here, before admission, so a bad request is a 400 and never
occupies a place in the queue.
"""

from __future__ import annotations

from typing import Any

from coordinator.api.client import EngineClient
from coordinator.api.errors import as_api_error, invalid
from coordinator.api.protocol import ChatMessage, Prompt, SamplingRequest
from engine.tokenizer import Tokenizer
from protocol.errors import RequestError
from protocol.sampling import SamplingError, SamplingParams


def completion_prompts(tokenizer: Tokenizer, prompt: Prompt, max_prompts: int) -> list[list[int]]:
    """One token id list per prompt: text is tokenized, token ids pass through. More than
    `max_prompts` is refused before any is tokenized (300,000 one-word prompts held the event
    loop, and every stream on the server, for 12 s before the count was checked)."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    check_prompt_count(len(prompts), max_prompts)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise invalid("the prompt is empty", param="prompt")
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


def check_prompt_count(count: int, max_prompts: int) -> None:
    if count > max_prompts:
        raise invalid(
            f"the request holds {count} prompts; this server takes at most {max_prompts} per "
            "request",
            param="prompt",
        )


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], **options: Any) -> list[int]:
    """`options`: the template's (`ChatCompletionRequest.template_options`)."""
    return tokenizer.encode_chat([m.as_template_input() for m in messages], **options)


def build_params(
    client: EngineClient,
    request: SamplingRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    names: dict[str, str],
) -> SamplingParams:
    """SamplingParams for one prompt; `max_tokens` None means whatever context is left, and
    no more than that is ever given.
    `names` maps SamplingParams' names to the request's (chat says max_completion_tokens)."""
    try:
        client.check_request(prompt_ids)
    except RequestError as err:
        raise invalid(str(err), param=names.get("prompt", "prompt")) from err
    room = client.max_model_len - len(prompt_ids)
    if max_tokens is not None and max_tokens > client.max_model_len:
        raise invalid(
            f"{names.get('max_tokens', 'max_tokens')} is {max_tokens}, more than this "
            f"model's context ({client.max_model_len} tokens)",
            param=names.get("max_tokens", "max_tokens"),
        )
    # As vLLM does: the output stops where the context ends ("length"), whatever was asked
    # (a chat client with a fixed max_tokens and a growing history gets shorter replies).
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    if request.min_tokens > room:
        raise invalid(
            f"min_tokens is {request.min_tokens}, but the prompt ({len(prompt_ids)} tokens) "
            f"leaves {room} of this model's context ({client.max_model_len} tokens)",
            param="min_tokens",
        )
    try:
        params = SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, **_sampling_fields(request)
        )
        client.check_request(prompt_ids, params)
        return params
    except SamplingError as err:
        error = as_api_error(err)
        named = names.get(err.param, err.param)  # the message names it as the request does
        error.param, error.message = named, named + str(err)[len(err.param) :]
        raise error from err


def _sampling_fields(request: SamplingRequest) -> dict:
    """The request's sampling fields that were given (None keeps SamplingParams' default)."""
    fields = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": None if request.seed is None else request.seed % 2**64,  # as torch reads it
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "logit_bias": request.logit_bias,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
    }
    if request.top_k in (0, -1):  # both spell "off" in OpenAI-compatible servers
        fields["top_k"] = None
    given = {name: value for name, value in fields.items() if value is not None}
    return given | {
        "structure": request.structure(),
        "min_tokens": request.min_tokens,
        "ignore_eos": request.ignore_eos,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "prompt_logprobs": request.scored_prompt,
    }
