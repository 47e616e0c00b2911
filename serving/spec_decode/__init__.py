"""Speculative decoding: host-side proposers of draft tokens.

Pure Python, no jax. For the model-free methods ("ngram": prompt lookup,
"suffix": suffix decoding) the engine asks a `Proposer` for up to k guessed
next tokens of each decoding request (`proposers.py`); the runner verifies the
drafts against the target model inside its jitted step and keeps the accepted
prefix. The "draft" method (a small draft model) proposes on the device, in
the runner; its host-side `DraftModelProposer` only marks that. `backoff.py`
decides when the engine speculates at all (`SpecBackoff`).
"""

from serving.spec_decode.backoff import SpecBackoff
from serving.spec_decode.proposers import (
    DraftModelProposer,
    NgramProposer,
    Proposer,
    SuffixProposer,
    make_proposer,
)

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "SpecBackoff", "SuffixProposer",
           "make_proposer"]
