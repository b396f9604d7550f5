"""What one multimodal item of this model is, for both sides of the scheduler: its encoder
output's shape and dtype (what a producer announces and a consumer expects), and whether the
request carries its media (what decides if a miss can be encoded locally)."""

from __future__ import annotations

import logging
from typing import Optional

from ec_nixl import protocol as P

logger = logging.getLogger("ec_nixl.vllm")


class FeatureFacts:
    """Widths and media fields of this model's items, looked up once per modality."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self._resolver = None
        self._media_fields: dict[str, set[str]] = {}
        self._width_warned = False

    def resolver(self):
        """vLLM's ``PlaceholderMetadataResolver`` for this model (made on first use)."""
        if self._resolver is None:
            from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

            self._resolver = PlaceholderMetadataResolver(self.vllm_config.model_config)
        return self._resolver

    def width(self, modality: str) -> Optional[int]:
        """The encoder output width (measured by vLLM on producers; else the LM embedding size)."""
        widths = getattr(self.vllm_config.ec_transfer_config, "mm_encoder_output_widths", None) or {}
        if modality in widths:
            return int(widths[modality])
        try:
            w = int(self.vllm_config.model_config.get_inputs_embeds_size())
        except Exception:
            return None
        if not self._width_warned:
            logger.warning("no measured encoder output width for %s; using the LM embedding size %d", modality, w)
            self._width_warned = True
        return w

    def describe(self, feature) -> Optional[P.ItemDesc]:
        """The encoder output a producer of this model publishes for ``feature`` (None: no width)."""
        width = self.width(feature.modality)
        if width is None:
            return None
        rows = feature.mm_position.get_num_embeds()
        return P.ItemDesc(mm_hash=feature.identifier, shape=[rows, width], dtype=self.dtype,
                          nbytes=rows * width * P.DTYPE_SIZES[self.dtype])

    def has_media(self, feature) -> bool:
        """True when the item can be encoded here (not a metadata-only placeholder)."""
        data = getattr(feature, "data", None)
        if data is None:
            return False
        meta = self._media_fields.get(feature.modality)
        if meta is None:
            try:
                meta = set(self.resolver().fields_for(feature.modality))
            except Exception:
                meta = set()
            self._media_fields[feature.modality] = meta
        return any(k not in meta for k in data.keys())
