"""Model presets and engine presets as JSON files (read by `checkpoints.presets`)."""
