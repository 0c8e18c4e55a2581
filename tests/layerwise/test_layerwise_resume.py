"""A layerwise run killed outright (SIGKILL to its whole process group, torchrun included) after a layer is
committed resumes on rerun at the first incomplete layer and exports what the uninterrupted run exports,
byte for byte; one process and expert-parallel on two ranks; a resume of another run is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from layerwise.test_layerwise import MODELS, PTQ, assert_same_export

pytestmark = pytest.mark.slow  # each test: an uninterrupted run, a killed one and its resume

REPO = Path(__file__).resolve().parents[2]


def _command(nproc: int, *argv) -> list[str]:
    launcher = [sys.executable, "-m", "modelopt_k3.cli.hf_ptq"]
    if nproc > 1:
        from _mp import free_port

        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                    "--master_port", str(free_port()), "-m", "modelopt_k3.cli.hf_ptq"]
    return [*launcher, *PTQ, "--layerwise", *map(str, argv)]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MODELOPT_K3_DIST_TIMEOUT": "60",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    return env


def _run_killed_after(cmd: list[str], line: str) -> str:
    """Run ``cmd`` in its own process group; SIGKILL the whole group once ``line`` appears in its output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    seen = []
    try:
        for out in proc.stdout:
            seen.append(out)
            if line in out:
                os.killpg(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=120)
    text = "".join(seen)
    assert line in text, text[-3000:]
    assert proc.returncode == -signal.SIGKILL, text[-3000:]
    return text


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-4000:]
    return r.stdout


@pytest.mark.parametrize(("model", "nproc"), [("kimi_k3", 1), ("kimi_k3", 2), ("qwen3_moe", 1), ("gpt_oss", 1)])
def test_killed_layerwise_run_resumes_and_exports_the_same(model, nproc, tmp_path: Path):
    ckpt = MODELS[model](tmp_path / "src")
    common = ["--pyt_ckpt_path", ckpt, "--trust_remote_code"]
    _run(_command(nproc, *common, "--export_path", tmp_path / "whole"))
    ck = tmp_path / "ck"
    cmd = _command(nproc, *common, "--export_path", tmp_path / "resumed", "--layerwise_checkpoint_dir", ck)
    _run_killed_after(cmd, "layerwise: layer 1/")
    assert not (tmp_path / "resumed").exists()
    out = _run(cmd)
    assert "layerwise: resuming at layer " in out, out[-3000:]
    assert out.count("layerwise: resuming") == 1  # one line, rank 0 only
    assert_same_export(tmp_path / "whole", tmp_path / "resumed")
    # The report covers every layer or is not written: a resumed run says so (the whole run wrote its own).
    assert (tmp_path / "whole" / "quant_report" / "report.json").is_file()
    assert "no quantization report and no held-out evaluation: this run resumed a layerwise checkpoint" in out, out[-3000:]
    assert not (tmp_path / "resumed" / "quant_report").exists()


def test_a_resume_of_another_run_is_refused_naming_what_changed(tmp_path: Path):
    ckpt = MODELS["kimi_k3"](tmp_path / "src")
    ck = tmp_path / "ck"
    cmd = _command(1, "--pyt_ckpt_path", ckpt, "--trust_remote_code", "--export_path", tmp_path / "out",
                   "--layerwise_checkpoint_dir", ck)
    _run_killed_after(cmd, "layerwise: layer 1/")
    changed = [*cmd, "--calib_seq", "16"]  # a later flag wins: another token set
    r = subprocess.run(changed, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), timeout=600)
    assert r.returncode != 0 and "another calibration tokens" in r.stdout, r.stdout[-3000:]
    r = subprocess.run([*cmd, "--qformat", "fp8"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=_env(), timeout=600)
    assert r.returncode != 0 and "recipe" in r.stdout.split("another")[-1], r.stdout[-3000:]
    assert not (tmp_path / "out").exists()


def _killed_checkpoint(tmp_path: Path) -> tuple[list[str], Path, Path]:
    ckpt = MODELS["kimi_k3"](tmp_path / "src")
    ck = tmp_path / "ck"
    cmd = _command(1, "--pyt_ckpt_path", ckpt, "--trust_remote_code", "--export_path", tmp_path / "out",
                   "--layerwise_checkpoint_dir", ck)
    _run_killed_after(cmd, "layerwise: layer 1/")
    return cmd, ckpt, ck / "rank00000"


def _refused(cmd: list[str]) -> str:
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), timeout=600)
    assert r.returncode != 0 and "Traceback" not in r.stdout, r.stdout[-3000:]
    return r.stdout


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _layer0_tensor(ckpt: Path) -> tuple[str, Path, int]:
    """A tensor layer 0 reads: its key, its shard and the file offset of a byte in its middle."""
    from modelopt_k3.checkpoint import CheckpointReader

    with CheckpointReader(ckpt) as reader:
        key = next(k for k in sorted(reader.names()) if ".layers.0.mlp.down_proj." in k)
        info = reader.info(key)
    return key, ckpt / info.file, info.offset + info.nbytes // 2


