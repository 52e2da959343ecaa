"""The worker of the shard-to-shard sync tests (tests/distributed/test_shard_sync.py with the
embedded engine; tests/vllm/test_rollout_vllm_shard_sync.py with vLLM), started by
tests/helpers/gloo_launch.py in 4 processes. Light at import time (see
tests/distributed/weights_layouts_worker.py).

For every layout each rank converts the HF folder, and each replica's engine rank starts its
engine. Three rounds, each with new weights (every trainer parameter moved by the same
elementwise map, so replicas stay equal): ``push_shards`` syncs them and the engine ranks record
what the engine holds, its greedy tokens and their log-probs; then today's broadcast path
(``push_weights``) syncs the same weights and they record it again. Every rank records the
gathers and whole-tensor placements counted during the shard-to-shard sync and what it moved.
Then a rank that planned with another bucket size (every rank raises; the engine refuses to
generate), and the next layout, with the same sync state (the plan is made again). The parent
test makes the comparisons.
"""

from __future__ import annotations

import sys
import time

LAYOUTS = {  # name -> ParallelConfig fields
    "tp1": {},
    "tp2": {"tensor_model_parallel_size": 2},
    "tp2pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "moe-tp2pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
    "tp2-sp-ep2": {
        "tensor_model_parallel_size": 2,
        "sequence_parallel": True,
        "expert_model_parallel_size": 2,
    },
    "tp2-sp-ep2-pp2": {
        "tensor_model_parallel_size": 2,
        "sequence_parallel": True,
        "expert_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
    },
}
ROUNDS = 3
BUCKET_BYTES = 24_000
PROMPTS = [[3, 17, 42, 5], [9, 8, 7]]
NEW_TOKENS = 5


def moved(chunks, round_: int) -> None:
    """Every parameter through the same elementwise map (replicas stay equal)."""
    import torch

    from bapo_megatron.models.name_maps import chunk_parameters

    with torch.no_grad():
        for chunk in chunks:
            for _, param in chunk_parameters(chunk):
                param.mul_(1.0 + 0.05 * round_).add_(0.01 * round_)


class Counted:
    """Counts calls of the tensor gathers and of the whole-tensor assembly while active."""

    NAMES = ("gather", "all_gather", "all_gather_into_tensor", "all_gather_single")

    def __init__(self) -> None:
        import torch.distributed as dist

        import bapo_megatron.weights.tp_assembly as transports

        self.calls = 0
        self.saved = []
        for module, name in [(dist, n) for n in self.NAMES if hasattr(dist, n)] + [
            (transports, "place_shard")
        ]:
            original = getattr(module, name)
            self.saved.append((module, name, original))
            setattr(module, name, self._counting(original))

    def _counting(self, original):
        def call(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if hasattr(a, "is_floating_point")]
            if not tensors or any(t.is_floating_point() for t in tensors):
                self.calls += 1
            return original(*args, **kwargs)

        return call

    def close(self) -> None:
        for module, name, original in self.saved:
            setattr(module, name, original)


def engine_state(engine) -> dict:
    """What an engine holds and generates: its parameters (embedded) or its workers' weight
    checksums (vLLM), greedy tokens and their log-probs."""
    from bapo_megatron.rollout.protocol import SamplingParams

    params = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=NEW_TOKENS, seed=3)
    samples = engine.generate(PROMPTS, params)
    if hasattr(engine, "weights_checksums"):
        held = engine.weights_checksums()
    else:
        held = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return {
        "held": held,
        "tokens": [s.token_ids for s in samples],
        "logprobs": [s.logprobs for s in samples],
    }


def killed_mid_sync(actor, engine, ctx) -> dict:
    """SIGKILL the in-process vLLM's second worker when the engine rank starts its second bucket
    of a shard-to-shard sync (after the worker is seen dead, the sync goes on): what each rank
    raised, and on the engine rank what a generation then raises."""
    import datetime
    import os
    import signal

    import bapo_megatron.resharding.execute as execute
    from bapo_megatron.rollout.guard import EngineFailure
    from bapo_megatron.rollout.vllm.tensor_parallel import executor_of
    from bapo_megatron.weight_sync.shard_to_shard import ShardSync, push_shards

    original, calls = execute.exchange_bucket, []
    victim = executor_of(engine.llm).workers[1].proc if engine is not None else None

    def exchange(*args, **kwargs):
        calls.append(None)
        if victim is not None and len(calls) == 2:
            os.kill(victim.pid, signal.SIGKILL)
            victim.join()  # dead before anything more is sent
        return original(*args, **kwargs)

    execute.exchange_bucket = exchange
    outcome = {"pid": victim and victim.pid}
    try:
        sync = ShardSync(timeout=datetime.timedelta(seconds=30))
        push_shards(actor, engine, sync, version=9, bucket_bytes=BUCKET_BYTES)
        outcome["sync"] = "ran"
    except EngineFailure as error:
        outcome["sync"] = str(error)
    finally:
        execute.exchange_bucket = original
    if engine is not None:
        try:
            engine_state(engine)
            outcome["generate"] = "generated"
        except RuntimeError as error:
            outcome["generate"] = str(error)
    return outcome


