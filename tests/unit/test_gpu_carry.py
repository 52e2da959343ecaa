"""Carrying package sets to the lent GPU machine in parts (bapo_megatron/device_check/carry.py,
tools/gpu_parts.py), on small stand-in files: split, stash part by part, join with every
SHA-256 checked, and the slimmed vLLM wheel's RECORD."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bapo_megatron.device_check.carry import (
    MANIFEST,
    CarryError,
    bundle_and_split,
    join_parts,
    slim_wheel,
    stash_part,
)
from bapo_megatron.device_check.carry_sets import gpu_commands, vllm_slim
from tests.helpers.gloo_launch import REPO_ROOT


def gpu_parts(*argv: str) -> subprocess.CompletedProcess:
    """tools/gpu_parts.py as the GPU session runs it (from the checkout, PYTHONPATH=.)."""
    return subprocess.run(
        [sys.executable, "tools/gpu_parts.py", *argv], cwd=REPO_ROOT, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=60, check=False,
    )


def files(tmp_path: Path) -> list[Path]:
    source = tmp_path / "downloads"
    source.mkdir()
    made = []
    for name, size in (("a-1.0-py3-none-any.whl", 2500), ("b-2.0.tar.gz", 10), ("c.whl", 1)):
        path = source / name
        path.write_bytes(bytes((i * 7 + len(name)) % 256 for i in range(size)))
        made.append(path)
    return made


def test_a_set_travels_in_parts_and_joins_checked(tmp_path):
    originals = files(tmp_path)
    carry = tmp_path / ".carry"
    folders = bundle_and_split("te", originals, carry, part_bytes=1024)
    assert [f.name for f in folders] == [f"te-{k}" for k in range(1, len(folders) + 1)]
    assert len(folders) >= 4  # the tar headers and 2.5 KB of data in 1 KB parts
    for folder in folders:
        [part] = [p for p in folder.iterdir() if p.suffix[1:].isdigit()]
        assert part.stat().st_size <= 1024 and (folder / f"{part.name}.sha256").is_file()
        assert json.loads((folder / MANIFEST).read_text())["set"] == "te"

    parts = tmp_path / "root-parts"
    for folder in folders[:-1]:
        assert "missing" in stash_part(folder, parts)
    with pytest.raises(CarryError, match=rf"parts \['te.tar.{len(folders):02d}'\] are not in"):
        join_parts(parts / "te", tmp_path / "out")
    assert stash_part(folders[-1], parts).endswith("complete")
    joined = join_parts(parts / "te", tmp_path / "out")
    assert [p.name for p in joined] == [p.name for p in originals]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(joined, originals))
    assert not (tmp_path / "out" / "te.tar").exists()

    # a second split of the set replaces the first one's folders
    assert len(bundle_and_split("te", originals[1:], carry, part_bytes=1 << 20)) == 1
    assert sorted(p.name for p in carry.iterdir()) == ["te-1"]


def test_damaged_parts_are_named(tmp_path):
    folders = bundle_and_split("vllm", files(tmp_path), tmp_path / ".carry", part_bytes=2048)
    part = next(p for p in folders[0].iterdir() if p.name == "vllm.tar.01")
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(CarryError, match="vllm.tar.01: SHA-256 differs"):
        stash_part(folders[0], tmp_path / "parts")
    failed = gpu_parts("--parts", str(tmp_path / "parts"), "stash", str(folders[0]))
    assert failed.returncode == 1 and "SHA-256 differs" in failed.stderr
    data[100] ^= 1  # repaired
    part.write_bytes(bytes(data))
    for folder in folders:
        stashed = gpu_parts("--parts", str(tmp_path / "parts"), "stash", str(folder))
        assert stashed.returncode == 0, stashed.stderr
    stashed = tmp_path / "parts" / "vllm" / "vllm.tar.02"
    stashed.write_bytes(stashed.read_bytes()[:-1] + b"x")
    with pytest.raises(CarryError, match=r"parts \['vllm.tar.02'\] do not match"):
        join_parts(tmp_path / "parts" / "vllm", tmp_path / "out")


def _wheel(path: Path, members: dict[str, bytes]) -> None:
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, (2026, 1, 1, 0, 0, 0))
            info.external_attr = 0o755 << 16
            wheel.writestr(info, data)
            writer.writerow([name, "sha256=x", str(len(data))])
        writer.writerow(["vllm-0.26.0.dist-info/RECORD", "", ""])
        wheel.writestr("vllm-0.26.0.dist-info/RECORD", record.getvalue())


def test_the_vllm_wheel_loses_what_hopper_never_loads_and_its_record_lines(tmp_path):
    drop = [
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "vllm/vllm-rs",
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
        "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so",
    ]
    keep = [
        "vllm/__init__.py",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
        "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",
        "vllm-0.26.0.dist-info/METADATA",
    ]
    assert [n for n in drop + keep if vllm_slim(n)] == drop
    wheel = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    _wheel(wheel, {name: name.encode() * 50 for name in drop + keep})
    out = tmp_path / "slim.whl"
    assert sorted(slim_wheel(wheel, out, vllm_slim)) == sorted(drop)
    with zipfile.ZipFile(out) as slim:
        assert slim.testzip() is None
        names = slim.namelist()
        assert names == [*keep, "vllm-0.26.0.dist-info/RECORD"]
        assert all(slim.read(n) == n.encode() * 50 for n in keep)
        assert slim.getinfo(keep[1]).external_attr >> 16 == 0o755
        record = [row[0] for row in csv.reader(io.StringIO(slim.read(names[-1]).decode()))]
    assert record == [*keep, "vllm-0.26.0.dist-info/RECORD"]


def test_the_gpu_session_stashes_each_part_then_runs_the_pass_with_the_last(tmp_path):
    folders = [tmp_path / ".carry" / f"te-{k}" for k in (1, 2, 3)]
    commands = gpu_commands("te", folders, tmp_path)
    stash = "PYTHONPATH=. python3 tools/gpu_parts.py stash"
    assert commands[:2] == [(f"{stash} .carry/te-1", [".carry/te-1"]),
                            (f"{stash} .carry/te-2", [".carry/te-2"])]
    assert commands[2] == (
        f'{stash} .carry/te-3 && GPU_PASS=te bash tools/gpu_check.sh "$OUT"',
        [".carry/te-3", ".whl"],
    )
