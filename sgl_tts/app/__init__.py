"""The top layer: the session that wires runtimes, scorer and FastTTS together, the CLI, run reports."""
