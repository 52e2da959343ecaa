"""Check a recipe's parallel layout rank by rank on the meta device (no GPU): the console script
``bapo-plan-layout`` (:mod:`bapo_megatron.planning.cli`).

    python tools/plan_layout.py examples/deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml \
        --world-size 16 \
        --hf-config tests/data/published_configs/DeepSeek-R1-Distill-Qwen-7B.json
"""

import sys

from bapo_megatron.commands.console import plan_layout

if __name__ == "__main__":
    sys.exit(plan_layout())
