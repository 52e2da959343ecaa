"""The loss demo: BAPO's clip-bound search on synthetic stale data, without the trainer.

For each preset it prints the bounds the search chose and the positive contribution
rho = P/(P+N) before and after the search, at several staleness levels. A YAML file and dotted
overrides add a row with a custom loss configuration:

    python -m bapo_megatron.repro.loss_demo --config examples/loss.yaml loss.clip.c_high_max=2.5
"""

from __future__ import annotations

import argparse

import torch

from bapo_megatron.algo import SearchPlan, bapo_loss, loss_normalizer
from bapo_megatron.config import CLIP_PRESETS, ClipSearchConfig
from bapo_megatron.config.loading import load_config
from bapo_megatron.repro.stale_batches import off_policy_batch


def run_row(name: str, clip: ClipSearchConfig, aggregation: str, batch) -> str:
    plan = SearchPlan.from_config(clip)
    logp_new = batch.logp_new.clone().requires_grad_(True)
    loss, m = bapo_loss(
        logp_new,
        batch.logp_old,
        batch.advantages,
        batch.mask,
        plan=plan,
        normalizer=loss_normalizer(batch.mask, aggregation),
        aggregation=aggregation,
    )
    loss.backward()
    grad_norm = logp_new.grad.norm().item()
    return (
        f"{name:<12} {m['bapo/c_low'].item():>6.2f} {m['bapo/c_high'].item():>6.2f} "
        f"{int(m['bapo/search_steps']):>5d} {m['bapo/rho_before'].item():>10.3f} "
        f"{m['bapo/rho_after'].item():>9.3f} {m['bapo/clip_frac_positive'].item():>9.3f} "
        f"{m['bapo/clip_frac_negative'].item():>9.3f} {loss.item():>9.4f} {grad_norm:>9.2e}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML run config; its loss section adds a 'custom' row")
    parser.add_argument("--staleness", default="1,4,8", help="comma-separated staleness levels")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. loss.clip.c_high_max=2.5"
    )
    args = parser.parse_args(argv)
    custom = load_config(args.config, args.overrides) if (args.config or args.overrides) else None

    header = (
        f"{'preset':<12} {'c_low':>6} {'c_high':>6} {'steps':>5} {'rho_before':>10} "
        f"{'rho_after':>9} {'clip_pos':>9} {'clip_neg':>9} {'loss':>9} {'grad_norm':>9}"
    )
    for staleness in (float(s) for s in args.staleness.split(",")):
        batch = off_policy_batch(
            args.prompts, args.group_size, args.max_tokens, staleness=staleness, seed=args.seed
        )
        tokens = int(batch.mask.sum())
        print(f"\nstaleness {staleness:g}: {batch.mask.shape[0]} samples, {tokens} response tokens")
        print(header)
        for name in CLIP_PRESETS:
            print(run_row(name, ClipSearchConfig.from_preset(name), "token-mean", batch))
        if custom is not None:
            print(run_row("custom", custom.loss.clip, custom.loss.aggregation, batch))
    print(
        "\nrho = P/(P+N): share of the positive-advantage contribution "
        "(paper target 0.4; reference target P/N >= 1, i.e. 0.5)."
    )


if __name__ == "__main__":
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    main()
