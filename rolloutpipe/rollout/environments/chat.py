"""An environment's turn as token ids: the model's own chat template, applied once per turn.

The conversation is never re-rendered: the model's turns stay the ids the engine sampled, and each environment
turn is the text the chat template puts between the end of an assistant turn and the start of the next one
(``messages`` rendered after an assistant turn, with the generation prompt), tokenized once and appended. That text
is found as verl's and prime-rl's agent loops find it: render a short conversation ending in an assistant turn, then
the same conversation plus ``messages``, and take what the second adds. If the template writes something after the
assistant's end-of-turn token (Qwen's newline after ``<|im_end|>``), the model stopped before it, so it opens the
environment's turn. A template that re-renders earlier turns differently once more follow (some drop old reasoning)
fails the prefix check; ``messages`` are then rendered alone with the generation prompt.
"""

from __future__ import annotations

from rolloutpipe.rollout.environments.base import Message

_BASE: list[Message] = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
"""A conversation ending in an assistant turn; its content is irrelevant (only what follows is kept)."""


class TurnTemplate:
    """Token ids of an environment turn for ``tokenizer`` (see the module docstring)."""

    def __init__(self, tokenizer, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        if tokenizer.chat_template is None:
            raise ValueError("an environment needs a tokenizer with a chat template (its turns are rendered with "
                             "it); use a model whose tokenizer has one.")
        self._base = tokenizer.apply_chat_template(_BASE, tokenize=False)
        stops = [tokenizer.decode([t]) for t in stop_token_ids]
        end = max((self._base.rfind(s) + len(s) for s in stops if s and s in self._base), default=-1)
        self._after_stop = self._base[end:] if end >= 0 else ""
        """What the template writes after the assistant's end-of-turn token, which the model never samples."""

    def text(self, messages: list[Message]) -> str:
        full = self.tokenizer.apply_chat_template(_BASE + messages, tokenize=False, add_generation_prompt=True)
        if full.startswith(self._base):
            return self._after_stop + full[len(self._base):]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def ids(self, messages: list[Message]) -> list[int]:
        return self.tokenizer(self.text(messages), add_special_tokens=False)["input_ids"]
