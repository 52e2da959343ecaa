"""The worker of tests/distributed/test_weights_layouts.py, started by
tests/helpers/gloo_launch.py in 4 processes.

It is a separate module, light at import time (everything heavy is imported in :func:`main`),
so that a process started with the ``spawn`` method, which re-imports ``__main__``, does not pay
for torch and Megatron again.

For every layout (TP2/PP2 first, then TP2/PP1, TP1/PP2, TP1/PP2, PP2 x VPP2; data parallel fills
the 4 ranks) and every model variant it converts the HF folder, records the pipeline's logits,
loads the TP2/PP2 checkpoint at that layout and compares every parameter with the direct
conversion, and, at TP2/PP2 (both transports) and PP2 x VPP2, records the live export's
buckets; it converts the TP2/PP2 checkpoint back to HF at TP2/PP2 and TP1/PP1. The parent test
makes the comparisons.
"""

from __future__ import annotations

import os
import sys
import time

LAYERS = 4
VARIANTS = ("llama-untied", "qwen2-tied", "qwen3-tied", "qwen3-untied", "llama32-tied")
# name -> (TP, PP, virtual stages per PP rank); TP2/PP2 first: the others load its checkpoint
LAYOUTS = {
    "tp2pp2": (2, 2, None),
    "tp2pp1": (2, 1, None),
    "tp1pp2": (1, 2, None),
    "tp1pp1": (1, 1, None),
    "pp2vpp2": (1, 2, 2),
}
TRANSPORTS = ("shared_memory", "collective")
BUCKET_BYTES = 70_000  # every single tensor group fits (the largest, gate+up in fp32, is 64 KiB)
VERSION = 3


