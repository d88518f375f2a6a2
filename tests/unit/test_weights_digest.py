"""The weights digest (control/weights/digest.py) names a policy's exact bits, and nothing else; tools/report.py
finds the first step where two runs' digests differ."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rolloutpipe.control.weights.digest import DIGEST_CHARS, file_weights_digest, short, weights_digest
from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model

REPO = Path(__file__).resolve().parents[2]


def policy(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(7, 4, generator=g).to(dtype),
            "model.layers.0.mlp.up_proj.weight": torch.randn(4, 4, generator=g).to(dtype),
            "model.norm.weight": torch.ones(4, dtype=dtype),
            "model.layers.0.input_layernorm.weight": torch.randn(4, generator=g).to(dtype)}


def one_ulp_up(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """``tensor`` with one element moved to the next representable value (its bit pattern + 1)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    changed = tensor.clone()
    changed.view(bits).view(-1)[index] += 1
    return changed


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file whose header and data follow ``tensors``' order (safetensors' save_file sorts them)."""
    dtypes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float64: "F64"}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset, data = 0, b""
    for name, t in tensors.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        offset, data = offset + len(raw), data + raw
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_digest_depends_on_the_tensors_not_on_dict_or_file_header_order(tmp_path, dtype):
    state = policy(dtype)
    reordered = dict(reversed(list(state.items())))
    assert weights_digest(reordered) == weights_digest(state)

    saved, hand_written = tmp_path / "saved.safetensors", tmp_path / "reordered.safetensors"
    save_file(state, str(saved))
    write_safetensors(hand_written, reordered)
    file_sha256 = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (saved, hand_written)]
    assert file_sha256[0] != file_sha256[1], "the files must differ in their layout"
    assert file_weights_digest(saved) == file_weights_digest(hand_written) == weights_digest(state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_ulp_in_one_element_changes_the_digest(dtype):
    state = policy(dtype)
    for name in state:
        for index in (0, state[name].numel() - 1):
            changed = {**state, name: one_ulp_up(state[name], index)}
            assert not torch.equal(changed[name], state[name])
            assert short(weights_digest(changed)) != short(weights_digest(state)), (name, index)


def test_names_dtypes_and_shapes_are_part_of_the_digest():
    state = policy(torch.bfloat16)
    reference = weights_digest(state)
    name, tensor = "model.layers.0.mlp.up_proj.weight", state["model.layers.0.mlp.up_proj.weight"]
    renamed = {("model.layers.1.mlp.up_proj.weight" if k == name else k): v for k, v in state.items()}
    same_bits_other_dtype = {**state, name: tensor.view(torch.float16)}  # the same bytes
    same_bytes_other_shape = {**state, name: tensor.reshape(2, 8)}
    swapped = {**state, "model.norm.weight": state["model.layers.0.input_layernorm.weight"],
               "model.layers.0.input_layernorm.weight": state["model.norm.weight"]}
    digests = [weights_digest(s) for s in (renamed, same_bits_other_dtype, same_bytes_other_shape, swapped)]
    assert len({reference, *digests}) == 5
    assert weights_digest({k: v.float() for k, v in state.items()}) != reference  # the model's dtype, not a cast


def test_a_models_file_and_its_state_have_one_digest_of_16_hex_digits(tmp_path):
    model = load_model(ModelConfig(dtype=DType.bfloat16), len(build_tiny_tokenizer()))
    state = {k: v.detach() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    digest = weights_digest(state)
    assert file_weights_digest(tmp_path / "model.safetensors") == digest
    assert len(digest) == 64 and len(short(digest)) == DIGEST_CHARS == 16
    int(short(digest), 16)


# ---- tools/report.py --first-difference ------------------------------------------------------------------
def make_run(path: Path, digests: list[str | None]) -> Path:
    path.mkdir(parents=True)
    records = [{"step": step, "train/loss": 0.0} | ({"train/weights_digest": d} if d is not None else {})
               for step, d in enumerate(digests)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def report(*argv: str) -> tuple[int, str, str]:
    """``python tools/report.py ARGV``: exit status, stdout, stderr."""
    spec = importlib.util.spec_from_file_location("tools_report", REPO / "tools" / "report.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = tool.main(list(argv))
    return status, out.getvalue(), err.getvalue()


def test_report_names_the_first_step_where_two_runs_digests_differ(tmp_path):
    a = make_run(tmp_path / "a", ["d0", "d1", "d2", "d3", "d4"])
    b = make_run(tmp_path / "b", ["d0", "d1", "d2", "x3", "d4"])
    status, out, _ = report("--first-difference", str(a), str(b))
    assert status == 1
    assert out.startswith(f"first difference at step 3: train/weights_digest d3 ({a}) vs x3 ({b}); the 3 common steps "
                          "before it agree (steps 0-2)")

    c = make_run(tmp_path / "c", ["x0", "d1"])
    status, out, _ = report("--first-difference", str(a), str(c))
    assert status == 1 and "first difference at step 0" in out and "no common step before it" in out


def test_report_says_over_how_many_common_steps_two_runs_agree(tmp_path):
    a = make_run(tmp_path / "a", ["d0", "d1", "d2", "d3"])
    b = make_run(tmp_path / "b", ["d0", "d1"])
    status, out, _ = report("--first-difference", str(a), str(b))
    assert status == 0
    assert out.startswith("the weights digests agree at all 2 common steps (steps 0-1)")
    assert f"{a} logged steps 0-3, {b} steps 0-1" in out


def test_report_refuses_runs_without_digests_and_says_why(tmp_path):
    a = make_run(tmp_path / "a", ["d0", "d1"])
    old = make_run(tmp_path / "old", [None, None])
    status, out, err = report("--first-difference", str(a), str(old))
    assert status == 2 and not out
    assert f"{old}/metrics.jsonl logs no train/weights_digest" in err
    status, _, err = report("--first-difference", str(a), str(tmp_path / "missing"))
    assert status == 2 and "has no metrics.jsonl" in err
