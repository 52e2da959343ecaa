"""TRL side of the real-model CPU benchmark: TRL's GRPOTrainer on a small HF model.

Runs ``trl.GRPOTrainer`` (plain ``model.generate``, no vLLM) on a JSONL prompt file whose rows
look like ``{"prompt": [{"role": "user", "content": "What is 7 + 12?"}], "answer": "19"}`` and
times every rollout step. The setup mirrors the bapo-megatron side of the comparison:

* 8 prompts x 4 samples per step (``num_generations=4``). In TRL ``per_device_train_batch_size``
  counts *completions*, not prompts: it is 32 with ``gradient_accumulation_steps=1``, which makes
  ``steps_per_generation=1`` and ``generation_batch_size=32``, so one optimizer step per rollout.
  With generation and optimizer steps aligned like this TRL skips the old-log-prob forward pass
  and uses ``per_token_logps.detach()`` as the old policy: the ratio is exactly 1 and the clip
  (epsilon = epsilon_high = 0.2) never fires.
* max_completion_length 64, temperature 0.7 (top_p 1, top_k 0), beta 0 (no reference model),
  learning rate 5e-6 held constant, AdamW (transformers' default adamw_torch_fused: betas
  0.9/0.999, weight decay 0, grad-norm clip 1.0), loss_type "dapo" and group reward scaling
  (TRL defaults).
* float32, or ``--bf16`` for bfloat16 autocast (``bf16=True, use_cpu=True``; weights stay fp32).
  GRPOConfig defaults to bf16=True and gradient_checkpointing=True: both are set explicitly here.
* reward 1.0 when the last integer in the completion equals the answer, else 0.0.

Timing: a TrainerCallback takes each optimizer step from ``on_step_begin`` to ``on_step_end``
(that span contains the rollout, since TRL generates inside ``training_step``'s
``_prepare_inputs``). ``generate_s`` is the time spent in ``GRPOTrainer._generate_single_turn``
(the ``model.generate`` call and its EOS masking); ``score_s`` is the rest of
``_generate_and_score_completions`` (tokenising, reward, advantages); ``train_s`` is
``seconds - generate_s`` (scoring + forward/backward + optimizer). Peak RSS is
``getrusage(RUSAGE_SELF).ru_maxrss``.

The last stdout line is one JSON object (see ``summary`` below). ``--out`` receives
``trl_log.jsonl`` (TRL's own per-step logs) and ``result.json``; ``--save-final DIR`` saves the
trained model and tokenizer for held-out evaluation elsewhere. For time to accuracy, ``--save-every
N`` saves ``checkpoint-<optimizer step>`` folders every N rollout steps and records each save's
wall time since the script started (``saves``); ``--num-iterations`` and ``--epsilon-high`` set
the recipe's reuse of a batch and its clip range.

Run with the TRL venv (tools/real_model_bench/requirements-trl.txt), e.g.
  OMP_NUM_THREADS=2 ~/.cache/bapo-megatron/trl-venv/bin/python tools/real_model_bench/trl_side.py \\
      --model ~/.cache/bapo-megatron/models/SmolLM2-135M-Instruct --prompts arith.jsonl --steps 6
"""

import argparse
import json
import os
import re
import resource
import statistics
import sys
import time

STARTED = time.perf_counter()  # the saves' wall times count from here, imports included
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

INT_RE = re.compile(r"-?\d+")


def completion_text(completion):
    """A completion is a list of chat messages (conversational prompts) or a plain string."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion)
    return completion


def last_integer_reward(prompts, completions, answer, **kwargs):
    """1.0 when the last integer in the completion equals the row's answer, else 0.0."""
    rewards = []
    for completion, ans in zip(completions, answer, strict=True):
        found = INT_RE.findall(completion_text(completion).replace(",", ""))
        rewards.append(1.0 if found and found[-1] == str(ans).strip() else 0.0)
    return rewards


def peak_rss_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepTimer(TrainerCallback):
    """Per optimizer step: wall time, time in generation, time in scoring, and reward mean."""

    def __init__(self):
        self.steps = []
        self._t0 = None
        self.gen_s = 0.0
        self.score_s = 0.0
        self.rewards = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()
        self.gen_s = self.score_s = 0.0
        self.rewards = []

    def on_step_end(self, args, state, control, **kwargs):
        seconds = time.perf_counter() - self._t0
        row = {
            "seconds": round(seconds, 3),
            "generate_s": round(self.gen_s, 3),
            "train_s": round(seconds - self.gen_s, 3),
            "score_s": round(self.score_s, 3),
            "reward_mean": round(statistics.fmean(self.rewards), 4) if self.rewards else None,
            "peak_rss_gib": round(peak_rss_gib(), 3),
        }
        self.steps.append(row)
        print(f"[trl_side] step {len(self.steps)}: {json.dumps(row)}", file=sys.stderr, flush=True)


class SaveTimes(TrainerCallback):
    """The wall time of every checkpoint save since the script started (time to accuracy)."""

    def __init__(self):
        self.saves = []

    def on_save(self, args, state, control, **kwargs):
        wall = round(time.perf_counter() - STARTED, 1)
        row = {"optimizer_step": state.global_step, "wall_s": wall}
        self.saves.append(row)
        print(f"[trl_side] saved: {json.dumps(row)}", file=sys.stderr, flush=True)


