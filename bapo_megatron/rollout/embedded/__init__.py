"""The embedded CPU engine (transformers' model, our sampler): the default rollout engine."""
