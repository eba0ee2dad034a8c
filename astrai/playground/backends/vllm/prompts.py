"""The served model and its text: which model (``/v1/models``), its tokenizer when it is on this machine, else chat
templates and token text from the server's ``/tokenize`` and ``/detokenize``.

What is cached, and what is not:

- a chat-templated prompt, once the server applied the template; and a prompt the server said it has no template
  for (HTTP 400 naming the chat template: a model without one), in a bounded LRU of ``CHAT_CACHE`` prompts;
- never a failure. A transient one (no answer, a timeout, HTTP 408, 425, 429 or 5xx) raises
  ``BackendUnavailable`` naming it, for that run only: the next run asks again. Another refusal (4xx) falls back
  to ``prefix + prompt`` for that run, uncached.
- decoded token text in a bounded LRU of ``DECODE_CACHE``; a failed decode reads "?" and is asked again next time.

Thread-safe: one lock guards both caches; no HTTP call is made under it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import httpx

from astrai.playground.backends.protocol import BackendUnavailable, chat_messages

CHAT_CACHE = 256  # templated prompts kept (a scenario has a handful; a classroom a few hundred)
DECODE_CACHE = 8192
TRANSIENT = frozenset({408, 425, 429})  # and every 5xx
NO_TEMPLATE = "chat template"  # what vLLM's 400 says of a model without one


def resolve_model(http: httpx.Client, url: str, model_name: str | None) -> dict[str, Any]:
    """The served model's entry in ``/v1/models``: the one named, or the only one."""
    try:
        response = http.get("/v1/models")
        response.raise_for_status()
        models = response.json().get("data", [])
    except (httpx.HTTPError, ValueError) as exc:
        if model_name:
            return {"id": model_name}  # the operator named it: start, and reconnect when the server is up
        raise BackendUnavailable(
            f"cannot list the models of the vLLM server at {url}: {exc}. Is it running? "
            "(pass --model-name to start without it)"
        ) from exc
    if model_name:
        for model in models:
            if model.get("id") == model_name:
                return model
        names = ", ".join(m.get("id", "?") for m in models) or "none"
        raise ValueError(f"the vLLM server at {url} does not serve {model_name!r} (it serves: {names})")
    if len(models) != 1:
        names = ", ".join(m.get("id", "?") for m in models) or "none"
        raise ValueError(f"the vLLM server at {url} serves {len(models)} models ({names}): pick one with --model-name")
    return models[0]


def load_tokenizer(root: str | None) -> Any:
    """The served model's tokenizer when its path exists here (same text and ids as the server); else None,
    and /tokenize, /detokenize answer instead."""
    if not root or not Path(root).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(root)
    except Exception:  # noqa: BLE001 - a tokenizer this transformers cannot read: fall back to the server
        return None


class ServerText:
    """The server's tokenizer, over HTTP, with the caches the module docstring describes."""

    def __init__(self, http: httpx.Client, url: str, model: str):
        self._http, self._url, self._model = http, url, model
        self._lock = threading.Lock()
        self._chat: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._decoded: OrderedDict[tuple[int, ...], str] = OrderedDict()

    def chat(self, prefix: str, prompt: str) -> str:
        """The text that reaches the model: its chat template applied by the server, else ``prefix + prompt``."""
        key = (prefix, prompt)
        with self._lock:
            if key in self._chat:
                self._chat.move_to_end(key)
                return self._chat[key]
        payload = {"model": self._model, "messages": chat_messages(prefix, prompt), "add_generation_prompt": True}
        try:
            response = self._http.post("/tokenize", json=payload)
            code = response.status_code
            if code in TRANSIENT or code >= 500:
                raise BackendUnavailable(
                    f"the vLLM server at {self._url} answered /tokenize with HTTP {code} "
                    f"({_reason(response)}); nothing was sent: run again in a moment"
                )
            if code >= 400:  # it cannot apply a template to these messages: the text as it is
                text, keep = prefix + prompt, NO_TEMPLATE in _reason(response)
            else:
                text, keep = self.detokenize(response.json()["tokens"]), True
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            raise BackendUnavailable(f"the vLLM server at {self._url} did not answer /tokenize: {exc}") from exc
        if keep:
            self._remember(self._chat, key, text, CHAT_CACHE)
        return text

    def decode(self, token_ids: tuple[int, ...]) -> str:
        """The text of these tokens, or "?" while the server cannot say (a view must not fail)."""
        with self._lock:
            if token_ids in self._decoded:
                return self._decoded[token_ids]
        try:
            text = self.detokenize(list(token_ids))
        except (httpx.HTTPError, KeyError, ValueError):
            return "?"
        self._remember(self._decoded, token_ids, text, DECODE_CACHE)
        return text

    def detokenize(self, tokens: list[int]) -> str:
        response = self._http.post("/detokenize", json={"model": self._model, "tokens": tokens})
        response.raise_for_status()
        return response.json()["prompt"]

    def _remember(self, cache: OrderedDict[Any, str], key: object, value: str, limit: int) -> None:
        with self._lock:
            cache[key] = value
            cache.move_to_end(key)
            while len(cache) > limit:
                cache.popitem(last=False)


def _reason(response: httpx.Response) -> str:
    """The server's error message (vLLM: ``{"error": {"message": ...}}``), else the start of its body."""
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return str(message or response.text or response.reason_phrase)[:300]


__all__ = ["CHAT_CACHE", "ServerText"]
