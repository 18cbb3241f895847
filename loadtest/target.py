"""The server under test: its endpoint URL, headers and the model id found at start."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from loadtest.config import TargetConfig
from loadtest.errors import BenchError, describe_http_error, one_line


@dataclass(frozen=True)
class Target:
    url: str  # the full endpoint URL requests are posted to
    model: str
    headers: dict[str, str]
    is_chat: bool


def build_target(config: TargetConfig, model: str) -> Target:
    """`model` is the resolved model id; requests name --served-model-name instead when given."""
    return Target(
        url=config.base_url.rstrip("/") + config.endpoint,
        model=config.served_model_name or model,
        headers=request_headers(config),
        is_chat=config.is_chat,
    )


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def request_headers(config: TargetConfig) -> dict[str, str]:
    """Authorization from --api-key, then every --header, which wins (as in vLLM)."""
    return auth_headers(config.api_key) | dict(config.headers)


def resolve_model(client: httpx.Client, config: TargetConfig) -> str:
    """The configured model, else the first id the server lists at /v1/models."""
    if config.model is not None:
        return config.model
    url = config.base_url.rstrip("/").removesuffix("/v1") + "/v1/models"  # (an SDK's base URL)
    try:
        response = client.get(url, headers=request_headers(config))
    except httpx.HTTPError as err:
        raise BenchError(f"cannot reach {url}: {one_line(str(err)) or type(err).__name__}") from err
    if response.status_code != 200:
        error = describe_http_error(response.status_code, response.reason_phrase, response.text)
        raise BenchError(f"GET {url} returned {error}; pass --model")
    return _first_model_id(response, url)


def _first_model_id(response: httpx.Response, url: str) -> str:
    try:
        models = response.json().get("data")
        first = models[0]["id"]
    except (ValueError, AttributeError, LookupError, TypeError):
        raise BenchError(
            f"{url} lists no model id: {one_line(response.text)}; pass --model"
        ) from None
    if not isinstance(first, str):
        raise BenchError(f"{url} lists no model id: {one_line(response.text)}; pass --model")
    return first
