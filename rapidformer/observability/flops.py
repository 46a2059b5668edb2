"""Model FLOPs per token and model FLOPs utilization (MFU), in PaLM's convention.

Training a transformer costs, per token, 6 x N (forward 2N, backward 4N multiply-adds of every
weight) plus attention's scores and weighted sum, 12 x L x H x Q x T (L layers, H heads of
size Q, so H x Q = hidden; T tokens in the sequence). N counts every trainable parameter (a tied
embedding once: it is also the output projection), as nanoGPT does. Recompute is not counted
(MFU, not hardware utilization). MFU = achieved model FLOP/s per GPU / the GPU's dense bf16 peak.
"""
from __future__ import annotations

import torch

# dense (not sparse) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets (SXM parts)
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}


def flops_per_token(num_parameters: int, num_layers: int, hidden_size: int,
                    seq_length: float) -> float:
    return 6.0 * num_parameters + 12.0 * num_layers * hidden_size * seq_length


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is not in the table (CPUs included)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    # longest key first: "L40S" before "L4"
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def model_shape(model: torch.nn.Module, fallback_layers: int, fallback_hidden: int) -> tuple:
    """(layers, hidden size) from the model's own config (Hugging Face or megatron-core), else
    the run's model settings."""
    while hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    model = getattr(model, "_orig_mod", model)
    config = getattr(model, "config", None)
    layers = next((getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers")
                   if isinstance(getattr(config, k, None), int)), fallback_layers)
    hidden = next((getattr(config, k) for k in ("hidden_size", "n_embd")
                   if isinstance(getattr(config, k, None), int)), fallback_hidden)
    return layers, hidden


class ModelFlops:
    """What a log window needs to turn tokens/s into TFLOP/s and MFU."""

    def __init__(self, num_parameters: int, num_layers: int, hidden_size: int,
                 device: torch.device, num_devices: int):
        self.num_parameters, self.num_layers, self.hidden_size = (num_parameters, num_layers,
                                                                  hidden_size)
        self.peak = peak_flops(device)
        self.num_devices = num_devices

    def record(self, tokens_per_s: float, mean_seq_length: float) -> dict:
        per_token = flops_per_token(self.num_parameters, self.num_layers, self.hidden_size,
                                    mean_seq_length)
        per_device = tokens_per_s * per_token / self.num_devices
        out = {"tflops_per_device": per_device / 1e12}
        if self.peak:
            out["mfu"] = per_device / self.peak
        return out
