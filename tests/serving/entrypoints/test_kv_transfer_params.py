"""`kv_transfer_params` validation (serving/entrypoints/openai_protocol.py): vLLM's
prefill leg and decode leg shapes pass, anything malformed is a 400 naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.entrypoints.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest

DECODE_LEG = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
              "remote_request_id": "r", "remote_block_ids": [3, 4], "remote_host": "10.0.0.1",
              "remote_port": 8100}


def _completion(params) -> CompletionRequest:
  req = CompletionRequest.model_validate({"model": "m", "prompt": "hi",
                                          "kv_transfer_params": params})
  req.check_supported()
  return req


def test_vllm_proxy_legs_pass():
  # vLLM's toy proxy sends the prefill leg with null remote fields.
  prefill = _completion({"do_remote_decode": True, "do_remote_prefill": False,
                         "remote_engine_id": None, "remote_block_ids": None,
                         "remote_host": None, "remote_port": None})
  assert prefill.kv_transfer_params.do_remote_decode
  decode = _completion({**DECODE_LEG, "remote_tp_size": 1})  # other engines' keys: ignored
  assert decode.kv_transfer_params.remote_block_ids == [3, 4]
  nothing_cached = _completion({"do_remote_prefill": True, "remote_block_ids": []})
  assert nothing_cached.kv_transfer_params.remote_block_ids == []
  chat = ChatCompletionRequest.model_validate({
      "model": "m", "messages": [{"role": "user", "content": "hi"}],
      "kv_transfer_params": DECODE_LEG})
  chat.check_supported()


@pytest.mark.parametrize("params, field", [
    ({"do_remote_decode": True, "do_remote_prefill": True}, "kv_transfer_params"),
    ({"do_remote_prefill": True}, "kv_transfer_params.remote_block_ids"),
    ({**DECODE_LEG, "remote_host": None}, "kv_transfer_params.remote_host"),
    ({**DECODE_LEG, "remote_request_id": ""}, "kv_transfer_params.remote_request_id"),
    ({**DECODE_LEG, "remote_block_ids": [1, -2]}, "kv_transfer_params.remote_block_ids"),
])
def test_incomplete_params_are_400(params, field):
  with pytest.raises(APIError) as e:
    _completion(params)
  assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize("params", [
    {**DECODE_LEG, "remote_port": 0}, {**DECODE_LEG, "remote_port": "8100"},
    {**DECODE_LEG, "remote_block_ids": ["1"]}, {**DECODE_LEG, "do_remote_prefill": "yes"},
    {**DECODE_LEG, "remote_host": "h" * 300}, "do_remote_decode", [DECODE_LEG],
])
def test_malformed_params_fail_validation(params):
  with pytest.raises(ValidationError):  # the HTTP server answers these with 400
    _completion(params)
