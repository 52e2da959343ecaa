"""What a built actor holds, measured from its tensors: the reference the layout planner's byte
counts are checked against."""

from __future__ import annotations


def optimizer_state_bytes(actor) -> int:
    """Bytes of the optimizer's own tensors: the fp32 main copies of parameters stored in lower
    precision (those whose storage is not the model's) and Adam's two moments."""
    model_storages = {
        p.untyped_storage().data_ptr() for c in actor.chunks for p in c.module.parameters()
    }
    total = 0
    for inner in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in model_storages:  # an fp32 main copy
                    total += p.numel() * p.element_size()
                state = inner.optimizer.state[p]
                total += sum(
                    state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq")
                )
    return total