class LogSink(TrainerCallback):
    """Writes TRL's own log dicts (loss, reward, step_time, ...) one JSON object a line."""

    def __init__(self, path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"global_step": state.global_step, **(logs or {})}) + "\n")


def instrument(trainer, timer):
    """Wrap the trainer's generation methods so that the timer sees generation and scoring time."""
    gen_single = trainer._generate_single_turn
    gen_and_score = trainer._generate_and_score_completions

    def timed_single_turn(*a, **kw):
        t = time.perf_counter()
        try:
            return gen_single(*a, **kw)
        finally:
            timer.gen_s += time.perf_counter() - t

    def timed_gen_and_score(*a, **kw):
        t, g = time.perf_counter(), timer.gen_s
        try:
            return gen_and_score(*a, **kw)
        finally:
            timer.score_s += (time.perf_counter() - t) - (timer.gen_s - g)

    trainer._generate_single_turn = timed_single_turn
    trainer._generate_and_score_completions = timed_gen_and_score


def compute_dtype_probe(model, seen):
    """Forward hook recording the dtype a linear layer actually computes in (autocast or not)."""
    layer = model.model.layers[0].mlp.down_proj

    def hook(module, inputs, output):
        seen.add(str(output.dtype).replace("torch.", ""))

    return layer.register_forward_hook(hook)


def load_prompts(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in rows])


def median_after(values, skip=2):
    tail = values[skip:] or values
    return round(statistics.median(tail), 3) if tail else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--prompts", required=True, help="JSONL: prompt, answer")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (rollout steps x mu)")
    p.add_argument("--out", default="/tmp/trl_side_out", help="folder for logs and result.json")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast on CPU (fp32 weights)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--epsilon", type=float, default=0.2, help="clip epsilon (low, and high)")
    p.add_argument("--epsilon-high", type=float, default=None, help="default: --epsilon")
    p.add_argument(
        "--num-iterations", type=int, default=1, help="optimizer steps per rollout batch (TRL's mu)"
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="save a checkpoint every this many rollout steps, timed (0: none)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--grad-checkpointing", action="store_true", help="TRL's default; off here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-final", default=None, help="save the trained model + tokenizer here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "trl_log.jsonl")
    if os.path.exists(log_path):
        os.remove(log_path)

    t_start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    dataset = load_prompts(args.prompts)
    completions_per_step = args.prompts_per_step * args.num_generations

    config = GRPOConfig(
        output_dir=args.out,
        use_cpu=True,
        bf16=args.bf16,  # GRPOConfig's default is True: must be explicit for fp32
        fp16=False,
        # GRPOConfig defaults gradient_checkpointing=True; transformers 5 calls it activation_*
        activation_checkpointing=args.grad_checkpointing,
        gradient_checkpointing=args.grad_checkpointing,
        per_device_train_batch_size=completions_per_step,  # counts completions, not prompts
        gradient_accumulation_steps=1,  # -> steps_per_generation=1, generation_batch_size=32
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=args.epsilon,
        epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        num_iterations=args.num_iterations,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=args.steps,
        use_vllm=False,
        logging_steps=1,
        save_strategy="steps" if args.save_every else "no",
        save_steps=max(args.save_every, 1) * args.num_iterations,
        save_only_model=True,
        report_to="none",
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    timer = StepTimer()
    save_times = SaveTimes()

    def last_integer_reward_recorded(prompts, completions, answer, **kwargs):
        rewards = last_integer_reward(prompts, completions, answer)
        timer.rewards.extend(rewards)  # the step's reward mean, as the reward function saw it
        return rewards

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=last_integer_reward_recorded,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer, save_times, LogSink(log_path)],
    )
    assert trainer.args.generation_batch_size == completions_per_step, trainer.args
    assert trainer.args.steps_per_generation == 1, trainer.args.steps_per_generation
    instrument(trainer, timer)

    dtypes_seen = set()
    probe = compute_dtype_probe(trainer.model, dtypes_seen)
    t_train = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t_train
    probe.remove()

    if args.save_final:
        trainer.save_model(args.save_final)
        tokenizer.save_pretrained(args.save_final)

    steps = timer.steps
    summary = {
        "side": "trl",
        "trl_version": trl.__version__,
        "torch_version": torch.__version__,
        "steps": [{k: s[k] for k in ("seconds", "generate_s", "train_s")} for s in steps],
        "steady_step_s": median_after([s["seconds"] for s in steps]),
        "steady_generate_s": median_after([s["generate_s"] for s in steps]),
        "steady_train_s": median_after([s["train_s"] for s in steps]),
        "peak_rss_gib": round(peak_rss_gib(), 3),
        "dtype": "bfloat16-autocast" if args.bf16 else "float32",
        "compute_dtypes_seen": sorted(dtypes_seen),
        "reward_mean_per_step": [s["reward_mean"] for s in steps],
        "completions_per_step": completions_per_step,
        "max_completion_length": args.max_completion_length,
        "threads": torch.get_num_threads(),
        "activation_checkpointing": bool(trainer.args.activation_checkpointing),
        "train_wall_s": round(train_wall, 3),
        "total_wall_s": round(time.perf_counter() - t_start, 3),
        "num_iterations": args.num_iterations,
        "saves": save_times.saves,
    }
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump({**summary, "steps_detail": steps}, f, indent=1)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
