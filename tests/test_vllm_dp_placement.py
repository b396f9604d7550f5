"""DP placement on vLLM's real config: a dense model's DP ranks run as independent engines, and
vLLM resets their ``data_parallel_rank`` to 0 (``ParallelConfig.reconfigure_for_independent_dp_rank``,
called in ``vllm/v1/engine/core.py`` ``run_engine_core``); the rank survives in
``data_parallel_index``. Found with a real ``--data-parallel-size 2`` producer
(tests/e2e/test_e2e_tp.py): its second DP rank failed to start, "cannot listen on ...: Address
already in use", because both took ``ec_port + 0``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is part of the test environment")

from test_vllm_adapter import tiny_model, vllm_config  # noqa: E402,F401  (fixture and helper)


@pytest.mark.parametrize("dp", [0, 1])
def test_dense_dp_rank_keeps_its_port_and_group(tiny_model, dp):  # noqa: F811
    """What vLLM's engine core does to a dense model's DP rank ``dp``, then the placement."""
    from ec_nixl.vllm.options import placement

    vc = vllm_config(tiny_model, "ec_producer", port=15600)
    par = vc.parallel_config
    par.data_parallel_size = 2
    par.data_parallel_index = dp
    par.reconfigure_for_independent_dp_rank()  # vLLM's own call: rank and size back to 0 and 1
    assert par.data_parallel_rank == 0 and par.data_parallel_index == dp
    p = placement(vc, worker=False)
    assert (p.dp_rank, p.port, p.producer_port) == (dp, 15600 + dp, 15600 + dp)
    assert p.group == f"t-ec_producer-dp{dp}" and p.agent_name == f"t-ec_producer-dp{dp}-tp0"


def test_config_without_dp_index_uses_the_rank(tiny_model):  # noqa: F811
    """Older configs have no ``data_parallel_index``: the rank is used as before."""
    from types import SimpleNamespace

    from ec_nixl.vllm.options import placement

    vc = vllm_config(tiny_model, "ec_consumer", port=15600)
    par = SimpleNamespace(tensor_parallel_size=1, prefill_context_parallel_size=1, data_parallel_rank=1)
    p = placement(SimpleNamespace(ec_transfer_config=vc.ec_transfer_config, parallel_config=par), worker=False)
    assert (p.dp_rank, p.port, p.group) == (1, 15601, "t-ec_consumer-dp1")
