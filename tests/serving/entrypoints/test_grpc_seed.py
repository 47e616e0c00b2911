"""gRPC `SamplingParams.seed` is a uint64 and the server takes that whole range.

Through the real gRPC server over the FakeRunner-backed engine: a seed of
2^64 - 1 is served, reaches the runner unchanged (not refused, not folded onto
another seed: 2^63 - 1 and 2^64 - 1 stay distinct), and the same seed gives the
same tokens. The runner turns the 64 bits into its sampling key
(tests/serving/runner/test_sampling.py checks that half).
"""

import grpc
import pytest
from frontend_fake import VOCAB, ByteTokenizer, InProcessServer

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc
from serving.types import SamplingParams

SEED_MAX = 2**64 - 1


class SeedRecordingRunner:
  """The FakeRunner, recording the seed of each sequence it runs (by request id)."""

  def __init__(self, runner: FakeRunner):
    self.runner = runner
    self.seeds: dict[str, int] = {}

  def __getattr__(self, name: str):
    return getattr(self.runner, name)

  def execute(self, *, plan):
    for seq in plan.sequences:
      self.seeds[seq.request_id] = seq.seed
    return self.runner.execute(plan=plan)


@pytest.fixture(scope="module")
def server():
  config = EngineConfig.of(max_num_seqs=4, max_model_len=256, num_pages=64)
  runner = SeedRecordingRunner(FakeRunner(num_pages=64, page_size=config.cache.page_size,
                                          max_num_seqs=4, vocab_size=VOCAB, step_s=0.002))
  engine = LLMEngine(runner=runner, tokenizer=ByteTokenizer(), config=config, model_name="fake")
  with InProcessServer(engine) as srv, grpc.insecure_channel(srv.grpc) as channel:
    yield pb_grpc.GenerationStub(channel), runner


def _generate(stub, seed: int) -> tuple[str, list[int]]:
  """(request id, tokens) of a sampled (temperature 1) completion with `seed`."""
  msgs = list(stub.Generate(pb.GenerateRequest(text="seeded", sampling=pb.SamplingParams(
      max_tokens=6, temperature=1.0, seed=seed))))
  return msgs[0].request_id, [t for m in msgs for t in m.token_ids]


def test_largest_uint64_seed_is_served_as_given(server):
  stub, runner = server
  rid, tokens = _generate(stub, SEED_MAX)
  assert len(tokens) == 6
  assert runner.seeds[rid] == SEED_MAX
  rid_again, tokens_again = _generate(stub, SEED_MAX)
  assert tokens_again == tokens  # the same seed, the same tokens
  assert runner.seeds[rid_again] == SEED_MAX


def test_seeds_past_2_63_do_not_fold_onto_smaller_ones(server):
  stub, runner = server
  seeds = [2**63 - 1, 2**63, SEED_MAX - 1, SEED_MAX]
  got = [runner.seeds[_generate(stub, s)[0]] for s in seeds]
  assert got == seeds


def test_python_api_takes_the_same_range():
  assert SamplingParams(seed=SEED_MAX).seed == SEED_MAX
  for bad in (-1, SEED_MAX + 1):
    with pytest.raises(ValueError, match="seed"):
      SamplingParams(seed=bad)
