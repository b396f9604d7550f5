"""``mrv2_engine.MRv2Engine`` with the worker's EC calls made as vLLM's V1 model runner makes them.

vLLM 0.26 has no Model Runner V2 EC wrapper (it lists EC transfer among MRv2's unsupported
features), so every EC instance runs the V1 runner there; vLLM 0.32 and 0.33 still have it (0.34
removed it). What the V1 runner does, in ``gpu_model_runner.py`` of each (``execute_model``,
``_preprocess``, ``_execute_mm_encoder``) and its ``ECConnectorModelRunnerMixin``:

* encode-only instance (``has_ec_transfer() and not is_consumer``), on every step, with tokens or
  without: the mixin's context (bind, ``start_save_caches`` where vLLM has it, ``start_load_caches``
  for consumers; on leaving ``get_finished``, ``build_connector_worker_meta`` where vLLM has it,
  clear) around ``_execute_mm_encoder`` only, then ``make_empty_encoder_model_runner_output``: the
  connector's output is dropped;
* any other instance: a step without tokens returns ``EMPTY_MODEL_RUNNER_OUTPUT`` before the
  connector; otherwise the same context around ``_execute_mm_encoder`` and ``_gather_mm_embeddings``,
  and the output is built with ``ec_connector_output`` (0.26's ``ECConnectorOutput`` has only the
  finished sets: its workers' reports go over ec-nixl's own ``report_channel``);
* ``_execute_mm_encoder`` encodes what ``_batch_mm_inputs_from_scheduler`` (vLLM's own, called
  here) takes from ``scheduled_encoder_inputs``, batched by ``group_and_batch_mm_kwargs``, and
  hands each new output to ``maybe_save_ec_to_connector`` (``save_caches``) on every worker with
  a connector, consumers too.

Not vLLM's: the encoder (``ProjectionEncoder``) and the gather, MRv2's ``EncoderRunner`` (V1's
``_gather_mm_embeddings`` reads the same dict the same way, ``Encoder cache miss`` if absent, but
lives in the V1 GPU runner, which needs CUDA to construct). ``worker_meta`` holds the reports the
scheduler took: from the step's output (vLLM >= 0.32) or from ``report_channel`` (0.26).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mrv2_engine import MRv2Engine


class V1Engine(MRv2Engine):
    """vLLM's Scheduler and V1's EC mixin around the encoder and the gather, in one process."""

    RUNNER_V2 = False

    def __init__(self, vc, **kw):
        super().__init__(vc, **kw)
        import ec_nixl.vllm.hooks as hooks

        if not hooks.WORKER_REPORTS:  # observe the reports the scheduler takes (the call goes through)
            side = self.scheduler.get_ec_connector().scheduler
            inner = side.update_connector_output

            def took(report):
                self.worker_meta.append(report)
                return inner(report)

            side.update_connector_output = took

    def _ec_wrapper(self, vc):
        return None  # no MRv2 wrapper: the mixin's static methods reach the connector themselves

    def execute_model(self, so):
        from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
        from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin as Mixin

        self._update_states(so)
        cache = self.encoder_cache.encoder_outputs
        if so.total_num_scheduled_tokens == 0:
            self.zero_token_steps += 1
        if has_ec_transfer() and not get_ec_transfer().is_consumer:
            with Mixin.maybe_get_ec_connector_output(so, encoder_cache=cache):
                self._execute_mm_encoder(so, cache)
                return self._output(so)  # make_empty_encoder_model_runner_output: the EC output is dropped
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT  # no connector call on a step without tokens
        with Mixin.maybe_get_ec_connector_output(so, encoder_cache=cache) as ec_out:
            self._execute_mm_encoder(so, cache)
            self._gather(so)
        out = self._output(so)
        out.ec_connector_output = ec_out  # (V1 builds its ModelRunnerOutput with it)
        return out

    def _execute_mm_encoder(self, so, cache) -> None:
        from vllm.multimodal.utils import group_and_batch_mm_kwargs
        from vllm.utils.torch_utils import PIN_MEMORY
        from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin as Mixin
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        from vllm.v1.worker.utils import sanity_check_mm_encoder_outputs

        runner = SimpleNamespace(requests={rid: SimpleNamespace(mm_features=f)
                                           for rid, f in self.encoder_cache.mm_features.items()})
        hashes, kwargs = GPUModelRunner._batch_mm_inputs_from_scheduler(runner, so)[:2]
        outs = []
        for _, num_items, batch in group_and_batch_mm_kwargs(kwargs, device=torch.device("cpu"), pin_memory=PIN_MEMORY):
            got = self.model.embed_multimodal(**batch)
            sanity_check_mm_encoder_outputs(got, expected_num_items=num_items)
            outs.extend(got)
        for h, out in zip(hashes, outs):
            cache[h] = out
            Mixin.maybe_save_ec_to_connector(cache, h)
