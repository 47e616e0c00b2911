"""SpecBackoff's speed rule: speculative steps must give the tokens per second plain
decode steps give, else speculation pauses (serving/spec_decode/backoff.py)."""

from __future__ import annotations

from serving.spec_decode import SpecBackoff


def backoff(**kw) -> SpecBackoff:
  return SpecBackoff(enabled=True, max_batch=4, window=4, pause_steps=3, probe_steps=2, **kw)


def speculate(b: SpecBackoff, steps: int, tokens: int, seconds: float) -> list[bool]:
  """`steps` steps: whether each speculated; a speculative one records its time."""
  wanted = []
  for _ in range(steps):
    wanted.append(b.wants_step(1))
    if wanted[-1]:
      b.record(rows=1, kept=tokens - 1)
    b.record_time(wanted[-1], tokens if wanted[-1] else 4, seconds if wanted[-1] else 0.01)
  return wanted


def test_faster_speculation_goes_on():
  b = backoff()
  for _ in range(2):
    b.record_time(False, 4, 0.01)  # plain: 400 tokens/s
  assert speculate(b, 12, tokens=6, seconds=0.01) == [True] * 12  # 600 tokens/s
  assert b.num_slow_pauses == 0 and b.num_pauses == 0


def test_slower_speculation_pauses_then_tries_again():
  b = backoff()
  for _ in range(2):
    b.record_time(False, 4, 0.01)  # 400 tokens/s
  # 300 tokens/s with 2 of 2 drafts kept: acceptance alone would go on.
  wanted = speculate(b, 8, tokens=3, seconds=0.01)
  assert wanted == [True] * 4 + [False] * 3 + [True]
  assert b.num_slow_pauses == 1 and b.num_pauses == 0


def test_without_timed_plain_steps_the_first_window_probes():
  b = backoff()
  assert speculate(b, 7, tokens=6, seconds=0.01) == [True] * 4 + [False] * 2 + [True]
  assert b.num_slow_pauses == 0  # the probe's plain steps (400 tokens/s) are slower


def test_nothing_is_timed_when_off_or_empty():
  b = SpecBackoff(enabled=False, max_batch=4, window=1, probe_steps=1)
  b.record_time(True, 1, 1.0)
  assert not b.wants_step(1) and b.num_slow_pauses == 0
  b = backoff()
  b.record_time(False, 4, 0.01)
  b.record_time(False, 4, 0.01)
  for _ in range(8):
    b.record_time(True, 0, 0.01)  # a step whose rows all finished: no tokens, no sample
  assert b.wants_step(1)


def test_slow_pauses_double_while_they_follow_one_another_and_reset_when_fast():
  b = backoff(max_pause_factor=4)
  for _ in range(2):
    b.record_time(False, 4, 0.01)  # 400 tokens/s
  wanted = speculate(b, 4 + 3 + 4 + 6 + 4 + 12 + 4 + 12, tokens=3, seconds=0.01)  # 300/s
  # Pauses of 3, 6, 12, then 12 (the cap: 4 x 3) plain steps, each after 4 speculative.
  pauses = [len(run) for run in "".join("s" if w else "p" for w in wanted).split("s") if run]
  assert pauses == [3, 6, 12, 12] and b.num_slow_pauses == 4
  # A fast window (600 tokens/s) starts over: the next slow pause is 3 steps again.
  assert speculate(b, 4, tokens=6, seconds=0.01) == [True] * 4
  wanted = speculate(b, 4 + 3 + 1, tokens=3, seconds=0.01)
  assert wanted == [True] * 4 + [False] * 3 + [True]
