"""Speculative beam extension (FastTTS §4.1): which finished beams fill idle batch slots, how much of
their speculative text a duplicate keeps, and when speculative text already holds a whole next step.

Pure functions and small classes; the search layer calls them between generation rounds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence


def score_bins(scores: Sequence[float], num_bins: int) -> list[int]:
    """The bin j (1 = highest) of each score: scores ranked best first and cut into `num_bins` equal
    shares by rank; equal scores share the better bin.

    Bins by rank rather than by value range: the bins do not depend on the scale of the aggregated
    scores, and with N beams and branching B the top bin holds about the N/B beams the search keeps.
    """
    assert num_bins >= 1, f"num_bins must be >= 1, got {num_bins}"
    n = len(scores)
    by_rank = sorted(range(n), key=lambda i: -scores[i])
    bins = [0] * n
    for rank, i in enumerate(by_rank):
        if rank and scores[i] == scores[by_rank[rank - 1]]:
            bins[i] = bins[by_rank[rank - 1]]
        else:
            bins[i] = rank * num_bins // n + 1
    return bins


def speculative_potential(bin_index: int, num_bins: int) -> int:
    """M_i = B − j + 1 for a beam in bin C_j (§4.1.1): the most speculative branches it may get."""
    assert 1 <= bin_index <= num_bins, f"bin {bin_index} outside 1..{num_bins}"
    return num_bins - bin_index + 1


def speculative_slots(batch_size: int, standard_in_flight: int) -> int:
    """Slots left for speculation: standard work always comes first, speculation only fills the rest."""
    assert batch_size >= 0 and standard_in_flight >= 0, "batch_size and standard_in_flight must be >= 0"
    return max(0, batch_size - standard_in_flight)


@dataclass(frozen=True)
class SpeculativeSlot:
    """One speculative branch to launch: extend `beam_id`, whose score bin is `bin_index`."""

    beam_id: Hashable
    bin_index: int


class SpeculativeSelector:
    """SelectSPEC of Algorithm 1 for one iteration, from the beams' previous-step scores."""

    def __init__(self, scores: Mapping[Hashable, float], num_bins: int) -> None:
        ids = list(scores)
        self.num_bins = num_bins
        self.bin_of = dict(zip(ids, score_bins([scores[i] for i in ids], num_bins)))
        self.potential = {i: speculative_potential(b, num_bins) for i, b in self.bin_of.items()}

    def select_speculative(
        self,
        finished_beams: Sequence[Hashable],
        free_slots: int,
        launched: Mapping[Hashable, int] | None = None,
    ) -> list[SpeculativeSlot]:
        """Fill `free_slots` from `finished_beams`: highest bin first (finish order within a bin), each
        beam up to its M_i minus the branches already `launched` for it."""
        launched = launched or {}
        unknown = [b for b in finished_beams if b not in self.bin_of]
        assert not unknown, f"finished beams without a previous score: {unknown[:5]}"
        slots: list[SpeculativeSlot] = []
        for beam in sorted(finished_beams, key=self.bin_of.__getitem__):
            if len(slots) >= free_slots:
                break
            room = self.potential[beam] - launched.get(beam, 0)
            take = max(0, min(room, free_slots - len(slots)))
            slots.extend(SpeculativeSlot(beam, self.bin_of[beam]) for _ in range(take))
        return slots


class TruncationSampler:
    """How many speculative tokens each duplicate of a selected beam keeps (Algorithm 1, lines 18-19).

    The kept fraction is drawn from N(ratio, std) clipped to [0, 1], from a seeded generator.
    """

    def __init__(self, ratio: float = 0.85, std: float = 0.1, seed: int = 0) -> None:
        assert 0.0 <= ratio <= 1.0 and std >= 0, f"need 0 <= ratio <= 1 and std >= 0, got {ratio}, {std}"
        self.ratio = ratio
        self.std = std
        self._rng = random.Random(seed)

    def keep_fraction(self) -> float:
        return min(1.0, max(0.0, self._rng.gauss(self.ratio, self.std)))

    def duplicate_lengths(self, speculative_len: int, copies: int) -> list[int]:
        """Kept speculative length per copy of a beam: the original (first) keeps all of it, the other
        `copies - 1` duplicates are truncated, so the copies diverge."""
        assert speculative_len >= 0 and copies >= 1, f"bad speculative_len={speculative_len}, copies={copies}"
        return [speculative_len] + [round(self.keep_fraction() * speculative_len) for _ in range(copies - 1)]


def lookahead_split(text: str, delimiter: str = "\n\n", ended: bool = False) -> tuple[str, str] | None:
    """LookAhead verification (§4.1.3): if speculative `text` holds a whole next step, return
    (that step, the text after it), else None.

    A step is whole when a delimiter follows non-blank text, or when generation `ended` (EOS or the
    answer) after non-blank text. Leading delimiters are skipped. The search layer then verifies the
    current step and this step in one verifier request.
    """
    assert delimiter, "delimiter must be non-empty"
    start = 0
    while text.startswith(delimiter, start):
        start += len(delimiter)
    end = text.find(delimiter, start)
    if end >= 0 and text[start:end].strip():
        return text[start:end], text[end + len(delimiter):]
    if end < 0 and ended and text[start:].strip():
        return text[start:], ""
    return None
