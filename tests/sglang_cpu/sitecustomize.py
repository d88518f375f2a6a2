"""TEST SUPPORT ONLY: run SGLang 0.5.23 on a CPU machine (unsupported by SGLang). Never imported by rolloutpipe.

The real-SGLang tier (``tests/sglang_real/test_sglang_real.py``, marker ``sglang_real``) puts this directory first on
the ``PYTHONPATH`` of the SGLang servers it starts, so Python imports this file at start-up in every process SGLang
spawns (server, scheduler, detokenizer). It does two things, nothing else:

1. **Stand-in modules** for ``sgl_kernel`` and ``torchvision`` (and every submodule of theirs). SGLang imports them
   at module level, but its CPU path (``SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native
   --sampling-backend pytorch``) never calls them: ``sgl_kernel`` is CUDA-only and PyPI's ``torchvision`` does not
   import beside the CPU torch 2.13.0 wheel. Any attribute of a stand-in is a placeholder that raises
   ``NotImplementedError`` when called, so a code path that does need one fails loudly, never silently.
2. **Seeded sampling without deterministic inference** (only with ``RP_SGLANG_CPU_SEEDED_SAMPLER=1``). SGLang
   builds per-request sampling seeds (``SamplingBatchInfo.sampling_seed``, from each request's ``sampling_seed``)
   only under ``--enable-deterministic-inference``, which refuses the CPU's ``torch_native`` attention. The patch
   wraps ``get_exec`` as seen by ``sglang.srt.sampling.sampling_batch_info`` (that module only) so that
   ``deterministic.enable_deterministic_inference`` reads True there; everything else SGLang reads from its
   configuration is unchanged, so the rest of deterministic inference (batch-invariant kernels, the radix-cache
   and chunked-prefill changes) stays off. Sampling then goes through SGLang's own ``multinomial_with_seed``, as
   it does on a GPU started with ``--enable-deterministic-inference``. That sampler hashes (seed, position,
   token) with MurmurHash3 in ``sgl_kernel``'s CPU build (``murmur_hash32_cpu``), which the stand-in lacks: the
   patch replaces ``sglang.kernels.ops.sampling.murmur_hash.murmur_hash32`` for CPU tensors with the same hash
   written in torch (``murmur_hash32``, below), the steps of SGLang's own Triton kernel in that module; GPU
   tensors still take the kernel.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

STAND_INS = ("sgl_kernel", "torchvision")
SEEDED_SAMPLER_ENV = "RP_SGLANG_CPU_SEEDED_SAMPLER"
SEEDED_MODULE = "sglang.srt.sampling.sampling_batch_info"
HASH_MODULE = "sglang.kernels.ops.sampling.murmur_hash"


class _Placeholder:
    """Any name looked up in a stand-in module: usable as a base class or a value, raises when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name}: a CPU stand-in (tests/sglang_cpu/sitecustomize.py), not the real "
                                  "module; this code path needs the CUDA build")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __mro_entries__(self, bases):
        return (object,)


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # transformers parses it
        return module

    def exec_module(self, module) -> None:
        pass


class _SeededConfig:
    """``get_exec()``'s bag, but ``deterministic.enable_deterministic_inference`` is True."""

    def __init__(self, bag, deterministic: bool = False) -> None:
        self._bag, self._deterministic = bag, deterministic

    def __getattr__(self, name: str):
        if self._deterministic and name == "enable_deterministic_inference":
            return True
        value = getattr(self._bag, name)
        if not self._deterministic and name == "deterministic":
            return _SeededConfig(value, deterministic=True)
        return value


MASK32 = 0xFFFFFFFF


def _rotl32(x, r: int):
    return ((x << r) | (x >> (32 - r))) & MASK32


def _mix(h, k):
    k = _rotl32((k * 0xCC9E2D51) & MASK32, 15)
    k = (k * 0x1B873593) & MASK32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & MASK32


def murmur_hash32(seed, positions, col_indices):
    """MurmurHash3 (32 bit) of the 16 bytes (seed low, seed high, position, column) for every row's seed and
    position and every column, as ``murmur_hash32_kernel`` computes it: an [n, m] tensor of values in [0, 2**32).
    In int64: every product is taken mod 2**64 and masked to its low 32 bits, which is uint32 arithmetic."""
    import torch

    seed = seed.to(torch.int64)
    h = torch.zeros(seed.shape[0], 1, dtype=torch.int64, device=seed.device)
    h = _mix(h, (seed & MASK32)[:, None])
    h = _mix(h, ((seed >> 32) & MASK32)[:, None])
    h = _mix(h, (positions.to(torch.int64) & MASK32)[:, None])
    h = _mix(h, (col_indices.to(torch.int64) & MASK32)[None, :])
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def _seed_the_sampler(module) -> None:
    real_get_exec = module.get_exec
    module.get_exec = lambda: _SeededConfig(real_get_exec())


def _hash_on_the_cpu(module) -> None:
    kernel = module.murmur_hash32

    def hash32(seed, positions, col_indices):
        if seed.device.type == "cpu":
            return murmur_hash32(seed, positions, col_indices)
        return kernel(seed, positions, col_indices)

    module.murmur_hash32 = hash32


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after module ``name`` is executed, before anyone imports from it."""

    def __init__(self, patches) -> None:
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module) -> None:
            real_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _StandIns())
if os.environ.get(SEEDED_SAMPLER_ENV) == "1":
    sys.meta_path.insert(0, _AfterImport({SEEDED_MODULE: _seed_the_sampler, HASH_MODULE: _hash_on_the_cpu}))
