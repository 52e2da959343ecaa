"""vLLM: the in-process engine (``vllm.LLM``) and the OpenAI-compatible server client."""