def test_a_resume_never_trusts_what_it_has_not_checked(tmp_path: Path):
    """Issue 42, one killed run reused case by case: another load dtype, a flipped byte or a truncation in a
    committed layer file, and a symbolic link planted in the checkpoint directory are each refused naming what
    changed, before anything is published; the source checkpoint stays byte-identical."""
    cmd, ckpt, rank_dir = _killed_checkpoint(tmp_path)
    source = _tree(ckpt)
    assert "another load dtype" in _refused([*cmd, "--dtype", "float32"])

    layer = sorted(rank_dir.glob("layer00000-*.safetensors"))[0]
    good = layer.read_bytes()
    layer.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size, one bit
    assert f"{layer} changed since it was committed" in _refused(cmd)
    layer.write_bytes(good[: len(good) // 2])
    assert f"{layer} changed since it was committed" in _refused(cmd)
    layer.write_bytes(good)

    # The source edited in place with its old size and mtime (85 tensors differed after such a resume):
    # the ctime changed, so layer 0's reads are hashed again and the changed tensor is named.
    key, shard, offset = _layer0_tensor(ckpt)
    st, data = shard.stat(), bytearray(shard.read_bytes())
    data[offset] ^= 1
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f"tensor {key} in {shard.name} no longer holds the bytes" in _refused(cmd)
    data[offset] ^= 1
    shard.write_bytes(bytes(data))  # the same bytes again: hashed again, equal, so it resumes below

    planted = rank_dir / "layer00099-r00000-00000.safetensors"
    planted.symlink_to(next(ckpt.glob("*.safetensors")))
    assert f"{planted} is a symbolic link" in _refused(cmd)
    planted.unlink()
    assert not (tmp_path / "out").exists() and _tree(ckpt) == source
    out = _run(cmd)  # restored: it resumes
    assert "layerwise: resuming at layer " in out


def test_a_checkpoint_dir_linked_into_the_source_is_never_written_through(tmp_path: Path):
    ckpt = MODELS["kimi_k3"](tmp_path / "src")
    source = _tree(ckpt)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "rank00000").symlink_to(ckpt, target_is_directory=True)
    out = _refused(_command(1, "--pyt_ckpt_path", ckpt, "--trust_remote_code", "--export_path", tmp_path / "out",
                            "--layerwise_checkpoint_dir", ck))
    assert "is a symbolic link" in out, out[-2000:]
    assert _tree(ckpt) == source and not (tmp_path / "out").exists()


def test_a_checkpoint_from_another_producer_is_refused(tmp_path: Path):
    """Layers committed by another version of this package (or another layer format) are not republished."""
    import json

    cmd, _, rank_dir = _killed_checkpoint(tmp_path)
    from modelopt_k3 import __version__
    from modelopt_k3.layerwise.state import LAYER_FORMAT_VERSION

    state = json.loads((rank_dir / "state.json").read_text())
    assert state["fingerprint"]["producer"] == f"modelopt_k3 {__version__}, layer format {LAYER_FORMAT_VERSION}"
    state["fingerprint"]["producer"] = "modelopt_k3 0.0.9, layer format 1"  # as an older package wrote it
    (rank_dir / "state.json").write_text(json.dumps(state))
    assert "another producer" in _refused(cmd)
