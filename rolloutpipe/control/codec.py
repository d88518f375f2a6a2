"""A complete group as bytes and back: safetensors (tensors plus a JSON header), never pickle.

The payload of a group handle (control/transport.py): inline in the store or a file under run_dir/payloads;
the handle carries its sha256, checked before ``decode_group`` reads it.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rolloutpipe.types import CompleteGroup, EpisodeEnd, FinishReason, Sample


def encode_group(group: CompleteGroup) -> bytes:
    samples = group.samples
    tensors = {
        "prompt_ids": torch.tensor(group.prompt_ids, dtype=torch.int64),
        "response_ids": torch.tensor([t for s in samples for t in s.response_ids], dtype=torch.int64),
        "response_lens": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.int64),
        "logprobs": torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float64),
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float64),
        "policy_versions": torch.tensor([s.policy_version for s in samples], dtype=torch.int64),
        "advantages": torch.tensor(group.advantages, dtype=torch.float64),
    }
    if any(s.response_mask is not None for s in samples):  # episodes: which tokens the model sampled
        tensors["response_mask"] = torch.tensor(
            [m for s in samples for m in (s.response_mask or [1] * len(s.response_ids))], dtype=torch.int8)
    header = {
        "step": group.step,
        "group": group.group,
        "batch": group.batch,
        "policy_version": group.policy_version,
        "prompt_index": group.prompt_index,
        "completed_s": group.completed_s,
        "samples": [
            {"text": s.response_text, "finish_reason": s.finish_reason.value, "reward_error": s.reward_error,
             "reward_timed_out": s.reward_timed_out, "num_turns": s.num_turns, "episode_end": s.episode_end.value}
            for s in samples
        ],
    }
    return save_safetensors(tensors, metadata={"group": json.dumps(header)})


def decode_group(payload: bytes) -> CompleteGroup:
    tensors = load_safetensors(payload)
    header = json.loads(_safetensors_metadata(payload)["group"])
    lens = tensors["response_lens"].tolist()
    ids = tensors["response_ids"].split(lens)
    logprobs = tensors["logprobs"].split(lens)
    masks = tensors["response_mask"].split(lens) if "response_mask" in tensors else None
    rewards = tensors["rewards"].tolist()
    versions = tensors["policy_versions"].tolist()
    samples = [
        Sample(
            group=header["group"],
            index=i,
            response_ids=ids[i].tolist(),
            logprobs=logprobs[i].tolist(),
            response_text=meta["text"],
            finish_reason=FinishReason(meta["finish_reason"]),
            reward=rewards[i],
            policy_version=versions[i],
            reward_error=meta["reward_error"],
            reward_timed_out=meta["reward_timed_out"],
            response_mask=None if masks is None else masks[i].tolist(),
            num_turns=meta["num_turns"],
            episode_end=EpisodeEnd(meta["episode_end"]),
        )
        for i, meta in enumerate(header["samples"])
    ]
    return CompleteGroup(
        step=header["step"],
        group=header["group"],
        policy_version=header["policy_version"],
        prompt_index=header["prompt_index"],
        prompt_ids=tensors["prompt_ids"].tolist(),
        samples=samples,
        advantages=tensors["advantages"].tolist(),
        completed_s=header["completed_s"],
        batch=header["batch"],
    )


def _safetensors_metadata(payload: bytes) -> dict[str, str]:
    header_len = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8 : 8 + header_len]).get("__metadata__", {})
