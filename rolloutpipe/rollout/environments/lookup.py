"""``lookup``: the multi-turn default for the embedded tiny model, a tool task it can learn on a CPU.

A row hides a short string (``metadata.hidden``; data.task.kind=lookup writes such rows). The model cannot answer
from the prompt: it has to call the lookup tool, by answering with a turn that contains ``?``; the tool's turn
shows the string; then the model answers with its reversal. The episode's reward is the reversal's partial credit
(tasks.reversal_reward: the share of positions right) for the first turn that is not a tool call, and 0 when the
model answers without having looked the string up. A second lookup shows the string again (a wasted turn, within
environment.max_turns). Every message stays within the tiny tokenizer's characters.
"""

from __future__ import annotations

from typing import Any

from rolloutpipe.rollout.environments.base import Message, Turn, register_environment
from rolloutpipe.rollout.tasks import reversal_reward

TOOL_CALL = "?"


class Lookup:
    def __init__(self) -> None:
        self.hidden = self.answer = ""
        self.looked_up = False

    def reset(self, label: Any, metadata: dict[str, Any]) -> list[Message]:
        hidden = metadata.get("hidden")
        if not isinstance(hidden, str) or not hidden or not isinstance(label, str):
            raise ValueError("a lookup row needs metadata.hidden (the string the tool shows) and a string label (its "
                             f"reversal), got metadata.hidden={hidden!r} and label={label!r}")
        self.hidden, self.answer, self.looked_up = hidden, label, False
        return []

    def step(self, response: str) -> Turn:
        if TOOL_CALL in response:
            self.looked_up = True
            return Turn(messages=[{"role": "tool", "content": self.hidden}])
        reward = reversal_reward(response, self.answer, {}) if self.looked_up else 0.0
        return Turn(reward=reward, done=True)


@register_environment("lookup")
def lookup(args: dict[str, Any]) -> Lookup:
    if args:
        raise ValueError(f"the lookup environment takes no environment.args, got {sorted(args)}")
    return Lookup()
