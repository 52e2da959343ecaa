"""What a conversion (tools/convert_checkpoint.py) refuses before it writes, and how it names a
damaged checkpoint (issue 18, items 5, 6 and 8), through the command line in this process.

- An output that is its input, lies inside it or contains it (symlinks resolved) is refused in
  both directions, naming both folders, and the input is left as it was.
- A second conversion into an output another process is converting into is refused, naming
  that process's PID and host; the lock leaves nothing beside the output.
- A Megatron checkpoint with a truncated ``.distcp`` shard, a garbled ``metadata.json`` or a
  truncated ``common.pt`` is refused with one line naming the file (Megatron's and torch's own
  errors do not).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_megatron.weights import convert_cli
from tests.helpers import hf_models


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny HF folder, the Megatron checkpoint converted from it)."""
    root = tmp_path_factory.mktemp("convert_refusals")
    hf_models.save_hf_folder(root / "hf", "llama-tied", seed=0)
    convert_cli.main(["hf-to-megatron", str(root / "hf"), str(root / "megatron"), "--no-progress"])
    return root / "hf", root / "megatron"


def _refused(argv: list[str], capsys) -> str:
    """The one-line error of the command line ``argv``, which must exit with code 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as failed:
        convert_cli.main([*argv, "--no-progress"])
    assert failed.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_an_output_that_is_inside_or_contains_its_input_is_refused(folders, tmp_path, capsys):
    source_hf, source_megatron = folders
    hf, megatron = tmp_path / "models" / "hf", tmp_path / "models" / "megatron"
    shutil.copytree(source_hf, hf)
    shutil.copytree(source_megatron, megatron)
    before = {hf: _contents(hf), megatron: _contents(megatron)}
    (tmp_path / "link").symlink_to(hf)
    to_megatron, to_hf = ["hf-to-megatron", str(hf)], ["megatron-to-hf", str(megatron)]
    cases = [
        (to_megatron + [str(hf), "--overwrite"], f"output {hf} is the HF folder {hf}: "),
        (to_megatron + [str(hf / "out")], f"output {hf / 'out'} lies inside the HF folder {hf}"),
        (
            to_megatron + [str(tmp_path / "models"), "--overwrite"],
            f"output {tmp_path / 'models'} contains the HF folder {hf}",
        ),
        (
            to_megatron + [str(tmp_path / "link"), "--overwrite"],
            f"output {tmp_path / 'link'} is the HF folder {hf} (resolved: {hf.resolve()} and "
            f"{hf.resolve()})",
        ),
        (
            to_hf + [str(megatron), "--overwrite"],
            f"output {megatron} is the Megatron checkpoint {megatron}: ",
        ),
        (
            to_hf + [str(megatron / "hf")],
            f"output {megatron / 'hf'} lies inside the Megatron checkpoint {megatron}",
        ),
        (
            to_hf + [str(hf), "--hf-files-from", str(hf), "--overwrite"],
            f"output {hf} is the folder of HF files {hf}: ",
        ),
    ]
    for argv, message in cases:
        assert message in _refused(argv, capsys), argv
    assert {hf: _contents(hf), megatron: _contents(megatron)} == before
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["hf", "megatron"]


HOLD = (
    "import sys\n"
    "from bapo_megatron.files.lock import FolderLock\n"
    "FolderLock.beside(sys.argv[1], 'conversion').acquire()\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)  # holds the output's lock until its stdin closes


def test_a_second_conversion_into_one_output_is_refused_naming_the_first(folders, tmp_path, capsys):
    hf, megatron = folders
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        holder_name = f"PID {holder.pid} on host {socket.gethostname()}, conversion"
        for argv in (
            ["hf-to-megatron", str(hf), str(out)],
            ["megatron-to-hf", str(megatron), str(out)],
        ):
            err = _refused(argv, capsys)
            assert f"{out} is in use by another process ({holder_name})" in err, err
        assert not out.exists()
    finally:
        holder.stdin.close()
        holder.wait()
    convert_cli.main(["megatron-to-hf", str(megatron), str(out), "--no-progress"])
    assert (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the lock file went with its holder


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize(
    "file, damage, message",
    [
        ("__0_1.distcp", lambda p: _truncate(p, 1000), "is truncated: 1000 bytes"),
        ("metadata.json", lambda p: p.write_text("{garbage"), "is not valid JSON"),
        ("common.pt", lambda p: _truncate(p, 500), "cannot be read"),
        (".metadata", lambda p: _truncate(p, 500), "cannot be read"),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file(
    folders, tmp_path, capsys, file, damage, message
):
    _, megatron = folders
    damaged = tmp_path / "damaged"
    shutil.copytree(megatron, damaged)
    damage(damaged / file)
    err = _refused(["megatron-to-hf", str(damaged), str(tmp_path / "out")], capsys)
    assert f"{damaged / file} {message}" in err, err
    assert not (tmp_path / "out").exists()
