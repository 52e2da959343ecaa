"""Check a recipe's parallel layout rank by rank on the meta device (no GPU): the console script
``bapo-plan-layout`` (:mod:`bapo_megatron.planning.cli`).

    python tools/plan_layout.py examples/qwen2.5-7b/train.yaml --world-size 16 \
        --hf-config tests/data/published_configs/DeepSeek-R1-Distill-Qwen-7B.json
"""

import sys

from bapo_megatron.planning.cli import main
from bapo_megatron.train.process_exit import skip_final_collection

if __name__ == "__main__":
    status = main()
    skip_final_collection()
    sys.exit(status)
