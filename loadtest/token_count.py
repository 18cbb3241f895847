"""Counting tokens the way the target model does: with a local Hugging Face tokenizer folder, or
with the server's own `POST /tokenize`. Special tokens are never counted."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import httpx

from loadtest.errors import BenchError, describe_http_error, one_line


class TokenCounter(Protocol):
    def count(self, text: str) -> int:
        """The number of tokens of `text`, without special tokens."""
        ...


class LocalTokenizer:
    """A tokenizer loaded with transformers' AutoTokenizer: a folder, or (as vLLM's --tokenizer
    takes it) a Hugging Face id such as org/name, from the local cache or the Hub."""

    def __init__(self, folder: Path, trust_remote_code: bool = False) -> None:
        if not folder.is_dir() and not _looks_like_hub_id(folder):
            raise BenchError(f"tokenizer folder {folder} does not exist")
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(
                str(folder), trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as err:
            raise BenchError(
                f"cannot load a tokenizer from {folder}: {one_line(str(err))}"
            ) from err

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens (what the server adds is its own)."""
        return self._tokenizer.encode(text, add_special_tokens=False)


class ServerTokenizer:
    """The server's `POST /tokenize {"model", "prompt"} -> {"tokens": [...], "count": N}`."""

    def __init__(self, client: httpx.Client, base_url: str, model: str) -> None:
        self._client = client
        self._url = base_url.rstrip("/") + "/tokenize"
        self._model = model

    def count(self, text: str) -> int:
        payload = {"model": self._model, "prompt": text, "add_special_tokens": False}
        try:
            response = self._client.post(self._url, json=payload)
        except httpx.HTTPError as err:
            raise BenchError(f"cannot reach {self._url}: {one_line(str(err))}") from err
        if response.status_code == 404:
            raise BenchError(f"{self._url} not found (HTTP 404); pass --tokenizer DIR")
        if response.status_code != 200:
            error = describe_http_error(response.status_code, response.reason_phrase, response.text)
            raise BenchError(f"POST {self._url} returned {error}")
        return _count_from(response, self._url)


def _count_from(response: httpx.Response, url: str) -> int:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("count"), int):
        return body["count"]
    if isinstance(body, dict) and isinstance(body.get("tokens"), list):
        return len(body["tokens"])
    raise BenchError(f"{url} answered without 'count' or 'tokens': {one_line(response.text)}")


def _looks_like_hub_id(path: Path) -> bool:
    """org/name or name: relative, not starting with '.' or '~', and nothing of it exists."""
    text = str(path)
    relative = not path.is_absolute() and not text.startswith((".", "~"))
    return relative and len(path.parts) <= 2 and not path.exists()


def open_counter(
    tokenizer: Path | None,
    client: httpx.Client,
    base_url: str,
    model: str,
    trust_remote_code: bool = False,
) -> TokenCounter:
    """The local tokenizer when one is named, else the server's /tokenize."""
    if tokenizer is not None:
        return LocalTokenizer(tokenizer, trust_remote_code)
    return ServerTokenizer(client, base_url, model)
