"""`sgl-tts serve`: an OpenAI-compatible HTTP endpoint whose answers are searches."""
