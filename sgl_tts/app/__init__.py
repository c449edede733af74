"""The top of the library: the session that wires runtimes, scorer and FastTTS together, run reports."""
