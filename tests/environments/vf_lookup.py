"""A small real verifiers v1 environment for the adapter's tests: look a hidden string up with a tool, answer with it
reversed.

Each task names a key; the ``lookup`` tool (a taskset-wide ``vf.Toolset``, served over MCP by verifiers) returns the
string hidden under that key; the reward is 1 when the final reply is that string reversed, else 0. Its text keeps
to the tiny test tokenizer's alphabet (``0-9 a-z = : + ?`` and space), so a CPU test model can read all of it.

verifiers v1 loads a taskset by package name (``taskset.id``, a top-level module exporting the ``Taskset`` via
``__all__``), so this file is imported as ``vf_lookup`` with tests/environments on the path; verifiers starts the
tool server as ``python -m vf_lookup``, hence the ``__main__`` block. ``ENV`` is the ``[env]`` config that runs it on
this machine.
"""

from __future__ import annotations

import verifiers.v1 as vf

HIDDEN = {"k1": "abc", "k2": "bdca", "k3": "dd1a", "k4": "zq9"}
"""key -> the hidden string; known to the tool and to the reward, never to the prompt."""

ENV = {
    "taskset": {"id": "vf_lookup"},
    # null: verifiers' plain chat loop with the task's MCP tools (no bash tool); subprocess: on this machine.
    "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}, "max_turns": 4},
}
"""The verifiers ``[env]`` config of this environment (the adapter's ``args.env``)."""


class LookupData(vf.TaskData):
    key: str
    answer: str
    """The hidden string reversed: what the final reply must be."""


class LookupTask(vf.Task[LookupData]):
    @vf.reward
    async def reversed_hidden(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)


class LookupToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is called plain ``lookup``, not ``lookup_toolset_lookup``

    @vf.tool
    def lookup(self, key: str) -> str:
        """the string hidden under key"""
        return HIDDEN.get(key, "none")


class LookupConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    def load(self) -> list[LookupTask]:
        return [
            LookupTask(LookupData(prompt=f"call lookup with key {key} then answer with its value reversed", key=key,
                                  answer=hidden[::-1]), self.config.task)
            for key, hidden in HIDDEN.items()
        ]

    @classmethod
    def toolsets(cls, config: LookupConfig) -> list[vf.Toolset]:
        return [LookupToolset(config.tools)]


__all__ = ["LookupTaskset"]

if __name__ == "__main__":
    LookupToolset.run()
