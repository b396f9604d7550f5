"""NixlECConnector inside the V1 model runner's EC path (vLLM 0.32 and 0.33; 0.34 removed it).

Same engine as tests/test_vllm_mrv2.py, with the worker's EC calls made by vLLM's V1 mixin
(``ECConnectorModelRunnerMixin``) in V1's order instead of MRv2's wrapper:
* bind, start_save_caches (producers), start_load_caches (consumers) on entering
  ``maybe_get_ec_connector_output``; get_finished, build_connector_worker_meta, clear on leaving;
* ``maybe_save_ec_to_connector`` right after each new encoder output, on every worker with a
  connector, consumers included (``GPUModelRunner._execute_mm_encoder``);
* steps without tokens return ``EMPTY_MODEL_RUNNER_OUTPUT`` without calling the connector, and an
  encode-only engine drops its connector output (``GPUModelRunner.execute_model``);
* the gather is MRv2's ``EncoderRunner.gather_mm_embeddings`` here: V1's
  ``_gather_mm_embeddings`` reads the same dict the same way (``Encoder cache miss`` if absent),
  but lives in the V1 GPU runner, which needs CUDA to construct.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is part of the test environment")
pytest.importorskip("vllm.v1.worker.ec_connector_model_runner_mixin",
                    reason="this vLLM has no V1 model runner (removed in 0.34)")

from mrv2_engine import ROWS, WIDTH, MRv2Engine, encoded, make_request, vllm_config  # noqa: E402
from peers import make_item  # noqa: E402
from vllm_fixtures import BF16, compat, e_engine, tiny_model  # noqa: E402,F401  (fixtures)


class V1Engine(MRv2Engine):
    """MRv2Engine whose worker drives the connector through vLLM's V1 mixin."""

    def execute_model(self, so):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
        from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin as Mixin

        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            self.zero_token_steps += 1
            return EMPTY_MODEL_RUNNER_OUTPUT  # V1: no connector call on a step without tokens
        cache = self.encoder_cache.encoder_outputs
        with Mixin.maybe_get_ec_connector_output(so, encoder_cache=cache) as ec_out:
            hashes, kwargs = self.runner.prepare_mm_inputs(so.scheduled_encoder_inputs)
            if kwargs:
                for h, out in zip(hashes, self.runner.execute_mm_encoder(kwargs)):
                    cache[h] = out
                    Mixin.maybe_save_ec_to_connector(cache, h)
            if not self.encode_only:
                self._gather(so)
        out = self._output(so)
        if self.encode_only:
            return out  # V1 drops an encode-only instance's connector output
        return ModelRunnerOutput.with_ec_conn_output(out, ec_out)


@pytest.fixture
def engine(tiny_model):
    made = []

    def make(role: str = "ec_consumer", **extra) -> V1Engine:
        e = V1Engine(vllm_config(tiny_model, role, extra=extra))
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


def test_e_to_pd_under_v1_runner(e_engine, engine):
    """Two images from an E engine; the V1 path hands save_caches nothing here (nothing is
    encoded on PD), the gather gets E's rows, and the worker report reaches the scheduler."""
    params = e_engine.call("encode", [("v1e", [("v1-a", 81, 4), ("v1-b", 82, 20)])])["v1e"]
    pd = engine()
    pd.add(make_request("v1pd", [("v1-a", 81, 4), ("v1-b", 82, 20)], params=params, media=False))
    pd.run_until(lambda: "v1pd" in pd.finished, what="v1pd finished")
    assert str(pd.finished["v1pd"].finish_reason).lower() == "length"
    assert torch.equal(pd.rows("v1pd"), torch.cat([encoded(81), encoded(82)]))
    assert sorted(h for m in pd.worker_meta for _, h in m.loaded) == ["v1-a", "v1-b"]
    assert pd.model.calls == [] and pd.saved == []


def test_consumer_ignores_v1_saves_of_its_local_encodes(engine):
    """V1 calls save_caches on consumers too: a PD that encodes an image itself (no params) must
    not pin or serve it (it has no serving endpoint), and the request runs normally."""
    pd = engine()
    pd.add(make_request("loc", [("v1-local", 83, 6)]))
    pd.run_until(lambda: "loc" in pd.finished, what="loc finished")
    assert pd.saved == ["v1-local"], "V1 hands every new output to save_caches"
    assert torch.equal(pd.rows("loc"), encoded(83))
    assert pd.worker.endpoint.published() == [] and pd.worker.endpoint.address is None


def test_late_item_waits_without_connector_calls(engine, compat):
    """Throttled producer under V1: steps without tokens do not reach the worker connector at all;
    admission is the scheduler's alone, and the gather still sees only the final bytes."""
    from peers import ProducerProcess

    delay = 1.0
    pd = engine(load_timeout_s="10")
    prod = ProducerProcess(device="cpu", pool_bytes=8 << 20, nixl_progress_thread=False, compat=compat)
    try:
        prod.call("publish_late", ("v1-late", (ROWS, WIDTH), BF16, 84, delay))
        t0 = time.monotonic()
        params = {"v1-late": {"item_indices": [0], "metadata": {"image_grid_thw": [1, 6, 6]},
                              "ec_nixl": {"v": 1, "producer": prod.address, "shape": [ROWS, WIDTH], "dtype": BF16,
                                          "nbytes": ROWS * WIDTH * 2}}}
        pd.add(make_request("late", [("v1-late", 0, 6)], params=params, media=False))
        pd.run_until(lambda: "late" in pd.gathered, what="late gathered")
        assert time.monotonic() - t0 >= delay * 0.9
        assert pd.zero_token_steps > 0
        assert torch.equal(pd.rows("late"), make_item(84, (ROWS, WIDTH), BF16))
        pd.run_until(lambda: "late" in pd.finished, what="late finished")
        assert str(pd.finished["late"].finish_reason).lower() == "length"
    finally:
        prod.close()
