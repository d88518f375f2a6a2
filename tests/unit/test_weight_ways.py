"""Weight sync's ways (control/weights/): each value of pipeline.weight_sync is one module holding both sides."""

from __future__ import annotations

import inspect

import pytest

from rolloutpipe.config import load_config
from rolloutpipe.control import weights
from rolloutpipe.control.weights import WeightReceiver, WeightSender, WeightSync


def public_methods(cls) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


@pytest.mark.parametrize("way", list(WeightSync), ids=lambda w: w.value)
def test_every_way_is_a_module_with_both_sides_of_the_protocol(way):
    module = weights._module(way)
    assert public_methods(module.Sender) >= public_methods(WeightSender)
    assert public_methods(module.Receiver) >= public_methods(WeightReceiver)


@pytest.mark.parametrize("way,cls", [("disk", "disk.Sender"), ("distributed", "distributed.Sender")])
def test_the_config_picks_the_way_once(tmp_path, way, cls):
    overrides = {"pipeline": {"weight_sync": way}, "rollout": {"engine": "embedded_http"}}
    cfg = load_config(overrides)
    sender = weights.sender(cfg.weight_sync(), transport=None, run_dir=tmp_path, policy=None)
    assert f"{type(sender).__module__.rpartition('.')[2]}.{type(sender).__name__}" == cls
