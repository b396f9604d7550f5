"""Disaggregated serving on one host: ``launcher`` starts E and PD vLLM instances plus ``proxy``,
which routes each request encoder-first, then to prefill/decode with the encoder's ``ec_transfer_params``.
``ttft`` measures time-to-first-token against any of them. Nothing here imports vLLM."""
