"""The worker of tests/real_model/test_conversion_round_trip.py, started by
tests/helpers/gloo_launch.py in TP x PP processes.

Every rank runs the project's conversion command (``bapo-convert-checkpoint``'s ``main``) in
the launch's gloo world: the real model's HF folder to a Megatron checkpoint at TP x PP, and
that checkpoint back to an HF folder at the same layout. With ``--refuse-tp N`` (N > 0) it then
asks for a conversion at TP N, which the model cannot split into, and records the command's
exit code and error line. The parent test compares the folders and the messages.

Light at import time (everything heavy is imported in :func:`main`), as a ``spawn`` child
re-imports ``__main__``.
"""

from __future__ import annotations

import sys


def run_command(arguments: list[str]) -> dict:
    """``bapo-convert-checkpoint arguments`` in this process: its exit code (0 when it returned)
    and what it printed."""
    import contextlib
    import io

    from bapo_megatron.weights import convert_cli

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            convert_cli.main([*arguments, "--no-progress"])
        except SystemExit as exited:
            code = exited.code
    print(out.getvalue() + err.getvalue(), flush=True)  # into the rank's log
    return dict(code=code, stdout=out.getvalue(), stderr=err.getvalue())


def main(argv: list[str]) -> None:
    from pathlib import Path

    import torch.distributed as dist

    from tests.helpers import gloo_launch

    args = gloo_launch.worker_arguments(argv, hf=str, workdir=str, tp=int, pp=int, refuse_tp=int)
    gloo_launch.join_group(args, timeout_s=600)
    work = Path(args.workdir)
    layout = ["--tp", str(args.tp), "--pp", str(args.pp)]
    results = {}
    results["to-megatron"] = run_command(
        ["hf-to-megatron", args.hf, str(work / "megatron"), *layout]
    )
    if results["to-megatron"]["code"] == 0:
        results["to-hf"] = run_command(
            ["megatron-to-hf", str(work / "megatron"), str(work / "hf"), *layout]
        )
    if args.refuse_tp:
        results["refused"] = run_command(
            ["hf-to-megatron", args.hf, str(work / "refused"), "--tp", str(args.refuse_tp)]
        )
    gloo_launch.save_result(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
