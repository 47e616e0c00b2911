"""Offline tools the server never imports: the benchmark harness, GPTQ, conversion.

`bench.py` (`xlaserve bench`) and its HTTP load client `bench_serve.py`;
`gptq.py` with its calibration text (int4 by GPTQ for `xlaserve convert`);
`convert.py` (`xlaserve convert`: any checkpoint to orbax).
"""
