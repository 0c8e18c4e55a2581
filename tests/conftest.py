"""Shared fixtures: the tiny Kimi-K3 stand-in checkpoint, derived (broken) copies of it, and a guard
that undoes the process-wide patch a Kimi-K3 ``prepare`` leaves on the checkpoint's remote code.

* ``tiny_ckpt`` -- a default-size tiny checkpoint, built once per session. Treat it as read-only;
  derive edited checkpoints with ``copy_ckpt`` (or ``copy_checkpoint``).
* ``tiny_reference`` -- the checkpoint's own (unpatched) model in fp32, experts decoded by
  compressed-tensors (``modelopt_k3.testing.reference``): the independent baseline.
* ``copy_ckpt`` -- factory: a copy of ``tiny_ckpt`` (or another dir) with keys dropped, tensors
  replaced, config.json or remote code edited.
* ``restore_remote_code`` -- after the test, every remote MoE block class is unpatched again.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys

# Tests never reach the network. Set before anything imports huggingface_hub (it reads this at import):
# transformers >= 5.25 falls back to downloading Hub kernels where flash-attn is missing, and a test that
# shows the remote code's forced flash_attention_2 failing must fail offline, not by trying the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from modelopt_k3.testing import make_tiny_kimi_k3

INDEX_NAME = "model.safetensors.index.json"
# Attribute a patched (fused) remote class carries, pointing at the class it replaced.
_ORIGINAL_ATTR = "_modelopt_k3_original"


def copy_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    drop: Iterable[str] = (),
    replace: Mapping[str, torch.Tensor] | None = None,
    drop_from_index: bool = True,
    edit_config: Callable[[dict], None] | None = None,
    edit_files: Mapping[str, Callable[[str], str]] | None = None,
) -> Path:
    """Copy checkpoint dir ``src`` to ``dst`` and rewrite only the shards that change.

    ``drop``: keys removed from their shard file (and from the index unless ``drop_from_index`` is
    False, which leaves a dangling index entry). ``replace``: key -> new tensor, written into the
    shard that holds the key (any dtype/shape). ``edit_config`` mutates the parsed config.json in
    place; ``edit_files`` maps a file name (e.g. a remote-code ``.py``) to a text transform.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists")
    shutil.copytree(src, dst)
    drop, replace = set(drop), dict(replace or {})
    index_path = dst / INDEX_NAME
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = index["weight_map"]
    unknown = (drop | set(replace)) - set(weight_map)
    if unknown:
        raise KeyError(f"not in {src}: {sorted(unknown)}")
    by_file: dict[str, set[str]] = defaultdict(set)
    for key in drop | set(replace):
        by_file[weight_map[key]].add(key)
    for fname in by_file:
        with safe_open(str(dst / fname), framework="pt") as f:
            metadata, names = f.metadata(), f.keys()  # safe_open handles are not iterable
            tensors = {k: f.get_tensor(k) for k in names if k not in drop}
        for key in by_file[fname] & set(replace):
            tensors[key] = replace[key].contiguous()
        save_file(tensors, str(dst / fname), metadata=metadata)
    if drop_from_index:
        for key in drop:
            del weight_map[key]
    total = 0
    for fname in sorted(set(weight_map.values())):
        with safe_open(str(dst / fname), framework="pt") as f:
            names = f.keys()
            for key in names:
                if weight_map.get(key) == fname:
                    tensor = f.get_tensor(key)
                    total += tensor.numel() * tensor.element_size()
    index.setdefault("metadata", {})["total_size"] = total
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for fname, transform in (edit_files or {}).items():
        (dst / fname).write_text(transform((dst / fname).read_text()))
    return dst


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (torch, transformers, the test modules): it lives for the whole run,
    and every full ``gc.collect()`` (``destroy_run_group`` runs one per destroyed group) would rescan it, ~0.3 s each."""
    gc.freeze()


def unpatch_remote_code() -> None:
    """Rebind every patched class in the checkpoints' dynamic modules to the class it replaced.

    Kimi-K3 ``prepare`` rebinds ``KimiSparseMoeBlock`` in the remote module (process-wide); models
    built before keep their blocks, models built after get fused experts. Tests that build the
    unpatched reference or switch placements call this first.
    """
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers_modules.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            original = getattr(value, _ORIGINAL_ATTR, None) if isinstance(value, type) else None
            if original is not None and value is not original:
                setattr(module, attr, original)


@pytest.fixture
def restore_remote_code():
    """Leave the remote code unpatched after the test, whatever the test prepared."""
    yield
    unpatch_remote_code()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A default-size tiny Kimi-K3 checkpoint (seed 0), built once per session. Do not modify it."""
    return make_tiny_kimi_k3(tmp_path_factory.mktemp("tiny_kimi_k3") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_wide_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 128-wide routed experts (the conformance matrix's ``wide`` experts sizes): the
    smallest one SGLang's NVFP4 MoE post-processing takes (flashinfer's shuffle needs routed-expert GEMM
    rows % 128). Built once per session; do not modify it."""
    from tools.conformance.matrix import WIDE_SIZES

    return make_tiny_kimi_k3(tmp_path_factory.mktemp("tiny_wide") / "ckpt", seed=0, **WIDE_SIZES)


@pytest.fixture(scope="session")
def tiny_reference(tiny_ckpt: Path) -> torch.nn.Module:
    """The unpatched remote model of ``tiny_ckpt`` in fp32, filled by the independent reference loader."""
    from modelopt_k3.testing.reference import load_reference_model

    unpatch_remote_code()  # a prepare earlier in the session would give it fused experts
    model = load_reference_model(tiny_ckpt, dtype=torch.float32)
    blocks = [m for n, m in model.named_modules() if n.endswith(".block_sparse_moe")]
    assert blocks and all(isinstance(b.experts, torch.nn.ModuleList) for b in blocks)
    return model


@pytest.fixture
def copy_ckpt(tmp_path: Path, tiny_ckpt: Path) -> Callable[..., Path]:
    """Factory: ``copy_ckpt(drop=..., replace=..., edit_config=..., edit_files=..., src=tiny_ckpt)``.

    Each call writes a fresh copy under this test's tmp_path (see ``copy_checkpoint``).
    """
    counter = iter(range(1_000_000))

    def make(src: str | Path | None = None, name: str = "ckpt_copy", **edits) -> Path:
        dst = tmp_path / f"{next(counter)}" / name
        dst.parent.mkdir(parents=True)
        return copy_checkpoint(src or tiny_ckpt, dst, **edits)

    return make
