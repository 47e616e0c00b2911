"""Constrained output: grammars from request constraints, and per-step token masks.

Host side only (no jax). A request's `StructuredOutputsParams` (JSON schema,
JSON object, regex, choice, Lark grammar) is compiled by llguidance
(`backend_guidance.py`) into a `Grammar`: a matcher that follows the tokens the
request generates. Before each step samples a constrained request, the
engine fills that request's row of a packed token bitmask
(`fill_masks`: one bit per vocabulary entry, 32 per int32 word); the runner
applies the masks inside its jitted sampler (rows of unconstrained requests
are all ones, so the program never changes). How the engine overlaps this with
the device, and what happens when a grammar fails: docs/structured_output.md.
"""

from serving.structured_output.backend_guidance import (
    Grammar,
    GrammarCompiler,
    bitmask_width,
    fill_draft_masks,
    fill_masks,
)

__all__ = ["Grammar", "GrammarCompiler", "bitmask_width", "fill_draft_masks", "fill_masks"]
