"""Prompt -> token ids, as vLLM's OpenAI server would tokenize them.

``/v1/completions``: a string prompt is encoded with the tokenizer's special tokens (vLLM's
default); a list of ints (or a one-element list of either) is taken as given. ``/v1/chat/
completions``: the tokenizer's chat template with ``add_generation_prompt=True`` when it has one;
without a template the message contents joined by newlines (an approximation: such a tokenizer
cannot serve chat in vLLM anyway). Anything else yields no tokens (the request is routed on load
alone). Loading the tokenizer is the only I/O.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from kvtier.errors import ConfigError


class _Tokenizer(Protocol):
    chat_template: Any

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any: ...


class PromptTokenizer:
    """Tokenizes request bodies; wraps a transformers tokenizer (or anything with ``encode``)."""

    def __init__(self, tokenizer: _Tokenizer | None) -> None:
        self._tok = tokenizer

    @classmethod
    def load(cls, path: str | None) -> "PromptTokenizer":
        """From a tokenizer directory (transformers ``AutoTokenizer``); None: no tokenizer.
        ConfigError (one line) when nothing loads from ``path``."""
        if not path:
            return cls(None)
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(path))
        except Exception as exc:  # noqa: BLE001  (transformers raises OSError, ValueError, HF errors...)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ConfigError(f"route.tokenizer: cannot load a tokenizer from {path[:200]!r} ({first}); give a "
                              "directory holding tokenizer files (tokenizer.json / tokenizer_config.json)") from exc

    @property
    def available(self) -> bool:
        return self._tok is not None

    def completion_ids(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a /v1/completions body's (first) prompt; [] when unknown."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str) and self._tok is not None:
            return list(self._tok.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True))))
        return []

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a /v1/chat/completions body's messages; [] when unknown."""
        messages = body.get("messages")
        if self._tok is None or not isinstance(messages, list):
            return []
        if getattr(self._tok, "chat_template", None):
            ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        text = "\n".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))
        return list(self._tok.encode(text, add_special_tokens=False))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
