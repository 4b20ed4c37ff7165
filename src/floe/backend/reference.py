"""The reference zone: a frozen model that only computes log-probs (for KL terms)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from floe.backend.scoring import score_batch
from floe.config import ComputeConfig
from floe.types import Batch, ForwardResult


class ReferenceZone:
    """Implements `zones.ReferenceWorker`: forward only, no state to save."""

    def __init__(self, model: PreTrainedModel, compute: ComputeConfig, source: str):
        self.model = model
        self.compute = compute
        self.source = source  # what it was loaded from, for info()
        for p in model.parameters():
            p.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, batch: Batch, temperature: float, with_entropy: bool) -> ForwardResult:
        return score_batch(self.model, batch, temperature, with_entropy, self.compute)
