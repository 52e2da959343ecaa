"""The RL trainer: the command line, the loop and its phases, its typed state, metrics,
checkpoints, the supervised warm-up and TensorBoard tracking."""