def main(argv: list[str]) -> None:
    # (gloo_launch.launch starts it with one thread per pool and the checkout on PYTHONPATH)
    import errno
    import types
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from bapo_megatron.actor.batch import PolicyBatch
    from bapo_megatron.actor.model import build_model
    from bapo_megatron.actor.pipeline_schedule import run_schedule
    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.models.name_maps import chunk_parameters
    from bapo_megatron.rollout.guard import EngineFailure
    from bapo_megatron.trainer.replicas import holds_engine
    from bapo_megatron.weight_sync.colocated_stream import push_weights
    from bapo_megatron.weights.convert import hf_to_megatron, megatron_to_hf
    from bapo_megatron.weights.export import export_weights
    from bapo_megatron.weights.megatron_checkpoint import load_megatron_checkpoint
    from bapo_megatron.weights.tp_assembly import make_transport
    from tests.helpers import gloo_launch, hf_models

    args = gloo_launch.worker_arguments(argv, workdir=str)
    gloo_launch.join_group(args, timeout_s=120)
    work = Path(args.workdir)
    start = time.monotonic()

    def log(what: str) -> None:  # in the rank's log, shown if the launch fails
        print(f"{time.monotonic() - start:6.1f} s  {what}", flush=True)

    def pipeline_logits(chunks, ctx):
        """Whole-vocabulary logits [b, s, V] on the last stage (None elsewhere), through the
        project's pipeline schedule (forward only)."""
        ids, _ = hf_models.tokens()
        batch = PolicyBatch(tokens=ids, response_mask=torch.zeros_like(ids, dtype=torch.bool))
        # the interleaved schedule wants as many micro-batches as stages
        outputs = run_schedule(
            chunks,
            [batch] * ctx.pp_size,
            lambda mb, logits: (logits.values.sum() * 0, {"logits": logits.values.detach()}),
            ctx,
            forward_only=True,
            every_position=True,
        )
        if not ctx.is_last_stage():
            return None
        local = outputs[0]["logits"].float().contiguous()  # [b, s, V / TP]
        pieces = [torch.empty_like(local) for _ in range(ctx.tp_size)]
        dist.all_gather(pieces, local, group=ctx.tp_group)
        return torch.cat(pieces, dim=-1)

    def records(buckets):
        return [
            dict(
                version=b.version,
                stage=b.pipeline_rank,
                index=b.index,
                last=b.last,
                nbytes=b.nbytes,
                tensors=b.tensors,
            )
            for b in buckets
        ]

    def with_full_shm(fn, *args, **kwargs):
        """fn(*args, **kwargs) while posix_fallocate fails as on a full /dev/shm."""

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        real, os.posix_fallocate = os.posix_fallocate, full
        try:
            return fn(*args, **kwargs)
        finally:
            os.posix_fallocate = real

    def refusal(buckets) -> str | None:
        try:
            list(buckets)
        except ValueError as err:
            return str(err)
        return None

    class RecordingEngine:
        """Keeps copies of what it loads, in order; refuses the ``refuse_at``-th tensor."""

        def __init__(self, refuse_at):
            self.refuse_at, self.loaded, self.version = refuse_at, [], -1

        def update_weights(self, named_tensors, *, version, checksum=False):
            for index, (name, tensor) in enumerate(named_tensors):
                if index == self.refuse_at:
                    raise ValueError(f"refused {name}")
                self.loaded.append((name, tensor.clone()))
            self.version = version

    results: dict[tuple, object] = {}
    for layout, (tp, pp, vpp) in LAYOUTS.items():
        ctx = ParallelContext.initialize(
            ParallelConfig(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
            )
        )
        for variant in VARIANTS:
            model, chunks = hf_to_megatron(work / variant, work / f"{variant}-{layout}", ctx)
            log(f"{layout} {variant}: converted")
            results["logits", variant, layout] = pipeline_logits(chunks, ctx)
            if layout != "tp2pp2":
                loaded = build_model(model, ctx.config, ctx, seed=99)
                load_megatron_checkpoint(loaded, model, work / f"{variant}-tp2pp2")
                converted = dict(p for c in chunks for p in chunk_parameters(c))
                resharded = dict(p for c in loaded for p in chunk_parameters(c))
                results["resharded", variant, layout] = sorted(converted) == sorted(
                    resharded
                ) and all(torch.equal(converted[k], resharded[k]) for k in converted)
                log(f"{layout} {variant}: loaded the TP2/PP2 checkpoint")
            if layout == "tp2pp2":
                for transport in TRANSPORTS:
                    results["export", variant, transport] = records(
                        export_weights(
                            chunks,
                            model,
                            ctx,
                            version=VERSION,
                            bucket_bytes=BUCKET_BYTES,
                            transport=transport,
                        )
                    )
                    results["export-bf16", variant, transport] = records(
                        export_weights(
                            chunks,
                            model,
                            ctx,
                            version=VERSION + 1,
                            bucket_bytes=BUCKET_BYTES // 2,
                            dtype=torch.bfloat16,
                            to_all_tp_ranks=True,
                            transport=transport,
                        )
                    )
                if variant == VARIANTS[0]:  # /dev/shm full: auto falls back, shared_memory refuses
                    results["export-shm-full", variant] = with_full_shm(
                        lambda *a, **k: records(export_weights(*a, **k)),
                        chunks,
                        model,
                        ctx,
                        version=VERSION,
                        bucket_bytes=BUCKET_BYTES,
                    )
                    results["refused-shm-full", variant] = with_full_shm(
                        lambda *a, **k: refusal(export_weights(*a, **k)),
                        chunks,
                        model,
                        ctx,
                        version=VERSION,
                        bucket_bytes=BUCKET_BYTES,
                        transport="shared_memory",
                    )
                    # one kept buffer, refilled for every bucket of two exports
                    mover = make_transport(
                        "shared_memory", ctx, torch.device("cpu"), False, reuse=True
                    )
                    for round_ in range(2):
                        kept, storages, alive = [], [], []
                        for bucket in export_weights(
                            chunks,
                            model,
                            ctx,
                            version=round_,
                            bucket_bytes=BUCKET_BYTES,
                            transport=mover,
                        ):
                            first = next(iter(bucket.tensors.values()))
                            alive.append(first)  # new mappings could not take its address
                            storages.append(first.untyped_storage().data_ptr())
                            kept.append({n: t.clone() for n, t in bucket.tensors.items()})
                        results["export-reuse", variant, round_] = (kept, storages)
                # into a colocated engine: stage 1 streams its buckets to the engine's rank
                actor = types.SimpleNamespace(context=ctx, chunks=chunks, model_config=model)
                for key, refuse_at in (("push-refused", 3), ("push", None)):
                    engine = RecordingEngine(refuse_at) if holds_engine(ctx) else None
                    try:
                        push_weights(actor, engine, version=VERSION, bucket_bytes=BUCKET_BYTES)
                        results[key, variant] = engine and (engine.loaded, engine.version)
                    except EngineFailure as err:
                        results[key, variant] = str(err)
                log(f"{layout} {variant}: exported")
            if layout == "pp2vpp2":
                results["export-vpp", variant] = records(
                    export_weights(chunks, model, ctx, version=VERSION, bucket_bytes=BUCKET_BYTES)
                )
            if layout in ("tp2pp2", "tp1pp1"):
                megatron_to_hf(
                    work / f"{variant}-tp2pp2",
                    work / f"{variant}-back-{layout}",
                    ctx,
                    max_shard_bytes=BUCKET_BYTES,
                )
                log(f"{layout} {variant}: back to HF")
        results["place", layout] = dict(
            tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank, dp_rank=ctx.dp_rank
        )
        ctx.teardown()
    gloo_launch.save_result(results, args.out)
    dist.destroy_process_group()
    log("done")


if __name__ == "__main__":
    main(sys.argv[1:])
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
