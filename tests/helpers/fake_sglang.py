"""Stand-ins for SGLang in the adapter tests: a ``/generate`` output as SGLang documents it, a
server that answers like one, and an in-process ``sglang.Engine`` that records what it is asked."""

from __future__ import annotations

import asyncio
import threading
import types


def sglang_output(tokens, logprobs, finish="length", *, ids=True, **finish_extra):
    """One ``/generate`` output as SGLang 0.5.x documents it (``skip_tokenizer_init``)."""
    out = {
        "text": "",
        "meta_info": {
            "id": "4f2c",
            "finish_reason": {"type": finish, **finish_extra},
            "prompt_tokens": 3,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
        },
    }
    if ids:
        out["output_ids"] = list(tokens)
    return out


class FakeServer:
    """Answers like an SGLang server: each generated token is ``100 + position in the context``
    with log-prob ``-0.01 * token``. ``cut_after`` makes every request of the next
    ``/generate`` stop after that many tokens with finish ``abort`` (as after an abort or a
    pause); ``on_generate`` runs before it answers."""

    def __init__(self):
        self.calls: list[tuple[str, str, dict | None]] = []
        self.cut_after: int | None = None
        self.on_generate = None
        self.status: dict[str, int] = {}

    def __call__(self, method, path, body):
        self.calls.append((method, path, body))
        if path in self.status:
            return self.status[path], {"success": False, "message": "no"}
        if path == "/generate":
            if self.on_generate:
                self.on_generate()
            return 200, [
                self._one(ids, sp) for ids, sp in zip(body["input_ids"], body["sampling_params"])
            ]
        if path == "/health":
            return 200, None
        return 200, {"success": True, "message": ""}

    def _one(self, ids, sp):
        count = (
            sp["max_new_tokens"]
            if self.cut_after is None
            else min(self.cut_after, sp["max_new_tokens"])
        )
        tokens = [100 + len(ids) + k for k in range(count)]
        finish = "abort" if self.cut_after is not None else "length"
        for k, token in enumerate(tokens):
            if token in sp["stop_token_ids"]:
                tokens, finish = tokens[: k + 1], "stop"
                break
        return sglang_output(tokens, [-0.01 * t for t in tokens], finish)

    def paths(self):
        return [path for _, path, _ in self.calls]


class FakeLoop:
    def __init__(self):
        self.ran = []

    def is_running(self):
        return False

    def run_until_complete(self, coroutine):
        self.ran.append(coroutine)
        asyncio.run(coroutine)


class FakeEngine:
    """Records what ``SGLangEngine`` asks of ``sglang.Engine``; ``healthy`` False makes
    ``get_server_info`` fail."""

    def __init__(self):
        self.loop = FakeLoop()
        self.calls = []
        self.healthy = True
        manager = types.SimpleNamespace()
        manager.abort_request = lambda **kw: self.calls.append(("abort_request", kw))

        async def pause_generation(obj):
            self.calls.append(("pause_generation", obj.mode))

        async def continue_generation(obj):
            self.calls.append(("continue_generation", None))

        manager.pause_generation = pause_generation
        manager.continue_generation = continue_generation
        self.tokenizer_manager = manager

    def generate(self, **kwargs):
        assert threading.current_thread() is threading.main_thread()  # the loop's thread
        self.calls.append(("generate", kwargs))
        return [sglang_output([9], [-0.5]) for _ in kwargs["input_ids"]]

    def update_weights_from_tensor(self, **kwargs):
        self.calls.append(("update_weights_from_tensor", kwargs))
        return True, "Succeeded to update model weights."

    def flush_cache(self):
        self.calls.append(("flush_cache", None))
        return types.SimpleNamespace(success=True)

    def release_memory_occupation(self):
        self.calls.append(("release_memory_occupation", None))

    def resume_memory_occupation(self):
        self.calls.append(("resume_memory_occupation", None))

    def begin_weight_update(self):
        self.calls.append(("begin_weight_update", None))
        return True, ""

    def end_weight_update(self):
        self.calls.append(("end_weight_update", None))
        return False, "packed weights incomplete"

    def get_server_info(self):
        if not self.healthy:
            raise RuntimeError("scheduler died")
        return {}
