"""Reward-guided speculative decoding: acceptance math, the delta sweep, token-level speculative decoding."""
