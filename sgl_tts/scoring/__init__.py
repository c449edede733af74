"""Step scorers (likelihood, PRMs), score aggregation, and the PRM model classes served by SGLang."""
