"""Client and AsyncClient: the one API callers use, whatever the backend's placement.

One client's calls run in the order they are made: `Client` is synchronous, and
`AsyncClient` funnels every call through a single worker thread, so awaiting out of order
never reorders execution.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from floe.client.transport import Transport
from floe.types import (
    Batch,
    ForwardBackwardResult,
    ForwardResult,
    Group,
    Info,
    OptimStepResult,
    SampleResult,
    SamplingParams,
    StateResult,
    SyncResult,
)


class Client:
    """Synchronous client. Build it with `floe.connect(...)`."""

    def __init__(self, transport: Transport):
        self.transport = transport

    def sample(self, prompts: list[list[int]], n: int = 1, params: SamplingParams | None = None) -> SampleResult:
        """n samples for each prompt (token ids); see SamplingParams."""
        return self.transport.call("sample", prompts=prompts, n=n, params=params or SamplingParams())

    def forward(
        self, batch: Batch | list[Group], zone: str = "policy", temperature: float = 1.0, with_entropy: bool = False
    ) -> ForwardResult:
        """Per-token log-probs of each sample's tokens under `zone` ('policy' or 'reference')."""
        return self.transport.call("forward", batch=batch, zone=zone, temperature=temperature, with_entropy=with_entropy)

    def forward_backward(
        self,
        batch: Batch | list[Group],
        loss: str = "cross_entropy",
        loss_config: dict[str, Any] | None = None,
        temperature: float = 1.0,
    ) -> ForwardBackwardResult:
        """Compute `loss` on the batch and add its gradients to the policy's accumulators."""
        return self.transport.call(
            "forward_backward", batch=batch, loss=loss, loss_config=loss_config, temperature=temperature
        )

    def optim_step(self) -> OptimStepResult:
        """Apply the accumulated gradients (AdamW, clipping, LR schedule), then zero them."""
        return self.transport.call("optim_step")

    def sync_weights(self) -> SyncResult:
        """Copy the policy's weights to the sampler, verify them, bump the version."""
        return self.transport.call("sync_weights")

    def save_state(self, name: str) -> StateResult:
        return self.transport.call("save_state", name=name)

    def load_state(self, name: str) -> StateResult:
        return self.transport.call("load_state", name=name)

    def list_states(self) -> list[str]:
        return self.transport.call("list_states")

    def export_hf(self, path: str) -> str:
        return self.transport.call("export_hf", path=path)

    def info(self) -> Info:
        return self.transport.call("info")

    def tokenizer(self) -> Any:
        return self.transport.tokenizer()

    def fork(self) -> "Client":
        """A client on the same backend whose calls form their own ordered stream, so it can
        run concurrently with this one (the async RL loop samples through a fork)."""
        return Client(self.transport.fork())

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _async_method(name: str):
    sync = getattr(Client, name)

    async def method(self: "AsyncClient", *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, lambda: sync(self._client, *args, **kwargs))

    method.__name__ = name
    method.__doc__ = sync.__doc__
    return method


class AsyncClient:
    """The same methods as Client, awaitable. Calls execute in submission order."""

    def __init__(self, transport: Transport):
        self._client = Client(transport)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="floe-client")

    sample = _async_method("sample")
    forward = _async_method("forward")
    forward_backward = _async_method("forward_backward")
    optim_step = _async_method("optim_step")
    sync_weights = _async_method("sync_weights")
    save_state = _async_method("save_state")
    load_state = _async_method("load_state")
    list_states = _async_method("list_states")
    export_hf = _async_method("export_hf")
    info = _async_method("info")

    def tokenizer(self) -> Any:
        return self._client.tokenizer()

    async def close(self) -> None:
        self._worker.shutdown(wait=True)
        self._client.close()
