"""Rollout engines: the protocol (:mod:`.protocol`), the embedded CPU engine on transformers
(:mod:`.embedded`, the default), and the pieces they share (sampling, weight checksums)."""
