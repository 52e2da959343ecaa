"""The warning filters of pyproject.toml ([tool.pytest.ini_options] filterwarnings) are in force
in every test: a warning raised from this project's code is an error, while the known
third-party deprecations are silenced. Warnings are raised here from code whose module name is
that of a real module (``exec`` with its ``__name__``), which is what Python attributes a
warning to."""

from __future__ import annotations

import tomllib
import warnings

import pytest

from tests.helpers.gloo_launch import REPO_ROOT


def warn_from(module: str, message: str, category: type[Warning]) -> list[str]:
    """Raise ``message`` from code running as module ``module``; the messages that got through
    the filters (an ``error`` filter raises instead)."""
    code = compile(
        f"import warnings\nwarnings.warn({message!r}, {category.__name__})",
        module.replace(".", "/") + ".py",
        "exec",
    )
    with warnings.catch_warnings(record=True) as caught:  # keeps the filters in force
        exec(code, {"__name__": module, category.__name__: category})
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("module", ["bapo_megatron.trainer.loop", "tests.unit.test_config"])
def test_a_warning_from_our_code_is_an_error(module):
    with pytest.raises(UserWarning, match="ours"):
        warn_from(module, "ours", UserWarning)
    with pytest.raises(DeprecationWarning):
        warn_from(module, "ours, deprecated", DeprecationWarning)


def test_other_third_party_warnings_still_show():
    assert warn_from("megatron.core.models", "something new", UserWarning) == ["something new"]
    assert warn_from("bapo_megatron_other", "a module of another package", UserWarning) == [
        "a module of another package"
    ]


@pytest.mark.parametrize(
    "module, message, category",
    [
        (
            "megatron.core.tensor_parallel.layers",
            "Warning: tp_group is None, using default tp group. Passing tp_group will be "
            "mandatory soon",
            DeprecationWarning,
        ),
        (
            "megatron.core.transformer.spec_utils",
            "MLP requires ffn_hidden_size, but it was not provided.",
            DeprecationWarning,
        ),
        (
            "megatron.core.transformer.multi_latent_attention",
            "The 'megatron.core.transformer.custom_layers.transformer_engine' \n    module is "
            "deprecated",
            DeprecationWarning,
        ),
        # passes through our CPU runtime patch, so it is attributed to our module
        (
            "bapo_megatron.megatron_patches.cpu_runtime",
            "Please use DTensor instead and we are deprecating ShardedTensor.",
            FutureWarning,
        ),
        (
            "megatron.core.dist_checkpointing.strategies.torch",
            "`load_state_dict` is deprecated and will be removed in future versions.",
            FutureWarning,
        ),
        (
            "megatron.core.distributed.param_and_grad_buffer",
            "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
            "`torch.distributed.all_gather_single` instead.",
            FutureWarning,
        ),
        (
            "torch.distributed.c10d_logger",
            "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
            "`torch.distributed.all_gather_single` instead.",
            FutureWarning,
        ),
        (
            "megatron.core.optimizer",
            "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
            UserWarning,
        ),
        (
            "torch.nn.functional",
            "Mismatch dtype between input and weight: input dtype = c10::BFloat16",
            UserWarning,
        ),
    ],
)
def test_known_third_party_deprecations_are_silenced(module, message, category):
    assert warn_from(module, message, category) == []


def test_our_call_of_a_deprecated_torch_collective_would_not_be_silenced():
    # the collective deprecations are silenced for Megatron's calls only
    with pytest.raises(FutureWarning):
        warn_from(
            "bapo_megatron.weights.tp_assembly",
            "`torch.distributed.all_gather_into_tensor` is deprecated.",
            FutureWarning,
        )


def test_every_filter_names_its_reason():
    text = (REPO_ROOT / "pyproject.toml").read_text()
    filters = tomllib.loads(text)["tool"]["pytest"]["ini_options"]["filterwarnings"]
    lines = text.splitlines()
    start = lines.index("filterwarnings = [")
    end = lines.index("]", start)
    seen, reason = [], None
    for line in lines[start + 1 : end]:
        line = line.strip()
        if line.startswith("#"):
            reason = line
        elif line.startswith('"'):
            (entry,) = tomllib.loads(f"entry = {line.rstrip(',')}").values()
            # an ignore shares the reason of the comment block above it
            assert entry.startswith("error:") or reason is not None, f"{entry}: no reason"
            seen.append(entry)
    assert seen == filters