def main(argv: list[str]) -> None:
    import types
    from pathlib import Path

    import torch.distributed as dist

    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.rollout.guard import EngineFailure
    from bapo_megatron.trainer.replicas import holds_engine
    from bapo_megatron.weight_sync.colocated_stream import push_weights
    from bapo_megatron.weight_sync.shard_to_shard import ShardSync, push_shards
    from bapo_megatron.weights.convert import hf_to_megatron
    from tests.distributed import shard_sync_engines
    from tests.helpers import gloo_launch

    args = gloo_launch.worker_arguments(
        argv, workdir=str, engine=str, layouts=str, url=str, kill=int
    )
    gloo_launch.join_group(args, timeout_s=120)
    work = Path(args.workdir)
    # "name" or "name:engine" (another engine kind than --engine for that layout)
    layouts = {name: LAYOUTS[name.split(":")[0]] for name in args.layouts.split(",")}
    start = time.monotonic()

    def log(what: str) -> None:  # in the rank's log, shown if the launch fails
        print(f"{time.monotonic() - start:6.1f} s  {what}", flush=True)

    results: dict = {}
    sync = ShardSync()  # kept across layouts: a new layout makes the plan again
    engines: dict = {}
    for name, fields in layouts.items():
        ctx = ParallelContext.initialize(ParallelConfig(**fields))
        layout, _, kind = name.partition(":")
        kind = kind or args.engine
        folder = work / ("hf-moe" if "ep2" in layout or layout.startswith("moe") else "hf")
        model, chunks = hf_to_megatron(folder, work / f"ckpt-{layout}-{kind}", ctx)
        actor = types.SimpleNamespace(context=ctx, chunks=chunks, model_config=model)
        log(f"{name}: converted")
        # one engine per model and kind, kept across layouts
        if holds_engine(ctx) and (folder, kind) not in engines:
            engines[folder, kind] = shard_sync_engines.start(kind, args.url, folder)
            if kind in ("vllm", "vllm-tp1"):  # in process: the probe check reads its workers
                results["probed", kind] = shard_sync_engines.probed(engines[folder, kind], kind)
        engine = engines.get((folder, kind)) if holds_engine(ctx) else None
        log(f"{name}: engine started")
        for round_ in range(1, ROUNDS + 1):
            moved(chunks, round_)
            counted = Counted()
            try:
                reports = push_shards(
                    actor, engine, sync, version=round_, bucket_bytes=BUCKET_BYTES, checksum=True
                )
            finally:
                counted.close()
            result = results[name, round_] = {
                "gathers": counted.calls,
                "counts": sync.last,
                "digest": sync.plan.digest,
                "reports": reports,
                "plan_bytes": (sync.plan.sent_bytes(), sync.plan.received_bytes()),
            }
            if engine is not None:
                result["shards"] = engine_state(engine)
            # the same weights through the broadcast path
            push_weights(actor, engine, version=round_, bucket_bytes=BUCKET_BYTES)
            if engine is not None:
                result["broadcast"] = engine_state(engine)
                if round_ == ROUNDS and hasattr(engine, "last_loaded"):
                    result["hf_tensors"] = engine.last_loaded
        log(f"{name}: {ROUNDS} rounds synced")
        # a rank that planned with another bucket size: every rank stops, and the engine does
        # not generate until a whole update lands
        odd = BUCKET_BYTES // 2 if ctx.rank == ctx.world_size - 1 else BUCKET_BYTES
        try:
            push_shards(actor, engine, sync, version=ROUNDS + 1, bucket_bytes=odd)
            results[name, "mismatch"] = "ran"
        except EngineFailure as error:
            results[name, "mismatch"] = str(error)
        if engine is not None:
            try:
                engine_state(engine)
                results[name, "after-mismatch"] = "generated"
            except RuntimeError as error:
                results[name, "after-mismatch"] = str(error)
        results[name, "layout"] = (ctx.tp_size, ctx.pp_size, ctx.ep_size, ctx.rank)
        log(f"{name}: mismatch refused")
        if args.kill and name == list(layouts)[-1]:
            results["killed"] = killed_mid_sync(actor, engine, ctx)
            log(f"{name}: killed mid-sync")
        ctx.teardown()
    sync.close()
    for engine in engines.values():  # the world they found stays (rollout/vllm/borrowed_world.py)
        shard_sync_engines.stop(engine)
    gloo_launch.save_result(results, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
