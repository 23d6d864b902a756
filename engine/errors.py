class CheckpointError(ValueError):
    """A checkpoint or config that cannot be loaded as asked; the message names the file, tensor or field."""
