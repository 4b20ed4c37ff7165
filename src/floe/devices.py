"""Whether this torch can use a device: the check every entry point runs before anything heavy.

`check_device` needs torch alone (no transformers, no model stack), so `floe train | sft | eval`
run it right after the recipe validates, before importing the training loop: a wrong
`--backend.device` is one line in about the time torch takes to import. The Backend runs it
again at start-up.
"""

from __future__ import annotations

from floe.errors import InvalidInput

__all__ = ["check_device", "device_name"]


def check_device(device: str, field: str = "device", cpu_hint: str = "device='cpu'") -> None:
    """InvalidInput(field, ...) when ``device`` names an accelerator this torch build cannot use.

    "cpu" (and any device that is neither CUDA nor MPS) passes unchecked, without importing
    torch. ``cpu_hint`` is how the caller's user picks the CPU instead (the CLI says
    "--backend.device cpu").
    """
    kind = device.split(":", 1)[0]
    if kind not in ("cuda", "mps"):
        return
    import torch  # noqa: PLC0415 - only an accelerator needs asking

    if kind == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU is visible"
            raise InvalidInput(field, f"{device!r} is not available: torch {torch.__version__} is {build}; "
                                      f"use {cpu_hint}, or install a CUDA build of torch")
        index = device.split(":", 1)[1] if ":" in device else "0"
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise InvalidInput(field, f"{device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif not torch.backends.mps.is_available():
        raise InvalidInput(field, f"{device!r} is not available on this machine; use {cpu_hint}")


def device_name(device: object) -> str:
    """The hardware behind a torch device: torch.cuda.get_device_name for a CUDA device (e.g.
    "NVIDIA H100 80GB HBM3"), else the device type ("cpu", "mps"); what the peak-FLOPs table of
    floe.compute.flops is matched against."""
    import torch  # noqa: PLC0415 - only called where torch is loaded already

    dev = torch.device(device)  # type: ignore[arg-type]
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return dev.type
